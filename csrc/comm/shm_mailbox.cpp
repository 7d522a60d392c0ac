#include "comm/shm_mailbox.h"

#include "comm/futex.h"
#include "types.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <vector>

namespace chainermn::shm {
namespace {

constexpr size_t kPage = 4096;
// Frames start on 16-byte boundaries and rings are whole pages, so a frame header never wraps.
constexpr size_t kAlign = 16;
constexpr uint16_t kMagic = 0x4d42;  // "MB"
// The progress thread re-checks whether it is being stopped this often.
constexpr auto kSleepSlice = std::chrono::milliseconds(100);
constexpr auto kLinger = std::chrono::microseconds(50);
// Messages move through a ring in pieces of this size, so sender and receiver copy at once.
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

struct alignas(64) Doorbell {
  std::atomic<uint32_t> rings;     // bumped by a peer that wrote into, or drained, one of this rank's rings
  std::atomic<uint32_t> sleeping;  // this rank's progress thread is (about to be) asleep on `rings`
};

// The counters of one ring; its bytes follow, at kRingHeader. Sender, receiver and the flag on cache
// lines of their own.
struct RingCounters {
  alignas(64) std::atomic<uint64_t> head;           // bytes the sender has appended, ever
  alignas(64) std::atomic<uint64_t> tail;           // bytes the receiver has taken, ever
  alignas(64) std::atomic<uint32_t> senderWaiting;  // the sender found it full: ring it after draining
};
constexpr size_t kRingHeader = 256;
static_assert(sizeof(RingCounters) <= kRingHeader, "the ring's bytes start after its counters");

struct FrameHeader {
  int64_t count;
  int32_t tag;
  int16_t dtype;
  uint16_t magic;

  uint64_t bytes() const {
    return static_cast<uint64_t>(count) * c10::elementSize(static_cast<c10::ScalarType>(dtype));
  }
};
static_assert(sizeof(FrameHeader) == kAlign, "a frame header is one aligned unit");

size_t doorbellBytes(int size) {
  return roundUp(sizeof(Doorbell) * size, kPage);
}

// Copies n bytes to or from a ring of `size` bytes at stream position `at`, across its end.
void intoRing(char* ring, size_t size, uint64_t at, const char* from, size_t n) {
  const size_t offset = at % size;
  const size_t first = std::min(n, size - offset);
  std::memcpy(ring + offset, from, first);
  std::memcpy(ring, from + first, n - first);
}

void outOfRing(const char* ring, size_t size, uint64_t at, char* to, size_t n) {
  const size_t offset = at % size;
  const size_t first = std::min(n, size - offset);
  std::memcpy(to, ring + offset, first);
  std::memcpy(to + first, ring, n - first);
}

// Of the padded units [from, from + n) of a message of `bytes` bytes, how many are real bytes.
uint64_t realBytes(uint64_t bytes, uint64_t from, uint64_t n) {
  return from >= bytes ? 0 : std::min(n, bytes - from);
}

// What a request and the mailboxes share: whether it is done, how, and whom to tell.
struct Status {
  std::atomic<bool> done{false};
  std::string error;  // set before done
  bool mismatch = false;  // the error is the caller's (a receive that does not match its message)
  int source = -1;
  std::function<void()> wake;  // Request::wakeWhenReady
};
using StatusPtr = std::shared_ptr<Status>;

} // namespace

struct Mailboxes::State {
  State(char* area, int rank, int size)
      : rank(rank), size(size), ringSize(ringBytes(size)), outgoing(size), incoming(size) {
    doorbells = reinterpret_cast<Doorbell*>(area);
    rings = area + doorbellBytes(size);
  }

