// Block-quantised int8 on CUDA: kernels/int8.h's layout and arithmetic, bit for bit (IEEE products
// and quotients, round half to even, no fused multiply-add). CUDA builds only.
//
// Launches on `stream` (a cudaStream_t) only: no allocation, no host synchronisation.
#pragma once

#include <cstdint>

namespace chainermn {
namespace cuda {

// encodeInt8Cpu for `rows` rows at once: row r's values at values + r * count (residual likewise,
// may be null), its wire row at wire + r * rowBytes. One launch.
void encodeInt8(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, void* stream);

// decodeInt8Cpu: out = each row's values ([rows, count]), or with `sum` their sum ([count]), added to
// what out holds with `accumulate`. One launch.
void decodeInt8(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block, bool sum,
                bool accumulate, void* stream);

}  // namespace cuda
}  // namespace chainermn
