// A PhaseSpan as torch's profiler records it: an at::RecordFunction of the user scope, opened on the
// thread that runs the phase (it carries the profiled op's profiler state: runtime/op_span.h).
#include "phase.h"

#include <ATen/record_function.h>

#include <string>
#include <unordered_map>

namespace chainermn {

std::atomic<int> profiledOpsRunning{0};

void PhaseSpan::start(const char* name, const char* what, int64_t bytes) {
  auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE);
  if (!callbacks) {
    return;  // another thread's op is profiled, not this one
  }
  auto* span = new at::RecordFunction(std::move(*callbacks));
  if (what != nullptr && span->needsInputs()) {
    // What moves where, as keyword inputs: the Chrome trace shows them in the span's args (with
    // record_shapes=True), FunctionEvent.kwinputs in Python.
    const std::unordered_map<std::string, c10::IValue> detail{{"what", c10::IValue(std::string(what))},
                                                              {"bytes", c10::IValue(bytes)}};
    span->before(name, &detail);
  } else {
    span->before(name);
  }
  span_ = span;
}

void PhaseSpan::finish() {
  delete static_cast<at::RecordFunction*>(span_);  // its destructor ends the span
}

}  // namespace chainermn