  // A send not yet wholly in its ring. `data` points at byte `dataOffset` of the message (a send
  // dropped half-way keeps the rest in `owned`).
  struct Outgoing {
    StatusPtr status;
    const char* data;
    FrameHeader header;
    uint64_t bytes;
    bool headerWritten = false;
    uint64_t written = 0;  // payload units in the ring (padded to kAlign at the end)
    uint64_t dataOffset = 0;
    std::vector<char> owned;
  };
  // A receive no message has matched yet.
  struct Posted {
    StatusPtr status;
    char* data;
    int64_t count;
    c10::ScalarType dtype;
    int peer;
    int tag;
  };
  // A message that came before its receive: copied out of the ring so messages behind it pass.
  struct Arrived {
    int source;
    FrameHeader header;
    std::vector<char> data;
    bool complete = false;
    StatusPtr claimant;  // the receive that took it while it was still arriving
    char* claimantData = nullptr;
    bool drop = false;   // its receive failed or is gone
  };
  // The message being copied out of one sender's ring.
  struct Incoming {
    bool active = false;
    uint64_t bytes = 0, padded = 0, taken = 0;
    char* dest = nullptr;  // null: dropped (its receive failed or is gone)
    StatusPtr status;      // the receive it goes to, or
    Arrived* arrived = nullptr;  // the buffer it goes to
  };

  RingCounters& counters(int from, int to) {
    return *reinterpret_cast<RingCounters*>(rings + (static_cast<size_t>(from) * size + to) * (kRingHeader + ringSize));
  }
  char* ringData(int from, int to) {
    return reinterpret_cast<char*>(&counters(from, to)) + kRingHeader;
  }

  void ringDoorbell(int r) {
    Doorbell& bell = doorbells[r];
    bell.rings.fetch_add(1, std::memory_order_seq_cst);
    if (bell.sleeping.load(std::memory_order_seq_cst) != 0) {
      futexWakeAll(&bell.rings);
    }
  }

  // Under the lock. The first outcome stays.
  void finish(Status& status, std::string error) {
    if (status.done.load(std::memory_order_relaxed)) {
      return;
    }
    status.error = std::move(error);
    status.done.store(true, std::memory_order_release);
    if (status.wake) {
      wakes.push_back(std::move(status.wake));
    }
  }

  // Under the lock.
  void refuse(Status& status, std::string error) {
    status.mismatch = true;
    finish(status, std::move(error));
  }

  // As messages.cpp words it for the transports that need its headers.
  std::string mismatch(int source, const Posted& expected, const FrameHeader& sent) const {
    auto described = [](int64_t count, c10::ScalarType dtype) {
      return std::to_string(count) + " " + dtypeName(dtype) + " elements";
    };
    return "recv on rank " + std::to_string(rank) + " expected " + described(expected.count, expected.dtype) +
        " from rank " + std::to_string(source) + " (tag " + std::to_string(expected.tag) + "), which sent " +
        described(sent.count, static_cast<c10::ScalarType>(sent.dtype)) + "; the tensor was not written";
  }

  static bool matches(const Posted& posted, const FrameHeader& sent) {
    return posted.count == sent.count && static_cast<int16_t>(posted.dtype) == sent.dtype;
  }

  // Appends what fits of the sends queued for `to`, a piece at a time, each published at once so the
  // receiver copies one piece out while this rank copies the next in. Under the lock.
  void progressSends(int to) {
    auto& queue = outgoing[to];
    if (queue.empty()) {
      return;
    }
    RingCounters& ring = counters(rank, to);
    char* data = ringData(rank, to);
    uint64_t head = ring.head.load(std::memory_order_relaxed);  // only this rank writes it
    while (!queue.empty()) {
      Outgoing& out = queue.front();
      const uint64_t padded = roundUp(out.bytes, kAlign);
      uint64_t room = ringSize - (head - ring.tail.load(std::memory_order_acquire));
      if (room == 0) {
        room = awaitPeer(ring.tail, [&](uint64_t tail) { return ringSize - (head - tail); });
      }
      if (room == 0) {
        // Full: ask the receiver to ring once it drains, then look again (it may have drained since).
        ring.senderWaiting.store(1, std::memory_order_seq_cst);
        if (ringSize - (head - ring.tail.load(std::memory_order_seq_cst)) == 0) {
          return;
        }
        continue;
      }
      if (!out.headerWritten) {
        intoRing(data, ringSize, head, reinterpret_cast<const char*>(&out.header), sizeof out.header);
        head += kAlign;
        room -= kAlign;
        out.headerWritten = true;
      }
      const uint64_t n = std::min({room, padded - out.written, uint64_t{kPiece}});
      intoRing(data, ringSize, head, out.data + (out.written - out.dataOffset), realBytes(out.bytes, out.written, n));
      head += n;
      out.written += n;
      ring.head.store(head, std::memory_order_release);
      ringDoorbell(to);
      if (out.written == padded) {
        finish(*out.status, "");
        queue.pop_front();
      }
    }
  }

