// The checks every device's implementation of the torch_chainermn code operators makes of its
// arguments (python/codes_ops.cpp for the CPU, cuda/codes_ops.cpp for CUDA): the codes themselves are
// in kernels/codes.h, which includes no torch header; this is their one adapter to tensors.
#pragma once

#include "kernels/codes.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace chainermn {

// encode(values [rows, count] float32, wire [rows, wireRowBytes] uint8, residual [rows, count]
// float32 or undefined, ...): ValueErrors for shapes, dtypes, devices, layouts and the settings,
// naming the op and the argument. Returns (rows, count).
std::pair<int64_t, int64_t> checkEncode(const at::Tensor& values, const at::Tensor& wire,
                                        const std::optional<at::Tensor>& residual, Code code,
                                        const CodeSettings& settings);

// decode(wire [rows, wireRowBytes] uint8, out [count] when `sum` else [rows, count] float32, ...).
// Returns (rows, count).
std::pair<int64_t, int64_t> checkDecode(const at::Tensor& wire, const at::Tensor& out, Code code,
                                        const CodeSettings& settings, bool sum);

}  // namespace chainermn
