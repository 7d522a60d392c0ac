#include "os/spin.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace chainermn {

namespace {
// When a wait of this process last found its thread descheduled (steady clock, nanoseconds).
std::atomic<Spin::Clock::rep> gContendedAt{0};  // 0: never
// The last look at the machine's run queues: when, and whether more threads were runnable than it
// has CPUs.
std::atomic<Spin::Clock::rep> gLookedAt{0};
std::atomic<bool> gOversubscribed{false};
constexpr auto kLookEvery = std::chrono::milliseconds(10);
// Threads of this process inside an OwnWork, and when the last one ended (steady clock, nanoseconds).
std::atomic<int> gWorking{0};
std::atomic<Spin::Clock::rep> gWorkEndedAt{0};
thread_local int tlsWorkDepth = 0;  // this thread's OwnWork nesting (an op run inside an op's callback)

// The number of threads runnable on the machine now, this one included (/proc/loadavg's fourth
// field, "running/total"); 0 if it cannot be read.
int runnableThreads() {
  const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return 0;
  }
  char text[128] = {};
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) {
    return 0;
  }
  // "0.50 0.40 0.30 3/250 12345": skip three fields.
  const char* at = text;
  for (int field = 0; field < 3 && at != nullptr; ++field) {
    at = std::strchr(at, ' ');
    at = at != nullptr ? at + 1 : nullptr;
  }
  return at != nullptr ? std::atoi(at) : 0;
}

// More threads runnable than twice the machine's CPUs, as last seen (looked at again every kLookEvery:
// the read costs a few microseconds). Twice: the ranks' own threads count too, and on a machine that
// is otherwise idle each rank may have two runnable at once (a caller that yields to its worker, the
// worker running the op); at CPUs + 1 that alone read as busy under mpiexec, and 4 KiB took 62 us.
bool oversubscribed(Spin::Clock::time_point now) {
  const auto looked = gLookedAt.load(std::memory_order_relaxed);
  if (now.time_since_epoch().count() - looked > std::chrono::duration_cast<Spin::Clock::duration>(kLookEvery).count()) {
    gLookedAt.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    gOversubscribed.store(runnableThreads() > 2 * cpus, std::memory_order_relaxed);
  }
  return gOversubscribed.load(std::memory_order_relaxed);
}
}  // namespace

bool Spin::severalCpus() {
  static const bool several = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) > 1;
  }();
  return several;
}

bool Spin::allowed(Clock::time_point now) {
  const Clock::rep contendedAt = gContendedAt.load(std::memory_order_relaxed);
  const bool calm = contendedAt == 0 || now - Clock::time_point(Clock::duration(contendedAt)) > kCalm;
  return calm && (!severalCpus() || !oversubscribed(now));
}

bool Spin::yieldedTooLong(Clock::time_point before, Clock::time_point after) {
  // A process on several CPUs reads the run queue instead (allowed()), as measured for issue 38; on
  // several CPUs a late yield may also be another rank's thread of the same job taking this CPU.
  if (severalCpus() || after - before <= kDescheduled) {
    return false;
  }
  const int othersWorking = gWorking.load(std::memory_order_relaxed) - (tlsWorkDepth > 0 ? 1 : 0);
  if (othersWorking > 0 || gWorkEndedAt.load(std::memory_order_relaxed) >= before.time_since_epoch().count()) {
    return false;
  }
  sawContention(after);
  return true;
}

OwnWork::OwnWork() : marks_(!Spin::severalCpus()) {
  if (marks_ && tlsWorkDepth++ == 0) {
    gWorking.fetch_add(1, std::memory_order_relaxed);
  }
}

OwnWork::~OwnWork() {
  if (marks_ && --tlsWorkDepth == 0) {
    gWorkEndedAt.store(Spin::Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    gWorking.fetch_sub(1, std::memory_order_relaxed);
  }
}

void Spin::yieldCpu() {
  sched_yield();
}

void Spin::sawContention(Clock::time_point now) {
  gContendedAt.store(now.time_since_epoch().count(), std::memory_order_relaxed);
}

}  // namespace chainermn
