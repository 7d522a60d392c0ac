// The codes that carry float32 rows over a slow link, as torch operators see them
// (torch.ops.torch_chainermn.encode / decode, registered in python/codes_ops.cpp for the CPU and in
// cuda/codes_ops.cpp for CUDA): what a code is called, how many bytes a row takes, and the checks
// every device's implementation makes of its arguments.
//
//   "int8"  block-quantised int8, one float32 scale per `block` values (kernels/int8.h); the residual
//           (error feedback) is optional: gradients have one, weights do not.
//   "2bit"  MXNet's 2-bit code with `threshold`, "1bit" sign x mean |r| (kernels/quantize.h): a row
//           is one block of blockWords(kind, count) words; the residual is required.
#pragma once

#include "kernels/quantize.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace chainermn {

enum class Code : int32_t { Int8 = 0, TwoBit = 1, OneBit = 2 };

// The code called `name`; a ValueError naming `op` and the known names otherwise.
Code codeNamed(const std::string& name, const char* op);
CompressionKind compressionKindOf(Code code);  // TwoBit or OneBit

// Bytes of the wire row for `count` values (a multiple of 4).
int64_t wireRowBytes(Code code, int64_t count, int64_t block);

// encode(values [rows, count] float32, wire [rows, wireRowBytes] uint8, residual [rows, count]
// float32 or undefined, ...): ValueErrors for shapes, dtypes, devices, layouts and `block`, naming
// the op and the argument. Returns (rows, count).
std::pair<int64_t, int64_t> checkEncode(
    const at::Tensor& values, const at::Tensor& wire, const std::optional<at::Tensor>& residual, Code code, int64_t block);

// decode(wire [rows, wireRowBytes] uint8, out [count] when `sum` else [rows, count] float32, ...).
// Returns (rows, count).
std::pair<int64_t, int64_t> checkDecode(const at::Tensor& wire, const at::Tensor& out, Code code, int64_t block, bool sum);

} // namespace chainermn
