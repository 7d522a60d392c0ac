// The "int2" code: block-scaled 2-bit codes (ternary: -1, 0, +1 times the block's scale, as
// TernGrad's), four values a byte (value i in bits 2 x (i % 4) of byte i / 4: 0b01 is +1, 0b11 is -1,
// 0b00 is 0), 1 level a side: with m the block's largest |r|, its scale is m and value i travels as
// round_half_even(r x (1 / m)). One of the block-scaled integer codes (kernels/block_int.h: the
// layout, the arithmetic and the CPU kernels, written once for every width); its CUDA kernels:
// cuda/int2_kernels.cu.
#pragma once

#include "kernels/block_int.h"

namespace chainermn {

using Int2 = BlockInt<2>;  // 1 level a side, blocks a multiple of 4 values

}  // namespace chainermn
