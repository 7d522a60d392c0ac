// Whether a thread that just ran out of work spins a little before it sleeps.
//
// Spinning for a few tens of microseconds pays when the next event comes within them: a loop of
// small collectives or messages, where a futex wake-up would cost as much again. It only steals a
// core when nothing comes: a pipeline stage computes for milliseconds between its messages, and a
// spinning helper thread on the core it shares (ranks bound to cores, or more ranks than cores)
// slowed a 1F1B step by 10% (benchmarks/pipeline.py --bind). So each thread scores its recent idle
// gaps and spins while the short ones prevail. A gap counts as short up to a few lingers, not one:
// a thread that stopped spinning answers later, which makes the gaps it sees longer, and a
// threshold at the linger itself would keep a ping-pong that crossed it asleep for good. A long gap
// weighs twice a short one: it wasted a whole linger of a core, a short one saved one wake-up.
// A thread that sleeps still scores its gaps, so spinning comes back with the traffic.
#pragma once

#include <algorithm>
#include <chrono>

namespace chainermn {

class LingerPolicy {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LingerPolicy(std::chrono::microseconds linger) : linger_(linger) {}

  // How long to spin in the idle gap that starts now: the whole linger, or nothing.
  std::chrono::microseconds linger() const {
    return score_ > 0 ? linger_ : std::chrono::microseconds(0);
  }

  // An idle gap ended (the next event came, or the thread gave up waiting for it).
  void ended(Clock::duration gap) {
    score_ = gap < kShortGaps * linger_ ? std::min(score_ + 1, kMost) : std::max(score_ - 2, -kMost);
  }

 private:
  static constexpr int kShortGaps = 4;  // a gap this many lingers long still counts as short
  static constexpr int kMost = 4;       // the score saturates here: how far back it remembers
  std::chrono::microseconds linger_;
  int score_ = kMost;  // spin at first, as a latency-bound loop wants
};

}  // namespace chainermn
