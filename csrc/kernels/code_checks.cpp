#include "kernels/code_checks.h"

#include <c10/util/Exception.h>

namespace chainermn {

namespace {

void checkRows(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, const char* dtypeName) {
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D [rows, values], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtypeName, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

}  // namespace

std::pair<int64_t, int64_t> checkEncode(const at::Tensor& values, const at::Tensor& wire,
                                        const std::optional<at::Tensor>& residual, Code code,
                                        const CodeSettings& settings) {
  constexpr const char* op = "torch_chainermn.encode";
  checkCodeSettings(code, settings, op);
  checkRows(values, op, "values", at::kFloat, "float32");
  checkRows(wire, op, "wire", at::kByte, "uint8");
  const int64_t rows = values.size(0);
  const int64_t count = values.size(1);
  const int64_t rowBytes = wireRowBytes(code, count, settings);
  TORCH_CHECK_VALUE(wire.size(0) == rows && wire.size(1) == rowBytes, op, ": wire must be [", rows, ", ", rowBytes,
                    "] for values ", values.sizes(), ", got ", wire.sizes());
  TORCH_CHECK_VALUE(wire.device() == values.device(), op, ": wire is on ", wire.device(), ", values on ",
                    values.device());
  TORCH_CHECK_VALUE(!code->needsResidual || (residual && residual->defined()), op, ": the ", code->name,
                    " code needs a residual (error feedback)");
  if (residual && residual->defined()) {
    checkRows(*residual, op, "residual", at::kFloat, "float32");
    TORCH_CHECK_VALUE(residual->sizes() == values.sizes(), op, ": residual must have the values' shape ",
                      values.sizes(), ", got ", residual->sizes());
    TORCH_CHECK_VALUE(residual->device() == values.device(), op, ": residual is on ", residual->device(),
                      ", values on ", values.device());
  }
  return {rows, count};
}

std::pair<int64_t, int64_t> checkDecode(const at::Tensor& wire, const at::Tensor& out, Code code,
                                        const CodeSettings& settings, bool sum) {
  constexpr const char* op = "torch_chainermn.decode";
  checkCodeSettings(code, settings, op);
  checkRows(wire, op, "wire", at::kByte, "uint8");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.is_contiguous(), op,
                    ": out must be contiguous float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.device() == wire.device(), op, ": out is on ", out.device(), ", wire on ", wire.device());
  const int64_t rows = wire.size(0);
  TORCH_CHECK_VALUE(sum ? out.dim() == 1 : (out.dim() == 2 && out.size(0) == rows), op, ": out must be ",
                    sum ? "1-D [values] (sum=True)" : "2-D [rows, values]", " for wire ", wire.sizes(), ", got ",
                    out.sizes());
  const int64_t count = out.size(out.dim() - 1);
  const int64_t rowBytes = wireRowBytes(code, count, settings);
  TORCH_CHECK_VALUE(wire.size(1) == rowBytes, op, ": wire rows of ", wire.size(1), " bytes do not hold ", count,
                    " values (", rowBytes, " bytes)");
  return {rows, count};
}

}  // namespace chainermn
