// torch_chainermn.CompressionSpec as the bindings take it (python/compression.cpp binds it): a
// torch::jit::Object, so that in Python it is a torch.ScriptObject of the custom class
// torch.classes.torch_chainermn.CompressionSpec (kernels/code_checks.h), which the torch operators take
// as it is, with the spec at hand for the bindings that take one (compressed_mean,
// compression_residuals, the test harness).
#pragma once

#include "kernels/code_checks.h"

#include <torch/csrc/jit/api/object.h>

namespace chainermn {

class PyCompressionSpec : public torch::jit::Object {
 public:
  explicit PyCompressionSpec(CompressionSpec spec)
      : PyCompressionSpec(c10::make_intrusive<CompressionSpecObject>(std::move(spec))) {}

  const CompressionSpec& spec() const {
    return held_->spec;
  }

 private:
  explicit PyCompressionSpec(CompressionSpecRef held)
      : torch::jit::Object(c10::IValue(held).toObject()), held_(std::move(held)) {}

  CompressionSpecRef held_;  // the object's own (its capsule's), kept typed: no lookup per call
};

}  // namespace chainermn
