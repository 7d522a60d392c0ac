// Block-scaled 2-bit codes (ternary: -1, 0, +1 times the block's scale, as TernGrad's), four values a
// byte, on the CPU (CUDA: cuda/int2_kernels.cu, the same layout and arithmetic, bit for bit).
//
// A row of `count` float32 values travels as int2RowBytes(count, block) bytes: (count + 3) / 4 bytes
// of codes (value i in bits 2 * (i % 4) of byte i / 4, two's complement: 0b01 is +1, 0b11 is -1,
// 0b00 is 0), zero bytes up to a multiple of 4, then one float32 scale per block of `block` values
// (a multiple of 4, so that no byte holds values of two blocks; the last block may be short). As
// int8 (kernels/int8.h) with 1 level a side: with m the block's largest |r| its scale is m; value i
// travels as round_half_even(r x (1 / m)) (0 where m is 0) and comes back as code x scale.
//
// With a residual (error feedback, for gradients) r = residual + value and the residual keeps
// r - code x scale; without one r = value.
#pragma once

#include <cstdint>

namespace chainermn {

constexpr float kInt2Levels = 1.0f;

// What a block's values are multiplied by to give their codes: 1 / its largest |r| (0 for 0).
inline float int2Inverse(float largest) {
  return largest > 0.0f ? kInt2Levels / largest : 0.0f;
}

constexpr int64_t int2ScalesOffset(int64_t count) {
  return ((count + 3) / 4 + 3) / 4 * 4;
}
constexpr int64_t int2RowBytes(int64_t count, int64_t block) {
  return int2ScalesOffset(count) + 4 * ((count + block - 1) / block);
}

}  // namespace chainermn
