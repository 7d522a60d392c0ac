// The codes that carry float32 values over a slow link: the one registry. Every code has one name,
// one set of settings, one row layout, and one CPU implementation of encode and decode here (CUDA's:
// cuda/codes_kernels.h). The torch operators (python/codes_ops.cpp, cuda/codes_ops.cpp: FSDP2) and
// the backend's compressed mean (strategies/compressed.h, through a Scratch's Mover: the DDP hooks,
// double buffering, the optimizer, the communicator, DiLoCo) both encode and decode through it.
//
//   "int8"  block-quantised int8, one float32 scale per `block` values (kernels/int8.h)
//   "4bit"  block-quantised 4-bit, two values a byte, one float32 scale per `block` (kernels/int4.h)
//   "2bit"  MXNet's 2-bit code with `threshold` (kernels/quantize.h)
//   "1bit"  sign x mean |r| of the row (kernels/quantize.h)
//   "topk"  the `keep` largest |r| of each `block` values, their indices and int8 codes, one float32
//           scale per block (kernels/topk.h)
// The residual (error feedback) is optional for the block codes and top-k (gradients have one, weights do not)
// and required for 2-bit and 1-bit, which carry a fraction of a value.
//
// To add a code: its CPU kernel (kernels/), its CUDA kernel (cuda/), its row in kCodes and its
// branches in encodeCpu / decodeCpu here and in cuda/codes_kernels.cpp, its tests, docs/codes.md.
#pragma once

#include "kernels/code.h"

#include <cstdint>
#include <string>

namespace chainermn {

struct CodeInfo {
  Code code;
  const char* name;
  bool needsResidual;  // carries a fraction of each value: error feedback is required
  bool usesThreshold;
  bool usesBlock;  // also: a compressed mean's chunks are whole blocks
  bool usesKeep;
};

const CodeInfo& codeInfo(Code code);
const char* codeName(Code code);
// The code called `name`; a ValueError naming `op` and the known names otherwise.
Code codeNamed(const std::string& name, const char* op);
// The settings `code` reads, checked (a ValueError naming `op` and the setting otherwise).
void checkCodeSettings(Code code, const CodeSettings& settings, const char* op);

// Bytes of the wire row for `count` values (given the settings the code reads): always a multiple of 4.
int64_t wireRowBytes(Code code, int64_t count, const CodeSettings& settings);

// `rows` rows at once: row r's values at values + r * count (residual likewise; null for none, which
// only the block codes allow; 2-bit and 1-bit also take null values: the residual holds them), its
// wire row at wire + r * rowBytes, rowBytes >= wireRowBytes(code, count, settings), zero past the codes.
void encodeCpu(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire,
               int64_t rows, int64_t rowBytes, int64_t count);

// With `sum`: out [count] (+)= the sum of the rows' values (added to what out holds when `accumulate`);
// without: out [rows, count] = each row's values.
void decodeCpu(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
               int64_t count, bool sum, bool accumulate);

} // namespace chainermn
