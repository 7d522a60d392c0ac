// The registry of the codes that carry float32 values over a slow link. Each code registers its own
// descriptor (kernels/code.h says what one holds) from its own files: kernels/<code>.cpp (the CPU
// kernels and the descriptor) and, in the CUDA build, cuda/<code>_kernels.cu (the CUDA kernels). No
// list of the codes stands anywhere else: registeredCodes() is it (Python: _C.codes.registered()).
//
// Everything here works from the descriptors: the torch operators (python/codes_ops.cpp,
// cuda/codes_ops.cpp: FSDP2) and the backend's compressed mean (strategies/compressed.h, through a
// Scratch's Mover: the DDP hooks, double buffering, the optimizer, the communicator, DiLoCo) both
// encode and decode through it, and Python reads it (python/compression.cpp).
//
// To add a code: docs/codes.md, "Adding a code" (its own files and its tests, nothing else).
#pragma once

#include "kernels/code.h"

#include <cstdint>
#include <string>
#include <vector>

namespace chainermn {

// Every registered code, ordered by name.
const std::vector<Code>& registeredCodes();

// The code called `name`; a ValueError naming `op`, the argument and the known names otherwise.
Code codeNamed(const std::string& name, const char* op, const char* argument = "code");

// The settings `code` reads, checked against its descriptor's rules (a ValueError naming `op` and
// the setting otherwise): the one rule, which Python's torch_chainermn.codes also applies.
void checkCodeSettings(Code code, const CodeSettings& settings, const char* op);

// The settings `code` reads, named (for the cross-rank comparison).
void addCodeSettings(NamedSettings& named, Code code, const CodeSettings& settings);

// Bytes of the wire row for `count` values (given the settings the code reads): always a multiple of 4.
int64_t wireRowBytes(Code code, int64_t count, const CodeSettings& settings);

// `rows` rows at once: row r's values at values + r * count (residual likewise; null for none, which
// only codes that do not need a residual allow; those that do also take null values: the residual
// holds them), its wire row at wire + r * rowBytes, rowBytes >= wireRowBytes(code, count, settings),
// zero past the codes.
void encodeCpu(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire,
               int64_t rows, int64_t rowBytes, int64_t count);

// With `sum`: out [count] (+)= the sum of the rows' values (added to what out holds when `accumulate`);
// without: out [rows, count] = each row's values.
void decodeCpu(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
               int64_t count, bool sum, bool accumulate);

}  // namespace chainermn
