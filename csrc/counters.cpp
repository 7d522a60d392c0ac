#include "counters.h"

#include "phase.h"

#include <cstring>

namespace chainermn {

const char* const Counters::kPhaseNames[kPhases] = {phase::kWithinNode, phase::kBetweenNodes, phase::kEncode,
                                                    phase::kDecode,     phase::kWaitPeers,    phase::kCheck};

thread_local Counters* countingInto = nullptr;

namespace {

int phaseIndex(const char* name) {
  for (int p = 0; p < Counters::kPhases; ++p) {
    if (name == Counters::kPhaseNames[p]) {
      return p;  // the usual case: the constant itself
    }
  }
  for (int p = 0; p < Counters::kPhases; ++p) {
    if (std::strcmp(name, Counters::kPhaseNames[p]) == 0) {
      return p;  // the same literal at another address (another object file's copy)
    }
  }
  return -1;
}

bool sameName(const char* a, const char* b) {
  return a == b || std::strcmp(a, b) == 0;
}

}  // namespace

Counters::Cell* Counters::cell(int phase, const char* what) {
  Cell* cells = cells_[phase];
  for (int w = 0; w < kWhats; ++w) {
    const char* held = cells[w].what.load(std::memory_order_acquire);
    if (held == nullptr) {
      // The first call of this transport or code in this phase names a cell. Only the thread running
      // the group's op adds, but claim it as if two could.
      if (cells[w].what.compare_exchange_strong(held, what, std::memory_order_acq_rel) || sameName(held, what)) {
        return &cells[w];
      }
      continue;
    }
    if (sameName(held, what)) {
      return &cells[w];
    }
  }
  return &cells[kWhats - 1];  // more names than cells (no phase has that many): the last one holds the rest
}

void Counters::add(const char* phase, const char* what, const Moved& moved, uint64_t nanoseconds) {
  const int p = phaseIndex(phase);
  if (p < 0) {
    return;
  }
  Cell* into = cell(p, what == nullptr ? "" : what);
  into->calls.fetch_add(1, std::memory_order_relaxed);
  into->nanoseconds.fetch_add(nanoseconds, std::memory_order_relaxed);
  into->out.fetch_add(static_cast<uint64_t>(moved.out), std::memory_order_relaxed);
  into->in.fetch_add(static_cast<uint64_t>(moved.in), std::memory_order_relaxed);
}

std::vector<Counters::Row> Counters::rows() const {
  std::vector<Row> rows;
  for (int p = 0; p < kPhases; ++p) {
    for (const Cell& cell : cells_[p]) {
      const char* what = cell.what.load(std::memory_order_acquire);
      if (what != nullptr) {
        rows.push_back({kPhaseNames[p], what, cell.calls.load(std::memory_order_relaxed),
                        cell.nanoseconds.load(std::memory_order_relaxed), cell.out.load(std::memory_order_relaxed),
                        cell.in.load(std::memory_order_relaxed)});
      }
    }
  }
  return rows;
}

void Counters::reset() {
  ops_.store(0, std::memory_order_relaxed);
  for (auto& phase : cells_) {
    for (Cell& cell : phase) {
      cell.calls.store(0, std::memory_order_relaxed);
      cell.nanoseconds.store(0, std::memory_order_relaxed);
      cell.out.store(0, std::memory_order_relaxed);
      cell.in.store(0, std::memory_order_relaxed);
    }
  }
}

}  // namespace chainermn
