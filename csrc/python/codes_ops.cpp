// The codes of kernels/codes.h as torch operators, and their CPU implementation (CUDA's:
// cuda/codes_ops.cpp). Python reaches them as torch.ops.torch_chainermn.*; torch_chainermn/codes.py
// wraps them.
//
//   encode(values, wire, residual, code, block, threshold, keep=8)  every row of values (+ residual)
//       into its wire row; the residual keeps what the codes did not carry
//   decode(wire, out, code, block, threshold, sum, keep=8)          the rows back into out, or their sum
//   wire_row_bytes(code, count, block, keep=8)                      a wire row's bytes
// (keep, top-k's values per block, comes last with a default: the calls written before it stand.)
#include "kernels/code_checks.h"

#include <torch/library.h>

namespace chainermn {
namespace {

CodeSettings settingsOf(int64_t block, double threshold, int64_t keep) {
  return CodeSettings{static_cast<float>(threshold), block, keep};
}

void encodeCpuOp(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
                 c10::string_view codeName, int64_t block, double threshold, int64_t keep) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.encode");
  const CodeSettings settings = settingsOf(block, threshold, keep);
  const auto [rows, count] = checkEncode(values, wire, residual, code, settings);
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  encodeCpu(code, settings, values.data_ptr<float>(), kept, wire.data_ptr<uint8_t>(), rows, wire.size(1), count);
}

void decodeCpuOp(const at::Tensor& wire, const at::Tensor& out, c10::string_view codeName, int64_t block,
                 double threshold, bool sum, int64_t keep) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.decode");
  const CodeSettings settings = settingsOf(block, threshold, keep);
  const auto [rows, count] = checkDecode(wire, out, code, settings, sum);
  if (rows == 0) {
    out.zero_();
    return;
  }
  decodeCpu(code, settings, wire.data_ptr<uint8_t>(), rows, wire.size(1), out.data_ptr<float>(), count, sum,
            /*accumulate=*/false);
}

int64_t wireRowBytesOp(c10::string_view codeName, int64_t count, int64_t block, int64_t keep) {
  constexpr const char* op = "torch_chainermn.wire_row_bytes";
  TORCH_CHECK_VALUE(block >= 1, op, ": block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(count >= 0, op, ": count must be >= 0, got ", count);
  const Code code = codeNamed(std::string(codeName), op);
  const CodeSettings settings = settingsOf(block, /*threshold=*/0.5, keep);  // no row's bytes depend on the threshold
  checkCodeSettings(code, settings, op);
  return wireRowBytes(code, count, settings);
}

}  // namespace

TORCH_LIBRARY(torch_chainermn, m) {
  m.def(
      "encode(Tensor values, Tensor(a!) wire, Tensor(b!)? residual, str code, int block, float threshold, int keep=8) "
      "-> ()");
  m.def("decode(Tensor wire, Tensor(a!) out, str code, int block, float threshold, bool sum, int keep=8) -> ()");
  m.def("wire_row_bytes(str code, int count, int block, int keep=8) -> int", &wireRowBytesOp);
}

TORCH_LIBRARY_IMPL(torch_chainermn, CPU, m) {
  m.impl("encode", &encodeCpuOp);
  m.impl("decode", &decodeCpuOp);
}

}  // namespace chainermn
