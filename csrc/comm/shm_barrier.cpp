#include "comm/shm_barrier.h"

#include "comm/futex.h"
#include "phase.h"
#include "os/process.h"

#include <c10/util/Exception.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <string>

namespace chainermn::shm {

// One cache line per rank, so ranks publishing their flags do not slow each other down.
struct alignas(64) Flag {
  // The number of barriers this rank has entered. 32 bits, so that a waiter can sleep on it with a
  // futex; it wraps (after 2^32 barriers, hours of small collectives), hence reached() below.
  std::atomic<uint32_t> sequence;
  std::atomic<uint32_t> sleepers;  // ranks inside futexWait on `sequence`: the publisher must wake them
  std::atomic<int64_t> pid;        // lets a waiting rank tell a slow peer from a dead one
};

namespace {

// Whether a sequence number has reached `target`, across wrap-around (ranks are never more than a
// couple of barriers apart).
inline bool reached(uint32_t sequence, uint32_t target) {
  return static_cast<int32_t>(sequence - target) >= 0;
}

// How a rank waits for a peer at a barrier. Peers usually arrive within microseconds (they run the
// same copies), so it spins first; ranks may outnumber cores, so then it yields; and a peer may be
// busy for seconds (a node leader inside an inter-node allreduce on a slow network), so in the end
// it sleeps on the peer's futex rather than burn a core the leader's network stack needs. On a busy
// machine (spin.h) it sleeps at once: the peer's wake-up then gets a core at once, where a spinning
// or yielding rank would wait a scheduler slice for one.
constexpr auto kSpinFor = std::chrono::microseconds(20);
constexpr auto kYieldFor = std::chrono::microseconds(500);
constexpr auto kSleepSlice = std::chrono::milliseconds(20);  // re-check liveness and the timeout this often

}  // namespace

size_t Barrier::bytes(int size) {
  constexpr size_t kPage = 4096;
  return (sizeof(Flag) * size + kPage - 1) / kPage * kPage;
}

Barrier::Barrier(void* flags, int rank, int size, std::chrono::milliseconds timeout)
    : flags_(static_cast<Flag*>(flags)), rank_(rank), size_(size), timeout_(timeout) {
  flags_[rank_].pid.store(getpid(), std::memory_order_release);
}

void Barrier::sync() {
  if (aborted_.load(std::memory_order_relaxed)) {
    C10_THROW_ERROR(DistBackendError, "shared memory: the group was aborted");
  }
  const uint32_t target = ++sequence_;
  Flag& mine = flags_[rank_];
  // seq_cst on both sides (here and in waitFor): either the sleeper sees the new sequence before
  // it sleeps, or this rank sees the sleeper and wakes it.
  mine.sequence.store(target, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) != 0) {
    futexWakeAll(&mine.sequence);
  }
  try {
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) {
        waitFor(r, target);
      }
    }
  } catch (...) {
    // This rank gives up the barrier (its op failed: a timeout, an abort, a dead peer). A peer that
    // arrives later must not find it passed: when the barrier also carries an op's data and check
    // (shm.cpp, round()), that peer would complete the op this rank failed. Taken back, the peer
    // waits there until the group's break reaches it (runtime/health.h), and fails with its reason.
    // (A peer arriving in the same instant may still pass: the op was at its deadline.)
    mine.sequence.store(target - 1, std::memory_order_seq_cst);
    --sequence_;
    throw;
  }
}

void Barrier::waitFor(int r, uint32_t target) {
  Flag& peer = flags_[r];
  if (reached(peer.sequence.load(std::memory_order_acquire), target)) {
    return;  // there already: nothing to show on the profiler's timeline
  }
  PhaseSpan waiting(phase::kWaitPeers);
  Spin spin(kSpinFor, Awaited::Peer);
  do {
    if (reached(peer.sequence.load(std::memory_order_acquire), target)) {
      return;
    }
  } while (spin.again());
  const auto start = std::chrono::steady_clock::now();
  bool yields = Spin::allowed(start);
  while (true) {
    const uint32_t seen = peer.sequence.load(std::memory_order_acquire);
    if (reached(seen, target)) {
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    checkPeer(r, target, start, now);
    if (yields && now - start < kYieldFor) {
      sched_yield();
      // Another process took the CPU for a while: the machine is busy, and each further yield would
      // hand it over again for as long. Sleep instead.
      yields = !Spin::yieldedTooLong(now, std::chrono::steady_clock::now());
      continue;
    }
    peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!reached(peer.sequence.load(std::memory_order_seq_cst), target)) {
      futexWait(&peer.sequence, seen, kSleepSlice);
    }
    peer.sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
}

// Fails fast when the peer's process is gone or the group was aborted, and at the timeout when the
// peer is only absent.
void Barrier::checkPeer(int r, uint32_t target, std::chrono::steady_clock::time_point start,
                        std::chrono::steady_clock::time_point now) {
  if (aborted_.load(std::memory_order_relaxed)) {
    C10_THROW_ERROR(DistBackendError, "shared memory: the group was aborted while waiting for local rank " +
                                          std::to_string(r) + " of this node");
  }
  if (watchPids_ && now - lastLivenessCheck_ > std::chrono::milliseconds(50)) {
    lastLivenessCheck_ = now;
    const int64_t pid = flags_[r].pid.load(std::memory_order_acquire);
    // A peer that arrived and then exited (its last barrier before a clean exit) did its part.
    if (pid > 0 && !processAlive(pid) && !reached(flags_[r].sequence.load(std::memory_order_acquire), target)) {
      C10_THROW_ERROR(DistBackendError,
                      "shared memory: local rank " + std::to_string(r) + " of this node (pid " + std::to_string(pid) +
                          ") is gone");  // died or exited: the group's health (runtime/health.h) tells which
    }
  }
  if (now - start > timeout_) {
    C10_THROW_ERROR(DistBackendError, "shared memory: timed out: local rank " + std::to_string(r) +
                                          " of this node did not arrive within " + std::to_string(timeout_.count()) +
                                          " ms");
  }
}

void Barrier::abort() {
  aborted_.store(true, std::memory_order_relaxed);  // seen within kSleepSlice: no wake needed
}

void Barrier::startWatchingPeers() {
  watchPids_ = true;
  for (int r = 0; r < size_; ++r) {
    const int64_t pid = flags_[r].pid.load(std::memory_order_acquire);
    watchPids_ = watchPids_ && pid > 0 && kill(static_cast<pid_t>(pid), 0) == 0;
  }
}

}  // namespace chainermn::shm
