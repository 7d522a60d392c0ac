#include "kernels/code_spec.h"

#include "types.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>

namespace chainermn {

namespace {

// The codes that may carry another code's sums, as "'4bit', 'int8'".
std::string sumsCodes() {
  std::string names;
  for (Code code : registeredCodes()) {
    if (code->carriesSums) {
      names += std::string(names.empty() ? "" : ", ") + "'" + code->name + "'";
    }
  }
  return names;
}

}  // namespace

CompressionSpec compressionSpec(const std::string& code, const CodeSettings& settings, bool compressResult,
                                const std::string& resultCode, c10::ScalarType resultWire, const char* op,
                                const char* argument) {
  CompressionSpec spec;
  spec.code = codeNamed(code, op, argument);
  spec.settings = settings;
  spec.compressResult = compressResult;
  spec.resultCode = resultCode.empty() ? spec.code : codeNamed(resultCode, op, "compress_result");
  spec.resultWire = resultWire;
  checkCodeSettings(spec.code, settings, op);
  if (compressResult && spec.resultCode != spec.code) {
    TORCH_CHECK_VALUE(spec.resultCode->carriesSums, op, ": compress_result must be True or a code that carries ",
                      "sums (", sumsCodes(), "), got '", spec.resultCode->name, "'");
    checkCodeSettings(spec.resultCode, settings, op);
  }
  TORCH_CHECK_VALUE(resultWire == c10::ScalarType::Float || resultWire == c10::ScalarType::Half ||
                        resultWire == c10::ScalarType::BFloat16,
                    op, ": result_dtype must be torch.float32, torch.float16 or torch.bfloat16, got ",
                    dtypeName(resultWire));
  // What the ranks compare: a setting that neither phase's code reads changes nothing, and is left
  // out (1-bit's threshold may differ); compress_result names the sums' code, or False.
  auto named = std::make_shared<NamedSettings>();
  named->add("code", spec.code->name);
  addCodeSettings(*named, spec.code, settings);
  if (compressResult && spec.resultCode != spec.code) {
    NamedSettings sums;
    addCodeSettings(sums, spec.resultCode, settings);
    for (const auto& [name, value] : sums.fields) {
      if (std::none_of(named->fields.begin(), named->fields.end(), [&](const auto& f) { return f.first == name; })) {
        named->add(name, value);
      }
    }
  }
  named->add("compress_result", compressResult ? spec.resultCode->name : "False");
  named->add("result_dtype", dtypeName(resultWire));
  spec.named = std::move(named);
  return spec;
}

bool usesBlock(const CompressionSpec& spec) {
  return spec.code->readsBlock || (spec.compressResult && spec.resultCode->readsBlock);
}

}  // namespace chainermn
