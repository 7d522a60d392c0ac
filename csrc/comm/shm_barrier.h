// The barrier of a node's ranks through their shared-memory segment: a flag per rank that counts
// the barriers it has entered, and the wait for the other ranks' flags (spin, yield, then sleep on
// a futex), bounded by the group timeout and cut short when a peer's process dies or the group is
// aborted.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace chainermn::shm {

struct Flag;

class Barrier {
 public:
  // Bytes the flags of `size` ranks take at the start of the segment: whole pages, so that what
  // follows them starts on a page boundary.
  static size_t bytes(int size);

  // Over the flags at `flags` (bytes(size) bytes, zeroed, shared by the node's ranks). Publishes
  // this process's pid in this rank's flag. `timeout` bounds every wait for a peer.
  Barrier(void* flags, int rank, int size, std::chrono::milliseconds timeout);

  // Publishes this rank's arrival and waits for every other rank's. Throws DistBackendError when a
  // peer died or did not arrive within the timeout, or the barrier was aborted; the arrival is then
  // taken back, so a peer that comes later waits (and learns from the group why this rank left)
  // rather than pass a barrier this rank never finished.
  void sync();

  // After a first sync(), once every rank has published its pid: watch them only if this process
  // can see them all (ranks in other PID namespaces would look dead).
  void startWatchingPeers();

  // Any thread: a sync() waiting now throws within a sleep slice (20 ms), and so does every later
  // one. The group's watchdog calls it when the group breaks (a timeout, a peer's abort, an abort
  // here): a collective run on its caller's thread has no other way out of the wait.
  void abort();

 private:
  void waitFor(int r, uint32_t target);
  // Throws when peer r died before reaching `target`, or when the timeout has passed since `start`.
  void checkPeer(int r, uint32_t target, std::chrono::steady_clock::time_point start,
                 std::chrono::steady_clock::time_point now);

  Flag* flags_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  uint32_t sequence_ = 0;
  bool watchPids_ = false;
  std::atomic<bool> aborted_{false};
  std::chrono::steady_clock::time_point lastLivenessCheck_{};
};

}  // namespace chainermn::shm
