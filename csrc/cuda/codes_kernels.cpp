#include "cuda/codes_kernels.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace chainermn::cuda {

namespace {

// A code's CUDA kernels come from its CUDA file (cuda/<code>_kernels.cu); a code registered without
// them runs on the CPU only.
void checkHasCuda(Code code, const char* what) {
  TORCH_CHECK(code->encodeCuda != nullptr && code->decodeCuda != nullptr, "chainermn: ", what, ": the ", code->name,
              " code has no CUDA kernels in this build (cuda/<code>_kernels.cu registers them)");
}

}  // namespace

void encode(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire, int64_t rows,
            int64_t rowBytes, int64_t count, void* stream) {
  checkHasCuda(code, "encode");
  code->encodeCuda(settings, values, residual, wire, rows, rowBytes, count, stream);
  // The row's room past its codes (a chunk's row is sized for the longest chunk): zero, as on the CPU.
  const int64_t used = wireRowBytes(code, count, settings);
  if (rows > 0 && rowBytes > used) {
    C10_CUDA_CHECK(
        cudaMemset2DAsync(wire + used, rowBytes, 0, rowBytes - used, rows, static_cast<cudaStream_t>(stream)));
  }
}

void decode(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
            int64_t count, bool sum, bool accumulate, void* stream) {
  checkHasCuda(code, "decode");
  code->decodeCuda(settings, wire, rows, rowBytes, out, count, sum, accumulate, stream);
}

}  // namespace chainermn::cuda