  // Takes what has arrived from `from`, a piece at a time, each piece's room given back at once.
  // Under the lock.
  void progressReceives(int from) {
    RingCounters& ring = counters(from, rank);
    const char* data = ringData(from, rank);
    uint64_t head = ring.head.load(std::memory_order_acquire);
    uint64_t tail = ring.tail.load(std::memory_order_relaxed);  // only this rank writes it
    Incoming& in = incoming[from];
    while (true) {
      if (tail == head && in.active && in.taken < in.padded) {
        head = tail + awaitPeer(ring.head, [&](uint64_t h) { return h - tail; });  // the rest is on its way
      }
      if (tail == head && !(in.active && in.taken == in.padded)) {
        return;
      }
      if (!in.active) {
        FrameHeader header;
        outOfRing(data, ringSize, tail, reinterpret_cast<char*>(&header), sizeof header);
        tail += kAlign;
        TORCH_CHECK(header.magic == kMagic, "shared memory: a corrupt message from rank ", from, " to rank ", rank);
        begin(in, from, header);
      }
      const uint64_t n = std::min({head - tail, in.padded - in.taken, uint64_t{kPiece}});
      if (in.dest != nullptr) {
        outOfRing(data, ringSize, tail, in.dest + in.taken, realBytes(in.bytes, in.taken, n));
      }
      tail += n;
      in.taken += n;
      ring.tail.store(tail, std::memory_order_seq_cst);
      if (ring.senderWaiting.exchange(0, std::memory_order_seq_cst) != 0) {
        ringDoorbell(from);
      }
      if (in.taken == in.padded) {
        end(in);
      }
    }
  }

  // While a peer is in the middle of a message, its next piece is microseconds away: spins a little
  // for `counter` to give `available(counter) > 0`, and returns that (0 if it did not come).
  template <typename Available>
  static uint64_t awaitPeer(const std::atomic<uint64_t>& counter, Available available) {
    const auto until = std::chrono::steady_clock::now() + kAwaitPeer;
    do {
      for (int spin = 0; spin < 64; ++spin) {
        if (const uint64_t n = available(counter.load(std::memory_order_acquire))) {
          return n;
        }
        cpuRelax();
      }
    } while (std::chrono::steady_clock::now() < until);
    return 0;
  }

  // A message's header arrived: to the first receive waiting for it, else into a buffer of its own.
  void begin(Incoming& in, int from, const FrameHeader& header) {
    in = Incoming{};
    in.active = true;
    in.bytes = header.bytes();
    in.padded = roundUp(in.bytes, kAlign);
    auto match = std::find_if(posted.begin(), posted.end(), [&](const Posted& p) {
      return (p.peer == from || p.peer == kAnySource) && p.tag == header.tag;
    });
    if (match != posted.end()) {
      match->status->source = from;
      if (matches(*match, header)) {
        in.dest = match->data;
        in.status = match->status;
      } else {
        refuse(*match->status, mismatch(from, *match, header));
      }
      posted.erase(match);
      return;
    }
    unexpected.push_back(Arrived{from, header, std::vector<char>(in.bytes)});
    in.arrived = &unexpected.back();
    in.dest = in.arrived->data.data();
  }

  void end(Incoming& in) {
    if (in.status) {
      finish(*in.status, "");
    } else if (in.arrived != nullptr) {
      in.arrived->complete = true;
      if (in.arrived->claimant) {
        deliver(in.arrived);
      }
    }
    in = Incoming{};
  }

  // An arrived message to the receive that claimed it.
  void deliver(Arrived* arrived) {
    if (!arrived->drop) {
      std::memcpy(arrived->claimantData, arrived->data.data(), arrived->data.size());
      finish(*arrived->claimant, "");
    }
    unexpected.remove_if([arrived](const Arrived& a) { return &a == arrived; });
  }

  void progressAll() {
    if (closed) {
      return;
    }
    for (int peer = 0; peer < size; ++peer) {
      progressSends(peer);
      progressReceives(peer);
    }
  }

  // Runs the wakes collected under the lock. Without the lock.
  void runWakes(std::vector<std::function<void()>>& taken) {
    for (auto& wake : taken) {
      wake();
    }
    taken.clear();
  }

