#include "comm/shm.h"

#include "comm/shm_barrier.h"
#include "comm/shm_mailbox.h"
#include "comm/shm_segment.h"
#include "phase.h"
#include "kernels/reduce.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

namespace chainermn::shm {
namespace {

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// A rank's cell in each half of the exchange area (round()): a head of kExchangeBytes (the
// fingerprint a collective's ranks compare, exchange()) and a body of kCellBytes (the collectives
// small enough to take one barrier). What a small reduction (ranks x the body) costs every rank to
// read is less than the barrier it saves.
constexpr size_t kCellBytes = 16384;
constexpr size_t kCellStride = kExchangeBytes + kCellBytes;
static_assert(kExchangeBytes % 64 == 0, "a cell's body starts on a cache line");

// Two rounds of a cell per rank (see round()), in whole pages.
size_t exchangeBytes(int size) {
  return roundUp(2 * size * kCellStride, 4096);
}

// The segment holds the barrier's flags, the exchange area (two halves of a cell per rank: the
// fingerprints, and the collectives small enough to take one barrier), a slot per rank, two result
// buffers, then the point-to-point rings when the transport carries point to point.
size_t segmentBytes(int size, size_t chunk, bool pointToPoint) {
  return Barrier::bytes(size) + exchangeBytes(size) + (size + 2) * chunk + (pointToPoint ? Mailboxes::bytes(size) : 0);
}

class ShmTransport : public Transport {
 public:
  ShmTransport(TransportPtr fallback, std::unique_ptr<Segment> segment, size_t chunk, std::chrono::milliseconds timeout,
               bool pointToPoint)
      : fallback_(std::move(fallback)),
        segment_(std::move(segment)),
        rank_(fallback_->rank()),
        size_(fallback_->size()),
        chunk_(chunk),
        barrier_(segment_->base(), rank_, size_, timeout) {
    exchangeArea_ = segment_->base() + Barrier::bytes(size_);
    char* data = exchangeArea_ + exchangeBytes(size_);
    for (int r = 0; r < size_; ++r) {
      slots_.push_back(data + r * chunk_);
    }
    results_[0] = data + size_ * chunk_;
    results_[1] = results_[0] + chunk_;
    sources_.resize(size_);
    heads_.resize(size_ * kExchangeBytes);
    if (pointToPoint) {
      mailboxes_ = std::make_unique<Mailboxes>(results_[1] + chunk_, rank_, size_);
    }
  }

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  const char* library() const override {
    return "shm";
  }

  // See Barrier::startWatchingPeers.
  void startWatchingPeers() {
    barrier_.startWatchingPeers();
  }

  // The collectives' waits end (Barrier::abort): a collective run on its caller's thread
  // (backend/funnel.cpp) returns when the group breaks, as one on the worker is failed by the
  // watchdog. Point to point needs none: its requests are failed where they wait.
  void abort() override {
    barrier_.abort();
  }

