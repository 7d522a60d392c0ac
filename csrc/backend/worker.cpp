#include "backend/worker.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>

namespace chainermn {

namespace {

constexpr auto kLinger = std::chrono::microseconds(50);

struct Op {
  c10::intrusive_ptr<WorkChainerMN> work;
  Worker::Body body;  // owns the tensors and buffers the transport reads and writes
};

struct InFlight {
  c10::intrusive_ptr<WorkChainerMN> work;
  Worker::Body body;  // kept alive until the transfer is over
  RequestPtr request;
};

// Polling of point-to-point requests: yield at first (a reply is often microseconds away), then
// sleep longer and longer so an idle wait does not steal a core from other ranks.
class Backoff {
 public:
  std::chrono::microseconds next() {
    if (round_ < 64) {
      ++round_;
      return std::chrono::microseconds(0);
    }
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(1000));
    return delay_;
  }
  void reset() {
    round_ = 0;
    delay_ = std::chrono::microseconds(10);
  }

 private:
  int round_ = 0;
  std::chrono::microseconds delay_{10};
};

std::string describeError(const std::exception& error) {
  if (auto* c10error = dynamic_cast<const c10::Error*>(&error)) {
    return c10error->what_without_backtrace();
  }
  return error.what();
}

// What a Work fails with when its body or request throws. A ValueError stays one: the ranks
// disagreed on the call (backend/agreement.h) or a receive did not match its send, and the group is
// still in step. Anything else is the backend's failure.
std::exception_ptr failure(const WorkChainerMN& work, const std::exception& e) {
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) {
    return std::make_exception_ptr(
        c10::ValueError({__func__, __FILE__, __LINE__}, "chainermn " + work.description() + ": " + describeError(e)));
  }
  return backendError("chainermn " + work.description() + " failed: " + describeError(e));
}

} // namespace

struct Worker::State {
  explicit State(std::string name) : groupName(std::move(name)) {}

  const std::string groupName;
  mutable std::mutex mutex;
  std::condition_variable wakeWorker;    // an op was queued, or stop
  std::condition_variable wakeWatchdog;  // a deadline started, or stop
  std::condition_variable idle;          // the queue emptied or the worker left a call
  std::deque<Op> queue;
  c10::intrusive_ptr<WorkChainerMN> current;  // the op inside a transport call
  std::vector<InFlight> inFlight;
  std::string brokenReason;
  std::atomic<bool> hasQueued{false};  // !queue.empty(), readable without the mutex
  std::thread::id workerThread;        // set once, before the first op can be queued
  bool closed = false;    // stop() began: enqueue refuses
  bool stopping = false;  // the threads should leave

  void workerLoop();
  void watchdogLoop();
  void run(Op& op);
  bool progressInFlight();
  std::deque<Op> takeQueued();  // with mutex held
};

// Completing or failing a Work runs its future's callbacks, which may issue more operations on this
// group: it is never done with the mutex held.
void failAll(std::deque<Op>& ops, const std::string& why);

// Every live Worker, for stopWorkersAtExit(). Its mutex is held while that function stops them, so a
// Worker being destroyed meanwhile waits, and is never freed while it is being stopped.
std::mutex gLiveMutex;
std::vector<Worker*>& liveWorkers() {
  static auto* workers = new std::vector<Worker*>();  // never destroyed: used until the process ends
  return *workers;
}

std::deque<Op> Worker::State::takeQueued() {
  std::deque<Op> taken;
  taken.swap(queue);
  hasQueued.store(false, std::memory_order_release);
  idle.notify_all();
  return taken;
}

void failAll(std::deque<Op>& ops, const std::string& why) {
  for (auto& op : ops) {
    op.work->fail(backendError("chainermn " + op.work->description() + ": " + why));
  }
}

