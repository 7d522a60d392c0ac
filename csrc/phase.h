// A phase of an op on torch's profiler timeline: a span named where the phase runs (a transport's
// call, a code's encode, a wait for a peer), the child of the op's own span ("chainermn:all_reduce",
// runtime/op_span.h). Torch-free, so that every layer may name its phases; phase.cpp records them
// as at::RecordFunction spans.
//
// With no profiled op running in the process a PhaseSpan is one relaxed load and a branch: nothing
// is allocated and torch is not called (the benchmarks cannot see it). Inside a profiled op (on the
// thread that runs it, which carries the poster's profiler state) it is a span of torch's profiler,
// with the transport (or code) and bytes as its inputs when the profiler records shapes.
//
// Inside any op of a group it also counts (counters.h): the call, its time (two reads of the TSC,
// os/tick_clock.h) and
// the bytes it moves, into the group's counters. Always on: a few relaxed atomic additions.
#pragma once

#include "counters.h"
#include "os/tick_clock.h"

#include <atomic>
#include <cstdint>

namespace chainermn {

// The phases' names, as the profiler shows them (docs/observability.md).
namespace phase {
constexpr const char* kWithinNode = "chainermn:within_node";      // a collective among this node's ranks
constexpr const char* kBetweenNodes = "chainermn:between_nodes";  // a collective whose ranks span nodes
constexpr const char* kEncode = "chainermn:encode";               // a code's encode (docs/codes.md)
constexpr const char* kDecode = "chainermn:decode";               // a code's decode
constexpr const char* kWaitPeers = "chainermn:wait_peers";        // waiting for a peer to arrive
constexpr const char* kCheck = "chainermn:check";                 // the ranks' agreement on the op
}  // namespace phase

// How many threads are running a profiled op now (runtime/op_span.h counts them): phases are looked
// for only while it is not zero.
extern std::atomic<int> profiledOpsRunning;

class PhaseSpan {
 public:
  explicit PhaseSpan(const char* name) : PhaseSpan(name, nullptr, Moved{-1, 0, 0}) {}
  // A phase that moves or codes bytes: `what` is the transport ("shm", "mpi", "gloo") or the code
  // ("int8"); `moved` this rank's buffer handed to it and what the call sends and receives (a
  // transport: counters.h's moved::), or takes in and gives out (a code).
  PhaseSpan(const char* name, const char* what, const Moved& moved)
      : name_(name), what_(what), moved_(moved), counters_(countingInto) {
    if (profiledOpsRunning.load(std::memory_order_relaxed) != 0) {
      start(name, what, moved.bytes);
    }
    if (counters_ != nullptr) {
      began_ = tick_clock::now();
    }
  }
  ~PhaseSpan() {
    if (span_ != nullptr) {
      finish();
    }
    if (counters_ != nullptr) {
      counters_->add(name_, what_, moved_, static_cast<uint64_t>(tick_clock::nanosBetween(began_, tick_clock::now())));
    }
  }
  PhaseSpan(const PhaseSpan&) = delete;
  PhaseSpan& operator=(const PhaseSpan&) = delete;

 private:
  void start(const char* name, const char* what, int64_t bytes);
  void finish();

  void* span_ = nullptr;  // the at::RecordFunction, when this thread is being profiled
  const char* name_;
  const char* what_;
  const Moved moved_;
  Counters* counters_;  // the group's whose op this thread runs, if any
  tick_clock::Ticks began_ = 0;
};

// The phase of a collective on a level's transport: within the node or between nodes.
inline const char* levelPhase(bool withinNode) {
  return withinNode ? phase::kWithinNode : phase::kBetweenNodes;
}

}  // namespace chainermn
