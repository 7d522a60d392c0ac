// The codes of kernels/codes.h as torch operators, and their CPU implementation (CUDA's:
// cuda/codes_ops.cpp). Python reaches them as torch.ops.torch_chainermn.*; torch_chainermn/codes.py
// wraps them.
//
//   encode(values, wire, residual, code, block, threshold)  every row of values (+ residual) into its
//       wire row; the residual keeps what the codes did not carry
//   decode(wire, out, code, block, threshold, sum)          the rows back into out, or their sum
//   wire_row_bytes(code, count, block)                      a wire row's bytes
#include "kernels/code_checks.h"

#include <torch/library.h>

namespace chainermn {
namespace {

CodeSettings settingsOf(int64_t block, double threshold) {
  return CodeSettings{static_cast<float>(threshold), block};
}

void encodeCpuOp(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
                 c10::string_view codeName, int64_t block, double threshold) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.encode");
  const CodeSettings settings = settingsOf(block, threshold);
  const auto [rows, count] = checkEncode(values, wire, residual, code, settings);
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  encodeCpu(code, settings, values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, wire.size(1), count);
}

void decodeCpuOp(const at::Tensor& wire, const at::Tensor& out, c10::string_view codeName, int64_t block,
                 double threshold, bool sum) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.decode");
  const CodeSettings settings = settingsOf(block, threshold);
  const auto [rows, count] = checkDecode(wire, out, code, settings, sum);
  if (rows == 0) {
    out.zero_();
    return;
  }
  decodeCpu(code, settings, wire.data_ptr<uint8_t>(), rows, wire.size(1), out.data_ptr<float>(), count, sum,
            /*accumulate=*/false);
}

int64_t wireRowBytesOp(c10::string_view codeName, int64_t count, int64_t block) {
  TORCH_CHECK_VALUE(block >= 1, "torch_chainermn.wire_row_bytes: block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(count >= 0, "torch_chainermn.wire_row_bytes: count must be >= 0, got ", count);
  return wireRowBytes(codeNamed(std::string(codeName), "torch_chainermn.wire_row_bytes"), count, block);
}

} // namespace

TORCH_LIBRARY(torch_chainermn, m) {
  m.def("encode(Tensor values, Tensor(a!) wire, Tensor(b!)? residual, str code, int block, float threshold) -> ()");
  m.def("decode(Tensor wire, Tensor(a!) out, str code, int block, float threshold, bool sum) -> ()");
  m.def("wire_row_bytes(str code, int count, int block) -> int", &wireRowBytesOp);
}

TORCH_LIBRARY_IMPL(torch_chainermn, CPU, m) {
  m.impl("encode", &encodeCpuOp);
  m.impl("decode", &decodeCpuOp);
}

} // namespace chainermn
