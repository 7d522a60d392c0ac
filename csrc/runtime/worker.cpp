#include "runtime/worker.h"

#include "runtime/backoff.h"
#include "runtime/flight_recorder.h"
#include "runtime/gil_release.h"
#include "runtime/worker_state.h"
#include "os/linger.h"
#include "os/spin.h"
#include "os/thread_name.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <optional>

namespace chainermn {

namespace {
constexpr auto kLinger = std::chrono::microseconds(50);
}  // namespace

// Set by stopWorkersAtExit(): the interpreter is about to finalise. A worker thread detached earlier (a
// group destroyed while its op was stuck) may still end after that, holding the last reference to its
// State, whose queued Works hold tensors with Python objects: freeing them then needs the GIL, and a
// thread that asks for it during finalisation is ended inside their destructors (an abort). Such a
// thread leaves its State to the process's end instead.
std::atomic<bool> gProcessExiting{false};

// Every live Worker, for stopWorkersAtExit(). Its mutex is held while that function stops them, so a
// Worker being destroyed meanwhile waits, and is never freed while it is being stopped.
std::mutex gLiveMutex;
std::vector<Worker*>& liveWorkers() {
  static auto* workers = new std::vector<Worker*>();  // never destroyed: used until the process ends
  return *workers;
}

std::deque<QueuedOp> Worker::State::takeQueued() {
  std::deque<QueuedOp> taken;
  taken.swap(queue);
  hasQueued.store(false, std::memory_order_release);
  idle.notify_all();
  return taken;
}

void failAll(std::deque<QueuedOp>& ops, const std::string& why) {
  for (auto& op : ops) {
    op.work->fail(backendError("chainermn " + op.work->description() + ": " + why));
  }
}

void Worker::State::run(QueuedOp& op) {
  OwnWork working;  // a thread of this process yielding meanwhile waits for it (spin.h)
  std::string notRun;
  // An op posted by a completion callback runs inside the op whose completion ran the callback:
  // that op stays `current` again once the nested one is over.
  c10::intrusive_ptr<WorkChainerMN> outer;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (brokenReason.empty()) {
      outer = current;
      current = op.work;
      wake = wakesWatchdog(*op.work);
    } else {
      notRun = brokenReason;
    }
  }
  if (!notRun.empty()) {
    op.work->fail(backendError("chainermn " + op.work->description() + ": not run, " + notRun));
    return;
  }
  if (wake) {
    wakeWatchdog.notify_one();
  }
  RequestPtr request;
  bool queuedOnDevice = false;
  std::shared_ptr<void> scope;  // released once the Work completed when queued
  std::exception_ptr error;
  FlightRecorder::get().started(op.work->trace());
  try {
    Pending pending = op.body();
    request = std::move(pending.request);
    queuedOnDevice = pending.onDevice;
    scope = std::move(pending.scope);
  } catch (const std::exception& e) {
    error = failed(*op.work, e);
  }
  if (!request || queuedOnDevice) {
    // Let go of the op's tensors before anyone can see it finish: a tensor whose Python object is gone
    // needs the GIL to be freed, and once the caller has moved on the interpreter may be finalising,
    // when a thread that asks for the GIL is killed (terminate). The caller still holds them now.
    op.body = nullptr;
  }
  if (error) {
    op.work->fail(error);
  } else if (queuedOnDevice) {
    op.work->completeQueued();
    scope.reset();
  } else if (!request) {
    op.work->complete();
  }
  if (request && !queuedOnDevice) {
    finishOrKeep(op, std::move(request));  // before `current` is reset: drain() sees one or the other
  }
  bool watchFromNow = false;  // the watchdog polls the device while ops are queued there
  {
    std::lock_guard<std::mutex> lock(mutex);
    current = outer;
    if (queuedOnDevice && request) {
      watchFromNow = watch({op.work, std::move(request)});
    }
  }
  idle.notify_all();
  if (watchFromNow) {
    wakeWatchdog.notify_one();
  }
}

bool Worker::State::progress() {
  return progressInFlight();
}

