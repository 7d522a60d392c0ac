// Threads that wait for transfers which only learn they finished inside a blocking wait (Gloo's send
// and receive Works): every job gets a thread of its own at once, so that one transfer's completion
// never waits behind another's, but a thread whose job is done waits for the next job instead of
// ending. Creating a thread per transfer cost tens of microseconds a message, and each new thread
// that waited on a Gloo Work left about 140 bytes of per-thread state behind for good: a process
// grew by megabytes per ten thousand messages.
#pragma once

#include <functional>
#include <memory>

namespace chainermn {

class WaiterPool {
 public:
  WaiterPool();
  // Idle threads end now, busy ones after their job; jobs still queued are run first.
  ~WaiterPool();
  WaiterPool(const WaiterPool&) = delete;
  WaiterPool& operator=(const WaiterPool&) = delete;

  // Runs `job` on an idle thread, or on a new one when none is idle. `job` must not throw.
  void run(std::function<void()> job);

  // For tests: threads started so far, and those waiting for a job now.
  int threadsStarted() const;
  int threadsIdle() const;

  struct Shared;  // defined in waiter_pool.cpp

 private:
  std::shared_ptr<Shared> shared_;  // also held by every thread, which may outlive the pool
};

}  // namespace chainermn
