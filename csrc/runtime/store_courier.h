// Store calls with a deadline, for the failure paths.
//
// When a group fails, its ranks ask the store who died, who waited where and whether a peer gave up
// (runtime/health.h). If the network cut this node off from the store's host, a TCPStore call does
// not fail: its read waits until the kernel gives up on the connection, many minutes later, and the
// thread making it (the watchdog, the worker, the exiting process draining the worker) would wait
// as long. So those calls run on a thread of their own and the caller waits at most `patience`.
// Callers from several threads take turns, each within its own patience. A call that overran keeps
// its thread; until it returns, later calls fail at once rather than queue behind it (the store is
// unreachable: each would overrun too).
#pragma once

#include <chrono>
#include <functional>
#include <memory>

namespace chainermn {

class StoreCourier {
 public:
  explicit StoreCourier(std::chrono::milliseconds patience);
  ~StoreCourier();  // does not wait for a call that overran
  StoreCourier(const StoreCourier&) = delete;
  StoreCourier& operator=(const StoreCourier&) = delete;

  // Runs `call` on the courier's thread. True when it returned within the patience (its wait for
  // another thread's call included) without throwing; false when it threw, overran, or an earlier
  // call is still overrunning. `call` must own
  // what it touches: after an overrun it may still run after this returns.
  bool run(std::function<void()> call);

  // Whether an earlier call overran and has not returned yet.
  bool stuck() const;

 private:
  struct Shared;
  static void serve(const std::shared_ptr<Shared>& shared);  // the courier's thread

  std::shared_ptr<Shared> shared_;
  const std::chrono::milliseconds patience_;
};

}  // namespace chainermn
