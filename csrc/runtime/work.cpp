#include "runtime/work.h"

#include "runtime/backoff.h"
#include "runtime/flight_recorder.h"
#include "runtime/op_span.h"
#include "os/spin.h"

#include <c10/util/Exception.h>

#include <thread>

namespace chainermn {

namespace {
// How long wait() lingers past the deadline for the watchdog's verdict before giving its own.
constexpr auto kWatchdogGrace = std::chrono::seconds(2);
// How long wait() spins before it sleeps: a small collective is over in microseconds, and being
// woken from a condition variable costs about as much again. Not on a busy machine; yielding, when
// the worker that runs the op shares the caller's one CPU (mpiexec binds a rank to a core): spin.h.
constexpr auto kPollBeforeSleeping = std::chrono::microseconds(50);
thread_local Progressor* tlsProgressor = nullptr;  // set on a group's worker thread
}  // namespace

void setThreadProgressor(Progressor* progressor) {
  tlsProgressor = progressor;
}

std::exception_ptr backendError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError({__func__, __FILE__, __LINE__}, message));
}

WorkChainerMN::WorkChainerMN(c10d::OpType opType, Label label, uint64_t sequence, std::vector<at::Tensor> outputs,
                             Clock::time_point deadline, std::vector<c10::Device> devices)
    : c10d::Work(label.rank, opType),
      label_(label),
      sequence_(sequence),
      outputs_(std::move(outputs)),
      deadline_(deadline),
      onDevice_(!devices.empty()),
      // With devices, markCompleted (on the worker, whose current stream is the group's) records an
      // event per device, and the future's wait()/then() make the waiter's streams wait on it.
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::move(devices))) {}

std::string WorkChainerMN::description() const {
  return std::string(label_.op) + " (seq " + std::to_string(sequence_) + ", rank " + std::to_string(label_.rank) +
         " of " + std::to_string(label_.size) + ", " + label_.transport + ", timeout " +
         std::to_string(label_.timeout.count()) + " ms)";
}

bool WorkChainerMN::claim() {
  return !claimed_.exchange(true);
}

// The future is completed before the Work, so whoever returns from wait() finds the future's value.
// With `queuedOnly`, only a Work that completeQueued() left waiting for the device's verdict, once.
void WorkChainerMN::markDone(std::exception_ptr error, bool queuedOnly) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queuedOnly && (!queued_ || completed_)) {
      return;
    }
    completed_ = true;
    exception_ = error;
  }
  if (span_) {
    span_->end();  // before the waiter wakes: on the caller's thread, the span closes inside its op
  }
  FlightRecorder::get().ended(trace_, error == nullptr);
  done_.store(true, std::memory_order_release);
  cv_.notify_all();
}

void WorkChainerMN::complete() {
  if (claim()) {
    future_->markCompleted(c10::IValue(outputs_));
    markDone(nullptr);
  } else {
    markDone(nullptr, /*queuedOnly=*/true);
  }
}

void WorkChainerMN::fail(std::exception_ptr error) {
  if (claim()) {
    future_->setError(error);
    markDone(error);
  } else {
    markDone(error, /*queuedOnly=*/true);
  }
}

void WorkChainerMN::completeQueued() {
  if (claim()) {
    future_->markCompleted(c10::IValue(outputs_));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queued_ = true;
    }
    cv_.notify_all();
  }
}

void WorkChainerMN::waitQueued() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_until(lock, deadline_ + kWatchdogGrace, [this] { return completed_ || queued_; });
}

bool WorkChainerMN::wait(std::chrono::milliseconds timeout) {
  Spin spin(kPollBeforeSleeping, Awaited::OwnThread);
  while (!done_.load(std::memory_order_acquire) && !queued_.load(std::memory_order_acquire) && spin.again()) {
  }
  const auto limit = timeout == ::kNoTimeout ? deadline_ + kWatchdogGrace : Clock::now() + timeout;
  if (tlsProgressor != nullptr) {
    // On the worker, in a callback: this thread is the one that must move the op on.
    Backoff backoff;
    while (!done_.load(std::memory_order_acquire) && !queued_.load(std::memory_order_acquire) && Clock::now() < limit) {
      if (!tlsProgressor->progress()) {
        std::this_thread::sleep_for(backoff.next());
      }
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_until(lock, limit, [this] { return completed_ || queued_; })) {
    const auto waited =
        timeout == ::kNoTimeout ? std::string("its group timeout") : std::to_string(timeout.count()) + " ms";
    C10_THROW_ERROR(DistBackendError, "chainermn " + description() + ": wait() timed out after " + waited);
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  lock.unlock();
  if (onDevice_) {
    // Queued on the group's stream: the caller's current stream now waits for it (as
    // ProcessGroupNCCL's wait() does), without blocking the host. A failure the device reports later
    // reaches the caller through the next wait(), exception() or op of the group.
    future_->wait();
  }
  if (hostSync_) {
    hostSync_();
    // The device ran it: the watchdog completes the Work at its next look at the device (within
    // 100 ms), or failed it already (a peer never came: it aborted the kernels at the timeout).
    // A barrier's wait() returns with the Work complete, as ProcessGroupNCCL's does.
    std::unique_lock<std::mutex> relock(mutex_);
    cv_.wait_until(relock, limit, [this] { return completed_; });
    if (exception_) {
      std::rethrow_exception(exception_);
    }
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkChainerMN::getFuture() {
  return future_;
}

std::vector<at::Tensor> WorkChainerMN::result() {
  return outputs_;
}

int WorkChainerMN::sourceRank() const {
  return sourceRank_.load();
}

uint64_t WorkChainerMN::getSequencenumber() const {
  return sequence_;
}

void WorkChainerMN::setSourceRank(int rank) {
  sourceRank_.store(rank);
}

}  // namespace chainermn
