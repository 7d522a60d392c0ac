// The CUDA implementation of the torch_chainermn code operators (schemas and the CPU's:
// python/codes_ops.cpp; kernels/codes.h says what they do): the kernels run on the current stream
// of the tensors' device, as any torch operator's do.
#include "cuda/codes_kernels.h"
#include "kernels/code_checks.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace chainermn::cuda {
namespace {

void* currentStream(const at::Tensor& on) {
  return c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
}

void encodeCuda(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
                c10::string_view codeName, int64_t block, double threshold, int64_t keep) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.encode");
  const CodeSettings settings{static_cast<float>(threshold), block, keep};
  const auto [rows, count] = checkEncode(values, wire, residual, code, settings);
  const c10::cuda::CUDAGuard guard(values.device());
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  encode(code, settings, values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, wire.size(1), count,
         currentStream(values));
}

void decodeCuda(const at::Tensor& wire, const at::Tensor& out, c10::string_view codeName, int64_t block,
                double threshold, bool sum, int64_t keep) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.decode");
  const CodeSettings settings{static_cast<float>(threshold), block, keep};
  const auto [rows, count] = checkDecode(wire, out, code, settings, sum);
  const c10::cuda::CUDAGuard guard(out.device());
  if (rows == 0) {
    out.zero_();
    return;
  }
  decode(code, settings, wire.data_ptr<uint8_t>(), rows, wire.size(1), out.data_ptr<float>(), count, sum,
         /*accumulate=*/false, currentStream(out));
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_chainermn, CUDA, m) {
  m.impl("encode", &encodeCuda);
  m.impl("decode", &decodeCuda);
}

}  // namespace chainermn::cuda
