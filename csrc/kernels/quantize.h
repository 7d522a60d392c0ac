// Gradient compression's two kernels, on the CPU (CUDA: cuda/quantize_kernels.h, the same layout and
// the same arithmetic): quantize (error feedback + pack) and dequantize (unpack + accumulate), one
// pass each over the values.
//
// A chunk of `count` values travels as one block of blockWords(kind, chunk) 32-bit words:
//   TwoBit (MXNet's 2-bit): r = residual + add; code +t where r >= t (r -= t), -t where r <= -t
//     (r += t), else 0; r is the new residual. Value i is bits 2*(i%16) of word i/16: 0b01 is +t,
//     0b10 is -t, 0b00 is 0. 16 values a word: 1/16 of float32.
//   OneBit (sign with a scale): r = residual + add; scale = mean |r| over the chunk (summed in
//     double, in any order, then rounded to float: the rounding hides the order); code +scale where r >= 0, else
//     -scale; residual = r - code. Word 0 holds the scale's bits, value i is bit i%32 of word 1 + i/32 (1 is +scale).
//     32 values a word.
// Words past `count`'s last value, up to the block's end, are zero (they decode to 0 / -scale and
// are never read back: every block's count is known to both sides).
//
// These are the kernels of two codes, "2bit" and "1bit" (registered in kernels/quantize.cpp).
#pragma once

#include <cstdint>

namespace chainermn {

enum class QuantizeKind : int32_t { TwoBit, OneBit };

constexpr int64_t valuesPerWord(QuantizeKind kind) {
  return kind == QuantizeKind::TwoBit ? 16 : 32;
}
constexpr int64_t headerWords(QuantizeKind kind) {
  return kind == QuantizeKind::TwoBit ? 0 : 1;
}
// The words of a block that carries up to `chunk` values.
constexpr int64_t blockWords(QuantizeKind kind, int64_t chunk) {
  return headerWords(kind) + (chunk + valuesPerWord(kind) - 1) / valuesPerWord(kind);
}

// residual[i] += add[i] for i < count (add may be null: the residual already holds the values), then
// the block (blockWords(kind, chunk) words) gets their codes and the residual keeps what was not sent.
void quantizeCpu(QuantizeKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk,
                 float threshold);

// out[i] (+)= the value block codes for i < count: accumulated when `accumulate`, else assigned.
void dequantizeCpu(QuantizeKind kind, const uint32_t* block, float* out, int64_t count, float threshold,
                   bool accumulate);

}  // namespace chainermn
