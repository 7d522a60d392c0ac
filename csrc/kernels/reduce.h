// Element-wise reduction of several equally long buffers into one, on the CPU: the inner step of
// every shared-memory reduction. Each pass is a simple loop the compiler vectorises.
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>

namespace chainermn {

// dst[i] = sources[0][i] op sources[1][i] op ... for i < count. dst may be sources[0] or sources[1]
// (the first pass writes sources[0] op sources[1] into dst), never a later source.
void reduceBuffers(void* dst, const void* const* sources, int numSources, int64_t count, c10::ScalarType dtype,
                   ReduceKind op);

}  // namespace chainermn
