// The transfers a Worker's ops leave running (point to point): finished at once when they can be,
// else kept in flight, tested by the worker, and, for the libraries that progress in threads of
// their own, waking it when ready (worker.h).
#include "runtime/worker_state.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace chainermn {

void Worker::State::finishOrKeep(QueuedOp& op, RequestPtr request) {
  // A transfer already over (a message that fit in its ring, one that had arrived) completes here:
  // no wake of the worker to find it so.
  std::exception_ptr error;
  bool over = false;
  try {
    over = request->test();
  } catch (const std::exception& e) {
    error = failure(*op.work, e);
    over = true;
  }
  if (over) {
    op.body = nullptr;  // release the tensors before completing (see run())
    if (error) {
      op.work->fail(error);
    } else {
      op.work->setSourceRank(request->source());
      op.work->complete();
    }
    return;
  }
  // Asked before the entry is filed and without the lock, because the wake takes it (a flag set
  // without the lock can fall between the worker's look at it and its sleep: a lost wake-up, and the
  // worker would sleep on) and may run at once, here. A wake before the entry is filed is passed on
  // when it is: the worker may have looked in between.
  auto fired = std::make_shared<std::atomic<bool>>(false);
  const bool wakes = request->wakeWhenReady([weak = weak_from_this(), fired] {
    fired->store(true, std::memory_order_release);
    if (auto state = weak.lock()) {
      state->transferReady();
    }
  });
  {
    std::lock_guard<std::mutex> lock(mutex);
    inFlight.push_back({op.work, std::move(op.body), std::move(request), wakes});
  }
  if (fired->load(std::memory_order_acquire)) {
    transferReady();
  }
}

void Worker::State::transferReady() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    requestReady.store(true, std::memory_order_release);
  }
  wakeWorker.notify_one();
}

// Returns true when some request made progress. The requests are tested without the lock: a staged
// receive's test copies to the device and waits for it, and the watchdog and every enqueue would
// stall behind it. Only this thread removes entries from inFlight, so the pointers stay valid.
bool Worker::State::progressInFlight() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (inFlight.empty()) {
      return false;
    }
    testing.clear();
    for (auto& entry : inFlight) {
      testing.push_back({entry.request.get(), entry.work.get()});
    }
  }
  std::vector<std::pair<Request*, std::exception_ptr>> over;  // done, and how
  for (auto [request, work] : testing) {
    try {
      if (request->test()) {
        over.emplace_back(request, nullptr);
      }
    } catch (const std::exception& e) {
      over.emplace_back(request, failure(*work, e));
    }
  }
  if (over.empty()) {
    return false;
  }
  std::vector<std::pair<InFlight, std::exception_ptr>> finished;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& [request, error] : over) {
      auto it = std::find_if(inFlight.begin(), inFlight.end(),
                             [r = request](const InFlight& entry) { return entry.request.get() == r; });
      if (it != inFlight.end()) {
        finished.emplace_back(std::move(*it), error);
        inFlight.erase(it);
      }
    }
  }
  for (auto& [entry, error] : finished) {
    entry.body = nullptr;  // release the tensors before completing (see run())
    if (error) {
      entry.work->fail(error);
    } else {
      entry.work->setSourceRank(entry.request->source());
      entry.work->complete();
    }
  }
  idle.notify_all();
  return true;
}

}  // namespace chainermn
