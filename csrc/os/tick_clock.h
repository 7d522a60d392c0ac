// The clock every op reads on its way (the flight recorder's times, the stragglers' timer, the
// counters' phase times): torch's profiler clock, c10::getApproximateTime (the TSC on x86, the
// virtual counter on ARM), read in about 10 ns where a steady_clock::now() costs 35 ns on a cloud VM
// (measured here: a 4 KiB all_reduce reads it 7 times). Where the kernel does not trust the TSC (its
// clocksource is not "tsc"), the ticks are the steady clock's nanoseconds.
//
// Ticks become nanoseconds by a rate measured against the steady clock since the library loaded,
// refreshed about once a second and kept in an atomic, so that every thread reads it freely. Not
// torch's ApproximateClockToUnixTimeConverter: it fits against the wall clock, which NTP may step, and
// hands out a std::function that threads could not share while it is refreshed.
#pragma once

#include <c10/util/ApproximateClock.h>

#include <cstdint>

namespace chainermn {

namespace tick_clock {

using Ticks = uint64_t;

// Whether the kernel keeps time with the TSC (asked once): then ticks are torch's profiler clock.
bool kernelTrustsCounter();

inline bool countsCycles() {
#if defined(C10_RDTSC) || defined(C10_ARMTSC)
  static const bool counter = kernelTrustsCounter();
  return counter;
#else
  return false;
#endif
}

inline Ticks now() {
  if (countsCycles()) {
    return static_cast<Ticks>(c10::getApproximateTime());
  }
  return static_cast<Ticks>(c10::getTime(/*allow_monotonic=*/true));
}

// Nanoseconds between two readings of now() (0 if `ended` is not after `began`).
int64_t nanosBetween(Ticks began, Ticks ended);

// The wall clock (Unix nanoseconds, as c10::getTime) at a reading of now(): for dumps, rarely.
int64_t unixNanos(Ticks ticks);

}  // namespace tick_clock

}  // namespace chainermn
