// The watchdog of a Worker: deadlines, transport failures, and what the group's ranks tell each
// other about them (Monitor), so a failure on one rank reaches every rank within a couple of seconds.
#include "runtime/worker_state.h"

#include "runtime/flight_recorder.h"

#include <algorithm>

namespace chainermn {

namespace {
// An op that has waited this long makes the watchdog ask the store whether a peer aborted the group
// (then twice a second): fast ops never touch the store.
constexpr auto kAskPeersAfter = std::chrono::seconds(1);
constexpr auto kAskPeersEvery = std::chrono::milliseconds(500);
// While CUDA ops are queued, the device is asked this often whether they ended or failed (as often
// as torch's NCCL watchdog asks).
constexpr auto kAskDeviceEvery = std::chrono::milliseconds(100);
}  // namespace

std::string describeError(const std::exception& error) {
  if (auto* c10error = dynamic_cast<const c10::Error*>(&error)) {
    return c10error->what_without_backtrace();
  }
  return error.what();
}

std::exception_ptr failure(const WorkChainerMN& work, const std::exception& e) {
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) {
    return std::make_exception_ptr(
        c10::ValueError({__func__, __FILE__, __LINE__}, "chainermn " + work.description() + ": " + describeError(e)));
  }
  return backendError("chainermn " + work.description() + " failed: " + describeError(e));
}

std::string Worker::State::timeoutMessage(const WorkChainerMN& work) {
  const std::string where = monitor ? monitor->whoIsWhere(work) : "";
  return "chainermn " + work.description() + " timed out: a peer did not take part before the group timeout" +
         (where.empty() ? " (a rank may have died, or the ranks issued different collectives)" : ": " + where);
}

std::exception_ptr Worker::State::failed(const WorkChainerMN& work, const std::exception& e) {
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr || !monitor) {
    // The ranks' check found a mismatch (or a rank refused the op): every rank fails this op alone.
    std::exception_ptr error = failure(work, e);
    FlightRecorder::get().writeOnFailure(work.description() + " failed its cross-rank check");
    return error;
  }
  // The transport failed: a peer may be gone. Name it if this host can tell, tell every rank, and
  // issue nothing more on transports that may be half-way through a call. A transport that gave up
  // at the group timeout raced the watchdog to the same deadline: the message is the watchdog's,
  // whichever won, with the transport's words after it.
  std::string message;
  if (Clock::now() >= work.deadline()) {
    message = timeoutMessage(work) + " (" + describeError(e) + ")";
  } else {
    message = "chainermn " + work.description() + " failed: " + describeError(e);
    const std::string dead = monitor->deadRanks();
    if (!dead.empty()) {
      message += " (" + dead + ")";
    }
  }
  monitor->abort(message);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (brokenReason.empty()) {
      // The whole message: what asks errored() (torchft) learns which peer failed, not only which op.
      brokenReason = "the group is unusable after " + message;
    }
  }
  dumpOnBreak(work.description() + " failed");  // before the op's caller learns it
  if (comms) {
    comms->abort();  // device work queued before this op, or a caller's op, waits on the peers too
  }
  return backendError(message);
}

void Worker::State::dumpOnBreak(const std::string& why) {
  std::call_once(breakDumped, [&] { FlightRecorder::get().writeOnFailure(why); });
}

