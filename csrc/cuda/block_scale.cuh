// What the block codes' CUDA encoders (int8_kernels.cu, int4_kernels.cu) share, as
// kernels/block_scale.h on the CPU: a warp's pass over one block that forms r = value (+ residual),
// keeps it in the residual, and returns the block's largest |r| on every lane.
#pragma once

#include <cstdint>

namespace chainermn::cuda {

__device__ __forceinline__ float warpBlockLargest(const float* v, float* kept, int64_t n, int lane) {
  float largest = 0.0f;
  for (int64_t i = lane; i < n; i += 32) {
    float r = v[i];
    if (kept) {
      r = __fadd_rn(kept[i], r);
      kept[i] = r;
    }
    largest = fmaxf(largest, fabsf(r));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  return largest;
}

} // namespace chainermn::cuda
