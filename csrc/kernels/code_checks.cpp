#include "kernels/code_checks.h"

#include <c10/util/Exception.h>

#include <string>
#include <tuple>
#include <utility>

namespace chainermn {

namespace {

void checkRows(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, const char* dtypeName) {
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": ", name, " must be 2-D [rows, values], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtypeName, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The spec's code: every CompressionSpecObject holds a spec made by compressionSpec (checked), so a
// missing code is a programming error, named here rather than dereferenced.
Code checkedCode(const CompressionSpec& spec, const char* op) {
  TORCH_CHECK(spec.code != nullptr && spec.named != nullptr, op,
              ": the spec must come from compressionSpec (it checks the settings once)");
  return spec.code;
}

// The custom class's state for torch's serialization (torch.jit.save, torch.export): the spec as
// compressionSpec takes it.
using SpecState = std::tuple<std::string, double, int64_t, int64_t, bool, std::string, int64_t>;

SpecState stateOf(const CompressionSpecRef& held) {
  const CompressionSpec& spec = held->spec;
  const bool ownSums = !spec.compressResult || spec.resultCode == spec.code;
  return {spec.code->name,
          static_cast<double>(spec.settings.threshold),
          spec.settings.block,
          spec.settings.keep,
          spec.compressResult,
          ownSums ? "" : spec.resultCode->name,
          static_cast<int64_t>(spec.resultWire)};
}

CompressionSpecRef specFromState(SpecState state) {
  auto [code, threshold, block, keep, compressResult, resultCode, resultWire] = std::move(state);
  CodeSettings settings;
  settings.threshold = static_cast<float>(threshold);
  settings.block = block;
  settings.keep = keep;
  return c10::make_intrusive<CompressionSpecObject>(compressionSpec(code, settings, compressResult, resultCode,
                                                                    static_cast<c10::ScalarType>(resultWire),
                                                                    "torch_chainermn.CompressionSpec"));
}

}  // namespace

void registerCompressionSpecClass() {
  static const auto registered = torch::class_<CompressionSpecObject>(
                                     "torch_chainermn", "CompressionSpec",
                                     "A code and its settings (torch_chainermn.CompressionSpec): the operators' spec")
                                     .def_pickle([](const CompressionSpecRef& held) { return stateOf(held); },
                                                 [](SpecState state) { return specFromState(std::move(state)); });
  (void)registered;
}

std::pair<int64_t, int64_t> checkEncode(const at::Tensor& values, const at::Tensor& wire,
                                        const std::optional<at::Tensor>& residual, const CompressionSpec& spec) {
  constexpr const char* op = "torch_chainermn.encode";
  const Code code = checkedCode(spec, op);
  const CodeSettings& settings = spec.settings;
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

std::pair<int64_t, int64_t> checkDecode(const at::Tensor& wire, const at::Tensor& out, const CompressionSpec& spec,
                                        bool sum) {
  constexpr const char* op = "torch_chainermn.decode";
  const Code code = checkedCode(spec, op);
  const CodeSettings& settings = spec.settings;
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
