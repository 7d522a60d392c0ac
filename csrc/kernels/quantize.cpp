#include "kernels/quantize.h"

#include "kernels/code.h"

#include <cmath>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// Each kernel is one pass over the values (1-bit's quantize: two, the scale needs the whole chunk
// first). Where SSE2 is there (every x86-64), four values go at a time: compares give lane masks, and
// movemask turns them into code bits; the arithmetic is the scalar code's exactly (x - 0 and x + 0
// where nothing is sent), so both paths give the same bits. Elsewhere the scalar loops run.

namespace chainermn {
namespace {

// ---- scalar: the specification, and the tails ---------------------------------------------------

// One word of 2-bit codes for `n` (<= 16) values from `i0`.
inline uint32_t quantizeWord2bit(const float* add, float* residual, int64_t i0, int n, float t) {
  uint32_t bits = 0;
  for (int k = 0; k < n; ++k) {
    float r = residual[i0 + k] + (add ? add[i0 + k] : 0.0f);
    const uint32_t pos = r >= t;
    const uint32_t neg = r <= -t;
    r -= pos ? t : 0.0f;
    r += neg ? t : 0.0f;
    residual[i0 + k] = r;
    bits |= (pos | (neg << 1)) << (2 * k);
  }
  return bits;
}

inline float value2bit(uint32_t bits, int k, float t) {
  return static_cast<float>((bits >> (2 * k)) & 1u) * t - static_cast<float>((bits >> (2 * k + 1)) & 1u) * t;
}

#if defined(__SSE2__)

// Bit k of a nibble at bit 2k of a byte.
constexpr uint8_t kSpread[16] = {0x00, 0x01, 0x04, 0x05, 0x10, 0x11, 0x14, 0x15,
                                 0x40, 0x41, 0x44, 0x45, 0x50, 0x51, 0x54, 0x55};

// A full word of 2-bit codes for the 16 values from i0.
inline uint32_t quantizeWord2bitSse(const float* add, float* residual, int64_t i0, __m128 t, __m128 minusT) {
  uint32_t bits = 0;
  for (int g = 0; g < 4; ++g) {
    float* at = residual + i0 + 4 * g;
    __m128 r = _mm_add_ps(_mm_loadu_ps(at), add ? _mm_loadu_ps(add + i0 + 4 * g) : _mm_setzero_ps());
    const __m128 pos = _mm_cmpge_ps(r, t);
    const __m128 neg = _mm_cmple_ps(r, minusT);
    r = _mm_sub_ps(r, _mm_and_ps(pos, t));
    r = _mm_add_ps(r, _mm_and_ps(neg, t));
    _mm_storeu_ps(at, r);
    const uint32_t codes = kSpread[_mm_movemask_ps(pos)] | (kSpread[_mm_movemask_ps(neg)] << 1);
    bits |= codes << (8 * g);
  }
  return bits;
}

// out[0..4) (+)= the values of the four codes in `byte`.
template <bool Accumulate>
inline void dequantizeFour2bit(uint32_t byte, float* out, __m128 t) {
  const __m128i posBits = _mm_set_epi32(64, 16, 4, 1);
  const __m128i negBits = _mm_set_epi32(128, 32, 8, 2);
  const __m128i b = _mm_set1_epi32(static_cast<int>(byte));
  const __m128 pos = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(b, posBits), posBits));
  const __m128 neg = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(b, negBits), negBits));
  const __m128 value = _mm_sub_ps(_mm_and_ps(pos, t), _mm_and_ps(neg, t));
  _mm_storeu_ps(out, Accumulate ? _mm_add_ps(_mm_loadu_ps(out), value) : value);
}

// out[0..4) (+)= +scale or -scale by the four sign bits of `nibble`.
template <bool Accumulate>
inline void dequantizeFour1bit(uint32_t nibble, float* out, __m128 scale, __m128 minusScale) {
  const __m128i bits = _mm_set_epi32(8, 4, 2, 1);
  const __m128 positive =
      _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32(static_cast<int>(nibble)), bits), bits));
  const __m128 value = _mm_or_ps(_mm_and_ps(positive, scale), _mm_andnot_ps(positive, minusScale));
  _mm_storeu_ps(out, Accumulate ? _mm_add_ps(_mm_loadu_ps(out), value) : value);
}

