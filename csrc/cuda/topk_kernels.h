// Top-k sparsification on CUDA: kernels/topk.h's layout and arithmetic, bit for bit (the same values
// kept, in the same slots; IEEE products and quotients, round half to even, no fused multiply-add).
// CUDA builds only.
//
// Launches on `stream` (a cudaStream_t) only: no allocation, no host synchronisation.
#pragma once

#include <cstdint>

namespace chainermn {
namespace cuda {

// encodeTopkCpu for `rows` rows at once: row r's values at values + r * count (residual likewise,
// may be null), its wire row at wire + r * rowBytes. One launch.
void encodeTopk(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, int64_t keep, void* stream);

// decodeTopkCpu: out = each row's values ([rows, count]), or with `sum` their sum ([count]), added to
// what out holds with `accumulate`. One launch.
void decodeTopk(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block,
                int64_t keep, bool sum, bool accumulate, void* stream);

}  // namespace cuda
}  // namespace chainermn
