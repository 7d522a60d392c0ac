// Packing many tensors into one flat buffer and back, with the cast to the wire dtype and a scale in
// the same pass (ChainerMN's batched pack: the mean's 1/size costs nothing extra).
//
// On the CPU a pass is a loop per part (memcpy when nothing changes). On CUDA (cuda/pack_kernels.h) a
// whole pack or unpack is ONE kernel launch on the current stream, as ChainerMN's _batched_pack was;
// where _batched_pack had each element binary-search a table of the parts' sizes, a block here takes
// one chunk of one part from a table the host cuts (cuda/pack_kernels.cu).
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace chainermn {

// CPU: parts back to back into `packed` (wire dtype), each element cast and multiplied by `scale`.
// A part in the wire dtype with scale 1 is copied; `packed` may alias a single part.
void packCpu(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale);
// CPU: the reverse: consecutive elements of `packed` into the parts, cast back and scaled.
void unpackCpu(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale);

}  // namespace chainermn
