// Block-quantised 4-bit codes, two values a byte, on the CPU (CUDA: cuda/int4_kernels.h, the same
// layout and the same arithmetic, bit for bit).
//
// A row of `count` float32 values travels as int4RowBytes(count, block) bytes: (count + 1) / 2 bytes
// of codes (value i in the low nibble of byte i / 2 when i is even, the high nibble when odd), zero
// bytes up to a multiple of 4, then one float32 scale per block of `block` values (the last block may
// be short). As int8 (kernels/int8.h) with 7 levels a side: with m the block's largest |r|, its scale
// is m / 7; value i travels as round_half_even(r x (7 / m)), a nibble in two's complement from -7 to 7
// (0 where m is 0), and comes back as code x scale.
//
// With a residual (error feedback, for gradients) r = residual + value and the residual keeps
// r - code x scale; without one r = value.
#pragma once

#include <cstdint>

namespace chainermn {

constexpr float kInt4Levels = 7.0f;

// What a block's values are multiplied by to give their codes: 7 / its largest |r| (0 for 0).
inline float int4Inverse(float largest) {
  return largest > 0.0f ? kInt4Levels / largest : 0.0f;
}

constexpr int64_t int4ScalesOffset(int64_t count) {
  return ((count + 1) / 2 + 3) / 4 * 4;
}
constexpr int64_t int4RowBytes(int64_t count, int64_t block) {
  return int4ScalesOffset(count) + 4 * ((count + block - 1) / block);
}

// One row: `row` gets the codes and scales of values (+ residual, updated in place when not null).
void encodeInt4Cpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block);

// out (+)= code x scale of one row; with `sum`, the sum over `rows` rows (`rowBytes` apart) into one
// out, else row r into out + r * count. `accumulate`: added to what out holds (with `sum` only).
void decodeInt4Cpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   bool sum, bool accumulate);

}  // namespace chainermn