// Fails every op not yet done with `reason` and makes the group unusable. Called with the lock
// held; completes the Works without it.
void Worker::State::breakGroup(std::unique_lock<std::mutex>& lock, const std::string& reason) {
  brokenReason = reason;
  std::vector<c10::intrusive_ptr<WorkChainerMN>> pending;
  if (current && !current->isCompleted()) {
    pending.push_back(current);
  }
  for (auto& entry : inFlight) {
    if (!entry.work->isCompleted()) {
      pending.push_back(entry.work);
    }
  }
  std::vector<c10::intrusive_ptr<WorkChainerMN>> queuedOnDevice;
  for (auto& entry : onDevice) {
    queuedOnDevice.push_back(entry.work);
  }
  onDevice.clear();  // the abort below ends their kernels: nothing is left to watch
  auto queued = takeQueued();
  lock.unlock();
  // Work already completed when queued fails without running callbacks: before the abort ends its
  // kernels, so a wait() that blocks the host on the device (a barrier) finds the failure then.
  for (auto& work : queuedOnDevice) {
    work->fail(backendError("chainermn " + work->description() + ": " + reason));
  }
  if (comms) {
    // Kernels waiting on a peer that is gone or gave up would never return: NCCL's abort ends them,
    // so the streams that wait on them (the caller's too) move on; a caller's thread waiting in the
    // shared-memory barrier returns. Before the other failures, whose callbacks may wait for the
    // device.
    comms->abort();
  }
  for (auto& work : pending) {
    work->fail(backendError("chainermn " + work->description() + ": " + reason));
  }
  failAll(queued, "not run, " + reason);
  lock.lock();
  idle.notify_all();
}

// While an op has waited over kAskPeersAfter: tells the peers once, and asks whether one of them
// aborted the group. Returns true when it did (the group is then broken). Lock held on entry and exit.
bool Worker::State::askPeers(std::unique_lock<std::mutex>& lock, Clock::time_point now, Clock::time_point& nextCheck) {
  c10::intrusive_ptr<WorkChainerMN> waiter;
  auto consider = [&](const c10::intrusive_ptr<WorkChainerMN>& work) {
    if (work && !work->isCompleted() && (!waiter || work->issued() < waiter->issued())) {
      waiter = work;
    }
  };
  consider(current);
  for (auto& entry : inFlight) {
    consider(entry.work);
  }
  if (!onDevice.empty()) {
    consider(onDevice.front().work);  // the oldest: the device runs them in order
  }
  if (!monitor || !waiter || !brokenReason.empty()) {
    return false;
  }
  if (now < waiter->issued() + kAskPeersAfter) {
    nextCheck = std::min(nextCheck, waiter->issued() + kAskPeersAfter);
    return false;
  }
  const bool tell = waiter != reportedWaiting;
  reportedWaiting = waiter;
  lock.unlock();
  if (tell) {
    monitor->waiting(*waiter);
  }
  const std::string reason = monitor->peerAbort(*waiter);
  lock.lock();
  nextCheck = std::min(nextCheck, Clock::now() + kAskPeersEvery);
  if (reason.empty() || !brokenReason.empty()) {
    return false;
  }
  lock.unlock();
  dumpOnBreak(waiter->description() + " ended by a peer");  // before the ops fail
  lock.lock();
  if (!brokenReason.empty()) {
    return false;
  }
  breakGroup(lock, "the group was aborted: " + reason);
  return true;
}

