// What a group's ops moved and how long their phases took, counted where the phases run (phase.h):
// always on, per group, read by torch_chainermn.counters() (docs/observability.md#counters).
//
// A phase's span adds to the counters of the group whose op the thread is running (CountingScope,
// set where an op starts running: backend/funnel.cpp). Adding is a few relaxed atomic additions into
// cells made once per (phase, transport or code): nothing is allocated per op. Torch-free, as
// phase.h, so that every layer may count.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace chainermn {

// What one call of a phase moves. A transport's call: the bytes this rank sends (`out`) and
// receives (`in`); a code's encode or decode: the bytes it takes in and gives out.
struct Moved {
  int64_t bytes = 0;  // this rank's buffer handed to the call (what the profiler's span shows)
  int64_t out = 0;
  int64_t in = 0;
};

// The bytes one rank moves in one collective over `n` ranks, by the bandwidth-optimal algorithm of
// each call: a ring for all_reduce (a reduce-scatter then an all-gather: 2(n-1)/n of the buffer each
// way, Gloo's algorithm), all_gather and reduce_scatter ((n-1) blocks each way); a root that sends
// to or receives from every other rank for broadcast, scatter, reduce and gather. That is what the
// library moves where it runs these algorithms (Gloo's ring all_reduce; any algorithm between two
// ranks); elsewhere it is what the call must move at least. Its headers are not counted.
namespace moved {
inline Moved allreduce(int n, int64_t bytes) {
  const int64_t each = 2 * (n - 1) * bytes / n;
  return {bytes, each, each};
}
inline Moved allgather(int n, int64_t blockBytes) {
  return {blockBytes, (n - 1) * blockBytes, (n - 1) * blockBytes};
}
inline Moved reduceScatter(int n, int64_t blockBytes) {
  return {n * blockBytes, (n - 1) * blockBytes, (n - 1) * blockBytes};
}
// broadcast, scatter (`bytes` each rank's share)
inline Moved fromRoot(int n, bool isRoot, int64_t bytes) {
  return isRoot ? Moved{bytes, (n - 1) * bytes, 0} : Moved{bytes, 0, bytes};
}
// reduce, gather
inline Moved toRoot(int n, bool isRoot, int64_t bytes) {
  return isRoot ? Moved{bytes, 0, (n - 1) * bytes} : Moved{bytes, bytes, 0};
}
// all_to_all: every block but the one this rank keeps
inline Moved allToAll(int64_t sentBytes, int64_t receivedBytes, int64_t keptBytes, int64_t keptReceivedBytes) {
  return {sentBytes, sentBytes - keptBytes, receivedBytes - keptReceivedBytes};
}
}  // namespace moved

class Counters {
 public:
  // phase.h's phases, in this order.
  static constexpr int kPhases = 6;
  static const char* const kPhaseNames[kPhases];
  // Transports or codes one phase is counted apart for ("shm", "gloo"; "int8", "topk", ...).
  static constexpr int kWhats = 8;

  struct Cell {
    std::atomic<const char*> what{nullptr};  // a name with static storage; "" for phases without one
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> nanoseconds{0};
    std::atomic<uint64_t> out{0};  // Moved::out
    std::atomic<uint64_t> in{0};   // Moved::in
  };
  struct Row {
    const char* phase;
    const char* what;
    uint64_t calls, nanoseconds, out, in;
  };

  // A phase's call ended (`what` null: a phase without a transport or code).
  void add(const char* phase, const char* what, const Moved& moved, uint64_t nanoseconds);
  void opStarted() {
    ops_.fetch_add(1, std::memory_order_relaxed);
  }

  uint64_t ops() const {
    return ops_.load(std::memory_order_relaxed);
  }
  // The cells used so far (reads race with adds: each number is one atomic read).
  std::vector<Row> rows() const;
  // Zeroes every number; the cells keep their names. Exact between ops.
  void reset();

 private:
  Cell* cell(int phase, const char* what);

  std::atomic<uint64_t> ops_{0};
  Cell cells_[kPhases][kWhats];
};

// The counters the phases of this thread's op add to (null: none, outside any op).
extern thread_local Counters* countingInto;

// While a thread runs one op of a group: its phases count into the group's counters.
class CountingScope {
 public:
  explicit CountingScope(Counters& counters) : previous_(countingInto) {
    counters.opStarted();
    countingInto = &counters;
  }
  ~CountingScope() {
    countingInto = previous_;
  }
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

 private:
  Counters* previous_;
};

}  // namespace chainermn
