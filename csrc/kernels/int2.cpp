// The "int2" code's descriptor: a block-scaled integer code (kernels/block_int.h) of 2 bits.
#include "kernels/int2.h"

#include "kernels/code.h"

namespace chainermn {
namespace {

const CodeRegistration registered{blockIntDescriptor<Int2::kBits>(
    "int2",
    "round_half_even(x / m) (-1, 0 or +1), four values a byte, m the largest |x| of its block; "
    "one float32 scale a block")};

}  // namespace
}  // namespace chainermn