// Completes the device ops whose end the device reached, and asks the device transports for an
// asynchronous error (a peer gone, a network error: NCCL's kernels would wait forever). Returns true
// when it broke the group. Lock held on entry and exit.
bool Worker::State::watchDevice(std::unique_lock<std::mutex>& lock, Clock::time_point now,
                                Clock::time_point& nextCheck) {
  std::string error;
  c10::intrusive_ptr<WorkChainerMN> failedOp;
  const size_t watched = onDevice.size();
  while (!onDevice.empty()) {
    try {
      // In stream order: one not yet checked across ranks holds back those behind it.
      if (onDevice.front().awaitingCheck || !onDevice.front().end->test()) {
        break;
      }
    } catch (const std::exception& e) {
      // A sticky CUDA error (an illegal address, ...): the stream is lost.
      error = describeError(e);
      failedOp = onDevice.front().work;
      break;
    }
    if (brokenReason.empty()) {
      onDevice.front().work->complete();  // a queued Work: no callbacks run (its future completed when queued)
    } else {
      // Ended by the abort that broke the group (a transport failed): its result cannot be trusted.
      auto& work = *onDevice.front().work;
      work.fail(backendError("chainermn " + work.description() + ": " + brokenReason));
    }
    onDevice.pop_front();
  }
  if (onDevice.size() != watched) {
    idle.notify_all();  // drain() waits for the device too
  }
  // Point-to-point CUDA transfers (inFlight) are device work too; host transfers are not.
  auto oldestOnDevice = [this]() -> c10::intrusive_ptr<WorkChainerMN> {
    if (!onDevice.empty()) {
      return onDevice.front().work;
    }
    for (const auto& entry : inFlight) {
      if (entry.work->onDevice()) {
        return entry.work;
      }
    }
    return nullptr;
  };
  if (!comms || !oldestOnDevice() || !brokenReason.empty()) {
    return false;
  }
  nextCheck = std::min(nextCheck, now + kAskDeviceEvery);
  if (error.empty()) {
    if (now < nextDeviceAsk) {
      nextCheck = std::min(nextCheck, nextDeviceAsk);
      return false;
    }
    nextDeviceAsk = now + kAskDeviceEvery;
    lock.unlock();
    error = comms->asyncError();
    lock.lock();
    failedOp = oldestOnDevice();
    if (error.empty() || !failedOp || !brokenReason.empty()) {
      return false;
    }
  }
  failAndBreak(lock, *failedOp, "chainermn " + failedOp->description() + " failed on the GPU: " + error,
               "failed on the GPU");
  return true;
}

void Worker::State::failAndBreak(std::unique_lock<std::mutex>& lock, WorkChainerMN& work, const std::string& message,
                                 const std::string& what) {
  // The reason first: a caller whose wait() raises may ask errored() at once (torchft does).
  const bool first = brokenReason.empty();
  if (first) {
    brokenReason = "the group is unusable after " + work.description() + " " + what;
  }
  const std::string reason = brokenReason;
  lock.unlock();
  if (monitor) {
    monitor->abort(message);
  }
  dumpOnBreak(work.description() + " " + what);  // before its caller learns it
  work.fail(backendError(message));
  lock.lock();
  if (first) {
    breakGroup(lock, reason);  // fails what else is pending
  }
}

void Worker::State::watchdogLoop() {
  std::unique_lock<std::mutex> lock(mutex);
  while (!stopping) {
    const auto now = Clock::now();
    auto nextCheck = now + std::chrono::seconds(1);
    c10::intrusive_ptr<WorkChainerMN> overdue;
    auto check = [&](const c10::intrusive_ptr<WorkChainerMN>& work) {
      if (!work || work->isCompleted()) {
        return;  // a failed request stays until the transport lets go of it
      }
      if (work->deadline() <= now) {
        overdue = overdue ? overdue : work;
      } else {
        nextCheck = std::min(nextCheck, work->deadline());
      }
    };
    check(current);
    for (auto& entry : inFlight) {
      check(entry.work);
    }
    if (!onDevice.empty()) {
      check(onDevice.front().work);  // the oldest; one behind it is caught once this one ends
    }
    if (overdue) {
      // Who waited where, asked of the store without the lock; then every pending op fails.
      lock.unlock();
      const std::string message = timeoutMessage(*overdue);
      lock.lock();
      failAndBreak(lock, *overdue, message, "timed out");
      continue;
    }
    if (watchDevice(lock, now, nextCheck) || askPeers(lock, now, nextCheck)) {
      continue;
    }
    watchdogWakesAt = nextCheck;
    wakeWatchdog.wait_until(lock, nextCheck);
    watchdogWakesAt = Clock::time_point{};  // awake: it looks at every op before it sleeps again
  }
}

bool Worker::State::wakesWatchdog(const WorkChainerMN& work) const {
  return std::min(work.deadline(), work.issued() + kAskPeersAfter) < watchdogWakesAt;
}

}  // namespace chainermn
