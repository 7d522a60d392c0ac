// How a thread spins while it waits for another thread or process, and when it must not.
//
// Spinning pays on an idle machine: a peer that arrives within microseconds is seen at once, where a
// futex or condition-variable wake-up costs as much again. On a busy machine (every core computing:
// torch's intra-op threads, data loaders, other jobs) it costs dearly: a thread that spins or yields
// stays runnable, so once it yields or its slice ends, the computation on its core runs for a whole
// scheduler slice (about 1.5 ms on 2 cores) before the thread runs again, and the peer it waits for
// is as likely to be the one waiting for a core. A thread that sleeps is woken by its peer and, having
// slept, runs at once (the scheduler's wake-up preemption): that is how Gloo's threads wait, in the
// kernel. So a wait spins (or yields) only while the machine shows no contention.
//
// Contention is measured, not configured: a spinning thread that sees a gap between two of its polls
// longer than kDescheduled was taken off its core, and every wait of the process then sleeps at once
// for kCalm, after which one spins again (and so measures again). A thread that waits for another
// thread of its process, when the process may run on one CPU only (mpiexec --bind-to core), yields
// instead of pausing: they share that CPU, and on a machine that is not busy the yield hands it
// straight to the thread it waits for. There, a yield in a wait for an op (not an idle helper's
// linger, while the caller may compute for long) that comes back after more than kDescheduled, no
// other thread of the process working meanwhile (OwnWork), gave the CPU to another process:
// contention too.
//
// A process that may run on several CPUs also spins only while no more threads are runnable on the
// machine than twice its CPUs (looked at every few milliseconds). A process bound to one CPU does
// not look: its own threads taking turns on that CPU (under mpiexec a rank's caller, worker and
// mailbox thread each yield while they wait) are most of what that count holds on an idle machine,
// where it refused a quarter of the waits' spins and point to point lost 1.5-2x; its yields tell.
#pragma once

#include <atomic>
#include <chrono>

namespace chainermn {

// A hint to the core that this is a spin-wait (lets the sibling hyperthread run).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// What a wait is for: a peer process (on a CPU of its own); another thread of this process, at work on
// what the wait needs (the op the caller waits for); or the next event, whenever it comes (an idle
// helper thread lingering for the next op or message, while the caller may compute for long).
enum class Awaited { Peer, OwnThread, NextEvent };

class Spin {
 public:
  using Clock = std::chrono::steady_clock;
  // A thread off its core this long between two polls was descheduled: the machine is busy. (A
  // scheduler slice is longer; a virtual machine's own hiccups are mostly shorter.)
  static constexpr auto kDescheduled = std::chrono::microseconds(1000);
  // How long the process sleeps at once in its waits after it saw contention.
  static constexpr auto kCalm = std::chrono::milliseconds(250);

  // A spin of at most `budget` for `awaited`; none when spinning is not allowed now.
  Spin(std::chrono::microseconds budget, Awaited awaited)
      : last_(Clock::now()),
        until_(allowed(last_) ? last_ + budget : last_),
        yields_(awaited != Awaited::Peer && !severalCpus()),
        judgesYields_(awaited == Awaited::OwnThread) {}

  // Between two polls of what the caller waits for: pauses the core briefly, and says whether the
  // spin may go on (false once the budget is spent, or the thread was found descheduled).
  bool again() {
    if (last_ >= until_) {
      return false;
    }
    if (yields_) {
      yieldCpu();  // the awaited thread may run meanwhile
      const auto now = Clock::now();
      if (judgesYields_ && yieldedTooLong(last_, now)) {
        return false;
      }
      last_ = now;
      return now < until_;
    }
    for (int i = 0; i < kPausesPerPoll; ++i) {
      cpuRelax();
    }
    const auto now = Clock::now();
    if (now - last_ > kDescheduled) {
      sawContention(now);
      return false;
    }
    last_ = now;
    return now < until_;
  }

  // Whether waits may spin at `now`: no contention seen of late and, in a process on several CPUs, no
  // more runnable threads than twice the CPUs.
  static bool allowed(Clock::time_point now);
  // Whether this process may run on more than one CPU.
  static bool severalCpus();
  // A yield of this thread that began at `before` came back at `after`, in a process bound to one
  // CPU: whether it took the CPU away for longer than kDescheduled with no other thread of this
  // process working meanwhile, i.e. another process ran. Notes the contention when so.
  static bool yieldedTooLong(Clock::time_point before, Clock::time_point after);

 private:
  static constexpr int kPausesPerPoll = 8;
  static void sawContention(Clock::time_point now);
  static void yieldCpu();

  Clock::time_point last_;
  Clock::time_point until_;
  bool yields_;        // a wait for this process's own threads, on one CPU
  bool judgesYields_;  // a late yield says the machine is busy (not while idle: the caller may compute)
};

// Marks a stretch of real work by this thread (running an op, moving messages): a thread of the
// process that yielded the CPU meanwhile got it back late because of this work, not another process.
// Nothing to mark in a process on several CPUs, which does not judge its yields.
class OwnWork {
 public:
  OwnWork();
  ~OwnWork();
  OwnWork(const OwnWork&) = delete;
  OwnWork& operator=(const OwnWork&) = delete;

 private:
  bool marks_;
};

}  // namespace chainermn
