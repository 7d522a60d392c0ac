#include "cuda/codes_kernels.h"

#include "cuda/int4_kernels.h"
#include "cuda/int8_kernels.h"
#include "cuda/quantize_kernels.h"
#include "cuda/topk_kernels.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace chainermn::cuda {

void encode(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire, int64_t rows,
            int64_t rowBytes, int64_t count, void* stream) {
  switch (code) {
    case Code::Int8:
      encodeInt8(values, residual, wire, rows, rowBytes, count, settings.block, stream);
      break;
    case Code::FourBit:
      encodeInt4(values, residual, wire, rows, rowBytes, count, settings.block, stream);
      break;
    case Code::TopK:
      encodeTopk(values, residual, wire, rows, rowBytes, count, settings.block, settings.keep, stream);
      break;
    case Code::TwoBit:
    case Code::OneBit:
      for (int64_t r = 0; r < rows; ++r) {
        quantize(code, values ? values + r * count : nullptr, residual + r * count,
                 reinterpret_cast<uint32_t*>(wire + r * rowBytes), count, count, settings.threshold, stream);
      }
      break;
  }
  // The row's room past its codes (a chunk's row is sized for the longest chunk): zero, as on the CPU.
  const int64_t used = wireRowBytes(code, count, settings);
  if (rows > 0 && rowBytes > used) {
    C10_CUDA_CHECK(cudaMemset2DAsync(wire + used, rowBytes, 0, rowBytes - used, rows, static_cast<cudaStream_t>(stream)));
  }
}

void decode(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
            int64_t count, bool sum, bool accumulate, void* stream) {
  switch (code) {
    case Code::Int8:
      decodeInt8(wire, rows, rowBytes, out, count, settings.block, sum, accumulate, stream);
      return;
    case Code::FourBit:
      decodeInt4(wire, rows, rowBytes, out, count, settings.block, sum, accumulate, stream);
      return;
    case Code::TopK:
      decodeTopk(wire, rows, rowBytes, out, count, settings.block, settings.keep, sum, accumulate, stream);
      return;
    case Code::TwoBit:
    case Code::OneBit:
      for (int64_t r = 0; r < rows; ++r) {
        dequantize(code, reinterpret_cast<const uint32_t*>(wire + r * rowBytes), sum ? out : out + r * count, count,
                   settings.threshold, sum && (r > 0 || accumulate), stream);
      }
      return;
  }
}

} // namespace chainermn::cuda