void Worker::State::workerLoop() {
  setThreadProgressor(this);
  Backoff backoff;
  LingerPolicy linger(kLinger);
  std::optional<Clock::time_point> idleSince;  // when the worker last ran out of work
  const auto workCame = [&] {
    if (idleSince) {
      linger.ended(Clock::now() - *idleSince);
      idleSince.reset();
    }
  };
  while (true) {
    std::optional<QueuedOp> op;
    {
      std::unique_lock<std::mutex> lock(mutex);
      bool moved = false;
      if (queue.empty() && !stopping && backoff.fresh()) {
        if (!idleSince) {
          idleSince = Clock::now();
        }
        // Linger before sleeping: the next op of a training step often follows within
        // microseconds, and so does the message a transfer waits for; a wake-up through the
        // condition variable (or a transport's thread) costs as much again. Transfers in flight are
        // tested meanwhile. Not when recent gaps were longer than the linger (see linger.h).
        const auto spin = linger.linger();
        if (spin.count() == 0) {
          backoff.skipSpins();
        } else {
          const bool transfers = !inFlight.empty();
          lock.unlock();
          Spin spinning(spin, Awaited::NextEvent);  // none on a busy machine (spin.h)
          while (!hasQueued.load(std::memory_order_acquire) && spinning.again()) {
            if (transfers && progressInFlight()) {
              moved = true;
              break;
            }
          }
          lock.lock();
          if (moved) {
            workCame();
            backoff.reset();  // the next wait lingers again
          }
        }
      }
      if ((queue.empty() || callerRunning) && !stopping && !moved) {
        const bool poll =
            std::any_of(inFlight.begin(), inFlight.end(), [](const InFlight& entry) { return !entry.wakes; });
        if (!poll) {
          // Nothing to poll: transfers in flight wake this thread when they are ready. Polling them
          // would wake it every millisecond, and on a core shared with the caller (a rank bound to
          // one core) each wake preempts the caller's computation.
          wakeWorker.wait(lock, [this] {
            return stopping || (!queue.empty() && !callerRunning) || requestReady.load(std::memory_order_acquire);
          });
        } else {
          wakeWorker.wait_for(lock, backoff.next(), [this] {
            return stopping || (!queue.empty() && !callerRunning) || requestReady.load(std::memory_order_acquire);
          });
        }
      }
      if (!queue.empty() && !callerRunning) {
        op.emplace(std::move(queue.front()));
        queue.pop_front();
        hasQueued.store(!queue.empty(), std::memory_order_release);
        workerRunning = true;
      } else if (stopping) {
        return;
      }
    }
    if (op) {
      workCame();
      run(*op);
      {
        std::lock_guard<std::mutex> lock(mutex);
        workerRunning = false;
      }
      idle.notify_all();
      backoff.reset();
    }
    requestReady.store(false, std::memory_order_release);  // before testing: a later wake stays seen
    if (progressInFlight()) {
      workCame();
      backoff.reset();
    }
  }
}

