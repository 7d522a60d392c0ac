// The codes of kernels/codes.h as torch operators, and their CPU implementation (CUDA's:
// cuda/codes_ops.cpp). Python reaches them as torch.ops.torch_chainermn.*; torch_chainermn/codes.py
// wraps them. A code and its settings travel as one value, `spec`: torch's custom class
// torch.classes.torch_chainermn.CompressionSpec (kernels/code_checks.h), which every
// torch_chainermn.CompressionSpec is (python/compression.cpp).
//
//   encode(values, wire, residual, spec)     every row of values (+ residual) into its wire row; the
//                                            residual keeps what the codes did not carry
//   decode(wire, out, spec, sum=False)       the rows back into out, or their sum
//   wire_row_bytes(spec, count)              a wire row's bytes
#include "kernels/code_checks.h"

#include <torch/library.h>

namespace chainermn {
namespace {

void encodeCpuOp(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
                 const CompressionSpecRef& held) {
  const CompressionSpec& spec = held->spec;
  const auto [rows, count] = checkEncode(values, wire, residual, spec);
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  encodeCpu(spec.code, spec.settings, values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, wire.size(1),
            count);
}

void decodeCpuOp(const at::Tensor& wire, const at::Tensor& out, const CompressionSpecRef& held, bool sum) {
  const CompressionSpec& spec = held->spec;
  const auto [rows, count] = checkDecode(wire, out, spec, sum);
  if (rows == 0) {
    out.zero_();
    return;
  }
  decodeCpu(spec.code, spec.settings, wire.data_ptr<uint8_t>(), rows, wire.size(1), out.data_ptr<float>(), count, sum,
            /*accumulate=*/false);
}

int64_t wireRowBytesOp(const CompressionSpecRef& held, int64_t count) {
  constexpr const char* op = "torch_chainermn.wire_row_bytes";
  TORCH_CHECK_VALUE(count >= 0, op, ": count must be >= 0, got ", count);
  const CompressionSpec& spec = held->spec;
  return wireRowBytes(spec.code, count, spec.settings);
}

}  // namespace

TORCH_LIBRARY(torch_chainermn, m) {
  registerCompressionSpecClass();  // before the schemas that name it
  m.def(
      "encode(Tensor values, Tensor(a!) wire, Tensor(b!)? residual, "
      "__torch__.torch.classes.torch_chainermn.CompressionSpec spec) -> ()");
  m.def(
      "decode(Tensor wire, Tensor(a!) out, __torch__.torch.classes.torch_chainermn.CompressionSpec spec, "
      "bool sum=False) -> ()");
  m.def("wire_row_bytes(__torch__.torch.classes.torch_chainermn.CompressionSpec spec, int count) -> int",
        &wireRowBytesOp);
}

TORCH_LIBRARY_IMPL(torch_chainermn, CPU, m) {
  m.impl("encode", &encodeCpuOp);
  m.impl("decode", &decodeCpuOp);
}

}  // namespace chainermn
