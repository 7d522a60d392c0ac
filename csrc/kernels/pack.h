// Packing many tensors into one flat buffer and back, with the cast to the wire dtype and a scale in
// the same pass (ChainerMN's batched pack: the mean's 1/size costs nothing extra).
//
// On the CPU a pass is a loop per part (memcpy when nothing changes). On CUDA (pack.cu) a whole pack
// or unpack is ONE kernel launch on the current stream: each element finds its part by binary search
// of a prefix-sum table of the parts' sizes, as ChainerMN's _batched_pack did.
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace chainermn {

// CPU: parts back to back into `packed` (wire dtype), each element cast and multiplied by `scale`.
// A part in the wire dtype with scale 1 is copied; `packed` may alias a single part.
void packCpu(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale);
// CPU: the reverse: consecutive elements of `packed` into the parts, cast back and scaled.
void unpackCpu(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale);

#ifdef CHAINERMN_WITH_CUDA
namespace cuda {

// The parts' table (pointers, dtypes, prefix sums) in device memory, uploaded through a pinned
// host copy. Both only grow and are reused; nothing is allocated per call once warmed up.
class PartTable {
 public:
  PartTable();
  ~PartTable();
  PartTable(const PartTable&) = delete;
  PartTable& operator=(const PartTable&) = delete;

  size_t bytesHeld() const;

  struct State;
  std::unique_ptr<State> state;
};

// Floating dtypes only (float16, bfloat16, float32, float64), parts of any mix of them. One kernel
// launch on `stream` (a cudaStream_t); the parts and `packed` must be on the current device.
void pack(PartTable& table, const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale, void* stream);
void unpack(PartTable& table, const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale, void* stream);

} // namespace cuda
#endif

} // namespace chainermn