#endif

void quantize2bit(const float* add, float* residual, uint32_t* block, int64_t count, int64_t words, float t) {
  const int64_t full = count / 16;
  int64_t w = 0;
#if defined(__SSE2__)
  const __m128 tv = _mm_set1_ps(t);
  const __m128 minusT = _mm_set1_ps(-t);
  for (; w < full; ++w) {
    block[w] = quantizeWord2bitSse(add, residual, w * 16, tv, minusT);
  }
#else
  for (; w < full; ++w) {
    block[w] = quantizeWord2bit(add, residual, w * 16, 16, t);
  }
#endif
  if (count % 16) {
    block[w] = quantizeWord2bit(add, residual, w * 16, static_cast<int>(count % 16), t);
    ++w;
  }
  std::memset(block + w, 0, (words - w) * sizeof(uint32_t));
}

template <bool Accumulate>
void dequantize2bit(const uint32_t* block, float* out, int64_t count, float t) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 tv = _mm_set1_ps(t);
  for (; i + 16 <= count; i += 16) {
    const uint32_t bits = block[i / 16];
    for (int g = 0; g < 4; ++g) {
      dequantizeFour2bit<Accumulate>((bits >> (8 * g)) & 0xffu, out + i + 4 * g, tv);
    }
  }
#endif
  for (; i < count; ++i) {
    const float value = value2bit(block[i / 16], static_cast<int>(i % 16), t);
    out[i] = Accumulate ? out[i] + value : value;
  }
}

void quantize1bit(const float* add, float* residual, uint32_t* block, int64_t count, int64_t words) {
  // Pass 1: the error feedback, and the magnitude (in double: rounding the mean to float hides the
  // order of the sum, so four lanes may sum side by side).
  double magnitude = 0.0;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 sign = _mm_set1_ps(-0.0f);
  __m128d low = _mm_setzero_pd();
  __m128d high = _mm_setzero_pd();
  for (; i + 4 <= count; i += 4) {
    const __m128 r = _mm_add_ps(_mm_loadu_ps(residual + i), add ? _mm_loadu_ps(add + i) : _mm_setzero_ps());
    _mm_storeu_ps(residual + i, r);
    const __m128 size = _mm_andnot_ps(sign, r);
    low = _mm_add_pd(low, _mm_cvtps_pd(size));
    high = _mm_add_pd(high, _mm_cvtps_pd(_mm_movehl_ps(size, size)));
  }
  double lanes[2];
  _mm_storeu_pd(lanes, _mm_add_pd(low, high));
  magnitude = lanes[0] + lanes[1];
#endif
  for (; i < count; ++i) {
    const float r = residual[i] + (add ? add[i] : 0.0f);
    residual[i] = r;
    magnitude += std::fabs(r);
  }
  const float scale = count > 0 ? static_cast<float>(magnitude / static_cast<double>(count)) : 0.0f;
  std::memcpy(block, &scale, sizeof(float));
  // Pass 2: the signs; what was sent leaves the residual.
  uint32_t* signs = block + 1;
  i = 0;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  const __m128 scales = _mm_set1_ps(scale);
  const __m128 minusScales = _mm_set1_ps(-scale);
  for (; i + 32 <= count; i += 32) {
    uint32_t bits = 0;
    for (int g = 0; g < 8; ++g) {
      float* at = residual + i + 4 * g;
      const __m128 r = _mm_loadu_ps(at);
      const __m128 positive = _mm_cmpge_ps(r, zero);
      const __m128 sent = _mm_or_ps(_mm_and_ps(positive, scales), _mm_andnot_ps(positive, minusScales));
      _mm_storeu_ps(at, _mm_sub_ps(r, sent));
      bits |= static_cast<uint32_t>(_mm_movemask_ps(positive)) << (4 * g);
    }
    signs[i / 32] = bits;
  }
#endif
  for (; i < count; i += 32) {
    const int n = static_cast<int>(count - i < 32 ? count - i : 32);
    uint32_t bits = 0;
    for (int k = 0; k < n; ++k) {
      const uint32_t positive = residual[i + k] >= 0.0f;
      residual[i + k] -= positive ? scale : -scale;
      bits |= positive << k;
    }
    signs[i / 32] = bits;
  }
  const int64_t signWords = (count + 31) / 32;
  std::memset(signs + signWords, 0, (words - 1 - signWords) * sizeof(uint32_t));
}