  // The check rides in the head of this rank's cell in the next round of the exchange area: the small
  // collectives' one barrier, or a round of its own before any other call (settleCheck()).
  bool carryCheck(CarriedCheck* check) override {
    carried_ = check;
    return true;
  }
  void settleCheck() override {
    if (carried_ != nullptr) {
      round(nullptr, 0, /*checkAlone=*/true);
    }
  }
  uint64_t checksCarried() const override {
    return checksCarried_.load(std::memory_order_relaxed);
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(phase::kWithinNode, "shm", moved::allreduce(size_, count * c10::elementSize(dtype)));
    reduceChunks(buf, buf, count, dtype, op, /*root=*/-1);
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    PhaseSpan phase(phase::kWithinNode, "shm", moved::toRoot(size_, rank_ == root, count * c10::elementSize(dtype)));
    reduceChunks(send, recv, count, dtype, op, root);
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(phase::kWithinNode, "shm", moved::fromRoot(size_, rank_ == root, count * c10::elementSize(dtype)));
    const size_t width = c10::elementSize(dtype);
    if (count > 0 && count * width <= kCellBytes) {
      // One barrier: the root's cell body of this round, read after it.
      const bool isRoot = rank_ == root;
      char* cells = round(isRoot ? buf : nullptr, isRoot ? count * width : 0);
      if (!isRoot) {
        std::memcpy(buf, body(cells, root), count * width);
      }
      return;
    }
    settleCheck();
    const int64_t step = chunk_ / width;
    auto* data = static_cast<char*>(buf);
    for (int64_t offset = 0; offset < count; offset += step) {
      const size_t bytes = std::min(step, count - offset) * width;
      if (rank_ == root) {
        std::memcpy(slots_[root], data + offset * width, bytes);
      }
      barrier_.sync();
      if (rank_ != root) {
        std::memcpy(data + offset * width, slots_[root], bytes);
      }
      barrier_.sync();  // the root may not refill its slot while others still read it
    }
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    PhaseSpan phase(phase::kWithinNode, "shm", moved::allgather(size_, count * c10::elementSize(dtype)));
    const size_t width = c10::elementSize(dtype);
    if (count > 0 && count * width <= kCellBytes) {
      char* cells = round(send, count * width);  // one barrier
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<char*>(recv) + r * count * width, body(cells, r), count * width);
      }
      return;
    }
    settleCheck();
    const int64_t step = chunk_ / width;
    for (int64_t offset = 0; offset < count; offset += step) {
      const size_t bytes = std::min(step, count - offset) * width;
      std::memcpy(slots_[rank_], static_cast<const char*>(send) + offset * width, bytes);
      barrier_.sync();
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<char*>(recv) + (r * count + offset) * width, slots_[r], bytes);
      }
      barrier_.sync();
    }
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(phase::kWithinNode, "shm", moved::reduceScatter(size_, count * c10::elementSize(dtype)));
    // Each slot holds one piece of every block; rank r reduces block r's pieces into its output.
    settleCheck();
    const size_t width = c10::elementSize(dtype);
    const int64_t step = std::max<int64_t>(1, chunk_ / width / size_);
    for (int64_t offset = 0; offset < count; offset += step) {
      const int64_t n = std::min(step, count - offset);
      for (int block = 0; block < size_; ++block) {
        std::memcpy(slots_[rank_] + block * n * width,
                    static_cast<const char*>(send) + (block * count + offset) * width, n * width);
      }
      barrier_.sync();
      for (int r = 0; r < size_; ++r) {
        sources_[r] = slots_[r] + rank_ * n * width;
      }
      reduceBuffers(static_cast<char*>(recv) + offset * width, sources_.data(), size_, n, dtype, op);
      barrier_.sync();
    }
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    settleCheck();
    fallback_->gather(send, recv, count, dtype, root);
  }
  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    settleCheck();
    fallback_->scatter(send, recv, count, dtype, root);
  }
  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    settleCheck();
    fallback_->alltoallv(send, sendCounts, recv, recvCounts, dtype);
  }
  bool checksMessages() const override {
    return mailboxes_ != nullptr;
  }
  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    settleCheck();
    if (mailboxes_) {
      return mailboxes_->send(buf, count, dtype, peer, tag);
    }
    return fallback_->send(buf, count, dtype, peer, tag);
  }
  bool sendsGathered() const override {
    return mailboxes_ != nullptr;
  }
  RequestPtr sendGathered(const std::vector<Piece>& pieces, int peer, int tag) override {
    TORCH_CHECK(mailboxes_, "shared memory: a gathered send needs the mailboxes");
    settleCheck();
    return mailboxes_->sendGathered(pieces, peer, tag);
  }
  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    settleCheck();
    if (mailboxes_) {
      return mailboxes_->recv(buf, count, dtype, peer, tag);
    }
    return fallback_->recv(buf, count, dtype, peer, tag);
  }
  RequestPtr recvAnySize(int peer, int tag, Allocate allocate) override {
    TORCH_CHECK(mailboxes_, "shared memory: a receive of unknown size needs the mailboxes");
    settleCheck();
    return mailboxes_->recvAnySize(peer, tag, std::move(allocate));
  }
  void barrier() override {
    PhaseSpan phase(phase::kWithinNode, "shm", Moved{});
    round(nullptr, 0);  // a round of the exchange area: it carries a check, if any
  }

  // Into the cells' heads, where a carried check goes: a rank that exchanges its fingerprint alone
  // (it refused the call) meets its peers' carried ones in the same round.
  void exchange(const void* mine, void* all, size_t bytes) override {
    TORCH_CHECK(bytes <= kExchangeBytes, "shared memory: exchange of ", bytes, " bytes");
    settleCheck();
    char* cells = roundCells();
    std::memcpy(cells + rank_ * kCellStride, mine, bytes);
    barrier_.sync();
    exchangeParity_ ^= 1;
    for (int r = 0; r < size_; ++r) {
      std::memcpy(static_cast<char*>(all) + r * bytes, cells + r * kCellStride, bytes);
    }
  }

 private:
  // allreduce (root < 0: everyone gets the result) or reduce to root. Every rank reduces its own
  // slice of each chunk from all slots into a result buffer; the two result buffers alternate, so a
  // rank may start the next chunk while others still copy the last result out.
  void reduceChunks(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) {
    const size_t width = c10::elementSize(dtype);
    if (count > 0 && count * width <= kCellBytes) {
      reduceSmall(send, recv, count, dtype, op, root);
      return;
    }
    settleCheck();
    const int64_t step = chunk_ / width;
    const auto* input = static_cast<const char*>(send);
    for (int64_t offset = 0; offset < count; offset += step) {
      const int64_t n = std::min(step, count - offset);
      const int64_t slice = (n + size_ - 1) / size_;
      const int64_t begin = std::min(n, rank_ * slice);
      const int64_t end = std::min(n, begin + slice);
      const char* mine = input + offset * width;
      // Only the peers read this rank's slot, and none of them reads its own slice: that part stays
      // where it is, and is reduced straight from the input.
      std::memcpy(slots_[rank_], mine, begin * width);
      std::memcpy(slots_[rank_] + end * width, mine + end * width, (n - end) * width);
      barrier_.sync();
      char* result = results_[parity_];
      if (end > begin) {
        for (int r = 0; r < size_; ++r) {
          sources_[r] = (r == rank_ ? mine : slots_[r]) + begin * width;
        }
        reduceBuffers(result + begin * width, sources_.data(), size_, end - begin, dtype, op);
      }
      barrier_.sync();
      if (root < 0 || rank_ == root) {
        std::memcpy(static_cast<char*>(recv) + offset * width, result, n * width);
      }
      parity_ ^= 1;
    }
  }

  // This round's half of the exchange area: a cell per rank.
  char* roundCells() const {
    return exchangeArea_ + exchangeParity_ * size_ * kCellStride;
  }
  // Rank r's cell body in a round's half.
  static const char* body(const char* cells, int r) {
    return cells + r * kCellStride + kExchangeBytes;
  }

  // One round of the exchange area, one barrier: this rank writes its `bytes` of `data` (at most a
  // cell body) into its cell of this round's half, and the carried check, if any, into the cell's
  // head; after the barrier the check is verified (it throws, here on every rank, when the ranks
  // disagree, before the caller has written anything of the op's). Returns the round's half, whose
  // cells the caller reads. The halves alternate, so a rank may write the next round while a peer
  // still reads this one; it reaches this half again only after a barrier every peer has passed
  // since reading it (the next round's, whatever ops come between). `checkAlone`: the round is the
  // check's own (settleCheck()), not the collective's.
  char* round(const void* data, size_t bytes, bool checkAlone = false) {
    char* cells = roundCells();
    char* mine = cells + rank_ * kCellStride;
    CarriedCheck* check = std::exchange(carried_, nullptr);  // taken even if the barrier throws
    if (check != nullptr) {
      std::memcpy(mine, check->mine(), check->bytes());
    }
    if (bytes > 0) {
      std::memcpy(mine + kExchangeBytes, data, bytes);
    }
    barrier_.sync();
    exchangeParity_ ^= 1;
    if (check != nullptr) {
      const size_t head = check->bytes();
      for (int r = 0; r < size_; ++r) {
        std::memcpy(heads_.data() + r * head, cells + r * kCellStride, head);
      }
      check->verify(heads_.data());
      if (!checkAlone) {
        checksCarried_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    return cells;
  }

  // A reduction that fits a cell in one barrier instead of two: every rank writes its input to its
  // cell body in a round of the exchange area, and after the barrier reduces every rank's cell itself
  // (all of it, where reduceChunks shares the work out and needs a second barrier before the copy
  // out). The same order of operands on every rank: the same result, bit for bit, as reduceChunks.
  void reduceSmall(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) {
    char* cells = round(send, count * c10::elementSize(dtype));
    if (root >= 0 && rank_ != root) {
      return;
    }
    for (int r = 0; r < size_; ++r) {
      sources_[r] = body(cells, r);
    }
    reduceBuffers(recv, sources_.data(), size_, count, dtype, op);
  }

  TransportPtr fallback_;
  std::unique_ptr<Segment> segment_;
  const int rank_;
  const int size_;
  const size_t chunk_;
  Barrier barrier_;
  std::vector<char*> slots_;
  char* results_[2] = {nullptr, nullptr};
  char* exchangeArea_ = nullptr;
  int exchangeParity_ = 0;
  std::vector<const void*> sources_;        // reused: no allocation per chunk
  std::vector<char> heads_;                 // every rank's carried check, gathered for verify()
  CarriedCheck* carried_ = nullptr;         // rides in the next round (carryCheck())
  std::atomic<uint64_t> checksCarried_{0};  // read by other threads (checksCarried())
  int parity_ = 0;
  std::unique_ptr<Mailboxes> mailboxes_;  // point to point, when carried; gone before the segment
};

}  // namespace

TransportPtr createTransport(c10d::Store& store, const std::string& key, TransportPtr fallback,
                             std::chrono::milliseconds timeout, bool pointToPoint, size_t chunkBytes) {
  TORCH_CHECK_VALUE(chunkBytes >= kMinChunkBytes, "shared memory: the chunk must be at least ", kMinChunkBytes,
                    " bytes, got ", chunkBytes);
  const size_t chunk = roundUp(chunkBytes, 64);
  auto segment =
      std::make_unique<Segment>(store, key, fallback->rank(), segmentBytes(fallback->size(), chunk, pointToPoint));
  Segment& mapped = *segment;
  auto comm = std::make_shared<ShmTransport>(std::move(fallback), std::move(segment), chunk, timeout, pointToPoint);
  comm->barrier();  // every rank has mapped the segment and published its pid
  comm->startWatchingPeers();
  mapped.unlinkName();
  return comm;
}

}  // namespace chainermn::shm