  // Progresses everything; with `onlyIfFree`, not when another thread is at it already.
  void progress(bool onlyIfFree) {
    std::unique_lock<std::mutex> lock(mutex, std::defer_lock);
    if (onlyIfFree) {
      if (!lock.try_lock()) {
        return;
      }
    } else {
      lock.lock();
    }
    progressAllOrFail();
    std::vector<std::function<void()>> taken;
    taken.swap(wakes);
    lock.unlock();
    runWakes(taken);
  }

  // Under the lock. A ring found corrupt fails every transfer: nothing more can be trusted.
  void progressAllOrFail() {
    try {
      progressAll();
    } catch (const std::exception& e) {
      failEverything(e.what());
    }
  }

  StatusPtr post(std::function<void(const StatusPtr&)> enqueue) {
    auto status = std::make_shared<Status>();
    std::unique_lock<std::mutex> lock(mutex);
    if (closed) {
      finish(*status, "shared memory: the group's transport is closed");
    } else {
      enqueue(status);
      progressAllOrFail();  // a message already there, or room for this one: done without a thread hop
    }
    std::vector<std::function<void()>> taken;
    taken.swap(wakes);
    lock.unlock();
    runWakes(taken);
    return status;
  }

  void postReceive(const Posted& receive) {
    auto arrived = std::find_if(unexpected.begin(), unexpected.end(), [&](const Arrived& a) {
      return !a.claimant && (receive.peer == kAnySource || a.source == receive.peer) && a.header.tag == receive.tag;
    });
    if (arrived == unexpected.end()) {
      posted.push_back(receive);
      return;
    }
    const StatusPtr& status = receive.status;
    status->source = arrived->source;
    arrived->claimant = status;
    if (!matches(receive, arrived->header)) {
      refuse(*status, mismatch(arrived->source, receive, arrived->header));
      arrived->drop = true;
    } else {
      arrived->claimantData = receive.data;
    }
    if (arrived->complete) {
      deliver(&*arrived);
    }
  }

  // A request dropped before it was done: nothing may touch its buffer from now on.
  void cancel(const StatusPtr& status) {
    std::lock_guard<std::mutex> lock(mutex);
    if (status->done.load(std::memory_order_relaxed)) {
      return;
    }
    status->wake = nullptr;
    for (auto& queue : outgoing) {
      for (auto it = queue.begin(); it != queue.end(); ++it) {
        if (it->status != status) {
          continue;
        }
        if (!it->headerWritten) {
          queue.erase(it);
        } else {
          // Half in the ring: the receiver expects the rest, which is kept here.
          const uint64_t from = std::min(it->written, it->bytes);
          it->owned.assign(it->data + (from - it->dataOffset), it->data + (it->bytes - it->dataOffset));
          it->data = it->owned.data();
          it->dataOffset = from;
        }
        return;
      }
    }
    posted.erase(std::remove_if(posted.begin(), posted.end(), [&](const Posted& p) { return p.status == status; }), posted.end());
    for (auto& in : incoming) {
      if (in.status == status) {
        in.status.reset();
        in.dest = nullptr;
      }
    }
    for (auto& arrived : unexpected) {
      if (arrived.claimant == status) {
        arrived.drop = true;
      }
    }
  }

  // The transport is going away: every request still in flight fails, and the segment is not
  // touched again.
  void close() {
    std::unique_lock<std::mutex> lock(mutex);
    failEverything("shared memory: the group's transport was closed");
    std::vector<std::function<void()>> taken;
    taken.swap(wakes);
    lock.unlock();
    runWakes(taken);
  }

  // Under the lock.
  void failEverything(const std::string& reason) {
    closed = true;
    for (auto& queue : outgoing) {
      for (auto& out : queue) {
        finish(*out.status, reason);
      }
      queue.clear();
    }
    for (auto& p : posted) {
      finish(*p.status, reason);
    }
    posted.clear();
    for (auto& in : incoming) {
      if (in.status) {
        finish(*in.status, reason);
      }
      in = Incoming{};
    }
    for (auto& arrived : unexpected) {
      if (arrived.claimant) {
        finish(*arrived.claimant, reason);
      }
    }
    unexpected.clear();
  }

