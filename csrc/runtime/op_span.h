// An op's span on torch's profiler timeline: "chainermn:all_reduce", with the shapes and dtypes of
// its tensors, from the moment a thread starts running the op to its completion, as gloo's
// "gloo:all_reduce" is. The phases it runs (phase.h) are its children.
//
// torch's profiler records on the threads it was started on (its callbacks and state are the
// thread's own), and an op runs on the group's worker. So a span is made where the op is posted,
// only when that thread is being profiled, and carries that thread's state (at::ThreadLocalState)
// to the thread that runs the op; with no profiler active an op carries a null span and nothing
// else is done.
#pragma once

#include <c10/util/ThreadLocalDebugInfo.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace chainermn {

class OpSpan {
 public:
  // The profiler's thread-local state, applied on another thread for a scope and restored after.
  struct ProfilerState {
    std::shared_ptr<c10::ThreadLocalDebugInfo> debugInfo;  // the profiler's own state lives here
    at::RecordFunctionTLS callbacks;                       // its thread-local callbacks
  };
  class ProfilerScope {
   public:
    explicit ProfilerScope(const ProfilerState& state);
    ~ProfilerScope();
    ProfilerScope(const ProfilerScope&) = delete;
    ProfilerScope& operator=(const ProfilerScope&) = delete;

   private:
    c10::DebugInfoGuard debugInfo_;
    const at::RecordFunctionTLS previous_;
  };

  // Null when no profiler is active on the calling thread (one look at its callbacks). The span shows
  // the inputs' shapes and dtypes, then the outputs'.
  static std::shared_ptr<OpSpan> ifProfiled(const char* op, const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& outputs);

  // While a thread runs the op: the poster's profiler state applies there, the op's span has started
  // (once, whichever body of the op runs first), and phases are recorded. A null span does nothing.
  class Running {
   public:
    explicit Running(OpSpan* span);
    ~Running();
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    OpSpan* span_;
    std::optional<ProfilerScope> scope_;
  };

  // At the op's completion or failure, from whichever thread learns it; the first call ends the span.
  void end();

  OpSpan(std::string title, std::vector<c10::IValue> inputs);

 private:
  void start();

  const ProfilerState state_;        // the poster's
  const std::string title_;          // "chainermn:all_reduce"
  std::vector<c10::IValue> inputs_;  // the op's tensors, for their shapes; dropped once started
  std::mutex mutex_;
  std::unique_ptr<at::RecordFunction> span_;
  bool ended_ = false;
};

}  // namespace chainermn
