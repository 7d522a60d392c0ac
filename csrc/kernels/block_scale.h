// What the block codes (int8, block_int: 4-bit and int2; topk) share: one pass over a block that forms r = value (+
// residual) and finds its largest magnitude, from which the block's scale comes.
#pragma once

#include <cstdint>

namespace chainermn {

// r = value (+ residual) for the block's n values, kept in the residual when there is one; returns
// the largest |r|. Four values at a time where SSE2 is there; the same result either way.
float loadBlock(const float* values, float* residual, int64_t n);

}  // namespace chainermn
