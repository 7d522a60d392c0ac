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
