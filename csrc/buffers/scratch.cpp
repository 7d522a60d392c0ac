#include "buffers/scratch.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
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
  void encode(Code code, const CodeSettings& settings, const float* values, float* residual, void* wire, int64_t rows,
              int64_t rowBytes, int64_t count) override {
    encodeCpu(code, settings, values, residual, static_cast<uint8_t*>(wire), rows, rowBytes, count);
  }
  void decode(Code code, const CodeSettings& settings, const void* wire, int64_t rows, int64_t rowBytes, float* out,
              int64_t count, bool sum, bool accumulate) override {
    decodeCpu(code, settings, static_cast<const uint8_t*>(wire), rows, rowBytes, out, count, sum, accumulate);
  }
};
}  // namespace

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

void Scratch::grow(at::Tensor& buffer, size_t bytes) {
  // Geometrically, so that a slowly rising size does not reallocate every call.
  const size_t current = buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
  const size_t capacity = std::max<size_t>({bytes, current + current / 2, 4096});
  buffer = at::empty({static_cast<int64_t>(capacity)}, at::TensorOptions().dtype(at::kByte).device(device_));
}

at::Tensor Scratch::tensor(Slot slot, int64_t count, at::ScalarType dtype) {
  void* data = get(slot, static_cast<size_t>(count) * c10::elementSize(dtype));
  return at::from_blob(data, {count}, at::TensorOptions().dtype(dtype).device(device_));
}

size_t Scratch::bytesHeld() const {
  size_t total = mover_->bytesHeld();
  for (const auto& buffer : buffers_) {
    total += buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
  }
  return total;
}

}  // namespace chainermn