void Worker::State::run(Op& op) {
  std::string notRun;
  // An op posted by a completion callback runs inside the op whose completion ran the callback:
  // that op stays `current` again once the nested one is over.
  c10::intrusive_ptr<WorkChainerMN> outer;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (brokenReason.empty()) {
      outer = current;
      current = op.work;
    } else {
      notRun = brokenReason;
    }
  }
  if (!notRun.empty()) {
    op.work->fail(backendError("chainermn " + op.work->description() + ": not run, " + notRun));
    return;
  }
  wakeWatchdog.notify_one();
  RequestPtr request;
  std::exception_ptr error;
  try {
    request = op.body();
  } catch (const std::exception& e) {
    error = failure(*op.work, e);
  }
  if (!request) {
    // Let go of the op's tensors before anyone can see it finish: a tensor whose Python object is gone
    // needs the GIL to be freed, and once the caller has moved on the interpreter may be finalising,
    // when a thread that asks for the GIL is killed (terminate). The caller still holds them now.
    op.body = nullptr;
  }
  if (error) {
    op.work->fail(error);
  } else if (!request) {
    op.work->complete();
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    current = outer;
    if (request) {
      inFlight.push_back({op.work, std::move(op.body), std::move(request)});
    }
  }
  idle.notify_all();
}

// Returns true when some request made progress.
bool Worker::State::progressInFlight() {
  std::vector<InFlight> finished;
  std::vector<std::exception_ptr> errors;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = inFlight.begin(); it != inFlight.end();) {
      std::exception_ptr error;
      bool done = false;
      try {
        done = it->request->test();
      } catch (const std::exception& e) {
        done = true;
        error = failure(*it->work, e);
      }
      if (done) {
        finished.push_back(std::move(*it));
        errors.push_back(error);
        it = inFlight.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (size_t i = 0; i < finished.size(); ++i) {
    finished[i].body = nullptr;  // release the tensors before completing (see run())
    if (errors[i]) {
      finished[i].work->fail(errors[i]);
    } else {
      finished[i].work->setSourceRank(finished[i].request->source());
      finished[i].work->complete();
    }
  }
  if (!finished.empty()) {
    idle.notify_all();
  }
  return !finished.empty();
}

void Worker::State::workerLoop() {
  Backoff backoff;
  while (true) {
    std::optional<Op> op;
    {
      std::unique_lock<std::mutex> lock(mutex);
      if (queue.empty() && !stopping && inFlight.empty()) {
        // Linger before sleeping: the next op of a training step usually follows within
        // microseconds, and a wake-up through the condition variable costs as much again.
        lock.unlock();
        const auto lingerUntil = Clock::now() + kLinger;
        while (!hasQueued.load(std::memory_order_acquire) && Clock::now() < lingerUntil) {
          std::this_thread::yield();
        }
        lock.lock();
      }
      if (queue.empty() && !stopping) {
        if (inFlight.empty()) {
          wakeWorker.wait(lock, [this] { return stopping || !queue.empty(); });
        } else {
          wakeWorker.wait_for(lock, backoff.next(), [this] { return stopping || !queue.empty(); });
        }
      }
      if (!queue.empty()) {
        op.emplace(std::move(queue.front()));
        queue.pop_front();
        hasQueued.store(!queue.empty(), std::memory_order_release);
      } else if (stopping) {
        return;
      }
    }
    if (op) {
      run(*op);
      backoff.reset();
    }
    if (progressInFlight()) {
      backoff.reset();
    }
  }
}

void Worker::State::watchdogLoop() {
  std::unique_lock<std::mutex> lock(mutex);
  while (!stopping) {
    const auto now = Clock::now();
    auto nextCheck = now + std::chrono::seconds(1);
    std::vector<c10::intrusive_ptr<WorkChainerMN>> overdue;
    if (current && !current->isCompleted()) {
      if (current->deadline() <= now) {
        overdue.push_back(current);
      } else {
        nextCheck = std::min(nextCheck, current->deadline());
      }
    }
    for (auto& entry : inFlight) {
      if (entry.work->isCompleted()) {
        continue;  // failed earlier; the request stays until the transport lets go of it
      }
      if (entry.work->deadline() <= now) {
        overdue.push_back(entry.work);
      } else {
        nextCheck = std::min(nextCheck, entry.work->deadline());
      }
    }
    if (!overdue.empty()) {
      if (brokenReason.empty()) {
        brokenReason = "the group is unusable after " + overdue.front()->description() + " timed out";
      }
      auto queued = takeQueued();
      const std::string reason = brokenReason;
      lock.unlock();
      for (auto& work : overdue) {
        work->fail(backendError(
            "chainermn " + work->description() +
            " timed out: a peer did not take part before the group timeout (a rank may have died, or the "
            "ranks issued different collectives)"));
      }
      failAll(queued, "not run, " + reason);
      lock.lock();
      idle.notify_all();
      continue;
    }
    wakeWatchdog.wait_until(lock, nextCheck);
  }
}

Worker::Worker(std::string groupName) : state_(std::make_shared<State>(std::move(groupName))) {
  // The threads share the state, so a worker stuck in a transport call that never returns can be
  // detached without leaving it pointing at freed memory.
  std::promise<void> started;
  worker_ = std::thread([state = state_, &started] {
    state->workerThread = std::this_thread::get_id();
    started.set_value();
    state->workerLoop();
  });
  started.get_future().wait();
  watchdog_ = std::thread([state = state_] { state->watchdogLoop(); });
  std::lock_guard<std::mutex> lock(gLiveMutex);
  liveWorkers().push_back(this);
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(gLiveMutex);
    auto& live = liveWorkers();
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
  }
  stop();
}

