// A code and its settings as one value (CompressionSpec): what the torch operators (python/codes_ops.cpp,
// cuda/codes_ops.cpp), the backend's compressed mean (strategies/compressed.h) and the cross-rank
// agreement (backend/agreement.h) take, made and checked once (compressionSpec). Python sees it as
// torch_chainermn.CompressionSpec (python/compression.cpp), which is also torch's custom class
// torch.classes.torch_chainermn.CompressionSpec (kernels/code_checks.h holds it), the type of the
// operators' `spec` argument.
#pragma once

#include "kernels/codes.h"

#include <c10/core/ScalarType.h>

#include <memory>
#include <string>

namespace chainermn {

// A compressed exchange's code and settings: passed whole and compared whole across ranks (`named`:
// every field that changes what travels).
struct CompressionSpec {
  Code code = nullptr;
  CodeSettings settings;  // what the codes read: 2-bit's threshold, the block codes' block, top-k's keep
  bool compressResult = false;
  Code resultCode = nullptr;  // the sums' code with compressResult: `code`, or a code that carriesSums
  c10::ScalarType resultWire = c10::ScalarType::Float;  // the sums' dtype when not compressed
  std::shared_ptr<const NamedSettings> named;           // the fields above, named; shared: no copy per call
};

// A spec from its Python spelling: a code's name, the settings, and the sums' code ("": the code
// itself), checked: a ValueError naming `op` and the argument for an unknown code, a setting a code
// rejects (kernels/codes.h), a sums' code that cannot carry sums, or a result dtype other than
// float32, float16 and bfloat16.
CompressionSpec compressionSpec(const std::string& code, const CodeSettings& settings, bool compressResult,
                                const std::string& resultCode, c10::ScalarType resultWire, const char* op,
                                const char* argument = "code");

// Whether either phase's code reads the block (a compressed mean's chunks are then whole blocks).
bool usesBlock(const CompressionSpec& spec);

}  // namespace chainermn
