#include "kernels/scratch.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace chainermn {

namespace {
class CpuMover : public Mover {
 public:
  void copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void pack(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) override {
    packCpu(parts, packed, wire, scale);
  }
  void unpack(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) override {
    unpackCpu(packed, wire, parts, scale);
  }
  void quantize(CompressionKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk,
                float threshold) override {
    quantizeCpu(kind, add, residual, block, count, chunk, threshold);
  }
  void dequantize(CompressionKind kind, const uint32_t* block, float* out, int64_t count, float threshold,
                  bool accumulate) override {
    dequantizeCpu(kind, block, out, count, threshold, accumulate);
  }
};
} // namespace

std::unique_ptr<Mover> cpuMover() {
  return std::make_unique<CpuMover>();
}

Scratch::Scratch(at::Device device, std::unique_ptr<Mover> mover) : device_(device), mover_(std::move(mover)) {
  if (!mover_) {
    TORCH_CHECK(device_.is_cpu(), "chainermn: no staging buffers for device ", device_);
    mover_ = cpuMover();
  }
}

Scratch::~Scratch() = default;

size_t Scratch::bytesHeld() const {
  size_t total = mover_->bytesHeld();
  for (const auto& buffer : buffers_) {
    total += buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
  }
  return total;
}

} // namespace chainermn
