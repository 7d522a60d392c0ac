// The vocabulary every layer shares: what a reduction does and what a flat buffer is. It includes
// nothing of this project, so kernels, transports and strategies can all use it without pointing
// up a layer.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace chainermn {

// The associative reductions a transport must provide. AVG and PREMUL_SUM are built on Sum above
// the transports; bool is carried as uint8 with Min/Max.
enum class ReduceKind : uint8_t { Sum, Product, Min, Max, BitAnd, BitOr, BitXor };

const char* reduceKindName(ReduceKind kind);

// torch's spelling of a dtype, as users see it in Python ("torch.float16").
std::string dtypeName(c10::ScalarType dtype);

// `count` elements of `dtype` at `data`: a tensor's memory, or a whole packed buffer.
struct FlatBuffer {
  void* data;
  int64_t count;
  c10::ScalarType dtype;
};

// A receive that matches whichever rank sends first.
constexpr int kAnySource = -1;

}  // namespace chainermn
