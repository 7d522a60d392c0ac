// One FIFO worker per process group: every rank runs the group's operations in the order they were
// issued, off the caller's thread. A watchdog bounds each operation by its deadline.
//
// An operation is a Body. A collective's body runs to completion on the worker thread (the transport
// blocks) and returns nothing pending. A point-to-point body only starts its transfer and returns the
// Request; the worker tests it between operations, so a send and a receive issued in order never
// wait for each other. Idle, the worker sleeps until a transfer says it is ready (the transports
// whose libraries progress in threads of their own: shared memory, Gloo) or polls it (MPI). A CUDA
// collective's body queues kernels on the group's stream and returns a mark of their end: its Work
// completes at once, stream-ordered, and the watchdog watches the device until the mark is reached
// (a GPU op that hangs or fails is then still found, and named).
//
// When an operation outlives its deadline the watchdog fails its Work with an error that names it
// and says which ranks waited where, fails everything queued behind it, and marks the group
// unusable: the transport may still be inside that call, and nothing can safely be issued behind it
// (as with NCCL after a timeout). A transport failure makes the group unusable too. Either way the
// peers are told (Monitor), so their ops fail within a couple of seconds instead of at their own
// timeouts.
#pragma once

#include "runtime/work.h"
#include "comm/transport.h"

#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace chainermn {

// How a worker reaches its group's other ranks when something goes wrong (runtime/health.h). Called
// on the watchdog and worker threads, only on slow paths; never throws.
class Monitor {
 public:
  virtual ~Monitor() = default;
  // Why `waiter` will never complete, as the peers told it: a peer's reason for aborting the group,
  // or, for a collective, a peer that left the group before it; else "".
  virtual std::string peerAbort(const WorkChainerMN& waiter) = 0;
  // Tells the peers this rank's reason for aborting the group (the first reason published stays).
  virtual void abort(const std::string& reason) = 0;
  // Tells the peers that this rank has waited a while in `work`.
  virtual void waiting(const WorkChainerMN& work) = 0;
  // At `work`'s timeout: which ranks waited in it, where the others were, which died.
  virtual std::string whoIsWhere(const WorkChainerMN& work) = 0;
  // After a transport failure: the ranks that left ("rank 1 (host a, pid 7) exited") or are found
  // dead ("... died"), or "".
  virtual std::string deadRanks() = 0;
  // This rank leaves the group on purpose (it says so before its transports close), with the
  // collectives it issued on it: the peers fail the later ones at once.
  virtual void leaving() = 0;
};

// A group's transports as the watchdog needs them: those whose calls return before their data has
// moved (NCCL's), which alone can say that work already queued failed and which only an abort
// stops; and those a caller's thread may be waiting in (runIfIdle: shared memory), which only an
// abort frees, since no watchdog can fail a Work whose own waiter is running it.
class AbortableComms {
 public:
  virtual ~AbortableComms() = default;
  // "" while healthy; else the first asynchronous error a transport reports. Watchdog thread.
  virtual std::string asyncError() = 0;
  // Aborts them all: their queued kernels return, a call waiting for a peer throws, and their
  // later calls fail. Never throws.
  virtual void abort() = 0;
};

// What an operation's body leaves running when it returns.
struct Pending {
  Pending() = default;
  Pending(RequestPtr transfer) : request(std::move(transfer)) {}  // NOLINT: a body returns its Request
  RequestPtr request;                                             // null: the op is over
  bool onDevice = false;        // the request marks queued device work: the Work completes at once
  std::shared_ptr<void> scope;  // held until then: the device scope its completion records on
};

class Worker {
 public:
  using Body = std::function<Pending()>;

  // `monitor` and `comms` may be null (no relay between ranks; no transport to ask or abort).
  Worker(std::string groupName, std::shared_ptr<Monitor> monitor, std::shared_ptr<AbortableComms> comms = nullptr);
  // stop(), unless stopWorkersAtExit() already did.
  ~Worker();

  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void enqueue(c10::intrusive_ptr<WorkChainerMN> work, Body body);
  // Runs `body` for `work` now, on the calling thread, when the worker has nothing queued or running
  // (so the op keeps its place in the issue order); returns false, running nothing and leaving
  // `body` as it was, otherwise. The worker takes no op meanwhile. What the body leaves in flight is
  // the worker's, as for an op it ran. For the ops that gain nothing from a thread hop: collectives
  // the caller waits for at once, on transports whose waits the group's break aborts
  // (AbortableComms), and the transfers that need none (Transport::sendsGathered).
  bool runIfIdle(const c10::intrusive_ptr<WorkChainerMN>& work, Body& body);

  // CUDA work launched off the worker (on the caller's thread: process_group.cpp), already queued on
  // the device, its Work completed when queued: the watchdog watches `end` as for the worker's own
  // device ops. With `awaitCheck`, the Work completes only once its cross-rank check (enqueueCheck)
  // has passed too.
  void watchOnDevice(c10::intrusive_ptr<WorkChainerMN> work, RequestPtr end, bool awaitCheck);
  // The launch of `work` off the worker threw: it fails as if its body had thrown on the worker (a
  // transport failure breaks the group and tells the peers).
  void launchFailed(const c10::intrusive_ptr<WorkChainerMN>& work, const std::exception& error);
  // Queues the cross-rank check of `deviceWork`, whose kernels are already queued: `check` runs in
  // the group's order on the worker. When it throws (the ranks disagree, or one refused the call),
  // `deviceWork` fails with its error and the group breaks, aborting the device transports: the
  // mismatched kernels would hang or reduce the wrong data.
  void enqueueCheck(c10::intrusive_ptr<WorkChainerMN> checkWork, c10::intrusive_ptr<WorkChainerMN> deviceWork,
                    std::function<void()> check);

  // Blocks until everything enqueued so far has finished or failed, device work included (bounded
  // by the ops' deadlines).
  void drain();

  // Non-empty once a timeout has made the group unusable.
  std::string brokenReason() const;

  // Tells the group's other ranks that this one is leaving on purpose (destroy_process_group, the
  // interpreter's exit), so that their failures say it exited rather than died.
  void announceLeaving();

  // Ends the group on this rank at once (c10d's Backend::abort): `reason` goes to the peers through
  // the monitor (their ops that wait fail with it once they ask, within about a second), and
  // everything pending or issued later here fails with it. The device transports are aborted.
  void abortGroup(const std::string& reason);

  struct State;

 private:
  // Fails what is still queued, lets the operation inside the transport finish (up to its deadline),
  // and stops both threads. Later enqueues fail at once. Runs once.
  void stop();

  friend void stopWorkersAtExit();

  std::shared_ptr<State> state_;
  std::thread worker_;
  std::thread watchdog_;
  std::once_flag stopped_;
};

// Runs what every live worker has queued (bounded by the deadlines), then stops them all. Called when
// the interpreter exits, before it finalises: a worker thread that drops the last reference to a
// tensor with a Python object needs the GIL, and a thread asking for the GIL during finalisation is
// killed by forced unwinding, which aborts the process when it crosses a destructor. Call without the GIL.
void stopWorkersAtExit();

}  // namespace chainermn
