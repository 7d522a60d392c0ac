// Block-quantised 4-bit codes on CUDA: kernels/int4.h's layout and arithmetic, bit for bit (IEEE
// products and quotients, round half to even, no fused multiply-add). CUDA builds only.
//
// Launches on `stream` (a cudaStream_t) only: no allocation, no host synchronisation.
#pragma once

#include <cstdint>

namespace chainermn {
namespace cuda {

// encodeInt4Cpu for `rows` rows at once: row r's values at values + r * count (residual likewise,
// may be null), its wire row at wire + r * rowBytes. `block` is even (kernels/codes.h checks it), so
// no byte holds values of two blocks. One launch.
void encodeInt4(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, void* stream);

// decodeInt4Cpu: out = each row's values ([rows, count]), or with `sum` their sum ([count]), added to
// what out holds with `accumulate`. One launch.
void decodeInt4(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block, bool sum,
                bool accumulate, void* stream);

}  // namespace cuda
}  // namespace chainermn
