// Device work launched off the worker (on the caller's thread, over NCCL: process_group.cpp), watched
// by the worker's watchdog as its own device ops are, and the cross-rank checks that run beside it.
#include "runtime/worker_state.h"

namespace chainermn {

bool Worker::State::watch(OnDevice entry) {
  const bool wasIdle = onDevice.empty();
  onDevice.push_back(std::move(entry));
  return wasIdle;
}

void Worker::State::checked(const c10::intrusive_ptr<WorkChainerMN>& deviceWork) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& entry : onDevice) {
      if (entry.work == deviceWork) {
        entry.awaitingCheck = false;
      }
    }
  }
  wakeWatchdog.notify_one();
}

void Worker::State::checkFailed(const c10::intrusive_ptr<WorkChainerMN>& deviceWork, const std::exception& error) {
  dumpOnBreak(deviceWork->description() + " failed its cross-rank check");  // the group breaks below
  deviceWork->fail(failure(*deviceWork, error));
  std::unique_lock<std::mutex> lock(mutex);
  if (brokenReason.empty()) {
    // Its kernels are queued on every rank that agreed to it: they would wait for the ranks that
    // did not, or reduce what they did not mean. Only aborting the device transports ends them.
    breakGroup(lock, "the group is unusable after " + deviceWork->description() +
                         " was queued on the GPU but failed its cross-rank check");
  }
}

void Worker::watchOnDevice(c10::intrusive_ptr<WorkChainerMN> work, RequestPtr end, bool awaitCheck) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->brokenReason.empty()) {
      // Broken while it was being launched: its kernels were aborted, or will be.
      work->fail(backendError("chainermn " + work->description() + ": " + state_->brokenReason));
      return;
    }
    wake = state_->watch({std::move(work), std::move(end), awaitCheck});
  }
  if (wake) {
    state_->wakeWatchdog.notify_one();
  }
}

void Worker::launchFailed(const c10::intrusive_ptr<WorkChainerMN>& work, const std::exception& error) {
  work->fail(state_->failed(*work, error));
}

void Worker::enqueueCheck(c10::intrusive_ptr<WorkChainerMN> checkWork, c10::intrusive_ptr<WorkChainerMN> deviceWork,
                          std::function<void()> check) {
  std::weak_ptr<State> weak = state_;
  enqueue(std::move(checkWork), [weak, deviceWork, check = std::move(check)]() -> Pending {
    try {
      check();
    } catch (const std::exception& e) {
      if (auto state = weak.lock()) {
        state->checkFailed(deviceWork, e);
      }
      throw;
    }
    if (auto state = weak.lock()) {
      state->checked(deviceWork);
    }
    return Pending();
  });
}

}  // namespace chainermn
