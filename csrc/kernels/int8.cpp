#include "kernels/int8.h"
#include "kernels/code.h"

#include "kernels/block_scale.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// One pass over memory: a block (256 values by default, 1 KiB) is read once from memory for its
// largest magnitude and then again from the L1 cache for its codes. Where SSE2 is there (every
// x86-64) four values go at a time; the arithmetic is the scalar code's (IEEE products, rounding
// half to even as cvtps2dq does under the default rounding mode), so both give the same bits.

namespace chainermn {
namespace {

// round half to even, as torch.round and _mm_cvtps_epi32 do.
inline int32_t roundEven(float x) {
  return static_cast<int32_t>(std::nearbyint(x));
}

inline int8_t codeOf(float r, float inverse) {
  return static_cast<int8_t>(std::max(-127, std::min(127, roundEven(r * inverse))));
}

// The block's codes from r (the residual when there is one, else the values); the residual keeps
// what they do not carry.
void codeBlock(const float* values, float* residual, int8_t* codes, int64_t n, float scale, float inverse) {
  const float* r = residual ? residual : values;
  int64_t i = 0;
#if defined(__SSE2__)
  {
    const __m128 scales = _mm_set1_ps(scale);
    const __m128 inverses = _mm_set1_ps(inverse);
    for (; i + 16 <= n; i += 16) {
      __m128i q[4];
      for (int g = 0; g < 4; ++g) {
        const __m128 x = _mm_loadu_ps(r + i + 4 * g);
        q[g] = _mm_cvtps_epi32(_mm_mul_ps(x, inverses));
        if (residual) {
          _mm_storeu_ps(residual + i + 4 * g, _mm_sub_ps(x, _mm_mul_ps(_mm_cvtepi32_ps(q[g]), scales)));
        }
      }
      // Saturating packs: |q| <= 127 already (|r| <= the block's largest), so nothing is clipped.
      const __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), bytes);
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = r[i];
    const int8_t code = codeOf(x, inverse);
    codes[i] = code;
    if (residual) {
      residual[i] = x - static_cast<float>(code) * scale;
    }
  }
}

// out[0..n) = (or +=) codes x scale.
template <bool Accumulate>
void decodeBlock(const int8_t* codes, float scale, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 scales = _mm_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    // Sign-extend: each byte into the high half of a 16-bit lane, then shifted down arithmetically.
    const __m128i low16 = _mm_srai_epi16(_mm_unpacklo_epi8(bytes, bytes), 8);
    const __m128i high16 = _mm_srai_epi16(_mm_unpackhi_epi8(bytes, bytes), 8);
    const __m128i words[4] = {
        _mm_srai_epi32(_mm_unpacklo_epi16(low16, low16), 16), _mm_srai_epi32(_mm_unpackhi_epi16(low16, low16), 16),
        _mm_srai_epi32(_mm_unpacklo_epi16(high16, high16), 16), _mm_srai_epi32(_mm_unpackhi_epi16(high16, high16), 16)};
    for (int g = 0; g < 4; ++g) {
      const __m128 value = _mm_mul_ps(_mm_cvtepi32_ps(words[g]), scales);
      float* at = out + i + 4 * g;
      _mm_storeu_ps(at, Accumulate ? _mm_add_ps(_mm_loadu_ps(at), value) : value);
    }
  }
#endif
  for (; i < n; ++i) {
    const float value = static_cast<float>(codes[i]) * scale;
    out[i] = Accumulate ? out[i] + value : value;
  }
}

}  // namespace

void encodeInt8Cpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block) {
  auto* codes = reinterpret_cast<int8_t*>(row);
  auto* scales = reinterpret_cast<float*>(row + int8ScalesOffset(count));
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    float* blockResidual = residual ? residual + begin : nullptr;
    const float largest = loadBlock(values + begin, blockResidual, n);
    scales[b] = largest / kInt8Levels;
    codeBlock(values + begin, blockResidual, codes + begin, n, scales[b], int8Inverse(largest));
  }
  std::memset(row + count, 0, static_cast<size_t>(int8ScalesOffset(count) - count));
}

void decodeInt8Cpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   bool sum, bool accumulate) {
  // Block by block, every row's piece of it: with `sum` the block's out stays in the L1 cache while
  // the rows are added into it.
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    for (int64_t r = 0; r < rowCount; ++r) {
      const uint8_t* row = rows + r * rowBytes;
      const auto* codes = reinterpret_cast<const int8_t*>(row) + begin;
      float scale;
      std::memcpy(&scale, row + int8ScalesOffset(count) + 4 * b, sizeof(float));
      if (!sum) {
        decodeBlock<false>(codes, scale, out + r * count + begin, n);
      } else if (r == 0 && !accumulate) {
        decodeBlock<false>(codes, scale, out + begin, n);
      } else {
        decodeBlock<true>(codes, scale, out + begin, n);
      }
    }
  }
}

namespace {

// The "int8" code, described once (kernels/code.h): the registry's entry for it.
CodeDescriptor described() {
  CodeDescriptor code;
  code.name = "int8";
  code.summary = "round_half_even(x * 127 / m), m the largest |x| of its block; one float32 scale a block";
  code.readsBlock = true;
  code.carriesSums = true;
  code.rowBytes = [](int64_t count, const CodeSettings& s) { return int8RowBytes(count, s.block); };
  code.encodeRow = [](const CodeSettings& s, const float* values, float* residual, uint8_t* row, int64_t count) {
    encodeInt8Cpu(values, residual, row, count, s.block);
  };
  code.decodeRows = [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
                       int64_t count, bool sum,
                       bool accumulate) { decodeInt8Cpu(wire, rows, rowBytes, out, count, s.block, sum, accumulate); };
  return code;
}

const CodeRegistration registered{described()};

}  // namespace

}  // namespace chainermn
