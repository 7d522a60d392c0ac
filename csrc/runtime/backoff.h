// How the worker polls point-to-point requests between operations, when one of them cannot wake it
// (Request::wakeWhenReady).
#pragma once

#include <algorithm>
#include <chrono>

namespace chainermn {

// Polling of point-to-point requests: yield at first (a reply is often microseconds away), then
// sleep longer and longer so an idle wait does not steal a core from other ranks. The yielding
// rounds are skipped when replies have been slow to come of late (linger.h).
class Backoff {
 public:
  std::chrono::microseconds next() {
    if (round_ < kSpinRounds) {
      ++round_;
      return std::chrono::microseconds(0);
    }
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(1000));
    return delay_;
  }
  // Straight to sleeping.
  void skipSpins() {
    round_ = kSpinRounds;
  }
  // No wait since the last reset.
  bool fresh() const {
    return round_ == 0;
  }
  void reset() {
    round_ = 0;
    delay_ = std::chrono::microseconds(10);
  }

 private:
  static constexpr int kSpinRounds = 64;
  int round_ = 0;
  std::chrono::microseconds delay_{10};
};

}  // namespace chainermn
