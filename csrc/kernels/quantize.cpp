#include "kernels/quantize.h"

#include <cmath>
#include <cstring>

namespace chainermn {
namespace {

// One word of 2-bit codes for `n` (<= 16) values from `i0`. Branch-free, so the compiler vectorises
// the loop over a full word.
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

void quantize2bit(const float* add, float* residual, uint32_t* block, int64_t count, int64_t words, float t) {
  const int64_t full = count / 16;
  if (add) {
    for (int64_t w = 0; w < full; ++w) {
      block[w] = quantizeWord2bit(add, residual, w * 16, 16, t);
    }
  } else {
    for (int64_t w = 0; w < full; ++w) {
      block[w] = quantizeWord2bit(nullptr, residual, w * 16, 16, t);
    }
  }
  int64_t w = full;
  if (count % 16) {
    block[w] = quantizeWord2bit(add, residual, w * 16, static_cast<int>(count % 16), t);
    ++w;
  }
  std::memset(block + w, 0, (words - w) * sizeof(uint32_t));
}

void quantize1bit(const float* add, float* residual, uint32_t* block, int64_t count, int64_t words) {
  double magnitude = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const float r = residual[i] + (add ? add[i] : 0.0f);
    residual[i] = r;
    magnitude += std::fabs(r);
  }
  const float scale = count > 0 ? static_cast<float>(magnitude / static_cast<double>(count)) : 0.0f;
  std::memcpy(block, &scale, sizeof(float));
  uint32_t* signs = block + 1;
  const int64_t signWords = (count + 31) / 32;
  for (int64_t w = 0; w < signWords; ++w) {
    const int n = static_cast<int>(count - w * 32 < 32 ? count - w * 32 : 32);
    float* r = residual + w * 32;
    uint32_t bits = 0;
    for (int k = 0; k < n; ++k) {
      const uint32_t positive = r[k] >= 0.0f;
      r[k] -= positive ? scale : -scale;
      bits |= positive << k;
    }
    signs[w] = bits;
  }
  std::memset(signs + signWords, 0, (words - 1 - signWords) * sizeof(uint32_t));
}

template <bool Accumulate>
void dequantize2bit(const uint32_t* block, float* out, int64_t count, float t) {
  for (int64_t w = 0; w * 16 < count; ++w) {
    const uint32_t bits = block[w];
    const int n = static_cast<int>(count - w * 16 < 16 ? count - w * 16 : 16);
    float* o = out + w * 16;
    for (int k = 0; k < n; ++k) {
      const float value = static_cast<float>((bits >> (2 * k)) & 1u) * t - static_cast<float>((bits >> (2 * k + 1)) & 1u) * t;
      o[k] = Accumulate ? o[k] + value : value;
    }
  }
}

template <bool Accumulate>
void dequantize1bit(const uint32_t* block, float* out, int64_t count) {
  float scale;
  std::memcpy(&scale, block, sizeof(float));
  const uint32_t* signs = block + 1;
  for (int64_t w = 0; w * 32 < count; ++w) {
    const uint32_t bits = signs[w];
    const int n = static_cast<int>(count - w * 32 < 32 ? count - w * 32 : 32);
    float* o = out + w * 32;
    for (int k = 0; k < n; ++k) {
      const float value = ((bits >> k) & 1u) ? scale : -scale;
      o[k] = Accumulate ? o[k] + value : value;
    }
  }
}

} // namespace

void quantizeCpu(
    CompressionKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk, float threshold) {
  const int64_t words = blockWords(kind, chunk);
  if (kind == CompressionKind::TwoBit) {
    quantize2bit(add, residual, block, count, words, threshold);
  } else {
    quantize1bit(add, residual, block, count, words);
  }
}

void dequantizeCpu(CompressionKind kind, const uint32_t* block, float* out, int64_t count, float threshold, bool accumulate) {
  if (kind == CompressionKind::TwoBit) {
    accumulate ? dequantize2bit<true>(block, out, count, threshold) : dequantize2bit<false>(block, out, count, threshold);
  } else {
    accumulate ? dequantize1bit<true>(block, out, count) : dequantize1bit<false>(block, out, count);
  }
}

} // namespace chainermn
