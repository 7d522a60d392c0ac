// How the worker polls point-to-point requests between operations.
#pragma once

#include <algorithm>
#include <chrono>

namespace chainermn {

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
  // No wait since the last reset.
  bool fresh() const {
    return round_ == 0;
  }
  void reset() {
    round_ = 0;
    delay_ = std::chrono::microseconds(10);
  }

 private:
  int round_ = 0;
  std::chrono::microseconds delay_{10};
};

} // namespace chainermn
