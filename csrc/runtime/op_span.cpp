#include "runtime/op_span.h"

#include "phase.h"

namespace chainermn {

std::shared_ptr<OpSpan> OpSpan::ifProfiled(const char* op, const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& outputs) {
  if (C10_LIKELY(!at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE))) {
    return nullptr;
  }
  std::vector<c10::IValue> tensors;
  tensors.reserve(inputs.size() + outputs.size());
  tensors.insert(tensors.end(), inputs.begin(), inputs.end());
  tensors.insert(tensors.end(), outputs.begin(), outputs.end());
  return std::make_shared<OpSpan>(std::string("chainermn:") + op, std::move(tensors));
}

OpSpan::OpSpan(std::string title, std::vector<c10::IValue> inputs)
    : state_{c10::ThreadLocalDebugInfo::current(), at::get_record_function_tls_()},
      title_(std::move(title)),
      inputs_(std::move(inputs)) {}

OpSpan::ProfilerScope::ProfilerScope(const ProfilerState& state)
    : debugInfo_(state.debugInfo), previous_(at::get_record_function_tls_()) {
  at::set_record_function_tls_(state.callbacks);
}

OpSpan::ProfilerScope::~ProfilerScope() {
  at::set_record_function_tls_(previous_);
}

void OpSpan::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (span_ || ended_) {
    return;  // a batch's later transfers, or an op failed before it ran
  }
  span_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (span_->isActive()) {
    if (span_->needsInputs()) {
      span_->before(title_, c10::ArrayRef<const c10::IValue>(inputs_.data(), inputs_.size()));
    } else {
      span_->before(title_);
    }
  }
  inputs_.clear();  // the tensors are the op's, not the profiler's, to keep
}

void OpSpan::end() {
  std::unique_ptr<at::RecordFunction> span;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended_ = true;
    span = std::move(span_);
  }
  if (span) {
    // The profiler finds its state on the thread that ends a span: the poster's, here too.
    ProfilerScope scope(state_);
    span->end();
  }
}

OpSpan::Running::Running(OpSpan* span) : span_(span) {
  if (span_ == nullptr) {
    return;
  }
  scope_.emplace(span_->state_);
  span_->start();
  profiledOpsRunning.fetch_add(1, std::memory_order_relaxed);
}

OpSpan::Running::~Running() {
  if (span_ != nullptr) {
    profiledOpsRunning.fetch_sub(1, std::memory_order_relaxed);
  }
}

}  // namespace chainermn
