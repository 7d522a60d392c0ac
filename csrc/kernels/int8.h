// Block-quantised int8 (ZeRO++'s qwZ and qgZ code), on the CPU (CUDA: cuda/int8_kernels.h, the same
// layout and the same arithmetic, bit for bit).
//
// A row of `count` float32 values travels as int8RowBytes(count, block) bytes: `count` int8 codes,
// zero bytes up to a multiple of 4, then one float32 scale per block of `block` values (the last
// block may be short). With m the block's largest |r|, its scale is m / 127; value i travels as
// round_half_even(r x (127 / m)) (a product, not a division by the scale: a division costs several
// times more; 0 where m is 0) and comes back as code x scale.
//
// With a residual (error feedback, for gradients) r = residual + value and the residual keeps
// r - code x scale; without one (weights) r = value.
#pragma once

#include <cstdint>

namespace chainermn {

constexpr float kInt8Levels = 127.0f;

// What a block's values are multiplied by to give their codes: 127 / its largest |r| (0 for 0).
inline float int8Inverse(float largest) {
  return largest > 0.0f ? kInt8Levels / largest : 0.0f;
}

constexpr int64_t int8ScalesOffset(int64_t count) {
  return (count + 3) / 4 * 4;
}
constexpr int64_t int8RowBytes(int64_t count, int64_t block) {
  return int8ScalesOffset(count) + 4 * ((count + block - 1) / block);
}

// One row: `row` gets the codes and scales of values (+ residual, updated in place when not null).
void encodeInt8Cpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block);

// out[i] = code x scale of one row (sum: the sum over `rows` rows, `rowBytes` apart, into one out;
// `accumulate`: added to what out holds, with `sum` only).
void decodeInt8Cpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   bool sum, bool accumulate = false);

}  // namespace chainermn
