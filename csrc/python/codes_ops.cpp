// The codes of kernels/codes.h as torch operators, and their CPU implementation (CUDA's:
// cuda/codes_ops.cpp). Python reaches them as torch.ops.torch_chainermn.*; torch_chainermn/codes.py
// wraps them.
//
//   encode(values, wire, residual, code, block, threshold)  every row of values (+ residual) into its
//       wire row; the residual keeps what the codes did not carry
//   decode(wire, out, code, block, threshold, sum)          the rows back into out, or their sum
//   wire_row_bytes(code, count, block)                      a wire row's bytes
#include "kernels/codes.h"
#include "kernels/int8.h"

#include <torch/library.h>

namespace chainermn {
namespace {

void encodeCpu(const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual,
               c10::string_view codeName, int64_t block, double threshold) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.encode");
  const auto [rows, count] = checkEncode(values, wire, residual, code, block);
  const int64_t rowBytes = wire.size(1);
  const float* in = values.data_ptr<float>();
  float* kept = residual && residual->defined() ? residual->data_ptr<float>() : nullptr;
  uint8_t* out = wire.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    float* rowResidual = kept ? kept + r * count : nullptr;
    if (code == Code::Int8) {
      encodeInt8Cpu(in + r * count, rowResidual, out + r * rowBytes, count, block);
    } else {
      quantizeCpu(compressionKindOf(code), in + r * count, rowResidual, reinterpret_cast<uint32_t*>(out + r * rowBytes),
                  count, count, static_cast<float>(threshold));
    }
  }
}

void decodeCpu(const at::Tensor& wire, const at::Tensor& out, c10::string_view codeName, int64_t block, double threshold,
               bool sum) {
  const Code code = codeNamed(std::string(codeName), "torch_chainermn.decode");
  const auto [rows, count] = checkDecode(wire, out, code, block, sum);
  if (rows == 0) {
    out.zero_();
    return;
  }
  const int64_t rowBytes = wire.size(1);
  const uint8_t* in = wire.data_ptr<uint8_t>();
  float* values = out.data_ptr<float>();
  if (code == Code::Int8) {
    decodeInt8Cpu(in, rows, rowBytes, values, count, block, sum);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    dequantizeCpu(compressionKindOf(code), reinterpret_cast<const uint32_t*>(in + r * rowBytes),
                  sum ? values : values + r * count, count, static_cast<float>(threshold), sum && r > 0);
  }
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
  m.impl("encode", &encodeCpu);
  m.impl("decode", &decodeCpu);
}

} // namespace chainermn
