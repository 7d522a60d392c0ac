// The "4bit" code's CUDA kernels (cuda/block_int_kernels.cuh, at kernels/int4.h's width), added to
// its descriptor (kernels/int4.cpp) in the CUDA build.
#include "cuda/block_int_kernels.cuh"
#include "kernels/int4.h"

namespace chainermn::cuda {
namespace {

const CudaCodeRegistration registered{"4bit", encodeBlockIntCuda<Int4::kBits>, decodeBlockIntCuda<Int4::kBits>};

}  // namespace
}  // namespace chainermn::cuda
