// The "int2" code on the CPU (kernels/int2.h says what a row is), and its descriptor.
//
// Block by block: a block's values are read once for its largest magnitude (and kept in the residual:
// kernels/block_scale.h) and again, from the L1 cache, for their codes; IEEE products, rounding half
// to even (std::nearbyint under the default rounding mode), as cuda/int2_kernels.cu does.
#include "kernels/int2.h"

#include "kernels/block_scale.h"
#include "kernels/code.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace chainermn {
namespace {

inline int32_t code2Of(float r, float inverse) {
  return std::max(-1, std::min(1, static_cast<int32_t>(std::nearbyint(r * inverse))));
}

// Two bits in two's complement back to -1..1 (0b10, never written, reads as -2).
inline int32_t valueOfBits(uint32_t bits) {
  return static_cast<int32_t>(bits ^ 2u) - 2;
}

void encodeRow(const CodeSettings& settings, const float* values, float* residual, uint8_t* row, int64_t count) {
  const int64_t block = settings.block;
  auto* scales = reinterpret_cast<float*>(row + int2ScalesOffset(count));
  std::memset(row, 0, static_cast<size_t>(int2ScalesOffset(count)));
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    float* blockResidual = residual ? residual + begin : nullptr;
    const float largest = loadBlock(values + begin, blockResidual, n);
    const float scale = largest / kInt2Levels;
    const float inverse = int2Inverse(largest);
    scales[b] = scale;
    const float* r = blockResidual ? blockResidual : values + begin;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t code = code2Of(r[i], inverse);
      const int64_t at = begin + i;
      row[at / 4] |= static_cast<uint8_t>((static_cast<uint32_t>(code) & 0x3u) << (2 * (at % 4)));
      if (blockResidual) {
        blockResidual[i] = r[i] - static_cast<float>(code) * scale;
      }
    }
  }
}

void decodeRows(const CodeSettings& settings, const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out,
                int64_t count, bool sum, bool accumulate) {
  const int64_t block = settings.block;
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    for (int64_t r = 0; r < rowCount; ++r) {
      const uint8_t* row = rows + r * rowBytes;
      float scale;
      std::memcpy(&scale, row + int2ScalesOffset(count) + 4 * b, sizeof(float));
      float* into = (sum ? out : out + r * count) + begin;
      const bool add = sum && (r > 0 || accumulate);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = begin + i;
        const float value = static_cast<float>(valueOfBits((row[at / 4] >> (2 * (at % 4))) & 0x3u)) * scale;
        into[i] = add ? into[i] + value : value;
      }
    }
  }
}

// The "int2" code, described once (kernels/code.h): the registry's entry for it.
CodeDescriptor described() {
  CodeDescriptor code;
  code.name = "int2";
  code.summary =
      "round_half_even(x / m) (-1, 0 or +1), four values a byte, m the largest |x| of its block; "
      "one float32 scale a block";
  code.readsBlock = true;
  code.blockMultiple = 4;  // a block starts on a byte: no byte holds values of two blocks
  code.rowBytes = [](int64_t count, const CodeSettings& s) { return int2RowBytes(count, s.block); };
  code.encodeRow = encodeRow;
  code.decodeRows = decodeRows;
  return code;
}

const CodeRegistration registered{described()};

}  // namespace
}  // namespace chainermn
