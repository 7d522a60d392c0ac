#include "kernels/cast.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace chainermn {
namespace {

template <typename D, typename S>
void castScaleTyped(D* dst, const S* src, int64_t n, double scale) {
  // float arithmetic unless a double is involved: what torch would compute in.
  using C = std::conditional_t<std::is_same_v<D, double> || std::is_same_v<S, double>, double, float>;
  const C factor = static_cast<C>(scale);
  if (scale == 1.0) {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<C>(src[i]));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<C>(src[i]) * factor);
    }
  }
}

template <typename S>
void fromSource(void* dst, c10::ScalarType dstType, const S* src, int64_t n, double scale) {
  switch (dstType) {
    case c10::ScalarType::Float:
      return castScaleTyped(static_cast<float*>(dst), src, n, scale);
    case c10::ScalarType::Double:
      return castScaleTyped(static_cast<double*>(dst), src, n, scale);
    case c10::ScalarType::Half:
      return castScaleTyped(static_cast<c10::Half*>(dst), src, n, scale);
    case c10::ScalarType::BFloat16:
      return castScaleTyped(static_cast<c10::BFloat16*>(dst), src, n, scale);
    default:
      TORCH_CHECK(false, "chainermn: cannot cast to ", dstType);
  }
}

}  // namespace

void castScale(void* dst, c10::ScalarType dstType, const void* src, c10::ScalarType srcType, int64_t count,
               double scale) {
  switch (srcType) {
    case c10::ScalarType::Float:
      return fromSource(dst, dstType, static_cast<const float*>(src), count, scale);
    case c10::ScalarType::Double:
      return fromSource(dst, dstType, static_cast<const double*>(src), count, scale);
    case c10::ScalarType::Half:
      return fromSource(dst, dstType, static_cast<const c10::Half*>(src), count, scale);
    case c10::ScalarType::BFloat16:
      return fromSource(dst, dstType, static_cast<const c10::BFloat16*>(src), count, scale);
    default:
      TORCH_CHECK(false, "chainermn: cannot cast from ", srcType);
  }
}

}  // namespace chainermn
