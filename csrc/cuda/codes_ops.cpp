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
                const CompressionSpecRef& held) {
  const CompressionSpec& spec = held->spec;
  const auto [rows, count] = checkEncode(values, wire, residual, spec);
  const c10::cuda::CUDAGuard guard(values.device());
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  encode(spec.code, spec.settings, values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, wire.size(1), count,
         currentStream(values));
}

void decodeCuda(const at::Tensor& wire, const at::Tensor& out, const CompressionSpecRef& held, bool sum) {
  const CompressionSpec& spec = held->spec;
  const auto [rows, count] = checkDecode(wire, out, spec, sum);
  const c10::cuda::CUDAGuard guard(out.device());
  if (rows == 0) {
    out.zero_();
    return;
  }
  decode(spec.code, spec.settings, wire.data_ptr<uint8_t>(), rows, wire.size(1), out.data_ptr<float>(), count, sum,
         /*accumulate=*/false, currentStream(out));
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_chainermn, CUDA, m) {
  registerCompressionSpecClass();  // the impls' schemas name it; this block may run before TORCH_LIBRARY's
  m.impl("encode", &encodeCuda);
  m.impl("decode", &decodeCuda);
}

}  // namespace chainermn::cuda
