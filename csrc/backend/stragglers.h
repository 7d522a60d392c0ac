// Who arrived last at a group's collectives, and by how much: a window of recent collectives per
// group, read by torch_chainermn.stragglers(), and one warning line when one rank has been last in
// most of them by a margin (docs/observability.md#stragglers).
//
// No clock is compared between ranks, and no message is added: each rank measures how long its own
// collective took on its own clock, and sends that with its next collective's fingerprint (the
// cross-rank check every collective runs: backend/agreement.h, in a field the check does not
// compare). Every rank waits in a collective until the last one arrives, and then all finish within
// the same moment; so the rank that took least is the one that arrived last, and the next shortest
// time minus its time is how long after every other rank it arrived. Every rank learns every rank's
// time, so every rank holds the same window. With the checks off nothing is exchanged: nothing is
// learnt.
#pragma once

#include "os/tick_clock.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace chainermn {

// Who took least in one collective, merged over the ranks' times (through the levels of nodes, a
// rank sees its node's and its peers' across nodes, then its node's merges: agreement.h).
struct Arrival {
  static constexpr uint32_t kNone = UINT32_MAX;  // no time: no rank, or a rank that did not measure
  int32_t last = -1;                             // the rank that took least (the lowest rank among equals)
  uint32_t shortest = kNone;                     // its time, microseconds
  uint32_t nextShortest = kNone;                 // the least time of any other rank
  int32_t unmeasured = 0;  // a rank sent no time (its last collective was not timed): skip this one

  // One rank's time (kNone: it has none).
  static Arrival of(int rank, uint32_t micros);
  // Both sets of ranks together (they may share ranks).
  static Arrival merge(const Arrival& a, const Arrival& b);
};

struct StragglerSettings {
  int window = 16;        // collectives the summary covers (CHAINERMN_STRAGGLER_WINDOW)
  double marginMs = 5.0;  // the mean lateness that names a rank (CHAINERMN_STRAGGLER_MARGIN_MS)
  bool warn = true;       // log one line when a rank is named (CHAINERMN_STRAGGLER_WARN)
};

class Stragglers;

// Times one collective on the thread that runs it, from before its check to its end: done() once
// it completed (a collective that failed is not timed).
class CollectiveTimer {
 public:
  explicit CollectiveTimer(Stragglers& stragglers) : stragglers_(stragglers), began_(tick_clock::now()) {}
  void done();

 private:
  Stragglers& stragglers_;
  const tick_clock::Ticks began_;
};

class Stragglers {
 public:
  // `nodeOfRank`: the name of every rank's node; `rank`: this one's (rank 0 logs); `group`: for the line.
  Stragglers(int rank, std::vector<std::string> nodeOfRank, std::string group, StragglerSettings settings);

  // This rank's collective ran for `took` (on the thread that ran it).
  void ran(std::chrono::nanoseconds took);
  // The time to send with this collective's fingerprint: the previous collective's, once (kNone if
  // it was not timed: it failed, or ran over NCCL alone).
  uint32_t takeMine();
  // Every rank's times for one collective, merged: the window moves on, and a rank is named (and
  // logged, once) when it has been last in three quarters of the window by the margin on average.
  void observe(const Arrival& arrival);

  struct RankSummary {
    int last = 0;       // collectives of the window it arrived last at
    double meanMs = 0;  // how long after every other rank it arrived, on average over those ...
    double maxMs = 0;   // ... and at most
  };
  struct Summary {
    StragglerSettings settings;
    uint64_t observed = 0;  // collectives seen since the group began (or since reset)
    int inWindow = 0;       // of them in the window (at most settings.window)
    int named = -1;         // the rank last in most of the window by the margin, or -1
    std::vector<RankSummary> ranks;
    std::vector<std::string> nodeOfRank;
  };
  Summary summary() const;
  void reset();

 private:
  struct Entry {
    int32_t last;
    uint32_t latenessMicros;
  };
  int namedLocked() const;  // the rule, over the window held now

  const int rank_;
  const std::vector<std::string> nodeOfRank_;
  const std::string group_;
  const StragglerSettings settings_;

  // Set by ran(), taken by takeMine(): one op at a time, but the next may run on another thread (the
  // caller's or the worker's).
  std::atomic<uint32_t> mine_{Arrival::kNone};

  mutable std::mutex mutex_;           // the window: written on the op's thread, read from Python
  std::vector<Entry> window_;          // a ring of settings_.window entries, sized once
  std::vector<int> lastCount_;         // per rank: entries of the window it is last in
  std::vector<uint64_t> latenessSum_;  // per rank: their lateness, microseconds
  uint64_t observed_ = 0;
  int warnedFor_ = -1;     // the rank named in the last line logged, until no rank is named
  uint64_t warnedAt_ = 0;  // observed_ then
};

}  // namespace chainermn
