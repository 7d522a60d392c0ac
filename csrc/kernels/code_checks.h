// The torch side of the codes (kernels/codes.h includes no torch header; this is their one adapter to
// torch): the checks every device's implementation of the torch_chainermn code operators makes of
// its arguments (python/codes_ops.cpp for the CPU, cuda/codes_ops.cpp for CUDA), and the
// CompressionSpec as torch holds it, the type of the operators' `spec` argument.
#pragma once

#include "kernels/code_spec.h"

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>

namespace chainermn {

// A CompressionSpec (kernels/code_spec.h) as torch holds it: the custom class
// torch.classes.torch_chainermn.CompressionSpec, the operators' `spec` (schema type
// __torch__.torch.classes.torch_chainermn.CompressionSpec). Immutable, and only ever made from a
// checked spec: Python's torch_chainermn.CompressionSpec is a torch.ScriptObject of this class
// (python/compression.cpp), and torch's serialization (def_pickle) rebuilds one through compressionSpec.
struct CompressionSpecObject final : torch::CustomClassHolder {
  explicit CompressionSpecObject(CompressionSpec value) : spec(std::move(value)) {}
  const CompressionSpec spec;
};
using CompressionSpecRef = c10::intrusive_ptr<CompressionSpecObject>;

// Registers the custom class, once: every TORCH_LIBRARY and TORCH_LIBRARY_IMPL block that names it
// calls this first (an operator's schema is read when the block runs, and static blocks of different
// files run in no set order), as torch's quantized ops register their packed parameters.
void registerCompressionSpecClass();

// encode(values [rows, count] float32, wire [rows, wireRowBytes] uint8, residual [rows, count]
// float32 or undefined, spec): ValueErrors for shapes, dtypes, devices and layouts, naming the op and
// the argument (the spec's settings were checked when it was made). Returns (rows, count).
std::pair<int64_t, int64_t> checkEncode(const at::Tensor& values, const at::Tensor& wire,
                                        const std::optional<at::Tensor>& residual, const CompressionSpec& spec);

// decode(wire [rows, wireRowBytes] uint8, out [count] when `sum` else [rows, count] float32, spec).
// Returns (rows, count).
std::pair<int64_t, int64_t> checkDecode(const at::Tensor& wire, const at::Tensor& out, const CompressionSpec& spec,
                                        bool sum);

}  // namespace chainermn