template <bool Accumulate>
void dequantize1bit(const uint32_t* block, float* out, int64_t count) {
  float scale;
  std::memcpy(&scale, block, sizeof(float));
  const uint32_t* signs = block + 1;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 scales = _mm_set1_ps(scale);
  const __m128 minusScales = _mm_set1_ps(-scale);
  for (; i + 32 <= count; i += 32) {
    const uint32_t bits = signs[i / 32];
    for (int g = 0; g < 8; ++g) {
      dequantizeFour1bit<Accumulate>((bits >> (4 * g)) & 0xfu, out + i + 4 * g, scales, minusScales);
    }
  }
#endif
  for (; i < count; ++i) {
    const float value = ((signs[i / 32] >> (i % 32)) & 1u) ? scale : -scale;
    out[i] = Accumulate ? out[i] + value : value;
  }
}

}  // namespace

void quantizeCpu(QuantizeKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk,
                 float threshold) {
  const int64_t words = blockWords(kind, chunk);
  if (kind == QuantizeKind::TwoBit) {
    quantize2bit(add, residual, block, count, words, threshold);
  } else {
    quantize1bit(add, residual, block, count, words);
  }
}

void dequantizeCpu(QuantizeKind kind, const uint32_t* block, float* out, int64_t count, float threshold,
                   bool accumulate) {
  if (kind == QuantizeKind::TwoBit) {
    accumulate ? dequantize2bit<true>(block, out, count, threshold)
               : dequantize2bit<false>(block, out, count, threshold);
  } else {
    accumulate ? dequantize1bit<true>(block, out, count) : dequantize1bit<false>(block, out, count);
  }
}

namespace {

// "2bit" and "1bit", each described once (kernels/code.h): the registry's entries for them. A row is
// one block of blockWords words.
template <QuantizeKind Kind>
void encodeRow(const CodeSettings& s, const float* values, float* residual, uint8_t* row, int64_t count) {
  quantizeCpu(Kind, values, residual, reinterpret_cast<uint32_t*>(row), count, count, s.threshold);
}

template <QuantizeKind Kind>
void decodeRows(const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                bool sum, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    dequantizeCpu(Kind, reinterpret_cast<const uint32_t*>(wire + r * rowBytes), sum ? out : out + r * count, count,
                  s.threshold, sum && (r > 0 || accumulate));
  }
}

template <QuantizeKind Kind>
int64_t rowBytes(int64_t count, const CodeSettings&) {
  return 4 * blockWords(Kind, count);
}

CodeDescriptor twoBit() {
  CodeDescriptor code;
  code.name = "2bit";
  code.summary = "MXNet's: +threshold where r >= threshold, -threshold where r <= -threshold, else 0; 16 values a word";
  code.readsThreshold = true;
  code.needsResidual = true;  // what is not sent waits in the residual
  code.rowBytes = rowBytes<QuantizeKind::TwoBit>;
  code.encodeRow = encodeRow<QuantizeKind::TwoBit>;
  code.decodeRows = decodeRows<QuantizeKind::TwoBit>;
  return code;
}

CodeDescriptor oneBit() {
  CodeDescriptor code;
  code.name = "1bit";
  code.summary = "the sign, times the row's mean |r|; 32 values a word after a float32 scale";
  code.needsResidual = true;
  code.rowBytes = rowBytes<QuantizeKind::OneBit>;
  code.encodeRow = encodeRow<QuantizeKind::OneBit>;
  code.decodeRows = decodeRows<QuantizeKind::OneBit>;
  return code;
}

const CodeRegistration registeredTwoBit{twoBit()};
const CodeRegistration registeredOneBit{oneBit()};

}  // namespace

}  // namespace chainermn
