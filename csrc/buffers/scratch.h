// Staging buffers of a group on one device: they grow to the largest request and are then reused, so
// the hot path allocates nothing once warmed up. Only the thread that runs the group's ops on that
// device touches them (the worker; for CUDA over NCCL, the launching caller, under the device's lock).
//
// A Scratch lives on one device. It also moves bytes on that device (copy, pack, unpack) so that
// strategies, which only see a Scratch and Communicators, never name a library: on the CPU these are
// memcpy and loops; on CUDA they run on the current stream (the group's, in an op's scope) and
// pack/unpack are one kernel launch each.
#pragma once

#include "kernels/pack.h"
#include "kernels/codes.h"

// The tensor class only, not all of ATen: every strategy includes this header.
#include <ATen/core/Tensor.h>

#include <array>
#include <memory>
#include <optional>
#include <vector>

namespace chainermn {

// The tensors' memory as parts to pack or unpack, each as `as` (the same bytes read as another dtype
// of the same width: bool as uint8) or its own dtype.
inline std::vector<FlatBuffer> flatParts(const std::vector<at::Tensor>& tensors,
                                         std::optional<c10::ScalarType> as = std::nullopt) {
  std::vector<FlatBuffer> parts;
  parts.reserve(tensors.size());
  for (const auto& tensor : tensors) {
    parts.push_back(FlatBuffer{tensor.data_ptr(), tensor.numel(), as.value_or(tensor.scalar_type())});
  }
  return parts;
}

// What a staging buffer holds. Each op uses a slot for one purpose only, so an op and the strategy
// it runs never hand each other's buffers around.
enum class Slot : int {
  Packed = 0,         // an op's input, packed (the mean's packed buffer) or scaled
  Received = 1,       // what an op receives before it is unpacked (gathered blocks, a reduce's sink)
  StrategyWhole = 2,  // a strategy's working copy of the whole buffer
  StrategyBlock = 3,  // a strategy's one-block buffer
  Compressed = 4,     // gradient compression's packed codes, as sent
};

// How a Scratch moves bytes on its device: memcpy and loops on the CPU (cpuMover, kernels/pack.h); on
// CUDA, copies and one-kernel packs on the current stream (cuda/pack_kernels.h).
class Mover {
 public:
  virtual ~Mover() = default;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void pack(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) = 0;
  virtual void unpack(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) = 0;
  // The codes' encode and decode (kernels/codes.h), on this device.
  virtual void encode(Code code, const CodeSettings& settings, const float* values, float* residual, void* wire,
                      int64_t rows, int64_t rowBytes, int64_t count) = 0;
  virtual void decode(Code code, const CodeSettings& settings, const void* wire, int64_t rows, int64_t rowBytes,
                      float* out, int64_t count, bool sum, bool accumulate) = 0;
  // Bytes the mover itself holds (a device's table of parts).
  virtual size_t bytesHeld() const {
    return 0;
  }
};
std::unique_ptr<Mover> cpuMover();

class Scratch {
 public:
  static constexpr int kSlots = 5;

  // `mover` moves bytes on `device`; null: the CPU's (then `device` must be the CPU).
  explicit Scratch(at::Device device = at::kCPU, std::unique_ptr<Mover> mover = nullptr);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  at::Device device() const {
    return device_;
  }

  // At least `bytes` of memory in `slot`; the contents are not kept when it grows.
  void* get(Slot slot, size_t bytes) {
    at::Tensor& buffer = buffers_[static_cast<int>(slot)];
    if (!buffer.defined() || static_cast<size_t>(buffer.numel()) < bytes) {
      grow(buffer, bytes);
    }
    return buffer.data_ptr();
  }

  // `count` elements of `dtype` in `slot`, as a tensor view of the scratch memory.
  at::Tensor tensor(Slot slot, int64_t count, at::ScalarType dtype);

  // Bytes of device memory on this Scratch's device (non-overlapping, or equal pointers: a no-op).
  void copy(void* dst, const void* src, size_t bytes) {
    if (dst != src && bytes > 0) {
      mover_->copy(dst, src, bytes);
    }
  }

  // The parts back to back into `packed` in the wire dtype, cast and scaled in one pass (see
  // kernels/pack.h); unpack is the reverse. Parts already in the wire dtype with scale 1 are moved
  // as bytes (any dtype; only floating dtypes are cast). `packed` may be a single part itself.
  void pack(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) {
    mover_->pack(parts, packed, wire, scale);
  }
  void unpack(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) {
    mover_->unpack(packed, wire, parts, scale);
  }
  // Error feedback and encoding of `rows` rows of `count` values into wire rows `rowBytes` apart, and
  // their decoding (with `sum`: out (+)= the rows' sum), on this device (kernels/codes.h).
  void encode(Code code, const CodeSettings& settings, const float* values, float* residual, void* wire, int64_t rows,
              int64_t rowBytes, int64_t count) {
    mover_->encode(code, settings, values, residual, wire, rows, rowBytes, count);
  }
  void decode(Code code, const CodeSettings& settings, const void* wire, int64_t rows, int64_t rowBytes, float* out,
              int64_t count, bool sum, bool accumulate) {
    mover_->decode(code, settings, wire, rows, rowBytes, out, count, sum, accumulate);
  }

  // Bytes held in all slots (for tests that check nothing grows after warm-up).
  size_t bytesHeld() const;

 private:
  void grow(at::Tensor& buffer, size_t bytes);

  at::Device device_;
  std::array<at::Tensor, kSlots> buffers_;
  std::unique_ptr<Mover> mover_;
};

}  // namespace chainermn
