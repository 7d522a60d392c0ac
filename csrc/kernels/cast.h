// Cast with an optional scale, in one pass: dst[i] = (dst type)(src[i] * scale). Packing gradients
// into the wire dtype (and unpacking them) uses it so that cast and mean scaling cost one pass.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace chainermn {

// Floating dtypes only (float16, bfloat16, float32, float64), any pair.
void castScale(void* dst, c10::ScalarType dstType, const void* src, c10::ScalarType srcType, int64_t count,
               double scale);

}  // namespace chainermn