void Worker::stop() {
  std::call_once(stopped_, [this] {
    bool stuck = false;
    std::deque<Op> queued;
    std::vector<c10::intrusive_ptr<WorkChainerMN>> unfinished;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      state_->closed = true;
      queued = state_->takeQueued();
      lock.unlock();
      failAll(queued, "not run: the process group was destroyed");
      lock.lock();
      // Let an operation inside the transport finish, up to its deadline.
      const auto deadline = state_->current ? state_->current->deadline() : Clock::now();
      state_->idle.wait_until(lock, deadline, [this] { return !state_->current; });
      stuck = static_cast<bool>(state_->current);
      for (auto& entry : state_->inFlight) {
        unfinished.push_back(entry.work);
      }
      state_->stopping = true;
    }
    for (auto& work : unfinished) {
      work->fail(backendError("chainermn " + work->description() + ": not completed before the process group was destroyed"));
    }
    state_->wakeWorker.notify_all();
    state_->wakeWatchdog.notify_all();
    watchdog_.join();
    if (stuck) {
      worker_.detach();
    } else {
      worker_.join();
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->inFlight.empty()) {
      // Transfers the transport has not released may still write into their buffers: keep the
      // buffers alive for the life of the process rather than free memory under it.
      new std::vector<InFlight>(std::move(state_->inFlight));
    }
  });
}

void Worker::enqueue(c10::intrusive_ptr<WorkChainerMN> work, Body body) {
  if (std::this_thread::get_id() == state_->workerThread) {
    // Posted by a completion callback (a then() callback runs where its Work completes: here). The
    // callback may wait for this op (torch's PowerSGD hook does), and this thread is the one that
    // must run it, so it runs now, nested in the op that completed. Every rank completes its ops in
    // issue order, so every rank runs the callback's ops at the same point of its sequence.
    Op op{std::move(work), std::move(body)};
    state_->run(op);
    return;
  }
  std::string notRun;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->closed) {
      notRun = "the process group was destroyed (or the process is exiting)";
    } else if (state_->brokenReason.empty()) {
      state_->queue.push_back({work, std::move(body)});
      state_->hasQueued.store(true, std::memory_order_release);
    } else {
      notRun = state_->brokenReason;
    }
  }
  if (!notRun.empty()) {
    work->fail(backendError("chainermn " + work->description() + ": not run, " + notRun));
    return;
  }
  state_->wakeWorker.notify_one();
}

void Worker::drain() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->idle.wait(lock, [this] {
    // An op the watchdog failed counts as finished even if its transport call never returns.
    if (!state_->queue.empty() || (state_->current && !state_->current->isCompleted())) {
      return false;
    }
    return std::all_of(state_->inFlight.begin(), state_->inFlight.end(), [](const InFlight& entry) {
      return entry.work->isCompleted();
    });
  });
}

void stopWorkersAtExit() {
  std::lock_guard<std::mutex> lock(gLiveMutex);
  for (Worker* worker : liveWorkers()) {
    worker->drain();
    worker->stop();
  }
}

std::string Worker::brokenReason() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->brokenReason;
}

} // namespace chainermn
