#include "kernels/codes.h"

#include "phase.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <sstream>

namespace chainermn {

namespace {

// The codes as registered, each in one place for the life of the program (a deque: registering one
// moves no other). A function's static: the registrations run as static objects of other files,
// before or after this file's own (their order across files is not set).
struct Registry {
  std::deque<CodeDescriptor> entries;
  std::vector<Code> complete;  // the entries with their CPU part, by name (built on first lookup)
  bool sealed = false;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

CodeDescriptor& entryNamed(const char* name) {
  Registry& reg = registry();
  if (reg.sealed) {  // a registration after the first lookup: a code in a library loaded later
    std::fprintf(stderr, "chainermn: code '%s' registered after the registry was first read\n", name);
    std::abort();
  }
  for (auto& entry : reg.entries) {
    if (std::strcmp(entry.name, name) == 0) {
      return entry;
    }
  }
  reg.entries.emplace_back();
  reg.entries.back().name = name;
  return reg.entries.back();
}

std::string knownNames() {
  std::string names;
  for (Code code : registeredCodes()) {
    names += std::string(names.empty() ? "" : ", ") + "'" + code->name + "'";
  }
  return names;
}

std::string shownFloat(float value) {
  std::ostringstream text;
  text.precision(9);  // every float's own digits: two thresholds that differ show differently
  text << value;
  return text.str();
}

}  // namespace

CodeRegistration::CodeRegistration(const CodeDescriptor& descriptor) {
  CodeDescriptor& entry = entryNamed(descriptor.name);
  if (entry.rowBytes != nullptr) {
    std::fprintf(stderr, "chainermn: two codes are registered as '%s'\n", descriptor.name);
    std::abort();
  }
  if (descriptor.rowBytes == nullptr || descriptor.encodeRow == nullptr || descriptor.decodeRows == nullptr) {
    std::fprintf(stderr, "chainermn: code '%s' is registered without its row bytes, encode or decode\n",
                 descriptor.name);
    std::abort();
  }
  const EncodeRowsCuda encodeCuda = entry.encodeCuda;  // its CUDA file may have come first
  const DecodeRowsCuda decodeCuda = entry.decodeCuda;
  entry = descriptor;
  entry.encodeCuda = encodeCuda;
  entry.decodeCuda = decodeCuda;
}

CudaCodeRegistration::CudaCodeRegistration(const char* name, EncodeRowsCuda encode, DecodeRowsCuda decode) {
  CodeDescriptor& entry = entryNamed(name);
  entry.encodeCuda = encode;
  entry.decodeCuda = decode;
}

const std::vector<Code>& registeredCodes() {
  Registry& reg = registry();
  if (!reg.sealed) {  // the first lookup: every static registration has run (the module is loaded)
    reg.sealed = true;
    for (const auto& entry : reg.entries) {
      if (entry.rowBytes == nullptr) {  // CUDA kernels of a code with no CPU part: a build error
        std::fprintf(stderr, "chainermn: code '%s' has CUDA kernels but no descriptor (kernels/%s.cpp?)\n", entry.name,
                     entry.name);
        std::abort();
      }
      reg.complete.push_back(&entry);
    }
    std::sort(reg.complete.begin(), reg.complete.end(),
              [](Code a, Code b) { return std::strcmp(a->name, b->name) < 0; });
  }
  return reg.complete;
}

Code codeNamed(const std::string& name, const char* op, const char* argument) {
  for (Code code : registeredCodes()) {
    if (name == code->name) {
      return code;
    }
  }
  TORCH_CHECK_VALUE(false, op, ": ", argument, " must be one of ", knownNames(), ", got '", name, "'");
}

void checkCodeSettings(Code code, const CodeSettings& settings, const char* op) {
  if (code->readsThreshold) {
    TORCH_CHECK_VALUE(settings.threshold > 0.0f && std::isfinite(settings.threshold), op,
                      ": threshold must be a positive finite number, got ", settings.threshold);
  }
  if (code->readsBlock) {
    TORCH_CHECK_VALUE(settings.block >= 1, op, ": block must be >= 1, got ", settings.block);
    TORCH_CHECK_VALUE(settings.block <= code->maxBlock, op, ": block must be at most ", code->maxBlock, " for the ",
                      code->name, " code, got ", settings.block);
    TORCH_CHECK_VALUE(settings.block % code->blockMultiple == 0, op, ": block must be a multiple of ",
                      code->blockMultiple, " for the ", code->name, " code, got ", settings.block);
  }
  if (code->readsKeep) {
    TORCH_CHECK_VALUE(settings.keep >= 1 && settings.keep <= settings.block, op, ": keep must be >= 1 and <= block (",
                      settings.block, ") for the ", code->name, " code, got ", settings.keep);
  }
}

void addCodeSettings(NamedSettings& named, Code code, const CodeSettings& settings) {
  if (code->readsThreshold) {
    named.add("threshold", shownFloat(settings.threshold));
  }
  if (code->readsBlock) {
    named.add("block", std::to_string(settings.block));
  }
  if (code->readsKeep) {
    named.add("keep", std::to_string(settings.keep));
  }
}

int64_t wireRowBytes(Code code, int64_t count, const CodeSettings& settings) {
  return code->rowBytes(count, settings);
}

void encodeCpu(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire,
               int64_t rows, int64_t rowBytes, int64_t count) {
  // In: the rows' float32 values; out: their coded rows.
  PhaseSpan phase(phase::kEncode, code->name,
                  Moved{rows * rowBytes, rows * rowBytes, rows * count * static_cast<int64_t>(sizeof(float))});
  TORCH_CHECK(values != nullptr || rows * count == 0 || (residual != nullptr && code->needsResidual), "encode (",
              code->name, "): the values are needed (a code that needs a residual may take them from it)");
  const int64_t used = code->rowBytes(count, settings);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = wire + r * rowBytes;
    code->encodeRow(settings, values ? values + r * count : nullptr, residual ? residual + r * count : nullptr, row,
                    count);
    std::memset(row + used, 0, static_cast<size_t>(rowBytes - used));
  }
}

void decodeCpu(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
               int64_t count, bool sum, bool accumulate) {
  // In: the coded rows; out: their float32 values (one row of them when the rows are summed).
  PhaseSpan phase(
      phase::kDecode, code->name,
      Moved{rows * rowBytes, (sum ? 1 : rows) * count * static_cast<int64_t>(sizeof(float)), rows * rowBytes});
  code->decodeRows(settings, wire, rows, rowBytes, out, count, sum, accumulate);
}

void NamedSettings::add(const std::string& name, const std::string& value) {
  for (const std::string* part : {&name, &value}) {
    for (unsigned char byte : *part) {
      digest = (digest ^ byte) * 1099511628211ull;
    }
    digest = (digest ^ 0xFFu) * 1099511628211ull;  // a separator no name or value holds
  }
  fields.emplace_back(name, value);
}

std::string NamedSettings::text() const {
  std::string text;
  for (const auto& [name, value] : fields) {
    text += name + "=" + value + "\n";
  }
  return text;
}

NamedSettings NamedSettings::parse(const std::string& text) {
  NamedSettings named;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t equals = line.find('=');
    if (equals != std::string::npos) {
      named.add(line.substr(0, equals), line.substr(equals + 1));
    }
  }
  return named;
}

}  // namespace chainermn
