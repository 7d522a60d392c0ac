// The byte streams between the ranks of one node in their shared-memory segment: a ring per ordered
// pair of ranks (sender, receiver), and a doorbell per rank.
//
// The sender appends to a ring and advances its `head`; the receiver copies out and advances its
// `tail`; each is written by one rank only. Bytes move a piece at a time, each piece published at
// once, so the receiver copies one piece out while the sender copies the next in. Writing rings the
// receiver's doorbell (a futex word: a sleeping progress thread wakes); a receiver that frees room a
// waiting sender asked for rings the sender's.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace chainermn::shm {

struct Doorbell;
struct RingCounters;

class Rings {
 public:
  // Bytes the rings and doorbells of `size` ranks take in the segment (whole pages).
  static size_t bytes(int size);

  // Over `area` (bytes(size) bytes, zeroed, shared by the node's ranks), as rank `rank`.
  Rings(char* area, int rank, int size);

  // Copies up to `n` bytes of `from` into the ring to rank `to` (at most one piece), and returns how
  // many. When the ring is full it waits a little for the receiver to drain it; then it returns 0,
  // and the receiver rings this rank's doorbell once it has made room.
  size_t write(int to, const char* from, size_t n);
  // How many bytes from rank `from` are there to read.
  size_t readable(int from);
  // The bytes one ring holds.
  size_t capacity() const {
    return ringSize_;
  }
  // Copies up to `n` bytes from rank `from` into `to` (null: skips them), at most one piece, and
  // returns how many. With `more`, when none are there yet it waits a little for them (the sender
  // is in the middle of a message).
  size_t read(int from, char* to, size_t n, bool more);

  // Rings rank r's doorbell.
  void ring(int r);
  // This rank's doorbell: its count now, and a sleep until it moves past `seen` (at most `timeout`).
  uint32_t doorbellCount();
  void sleepUntilRung(uint32_t seen, std::chrono::milliseconds timeout);

 private:
  RingCounters& counters(int from, int to);
  char* data(int from, int to);

  Doorbell* doorbells_;
  char* rings_;
  const int rank_;
  const int size_;
  const size_t ringSize_;
};

}  // namespace chainermn::shm
