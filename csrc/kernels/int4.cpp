// The "4bit" code's descriptor: a block-scaled integer code (kernels/block_int.h) of 4 bits.
#include "kernels/int4.h"

#include "kernels/code.h"

namespace chainermn {
namespace {

CodeDescriptor described() {
  CodeDescriptor code = blockIntDescriptor<Int4::kBits>(
      "4bit",
      "round_half_even(x * 7 / m), two values a byte, m the largest |x| of its block; one float32 scale a block");
  code.carriesSums = true;  // 15 levels a block lose little of a mean's sums (kernels/code.h)
  return code;
}

const CodeRegistration registered{described()};

}  // namespace
}  // namespace chainermn
