// kernels/codes.h's encodeCpu and decodeCpu on a CUDA device: each code's CUDA kernels (registered by its own
// cuda/<code>_kernels.cu) behind one call,
// used by the torch operators (cuda/codes_ops.cpp) and by a CUDA Scratch's Mover (cuda/device_mover.cpp).
// Launches on `stream` (a cudaStream_t) only: no allocation, no host synchronisation.
#pragma once

#include "kernels/codes.h"

#include <cstdint>

namespace chainermn {
namespace cuda {

void encode(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire, int64_t rows,
            int64_t rowBytes, int64_t count, void* stream);

void decode(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
            int64_t count, bool sum, bool accumulate, void* stream);

}  // namespace cuda
}  // namespace chainermn
