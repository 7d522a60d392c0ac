// The "int2" code's CUDA kernels (cuda/block_int_kernels.cuh, at kernels/int2.h's width), added to
// its descriptor (kernels/int2.cpp) in the CUDA build.
#include "cuda/block_int_kernels.cuh"
#include "kernels/int2.h"

namespace chainermn::cuda {
namespace {

const CudaCodeRegistration registered{"int2", encodeBlockIntCuda<Int2::kBits>, decodeBlockIntCuda<Int2::kBits>};

}  // namespace
}  // namespace chainermn::cuda
