// What a code is (kernels/codes.h is the registry that names them and runs their kernels): its
// identity and the settings it may read. A header of its own so that each code's kernels can name
// the codes without including the registry that includes them.
#pragma once

#include <cstdint>

namespace chainermn {

enum class Code : int32_t { Int8 = 0, TwoBit = 1, OneBit = 2, FourBit = 3, TopK = 4 };

// What a code reads of these: 2-bit the threshold, int8 and 4-bit the block, top-k the block and keep.
struct CodeSettings {
  float threshold = 0.5f;
  int64_t block = 256;
  int64_t keep = 8;  // top-k: values sent per block (1 to block)
};

} // namespace chainermn
