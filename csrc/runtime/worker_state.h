// The inside of a Worker, shared by its two threads: the queue and the op running (worker.cpp), and
// the watchdog with what it tells and asks the group's other ranks (watchdog.cpp).
#pragma once

#include "runtime/worker.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace chainermn {

struct QueuedOp {
  c10::intrusive_ptr<WorkChainerMN> work;
  Worker::Body body;  // owns the tensors and buffers the transport reads and writes
};

struct InFlight {
  c10::intrusive_ptr<WorkChainerMN> work;
  Worker::Body body;  // kept alive until the transfer is over
  RequestPtr request;
  bool wakes = false;  // the request says when it is ready (wakeWhenReady): no need to poll it
};

// A CUDA op queued on the group's stream, whose Work completed when queued (completeQueued).
struct OnDevice {
  c10::intrusive_ptr<WorkChainerMN> work;
  RequestPtr end;              // reached once the device has run the op
  bool awaitingCheck = false;  // its cross-rank check runs beside it and has not passed yet
};

// An exception's message without c10's backtrace.
std::string describeError(const std::exception& error);

// What a Work fails with when its body or request throws. A ValueError stays one: the ranks
// disagreed on the call (backend/agreement.h) or a receive did not match its send, and the group is
// still in step. Anything else is the backend's failure.
std::exception_ptr failure(const WorkChainerMN& work, const std::exception& e);

struct Worker::State : std::enable_shared_from_this<Worker::State>, Progressor {
  State(std::string name, std::shared_ptr<Monitor> monitor, std::shared_ptr<AbortableComms> comms)
      : groupName(std::move(name)), monitor(std::move(monitor)), comms(std::move(comms)) {}

  const std::string groupName;
  const std::shared_ptr<Monitor> monitor;             // may be null
  const std::shared_ptr<AbortableComms> comms;        // may be null
  c10::intrusive_ptr<WorkChainerMN> reportedWaiting;  // watchdog only: the op the peers were told of
  Clock::time_point nextDeviceAsk{};                  // watchdog only: when to ask the device transports again
  mutable std::mutex mutex;
  std::condition_variable wakeWorker;    // an op was queued, or stop
  std::condition_variable wakeWatchdog;  // a deadline started, or stop
  std::condition_variable idle;          // the queue emptied or the worker left a call
  std::deque<QueuedOp> queue;
  c10::intrusive_ptr<WorkChainerMN> current;  // the op inside a transport call
  bool callerRunning = false;                 // an op runs on its caller's thread (runIfIdle): take none meanwhile
  // That thread, while callerRunning: read without the mutex by enqueue(), whose thread it may be.
  std::atomic<std::thread::id> callerThread{};
  // The worker took an op from the queue and has not finished it (from before `current` is set):
  // no caller may run one meanwhile.
  bool workerRunning = false;
  std::vector<InFlight> inFlight;
  std::vector<std::pair<Request*, WorkChainerMN*>> testing;  // worker only: progressInFlight's snapshot
  std::deque<OnDevice> onDevice;  // in stream order: the watchdog watches them end (watchdog.cpp)
  std::string brokenReason;
  // When the watchdog next wakes by itself (mutex): an op it must see sooner wakes it (wakesWatchdog).
  Clock::time_point watchdogWakesAt{};
  std::atomic<bool> hasQueued{false};     // !queue.empty(), readable without the mutex
  std::atomic<bool> requestReady{false};  // a request in flight may have completed (wakeWhenReady)
  std::thread::id workerThread;           // set once, before the first op can be queued
  bool closed = false;                    // stop() began: enqueue refuses
  bool stopping = false;                  // the threads should leave

  void workerLoop();
  // Runs `op` on the calling thread, which set callerRunning: then lets the worker take ops again.
  void runOnCaller(QueuedOp& op);
  void watchdogLoop();
  // Whether `work`, just started, needs the watchdog before it next wakes by itself (its deadline,
  // or the time to ask the peers about it, comes sooner). Lock held. Most ops do not: the watchdog
  // wakes at least once a second, and waking it per op costs a thread switch per op.
  bool wakesWatchdog(const WorkChainerMN& work) const;
  bool askPeers(std::unique_lock<std::mutex>& lock, Clock::time_point now, Clock::time_point& nextCheck);
  void breakGroup(std::unique_lock<std::mutex>& lock, const std::string& reason);
  // Tells the peers `message`, fails `work` with it and breaks the group ("unusable after <work>
  // <what>"). Lock held on entry and exit.
  void failAndBreak(std::unique_lock<std::mutex>& lock, WorkChainerMN& work, const std::string& message,
                    const std::string& what);
  std::exception_ptr failed(const WorkChainerMN& work, const std::exception& e);
  // The flight recorder's dump of the group's break (runtime/flight_recorder.h), written once: every
  // thread that fails ops for the break calls this first, without the lock, and so waits for the dump.
  void dumpOnBreak(const std::string& why);
  std::once_flag breakDumped;
  // "chainermn <op> timed out: ..., who waited where" (asks the store: without the lock).
  std::string timeoutMessage(const WorkChainerMN& work);
  // Runs an op's body: completes its Work, or leaves its transfer in flight or its device work watched.
  void run(QueuedOp& op);
  bool progress() override;  // a wait() inside a callback on the worker thread
  // Watchdog: completes the device ops whose end was reached; fails the group on a device error.
  bool watchDevice(std::unique_lock<std::mutex>& lock, Clock::time_point now, Clock::time_point& nextCheck);
  // Completes a transfer that is already over, else keeps it in flight (in_flight.cpp). Without
  // the lock.
  void finishOrKeep(QueuedOp& op, RequestPtr request);
  // A transfer in flight may be over: wakes the worker (takes the lock).
  void transferReady();
  bool progressInFlight();  // in_flight.cpp
  // Registers device work (lock held); wakes the watchdog when it was idle. Returns whether it did.
  bool watch(OnDevice entry);
  // A device op's cross-rank check passed, or failed with `error`.
  void checked(const c10::intrusive_ptr<WorkChainerMN>& deviceWork);
  void checkFailed(const c10::intrusive_ptr<WorkChainerMN>& deviceWork, const std::exception& error);
  std::deque<QueuedOp> takeQueued();  // with mutex held
};

// Completing or failing a Work runs its future's callbacks, which may issue more operations on this
// group: it is never done with the mutex held.
void failAll(std::deque<QueuedOp>& ops, const std::string& why);

}  // namespace chainermn
