#include "kernels/block_scale.h"

#include <algorithm>
#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace chainermn {

float loadBlock(const float* values, float* residual, int64_t n) {
  float largest = 0.0f;
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 sign = _mm_set1_ps(-0.0f);
  __m128 most = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) {
    __m128 r = _mm_loadu_ps(values + i);
    if (residual) {
      r = _mm_add_ps(_mm_loadu_ps(residual + i), r);
      _mm_storeu_ps(residual + i, r);
    }
    most = _mm_max_ps(most, _mm_andnot_ps(sign, r));
  }
  float lanes[4];
  _mm_storeu_ps(lanes, most);
  largest = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
#endif
  for (; i < n; ++i) {
    float r = values[i];
    if (residual) {
      r = residual[i] + r;
      residual[i] = r;
    }
    largest = std::max(largest, std::fabs(r));
  }
  return largest;
}

}  // namespace chainermn
