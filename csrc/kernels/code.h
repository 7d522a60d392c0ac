// What a code is: one descriptor that says everything the rest of the backend needs to know of it
// (its name, the settings it reads and their rules, whether it may carry another code's sums, its
// wire row's bytes, its kernels). Each code registers its descriptor from its own source file
// (kernels/<code>.cpp: CodeRegistration) and, in the CUDA build, adds its device kernels from its
// own CUDA file (cuda/<code>_kernels.cu: CudaCodeRegistration), as torch's TORCH_LIBRARY_IMPL adds
// one device's kernels from the file that defines them. kernels/codes.h is the registry that looks
// them up; nothing else names a code.
//
// A header of its own, with no torch header, so that a code's kernel files (nvcc's too) can
// describe the code without including the registry.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace chainermn {

// Every setting any code reads, with its default; a code reads those its descriptor names.
struct CodeSettings {
  float threshold = 0.5f;  // 2-bit: the value sent as +-threshold
  int64_t block = 256;     // the block codes: values per float32 scale
  int64_t keep = 8;        // top-k: values sent per block (1 to block)
};

// One row of `count` values (+ residual, updated in place when not null) into its wire row (at
// least rowBytes(count) bytes; the registry zeroes the rest).
using EncodeRowCpu = void (*)(const CodeSettings& settings, const float* values, float* residual, uint8_t* row,
                              int64_t count);
// `rows` wire rows `rowBytes` apart into out: with `sum` out [count] (+)= their sum (added to what
// out holds when `accumulate`), without out [rows, count] = each row's values.
using DecodeRowsCpu = void (*)(const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes,
                               float* out, int64_t count, bool sum, bool accumulate);
// The same on a CUDA device, for `rows` rows at once, launched on `stream` (a cudaStream_t) only.
using EncodeRowsCuda = void (*)(const CodeSettings& settings, const float* values, float* residual, uint8_t* wire,
                                int64_t rows, int64_t rowBytes, int64_t count, void* stream);
using DecodeRowsCuda = void (*)(const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes,
                                float* out, int64_t count, bool sum, bool accumulate, void* stream);

struct CodeDescriptor {
  const char* name = nullptr;  // what users write: compression="int8"
  const char* summary = "";    // one line: how a value travels
  // The settings it reads (checked, and compared across ranks); the others do not change its bits.
  bool readsThreshold = false;
  bool readsBlock = false;  // also: a compressed mean's chunks are whole blocks
  bool readsKeep = false;
  // Rules on the block beyond 1 <= block <= maxBlock: a multiple of blockMultiple (4-bit: 2, so that
  // no byte holds values of two blocks).
  int64_t blockMultiple = 1;
  int64_t maxBlock = int64_t{1} << 30;  // top-k: 65536 (its in-block indices are 16 bits)
  bool needsResidual = false;           // carries a fraction of each value: error feedback is required
  // May carry the sums of a compressed mean whose own code is another (compress_result="<name>"):
  // a code that keeps each value's scale, so the sums (which decide the step) lose little.
  bool carriesSums = false;
  int64_t (*rowBytes)(int64_t count, const CodeSettings& settings) = nullptr;  // a multiple of 4
  EncodeRowCpu encodeRow = nullptr;
  DecodeRowsCpu decodeRows = nullptr;
  // Set by the code's CUDA file in the CUDA build (null otherwise).
  EncodeRowsCuda encodeCuda = nullptr;
  DecodeRowsCuda decodeCuda = nullptr;
};

// A code as the backend passes it around: its registered descriptor (never null).
using Code = const CodeDescriptor*;

// Adds a code to the registry, from a static object of the code's own source file:
//   static const CodeRegistration registered{CodeDescriptor{...}};
// Two codes of one name stop the program at load with both names (a programming error).
struct CodeRegistration {
  explicit CodeRegistration(const CodeDescriptor& descriptor);
};
// Adds a registered code's CUDA kernels, from a static object of its CUDA file. Static objects of
// different files are constructed in no set order: the registry keeps whichever part comes first.
struct CudaCodeRegistration {
  CudaCodeRegistration(const char* name, EncodeRowsCuda encode, DecodeRowsCuda decode);
};

// Settings as (name, value as shown) pairs, in order, with a digest of them all: what ranks compare
// before a compressed mean moves data (backend/agreement.h), so that a setting added later is
// compared and named without any change to what the ranks exchange.
struct NamedSettings {
  std::vector<std::pair<std::string, std::string>> fields;
  uint64_t digest = 14695981039346656037ull;  // FNV-1a over every name and value

  void add(const std::string& name, const std::string& value);
  std::string text() const;                             // "name=value\n..." (every field)
  static NamedSettings parse(const std::string& text);  // text()'s inverse
};

}  // namespace chainermn
