#include "comm/shm_rings.h"

#include "comm/futex.h"

#include <algorithm>
#include <cstring>

namespace chainermn::shm {

struct alignas(64) Doorbell {
  std::atomic<uint32_t> count;     // bumped by a peer that wrote into, or drained, one of this rank's rings
  std::atomic<uint32_t> sleeping;  // this rank's progress thread is (about to be) asleep on `count`
};

// The counters of one ring; its bytes follow at kRingHeader. Each on a cache line of its own.
struct RingCounters {
  alignas(64) std::atomic<uint64_t> head;           // bytes the sender has appended, ever
  alignas(64) std::atomic<uint64_t> tail;           // bytes the receiver has taken, ever
  alignas(64) std::atomic<uint32_t> senderWaiting;  // the sender found it full: ring it after draining
};

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kRingHeader = 256;
static_assert(sizeof(RingCounters) <= kRingHeader, "a ring's bytes start after its counters");
// Bytes move through a ring in pieces of this size, so sender and receiver copy at once.
constexpr size_t kPiece = 64 << 10;
// How long a rank spins for the peer's next piece of a message in flight before it lets go.
constexpr auto kAwaitPeer = std::chrono::microseconds(30);

constexpr size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// A rank's incoming rings take about 2 MiB in all: 1 MiB each for two ranks, at least 64 KiB each.
size_t ringBytes(int size) {
  return std::clamp(roundUp((size_t{2} << 20) / size, kPage), size_t{64} << 10, size_t{1} << 20);
}

size_t doorbellBytes(int size) {
  return roundUp(sizeof(Doorbell) * size, kPage);
}

// Spins a little for available(counter) to turn non-zero, and returns it (0 if it did not, or the
// machine is too busy to spin: spin.h).
template <typename Available>
uint64_t awaitPeer(const std::atomic<uint64_t>& counter, Available available) {
  Spin spin(kAwaitPeer, Awaited::Peer);
  do {
    if (const uint64_t n = available(counter.load(std::memory_order_acquire))) {
      return n;
    }
  } while (spin.again());
  return 0;
}

}  // namespace

size_t Rings::bytes(int size) {
  return doorbellBytes(size) + static_cast<size_t>(size) * size * (kRingHeader + ringBytes(size));
}

Rings::Rings(char* area, int rank, int size)
    : doorbells_(reinterpret_cast<Doorbell*>(area)),
      rings_(area + doorbellBytes(size)),
      rank_(rank),
      size_(size),
      ringSize_(ringBytes(size)) {}

RingCounters& Rings::counters(int from, int to) {
  const size_t index = static_cast<size_t>(from) * size_ + to;
  return *reinterpret_cast<RingCounters*>(rings_ + index * (kRingHeader + ringSize_));
}

char* Rings::data(int from, int to) {
  return reinterpret_cast<char*>(&counters(from, to)) + kRingHeader;
}

size_t Rings::write(int to, const char* from, size_t n) {
  RingCounters& pair = counters(rank_, to);
  const uint64_t head = pair.head.load(std::memory_order_relaxed);  // only this rank writes it
  auto room = [&](uint64_t tail) { return ringSize_ - (head - tail); };
  uint64_t free = room(pair.tail.load(std::memory_order_acquire));
  if (free == 0) {
    free = awaitPeer(pair.tail, room);
  }
  if (free == 0) {
    // Ask the receiver to ring once it drains, then look again: it may have drained in between.
    pair.senderWaiting.store(1, std::memory_order_seq_cst);
    free = room(pair.tail.load(std::memory_order_seq_cst));
    if (free == 0) {
      return 0;
    }
  }
  const size_t count = std::min({n, static_cast<size_t>(free), kPiece});
  const size_t offset = head % ringSize_;
  const size_t first = std::min(count, ringSize_ - offset);
  std::memcpy(data(rank_, to) + offset, from, first);
  std::memcpy(data(rank_, to), from + first, count - first);
  pair.head.store(head + count, std::memory_order_release);
  ring(to);
  return count;
}

size_t Rings::readable(int from) {
  RingCounters& pair = counters(from, rank_);
  return pair.head.load(std::memory_order_acquire) - pair.tail.load(std::memory_order_relaxed);
}

size_t Rings::read(int from, char* to, size_t n, bool more) {
  RingCounters& pair = counters(from, rank_);
  const uint64_t tail = pair.tail.load(std::memory_order_relaxed);  // only this rank writes it
  uint64_t there = pair.head.load(std::memory_order_acquire) - tail;
  if (there == 0 && more) {
    there = awaitPeer(pair.head, [tail](uint64_t head) { return head - tail; });
  }
  const size_t count = std::min({n, static_cast<size_t>(there), kPiece});
  if (count == 0) {
    return 0;
  }
  if (to != nullptr) {
    const size_t offset = tail % ringSize_;
    const size_t first = std::min(count, ringSize_ - offset);
    std::memcpy(to, data(from, rank_) + offset, first);
    std::memcpy(to + first, data(from, rank_), count - first);
  }
  // seq_cst with the sender's senderWaiting store and tail load: either it sees the room, or this
  // rank sees that it waits.
  pair.tail.store(tail + count, std::memory_order_seq_cst);
  if (pair.senderWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
    ring(from);
  }
  return count;
}

void Rings::ring(int r) {
  Doorbell& bell = doorbells_[r];
  bell.count.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleeping.load(std::memory_order_seq_cst) != 0) {
    futexWakeAll(&bell.count);
  }
}

uint32_t Rings::doorbellCount() {
  return doorbells_[rank_].count.load(std::memory_order_seq_cst);
}

void Rings::sleepUntilRung(uint32_t seen, std::chrono::milliseconds timeout) {
  Doorbell& bell = doorbells_[rank_];
  bell.sleeping.store(1, std::memory_order_seq_cst);
  if (bell.count.load(std::memory_order_seq_cst) == seen) {
    futexWait(&bell.count, seen, timeout);
  }
  bell.sleeping.store(0, std::memory_order_seq_cst);
}

}  // namespace chainermn::shm
