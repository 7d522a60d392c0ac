// The CUDA implementation of the torch_chainermn code operators (schemas and the CPU's:
// python/codes_ops.cpp; kernels/codes.h says what they do): the kernels run on the current stream
// of the tensors' device, as any torch operator's do.
#include "cuda/int8_kernels.h"
#include "cuda/quantize_kernels.h"
#include "kernels/codes.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace chainermn::cuda {
namespace {

void* currentStream(const at::Tensor& on) {
  return c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
}

void encodeCuda(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
                c10::string_view codeName, int64_t block, double threshold) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.encode");
  const auto [rows, count] = checkEncode(values, wire, residual, code, block);
  const c10::cuda::CUDAGuard guard(values.device());
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  const int64_t rowBytes = wire.size(1);
  if (code == Code::Int8) {
    encodeInt8(values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, rowBytes, count, block,
               currentStream(values));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    quantize(compressionKindOf(code), values.data_ptr<float>() + r * count, kept + r * count,
             reinterpret_cast<uint32_t*>(wire.data_ptr<uint8_t>() + r * rowBytes), count, count,
             static_cast<float>(threshold), currentStream(values));
  }
}

void decodeCuda(const at::Tensor& wire, const at::Tensor& out, c10::string_view codeName, int64_t block, double threshold,
                bool sum) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.decode");
  const auto [rows, count] = checkDecode(wire, out, code, block, sum);
  const c10::cuda::CUDAGuard guard(out.device());
  if (rows == 0) {
    out.zero_();
    return;
  }
  const int64_t rowBytes = wire.size(1);
  if (code == Code::Int8) {
    decodeInt8(wire.data_ptr<uint8_t>(), rows, rowBytes, out.data_ptr<float>(), count, block, sum, currentStream(out));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    dequantize(compressionKindOf(code), reinterpret_cast<const uint32_t*>(wire.data_ptr<uint8_t>() + r * rowBytes),
               out.data_ptr<float>() + (sum ? 0 : r * count), count, static_cast<float>(threshold), sum && r > 0,
               currentStream(out));
  }
}

} // namespace

TORCH_LIBRARY_IMPL(torch_chainermn, CUDA, m) {
  m.impl("encode", &encodeCuda);
  m.impl("decode", &decodeCuda);
}

} // namespace chainermn::cuda