Worker::Worker(std::string groupName, std::shared_ptr<Monitor> monitor, std::shared_ptr<AbortableComms> comms)
    : state_(std::make_shared<State>(std::move(groupName), std::move(monitor), std::move(comms))) {
  // The threads share the state, so a worker stuck in a transport call that never returns can be
  // detached without leaving it pointing at freed memory.
  std::promise<void> started;
  worker_ = std::thread([state = state_, &started]() mutable {
    nameThisThread("cmn-worker");
    state->workerThread = std::this_thread::get_id();
    started.set_value();
    state->workerLoop();
    if (gProcessExiting.load(std::memory_order_acquire)) {
      new std::shared_ptr<State>(std::move(state));  // see gProcessExiting
    }
  });
  started.get_future().wait();
  watchdog_ = std::thread([state = state_] {
    nameThisThread("cmn-watchdog");
    state->watchdogLoop();
  });
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
  // The waits below may need a tensor freed on the worker, which needs the GIL (gil_release.h).
  GilReleased released;
  std::call_once(stopped_, [this] {
    bool stuck = false;
    std::deque<QueuedOp> queued;
    std::vector<c10::intrusive_ptr<WorkChainerMN>> unfinished;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      state_->closed = true;
      queued = state_->takeQueued();
      lock.unlock();
      failAll(queued, "not run: the process group was destroyed");
      lock.lock();
      // Let an operation inside the transport finish, up to its deadline; not when the group is
      // broken (its peers are gone or gave up: it will not finish).
      const bool wait = state_->current && state_->brokenReason.empty();
      const auto deadline = wait ? state_->current->deadline() : Clock::now();
      state_->idle.wait_until(lock, deadline, [this] { return !state_->current; });
      stuck = static_cast<bool>(state_->current);
      for (auto& entry : state_->inFlight) {
        unfinished.push_back(entry.work);
      }
      // Device work not seen to end (drain() waited for it, up to its deadline): no watchdog is left
      // to watch it.
      for (auto& entry : state_->onDevice) {
        unfinished.push_back(entry.work);
      }
      state_->onDevice.clear();
      state_->stopping = true;
    }
    for (auto& work : unfinished) {
      work->fail(
          backendError("chainermn " + work->description() + ": not completed before the process group was destroyed"));
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
  const auto self = std::this_thread::get_id();
  if (self == state_->workerThread || self == state_->callerThread.load(std::memory_order_relaxed)) {
    // Posted by a completion callback (a then() callback runs where its Work completes: here, on the
    // worker or on a caller running an op for it). The callback may wait for this op (torch's
    // PowerSGD hook does), and this thread is the one that must run it, so it runs now, nested in
    // the op that completed. Every rank completes its ops in issue order, so every rank runs the
    // callback's ops at the same point of its sequence.
    QueuedOp op{std::move(work), std::move(body)};
    // A transfer is left in flight: a wait() for it here keeps the transfers moving (progress()).
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

bool Worker::runIfIdle(const c10::intrusive_ptr<WorkChainerMN>& work, Body& body) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (std::this_thread::get_id() == state_->workerThread || state_->closed || !state_->queue.empty() ||
        state_->current || state_->callerRunning || state_->workerRunning) {
      return false;
    }
    state_->callerRunning = true;
    state_->callerThread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  QueuedOp op{work, std::move(body)};
  GilReleased released;  // the op may wait for its peers: other Python threads go on meanwhile
  state_->runOnCaller(op);
  return true;
}

void Worker::State::runOnCaller(QueuedOp& op) {
  run(op);  // never throws: a failing body fails the Work
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    callerRunning = false;
    callerThread.store(std::thread::id(), std::memory_order_relaxed);
    // An op another thread posted meanwhile; or a transfer the op left in flight, which the worker
    // moves on from now (it may be asleep with nothing to poll).
    if (!inFlight.empty()) {
      requestReady.store(true, std::memory_order_release);
    }
    wake = !queue.empty() || !inFlight.empty();
  }
  if (wake) {
    wakeWorker.notify_one();
  }
}

void Worker::drain() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->idle.wait(lock, [this] {
    // An op the watchdog failed counts as finished even if its transport call never returns.
    if (state_->stopping) {
      return true;  // stopped: nothing will finish any more
    }
    // workerRunning without `current`: the worker took an op and is about to run it.
    if (!state_->queue.empty() || (state_->workerRunning && !state_->current) ||
        (state_->current && !state_->current->isCompleted()) || !state_->onDevice.empty()) {
      return false;
    }
    return std::all_of(state_->inFlight.begin(), state_->inFlight.end(),
                       [](const InFlight& entry) { return entry.work->isCompleted(); });
  });
}

void Worker::announceLeaving() {
  if (state_->monitor) {
    state_->monitor->leaving();
  }
}

void Worker::abortGroup(const std::string& reason) {
  if (state_->monitor) {
    state_->monitor->abort(reason);  // first: the peers may be waiting on this rank already
  }
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (state_->brokenReason.empty()) {
    state_->breakGroup(lock, reason);
  }
}

void stopWorkersAtExit() {
  gProcessExiting.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(gLiveMutex);
  for (Worker* worker : liveWorkers()) {
    worker->announceLeaving();  // an uncaught exception ends here too: the peers are told it exited
    worker->drain();
    worker->stop();
  }
}

std::string Worker::brokenReason() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->brokenReason;
}

}  // namespace chainermn
