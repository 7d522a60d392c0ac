#include "backend/stragglers.h"

#include <algorithm>
#include <cstdio>

namespace chainermn {

Arrival Arrival::of(int rank, uint32_t micros) {
  Arrival arrival;
  if (micros == kNone) {
    arrival.unmeasured = 1;
    return arrival;
  }
  arrival.last = rank;
  arrival.shortest = micros;
  return arrival;
}

Arrival Arrival::merge(const Arrival& a, const Arrival& b) {
  if (a.last < 0 && !a.unmeasured) {
    return b;  // no rank yet
  }
  if (b.last < 0 && !b.unmeasured) {
    return a;
  }
  Arrival merged;
  merged.unmeasured = a.unmeasured || b.unmeasured;
  if (merged.unmeasured) {
    return merged;
  }
  const bool aFirst = a.shortest < b.shortest || (a.shortest == b.shortest && a.last <= b.last);
  const Arrival& first = aFirst ? a : b;
  const Arrival& other = aFirst ? b : a;
  merged.last = first.last;
  merged.shortest = first.shortest;
  // `other` holds the winner only as its own shortest (ties go to the lowest rank on both sides), so
  // its next shortest is always another rank's.
  merged.nextShortest = std::min(first.nextShortest, other.nextShortest);
  if (other.last != first.last) {
    merged.nextShortest = std::min(merged.nextShortest, other.shortest);
  }
  return merged;
}

Stragglers::Stragglers(int rank, std::vector<std::string> nodeOfRank, std::string group, StragglerSettings settings)
    : rank_(rank),
      nodeOfRank_(std::move(nodeOfRank)),
      group_(std::move(group)),
      settings_(settings),
      window_(std::max(1, settings.window), Entry{-1, 0}),
      lastCount_(nodeOfRank_.size(), 0),
      latenessSum_(nodeOfRank_.size(), 0) {}

void CollectiveTimer::done() {
  stragglers_.ran(std::chrono::nanoseconds(tick_clock::nanosBetween(began_, tick_clock::now())));
}

void Stragglers::ran(std::chrono::nanoseconds took) {
  const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(took).count();
  mine_.store(static_cast<uint32_t>(std::min<int64_t>(micros, Arrival::kNone - 1)), std::memory_order_relaxed);
}

uint32_t Stragglers::takeMine() {
  return mine_.exchange(Arrival::kNone, std::memory_order_relaxed);
}

int Stragglers::namedLocked() const {
  const int size = static_cast<int>(lastCount_.size());
  for (int r = 0; r < size; ++r) {
    // Three quarters of a full window (so at most one rank, and not before that many collectives):
    // on a busy machine a rank the scheduler holds back is last in about half of the collectives,
    // by a few milliseconds; a rank that is late every time is last in nearly all of them.
    if (4 * lastCount_[r] >= 3 * static_cast<int>(window_.size()) &&
        latenessSum_[r] >= settings_.marginMs * 1000.0 * lastCount_[r]) {
      return r;
    }
  }
  return -1;
}

void Stragglers::observe(const Arrival& arrival) {
  if (arrival.unmeasured || arrival.last < 0 || arrival.nextShortest == Arrival::kNone ||
      arrival.last >= static_cast<int>(lastCount_.size())) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& slot = window_[observed_ % window_.size()];
  if (slot.last >= 0) {  // the collective leaving the window
    --lastCount_[slot.last];
    latenessSum_[slot.last] -= slot.latenessMicros;
  }
  slot = Entry{arrival.last, arrival.nextShortest - arrival.shortest};
  ++lastCount_[slot.last];
  latenessSum_[slot.last] += slot.latenessMicros;
  ++observed_;

  const int named = namedLocked();
  const bool windowSinceWarning = observed_ - warnedAt_ >= window_.size();
  if (named < 0) {
    if (windowSinceWarning) {
      warnedFor_ = -1;  // a rank named again later is logged again
    }
    return;
  }
  if (named == warnedFor_ || (warnedFor_ >= 0 && !windowSinceWarning)) {
    return;
  }
  warnedFor_ = named;
  warnedAt_ = observed_;
  if (settings_.warn && rank_ == 0) {
    // One line, written at once: the ranks' own output goes to the same stream.
    std::fprintf(stderr,
                 "chainermn: straggler in group %s: rank %d (node %s) arrived last at %d of the last %zu "
                 "collectives, %.1f ms after every other rank on average (torch_chainermn.stragglers(); "
                 "CHAINERMN_STRAGGLER_WARN=0 silences this)\n",
                 group_.c_str(), named, nodeOfRank_[named].c_str(), lastCount_[named], window_.size(),
                 latenessSum_[named] / 1000.0 / lastCount_[named]);
  }
}

Stragglers::Summary Stragglers::summary() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Summary summary;
  summary.settings = settings_;
  summary.observed = observed_;
  summary.inWindow = static_cast<int>(std::min<uint64_t>(observed_, window_.size()));
  summary.named = namedLocked();
  summary.nodeOfRank = nodeOfRank_;
  summary.ranks.resize(lastCount_.size());
  for (size_t r = 0; r < lastCount_.size(); ++r) {
    if (lastCount_[r] > 0) {
      summary.ranks[r].last = lastCount_[r];
      summary.ranks[r].meanMs = latenessSum_[r] / 1000.0 / lastCount_[r];
    }
  }
  for (const Entry& entry : window_) {
    if (entry.last >= 0) {
      summary.ranks[entry.last].maxMs = std::max(summary.ranks[entry.last].maxMs, entry.latenessMicros / 1000.0);
    }
  }
  return summary;
}

void Stragglers::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::fill(window_.begin(), window_.end(), Entry{-1, 0});
  std::fill(lastCount_.begin(), lastCount_.end(), 0);
  std::fill(latenessSum_.begin(), latenessSum_.end(), 0);
  observed_ = 0;
  warnedFor_ = -1;
  warnedAt_ = 0;
}

}  // namespace chainermn
