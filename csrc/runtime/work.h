// The Work returned by every chainermn call: completion state, the error if any, and a Future whose
// value is the list of output tensors (DDP and comm hooks read fut.value()[0]).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace chainermn {

class OpSpan;  // runtime/op_span.h

using Clock = std::chrono::steady_clock;

class WorkChainerMN : public c10d::Work {
 public:
  // `deadline` is when the operation must have completed (enqueue time + group timeout); a wait()
  // without its own timeout never outlasts it by more than a moment.
  // What names the op in messages; the text is built only when a message needs it, not per call.
  struct Label {
    const char* op;         // "all_reduce"
    const char* transport;  // "gloo"
    int rank;
    int size;
    std::chrono::milliseconds timeout;
    // Numbered in the group's sequence of collectives (every rank takes part in each), not point to
    // point's: a peer that left the group after fewer collectives will never join this one.
    bool collective;
  };

  WorkChainerMN(c10d::OpType opType, Label label, uint64_t sequence, std::vector<at::Tensor> outputs,
                Clock::time_point deadline, std::vector<c10::Device> devices = {});

  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;
  uint64_t getSequencenumber() const override;

  // Both are thread safe and idempotent: the first completion wins (the watchdog may fail a Work
  // whose transport call later returns).
  void complete();
  void fail(std::exception_ptr error);
  // A CUDA op whose kernels are queued on the group's stream: the future completes now (wait() and
  // then() are stream-ordered, as with ProcessGroupNCCL) and wait() returns, but the Work stays
  // incomplete (isCompleted()) until complete() says the device finished it, or fail() says it never
  // will (then wait() and exception() report the failure; the future's value stands).
  void completeQueued();
  // Blocks until completeQueued() or the end (bounded by the deadline): the op's kernels are queued.
  void waitQueued();
  // Called at the end of every successful wait(): a barrier over NCCL blocks the host until the
  // device has run it, as ProcessGroupNCCL's does. Set before the Work is posted.
  void setHostSync(std::function<void()> sync) {
    hostSync_ = std::move(sync);
  }
  // The tensors the Work stands for: fut.value(), result(), and on a GPU the devices whose current
  // streams the future's events are recorded on (none without a CUDA output: wait() would order
  // nothing). Set before the Work is posted; a batch's Work exists from its first transfer and takes
  // all of the batch's tensors at endCoalescing.
  void setOutputs(std::vector<at::Tensor> outputs) {
    outputs_ = std::move(outputs);
  }
  void setSourceRank(int rank);
  // The op's span on torch's profiler timeline (null unless its poster was being profiled): ended when
  // the Work completes or fails. Set before the Work is posted.
  void setSpan(std::shared_ptr<OpSpan> span) {
    span_ = std::move(span);
  }
  const std::shared_ptr<OpSpan>& span() const {
    return span_;
  }
  // The op's entry in the flight recorder (runtime/flight_recorder.h), ended when the Work completes or
  // fails. Set before the Work is posted.
  void setTrace(uint64_t id) {
    trace_ = id;
  }
  uint64_t trace() const {
    return trace_;
  }

  // "all_reduce (seq 7, rank 0 of 4, gloo, timeout 30000 ms)", for messages.
  std::string description() const;
  Clock::time_point deadline() const {
    return deadline_;
  }
  // When it was issued.
  Clock::time_point issued() const {
    return deadline_ - label_.timeout;
  }
  std::string opName() const {
    return label_.op;
  }
  bool isCollective() const {
    return label_.collective;
  }
  // Whether the op's tensors are on a GPU.
  bool onDevice() const {
    return onDevice_;
  }

 private:
  bool claim();  // true for the first completion only
  void markDone(std::exception_ptr error, bool queuedOnly = false);

  const Label label_;
  const uint64_t sequence_;
  std::vector<at::Tensor> outputs_;
  const Clock::time_point deadline_;
  const bool onDevice_;  // CUDA outputs: wait() also orders the caller's current stream after the op
  std::atomic<bool> claimed_{false};
  std::atomic<bool> queued_{false};  // completeQueued() ran (set under mutex_)
  std::atomic<bool> done_{false};    // completed_, readable without the mutex (wait() polls it first)
  std::atomic<int> sourceRank_{-1};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::function<void()> hostSync_;
  std::shared_ptr<OpSpan> span_;
  uint64_t trace_ = ~uint64_t(0);  // FlightRecorder::kNotRecorded
};

// A thread that completes Works: a group's worker. The then() callbacks it runs may wait() for a
// Work they posted, whose transfer only that thread moves on (point to point is polled there): such a
// wait() calls progress() instead of sleeping. progress() returns true when something moved.
class Progressor {
 public:
  virtual ~Progressor() = default;
  virtual bool progress() = 0;
};
// The calling thread's Progressor (null on threads that are not a worker).
void setThreadProgressor(Progressor* progressor);

// A c10::DistBackendError (torch.distributed.DistBackendError in Python) as an exception_ptr.
std::exception_ptr backendError(const std::string& message);

}  // namespace chainermn
