// Gradient compression's two kernels on CUDA: the layout, the arithmetic and the zeroed tail words of
// kernels/quantize.h (the CPU versions, which say what a block is), bit for bit for 2-bit; for 1-bit
// the scale is the same mean |r| summed in double and rounded to float once, in another order (per
// thread, per block, then across blocks: deterministic for a given count and chunk). CUDA builds only.
//
// Launches on `stream` (a cudaStream_t) only: no allocation, no host synchronisation. 2-bit is one
// launch; 1-bit is two or three (the scale's partial sums, their total when there are several
// partial sums, then the signs), the partial sums held in the block's own sign words until the last
// launch overwrites them, and the scale computed on the device into word 0, never read back.
#pragma once

#include "kernels/quantize.h"

#include <cstdint>

namespace chainermn {
namespace cuda {

// quantizeCpu on the device: residual[i] += add[i] (add may be null), then the block's
// blockWords(kind, chunk) words get the codes and the residual keeps what was not sent. All pointers
// on the current device; count <= chunk.
void quantize(QuantizeKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk,
              float threshold, void* stream);

// dequantizeCpu on the device: out[i] (+)= the value block codes for i < count.
void dequantize(QuantizeKind kind, const uint32_t* block, float* out, int64_t count, float threshold, bool accumulate,
                void* stream);

}  // namespace cuda
}  // namespace chainermn
