// The "4bit" code: block-quantised 4-bit codes, two values a byte (value i in the low nibble of byte
// i / 2 when i is even, the high nibble when odd), 7 levels a side: with m the block's largest |r|,
// its scale is m / 7 and value i travels as round_half_even(r x (7 / m)), a nibble from -7 to 7. One
// of the block-scaled integer codes (kernels/block_int.h: the layout, the arithmetic and the CPU
// kernels, written once for every width); its CUDA kernels: cuda/int4_kernels.cu.
#pragma once

#include "kernels/block_int.h"

namespace chainermn {

using Int4 = BlockInt<4>;  // 7 levels a side, blocks a multiple of 2 values

}  // namespace chainermn
