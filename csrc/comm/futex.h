// Waiting on a word of shared memory between processes: a futex (no FUTEX_PRIVATE_FLAG, so it works
// across processes that map the same page) and the spin hint. Spurious and early returns are fine:
// callers re-check the word.
#pragma once

#include "os/spin.h"  // cpuRelax: the spin hint

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

namespace chainermn::shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "words shared between processes must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");

// Sleeps while *word == expected, at most `timeout`.
inline void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec relative{static_cast<time_t>(seconds.count()), static_cast<long>((timeout - seconds).count() * 1000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr, 0);
}

inline void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace chainermn::shm