  // The progress thread: sleeps until a peer rings, then moves what it can.
  void progressLoop() {
    Doorbell& bell = doorbells[rank];
    while (!stopping.load(std::memory_order_acquire)) {
      const uint32_t seen = bell.rings.load(std::memory_order_seq_cst);
      progress(/*onlyIfFree=*/false);
      const auto lingerUntil = std::chrono::steady_clock::now() + kLinger;
      while (bell.rings.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < lingerUntil) {
        std::this_thread::yield();
      }
      if (bell.rings.load(std::memory_order_acquire) != seen) {
        continue;
      }
      bell.sleeping.store(1, std::memory_order_seq_cst);
      if (bell.rings.load(std::memory_order_seq_cst) == seen && !stopping.load(std::memory_order_acquire)) {
        futexWait(&bell.rings, seen, kSleepSlice);
      }
      bell.sleeping.store(0, std::memory_order_seq_cst);
    }
  }

  const int rank;
  const int size;
  const size_t ringSize;
  Doorbell* doorbells = nullptr;
  char* rings = nullptr;

  std::mutex mutex;  // everything below
  bool closed = false;
  std::vector<std::deque<Outgoing>> outgoing;  // per receiver, in posting order
  std::deque<Posted> posted;                   // in posting order
  std::list<Arrived> unexpected;               // in arrival order
  std::vector<Incoming> incoming;              // per sender
  std::vector<std::function<void()>> wakes;    // collected under the lock, run after it
  std::atomic<bool> stopping{false};
};

namespace {

class MailboxRequest : public Request {
 public:
  MailboxRequest(std::shared_ptr<Mailboxes::State> state, StatusPtr status)
      : state_(std::move(state)), status_(std::move(status)) {}

  ~MailboxRequest() override {
    if (!status_->done.load(std::memory_order_acquire)) {
      state_->cancel(status_);
    }
  }

  bool test() override {
    if (!status_->done.load(std::memory_order_acquire)) {
      state_->progress(/*onlyIfFree=*/true);
      if (!status_->done.load(std::memory_order_acquire)) {
        return false;
      }
    }
    if (status_->mismatch) {
      C10_THROW_ERROR(ValueError, status_->error);  // as messages.cpp: the caller's error, the pair still usable
    }
    if (!status_->error.empty()) {
      C10_THROW_ERROR(DistBackendError, status_->error);
    }
    return true;
  }

  int source() const override {
    return status_->source;
  }

  void wakeWhenReady(std::function<void()> wake) override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!status_->done.load(std::memory_order_relaxed)) {
        status_->wake = std::move(wake);
        return;
      }
    }
    wake();
  }

 private:
  std::shared_ptr<Mailboxes::State> state_;
  StatusPtr status_;
};

} // namespace

size_t Mailboxes::bytes(int size) {
  return doorbellBytes(size) + static_cast<size_t>(size) * size * (kRingHeader + ringBytes(size));
}

Mailboxes::Mailboxes(char* area, int rank, int size) : state_(std::make_shared<State>(area, rank, size)) {}

Mailboxes::~Mailboxes() {
  state_->close();
  if (progress_.joinable()) {
    state_->stopping.store(true, std::memory_order_release);
    state_->ringDoorbell(state_->rank);
    progress_.join();
  }
}

void Mailboxes::startProgress() {
  std::call_once(progressStarted_, [this] { progress_ = std::thread([state = state_] { state->progressLoop(); }); });
}

RequestPtr Mailboxes::send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) {
  TORCH_CHECK(peer >= 0 && peer < state_->size, "shared memory: send to rank ", peer, " of ", state_->size);
  startProgress();
  const FrameHeader header{count, tag, static_cast<int16_t>(dtype), kMagic};
  auto status = state_->post([&](const StatusPtr& s) {
    state_->outgoing[peer].push_back({s, static_cast<const char*>(buf), header, header.bytes()});
  });
  return std::make_unique<MailboxRequest>(state_, std::move(status));
}

RequestPtr Mailboxes::recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) {
  TORCH_CHECK(
      peer == kAnySource || (peer >= 0 && peer < state_->size), "shared memory: recv from rank ", peer, " of ",
      state_->size);
  startProgress();
  auto status = state_->post([&](const StatusPtr& s) {
    state_->postReceive({s, static_cast<char*>(buf), count, dtype, peer, tag});
  });
  return std::make_unique<MailboxRequest>(state_, std::move(status));
}

} // namespace chainermn::shm
