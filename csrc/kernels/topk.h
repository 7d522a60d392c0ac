// Top-k sparsification (SparseLoCo's outer gradients: few values sent, the rest kept for later by
// error feedback), on the CPU (CUDA: cuda/topk_kernels.h, the same layout and arithmetic, bit for bit).
//
// Each block of `block` values (the last may be short) sends its `keep` values of largest |r| (ties:
// the lower index first; a block of keep values or fewer sends them all), as int8 against one float32
// scale. Block b of a row of `count` values lies at b * topkBlockBytes(keep):
//   float32   scale = m / 127, m the block's largest |r| (the largest kept one)
//   uint16    keep indices within the block, in increasing order
//   int8      keep codes, round_half_even(r x (127 / m)) (0 where m is 0), as int8 (kernels/int8.h)
//   zero bytes to a multiple of 4, so that every block's scale is 4-byte aligned
// A block shorter than keep leaves its last slots unused: index 0xFFFF, code 0. Every rank's row has
// the same bytes for the same count, block and keep, whatever its values. decode gives the dense row:
// zeros but for code x scale at the kept indices (a slot whose index is not in the block is ignored).
//
// With a residual (error feedback) r = residual + value and the residual keeps r - decoded: all of r
// where nothing was sent, the rounding where a value was. Without one r = value.
#pragma once

#include <cstdint>

namespace chainermn {

constexpr int64_t kTopkMaxBlock = int64_t{1} << 16;  // in-block indices travel as uint16
constexpr uint16_t kTopkUnused = 0xFFFF;             // the index of an unused slot (a short block's)

constexpr int64_t topkBlockBytes(int64_t keep) {
  return (4 + 3 * keep + 3) / 4 * 4;
}
constexpr int64_t topkIndicesOffset() {
  return 4;
}
constexpr int64_t topkCodesOffset(int64_t keep) {
  return 4 + 2 * keep;
}
constexpr int64_t topkRowBytes(int64_t count, int64_t block, int64_t keep) {
  return (count + block - 1) / block * topkBlockBytes(keep);
}

// One row: `row` gets the blocks of values (+ residual, updated in place when not null).
void encodeTopkCpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block, int64_t keep);

// out = the dense values of one row; with `sum` the sum over `rows` rows (`rowBytes` apart) into one
// out, else row r into out + r * count. `accumulate`: added to what out holds (with `sum` only).
void decodeTopkCpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   int64_t keep, bool sum, bool accumulate);

}  // namespace chainermn
