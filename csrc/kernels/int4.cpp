#include "kernels/int4.h"
#include "kernels/code.h"

#include "kernels/block_scale.h"

#include <algorithm>
#include <cmath>
#include <cstring>

// Block by block: a block's values are read once for its largest magnitude (and kept in the residual:
// kernels/block_scale.h) and again, from the L1 cache, for their codes; the arithmetic is the
// specification's: IEEE products, rounding half to even (std::nearbyint under the
// default rounding mode), as cuda/int4_kernels.cu does.

namespace chainermn {
namespace {

inline int32_t code4Of(float r, float inverse) {
  return std::max(-7, std::min(7, static_cast<int32_t>(std::nearbyint(r * inverse))));
}

// A nibble in two's complement back to -7..7.
inline int32_t valueOfNibble(uint32_t nibble) {
  return static_cast<int32_t>(nibble ^ 8u) - 8;
}

}  // namespace

void encodeInt4Cpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block) {
  auto* scales = reinterpret_cast<float*>(row + int4ScalesOffset(count));
  std::memset(row, 0, static_cast<size_t>(int4ScalesOffset(count)));
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    float* blockResidual = residual ? residual + begin : nullptr;
    const float largest = loadBlock(values + begin, blockResidual, n);
    const float scale = largest / kInt4Levels;
    const float inverse = int4Inverse(largest);
    scales[b] = scale;
    const float* r = blockResidual ? blockResidual : values + begin;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t code = code4Of(r[i], inverse);
      const int64_t at = begin + i;
      row[at / 2] |= static_cast<uint8_t>((static_cast<uint32_t>(code) & 0xFu) << (4 * (at % 2)));
      if (blockResidual) {
        blockResidual[i] = r[i] - static_cast<float>(code) * scale;
      }
    }
  }
}

void decodeInt4Cpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   bool sum, bool accumulate) {
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    for (int64_t r = 0; r < rowCount; ++r) {
      const uint8_t* row = rows + r * rowBytes;
      float scale;
      std::memcpy(&scale, row + int4ScalesOffset(count) + 4 * b, sizeof(float));
      float* into = (sum ? out : out + r * count) + begin;
      const bool add = sum && (r > 0 || accumulate);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = begin + i;
        const float value = static_cast<float>(valueOfNibble((row[at / 2] >> (4 * (at % 2))) & 0xFu)) * scale;
        into[i] = add ? into[i] + value : value;
      }
    }
  }
}

namespace {

// The "4bit" code, described once (kernels/code.h): the registry's entry for it.
CodeDescriptor described() {
  CodeDescriptor code;
  code.name = "4bit";
  code.summary =
      "round_half_even(x * 7 / m), two values a byte, m the largest |x| of its block; one float32 scale a block";
  code.readsBlock = true;
  code.blockMultiple = 2;  // a block starts on a byte: no byte holds values of two blocks
  code.carriesSums = true;
  code.rowBytes = [](int64_t count, const CodeSettings& s) { return int4RowBytes(count, s.block); };
  code.encodeRow = [](const CodeSettings& s, const float* values, float* residual, uint8_t* row, int64_t count) {
    encodeInt4Cpu(values, residual, row, count, s.block);
  };
  code.decodeRows = [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
                       int64_t count, bool sum,
                       bool accumulate) { decodeInt4Cpu(wire, rows, rowBytes, out, count, s.block, sum, accumulate); };
  return code;
}

const CodeRegistration registered{described()};

}  // namespace

}  // namespace chainermn
