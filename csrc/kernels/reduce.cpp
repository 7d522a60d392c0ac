#include "kernels/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace chainermn {
namespace {

// 16-bit floats are combined in float and rounded once per step, as torch does on the CPU.
template <typename T>
using Compute = std::conditional_t<std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, T>;

template <typename T, typename Combine>
void combine(T* dst, const T* a, const T* b, int64_t n, Combine f) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(f(static_cast<Compute<T>>(a[i]), static_cast<Compute<T>>(b[i])));
  }
}

template <typename T, typename Combine>
void reduceWith(void* dst, const void* const* sources, int numSources, int64_t n, Combine f) {
  auto* out = static_cast<T*>(dst);
  if (numSources == 1) {
    if (out != sources[0]) {
      std::copy_n(static_cast<const T*>(sources[0]), n, out);
    }
    return;
  }
  // The first pass reads two sources; each later one folds one more into dst (kept in cache by the
  // caller's chunking).
  combine(out, static_cast<const T*>(sources[0]), static_cast<const T*>(sources[1]), n, f);
  for (int s = 2; s < numSources; ++s) {
    combine(out, out, static_cast<const T*>(sources[s]), n, f);
  }
}

template <typename T>
void reduceTyped(void* dst, const void* const* sources, int numSources, int64_t n, ReduceKind op) {
  using C = Compute<T>;
  switch (op) {
    case ReduceKind::Sum:
      return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return a + b; });
    case ReduceKind::Product:
      return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return a * b; });
    case ReduceKind::Min:
      return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return std::min(a, b); });
    case ReduceKind::Max:
      return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return std::max(a, b); });
    default:
      break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case ReduceKind::BitAnd:
        return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return a & b; });
      case ReduceKind::BitOr:
        return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return a | b; });
      case ReduceKind::BitXor:
        return reduceWith<T>(dst, sources, numSources, n, [](C a, C b) { return a ^ b; });
      default:
        break;
    }
  }
  TORCH_CHECK(false, "chainermn: ", reduceKindName(op), " is not defined for this dtype");
}

}  // namespace

void reduceBuffers(void* dst, const void* const* sources, int numSources, int64_t count, c10::ScalarType dtype,
                   ReduceKind op) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return reduceTyped<float>(dst, sources, numSources, count, op);
    case c10::ScalarType::Double:
      return reduceTyped<double>(dst, sources, numSources, count, op);
    case c10::ScalarType::Half:
      return reduceTyped<c10::Half>(dst, sources, numSources, count, op);
    case c10::ScalarType::BFloat16:
      return reduceTyped<c10::BFloat16>(dst, sources, numSources, count, op);
    case c10::ScalarType::Char:
      return reduceTyped<int8_t>(dst, sources, numSources, count, op);
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return reduceTyped<uint8_t>(dst, sources, numSources, count, op);
    case c10::ScalarType::Int:
      return reduceTyped<int32_t>(dst, sources, numSources, count, op);
    case c10::ScalarType::Long:
      return reduceTyped<int64_t>(dst, sources, numSources, count, op);
    default:
      TORCH_CHECK(false, "chainermn: cannot reduce dtype ", dtype, " in shared memory");
  }
}

}  // namespace chainermn
