#include "os/tick_clock.h"

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>

namespace chainermn {

namespace tick_clock {

namespace {

int64_t steadyNanos() {
  return c10::getTime(/*allow_monotonic=*/true);
}

// A reading of both clocks, taken when the library loads and kept: the rate is measured from it (the
// first conversion comes after a rendezvous at least, so over milliseconds).
struct Anchor {
  Ticks ticks;
  int64_t steady;
};

const Anchor& anchor() {
  static const Anchor first{now(), steadyNanos()};
  return first;
}
[[maybe_unused]] const Anchor& gLoaded = anchor();

// Nanoseconds per tick, and the tick count it was measured at. Racing refreshes write equal values.
std::atomic<double> gRate{0.0};
std::atomic<Ticks> gRateAt{0};

constexpr int64_t kShortestSpanNs = 1000000;  // a rate measured over less is not trusted
constexpr double kRefreshNs = 1e9;

double rateAt(Ticks ticks) {
  if (!countsCycles()) {
    return 1.0;  // ticks are nanoseconds
  }
  double rate = gRate.load(std::memory_order_relaxed);
  const Ticks at = gRateAt.load(std::memory_order_relaxed);
  if (rate > 0 && (ticks <= at || static_cast<double>(ticks - at) * rate < kRefreshNs)) {
    return rate;
  }
  const Anchor& from = anchor();
  int64_t span = steadyNanos() - from.steady;
  while (span < kShortestSpanNs) {  // once, when the first conversion follows the anchor at once
    span = steadyNanos() - from.steady;
  }
  const Ticks reading = now();
  rate = static_cast<double>(span) / static_cast<double>(reading - from.ticks);
  gRate.store(rate, std::memory_order_relaxed);
  gRateAt.store(reading, std::memory_order_relaxed);
  return rate;
}

}  // namespace

bool kernelTrustsCounter() {
#if defined(C10_ARMTSC)
  return true;  // the architected counter: constant rate by definition
#else
  std::ifstream source("/sys/devices/system/clocksource/clocksource0/current_clocksource");
  std::string name;
  return static_cast<bool>(source >> name) && name == "tsc";
#endif
}

int64_t nanosBetween(Ticks began, Ticks ended) {
  if (ended <= began) {
    return 0;
  }
  return static_cast<int64_t>(static_cast<double>(ended - began) * rateAt(ended));
}

int64_t unixNanos(Ticks ticks) {
  const Ticks reading = now();
  const int64_t wall = c10::getTime();
  const double ago = (static_cast<double>(reading) - static_cast<double>(ticks)) * rateAt(reading);
  return wall - static_cast<int64_t>(ago);
}

}  // namespace tick_clock

}  // namespace chainermn
