// Staging buffers of the group's worker: they grow to the largest request and are then reused, so
// the hot path allocates nothing once warmed up. Only the worker thread touches them.
#pragma once

#include <ATen/ATen.h>

#include <array>

namespace chainermn {

class Scratch {
 public:
  // Slots 0 and 1 stage collectives' inputs and outputs (slot 0 holds packed tensors); strategies
  // use slots 1 and 2 for their own intermediate buffers.
  static constexpr int kSlots = 3;

  // At least `bytes` of memory in `slot`; the contents are not kept when it grows.
  void* get(int slot, size_t bytes) {
    at::Tensor& buffer = buffers_[slot];
    if (!buffer.defined() || static_cast<size_t>(buffer.numel()) < bytes) {
      // Grow geometrically so a slowly rising size does not reallocate every call.
      const size_t current = buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
      const size_t capacity = std::max<size_t>({bytes, current + current / 2, 4096});
      buffer = at::empty({static_cast<int64_t>(capacity)}, at::TensorOptions().dtype(at::kByte));
    }
    return buffer.data_ptr();
  }

  // `count` elements of `dtype` in `slot`, as a tensor view of the scratch memory.
  at::Tensor tensor(int slot, int64_t count, at::ScalarType dtype) {
    void* data = get(slot, static_cast<size_t>(count) * c10::elementSize(dtype));
    return at::from_blob(data, {count}, at::TensorOptions().dtype(dtype));
  }

  // Bytes held in all slots (for tests that check nothing grows after warm-up).
  size_t bytesHeld() const {
    size_t total = 0;
    for (const auto& buffer : buffers_) {
      total += buffer.defined() ? static_cast<size_t>(buffer.numel()) : 0;
    }
    return total;
  }

 private:
  std::array<at::Tensor, kSlots> buffers_;
};

} // namespace chainermn
