// What the ranks of an in-process run share (Gloo's test/base_test.h, ranks as threads).
//
// A Run is one harness call: its ranks are threads, and it owns one Hub per transport level
// ("world", "intra/<node>", "inter/<intra rank>"), so two runs never meet. A Hub is where the
// ranks of one level meet: every collective step publishes a Post per rank and waits for the
// others (exchange), reads straight from the peers' memory, and waits again (close) so that no rank
// returns, and reuses its buffers, while a peer is still reading them.
//
// No wait is unbounded: each gives up at the run's timeout, naming the ranks that never came, and
// the first failure on any rank aborts the run, which at once fails every rank waiting to exchange
// or polling a send or receive. Only close() waits on: its peers are past exchange, only reading
// (nothing they wait for), and leaving early would let this rank's caller free what they read.
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace chainermn::testing {

class Hub;

class Run {
 public:
  explicit Run(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  // The hub of a level, made by the first rank that asks; every rank must name the same ranks.
  Hub& hub(const std::string& key, const std::vector<int>& ranks);

  // Records the first error and wakes every rank waiting in a hub. Later errors (mostly the
  // "aborted" ones this causes) are dropped: the first one is the cause. `where` says which rank
  // failed in what, for the message the others get.
  void abort(std::exception_ptr error, const std::string& where);
  bool aborted() const {
    return aborted_.load(std::memory_order_acquire);
  }
  // Throws DistBackendError naming the cause, for a rank that finds the run aborted.
  [[noreturn]] void throwAborted(const std::string& where) const;
  // After every thread has joined: the first error, if any.
  void rethrowFirstError();

 private:
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<Hub>> hubs_;
  std::atomic<bool> aborted_{false};
  std::exception_ptr firstError_;
  std::string why_;
};

// One rank's part of a collective step: what it calls and with what, so that the ranks can check
// that they agree, and where its buffers are, so that the peers can read them.
struct Post {
  const char* op = "";
  int64_t count = 0;  // -1: not compared (alltoallv's counts are per peer)
  c10::ScalarType dtype = c10::ScalarType::Byte;
  int reduce = -1;  // a ReduceKind, or -1 for a collective that does not reduce
  int root = -1;
  const void* send = nullptr;
  void* recv = nullptr;
  const std::vector<int64_t>* counts = nullptr;  // alltoallv: elements sent to each peer
};

// The state of one send or receive, shared by the rank that posted it and the one that completes it.
struct Transfer {
  std::atomic<int> state{0};  // kPending, kDone or kFailed
  std::string error;          // written before state becomes kFailed
  int source = -1;            // the sender's index, written before state becomes kDone
};
constexpr int kPending = 0, kDone = 1, kFailed = 2;

class Hub {
 public:
  Hub(Run& run, std::string key, std::vector<int> ranks);

  const std::string& key() const {
    return key_;
  }
  const std::vector<int>& ranks() const {
    return ranks_;
  }
  int size() const {
    return static_cast<int>(ranks_.size());
  }

  // Publishes this rank's post and waits for every rank's. The posts stay valid until close(),
  // which every rank that returns from here must call, even if it fails in between.
  const std::vector<Post>& exchange(int index, const Post& mine);
  // Throws (on every rank alike) unless the ranks agree on the op, count, dtype, reduction and root.
  void checkAgreement() const;
  // Waits until every rank is done with the step's posts.
  void close(int index, const char* op);

  // Point to point, matched as MPI does: a receive takes the earliest send from its peer (or from
  // anyone, kAnySource) with its tag, in the order the receives were posted. The bytes move when both
  // sides are posted, straight from the sender's buffer: a send is done only once it is received.
  std::shared_ptr<Transfer> send(int from, int to, int tag, const void* buf, int64_t count, c10::ScalarType dtype);
  std::shared_ptr<Transfer> recv(int at, int from, int tag, void* buf, int64_t count, c10::ScalarType dtype);

  // Takes a transfer's side out of the queues if it is still there: once this returns, the hub never
  // touches that buffer. For a request that gives up, or is dropped, before it is matched.
  void cancel(const std::shared_ptr<Transfer>& transfer);

  // Run::abort's wake-up call.
  void wakeAll();

 private:
  struct Pending {
    int peer;  // the sender (for a send: who posted it), or the receive's source (maybe kAnySource)
    int tag;
    const void* sendBuf;
    void* recvBuf;
    int64_t count;
    c10::ScalarType dtype;
    std::shared_ptr<Transfer> transfer;
  };
  // Both sides are posted: moves the bytes and completes both transfers (or fails both).
  static void complete(Pending& send, Pending& recv, int sender);
  // Arrives and waits for every rank; false if it left instead: at the timeout, or (if abortable)
  // when the run is aborted before the step completes.
  bool rendezvous(std::unique_lock<std::mutex>& lock, int index, bool abortable);
  // Throws for a rank that left: the run's abort, or a timeout naming the ranks that never came.
  [[noreturn]] void leave(std::unique_lock<std::mutex>& lock, int index, const char* op);
  std::string who(int index) const;

  Run& run_;
  const std::string key_;
  const std::vector<int> ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t step_ = 0;          // completed rendezvous (exchange and close each count one)
  std::vector<bool> arrived_;  // at the current rendezvous
  std::vector<bool> gaveUp_;   // came, waited the timeout and left: not one that "never came"
  int arrivals_ = 0;
  std::vector<Post> posts_;
  std::vector<std::vector<Pending>> sends_;  // per receiver, in posting order
  std::vector<std::vector<Pending>> recvs_;  // per receiver, in posting order
};

}  // namespace chainermn::testing
