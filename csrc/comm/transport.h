// The buffer-level collective interface every transport implements.
//
// A Transport moves and reduces flat, contiguous buffers among a fixed group of ranks. It knows
// nothing of tensors, process groups or strategies: one adapter per library (MPI, Gloo through
// c10d::Backend, ...) maps each call onto that library and nothing more.
//
// Collectives block the calling thread (the group's worker) until they complete or throw: blocking
// MPI collectives use MPI's tuned algorithms and progress without polling. A watchdog above this
// layer bounds them by the group timeout. Point-to-point calls return a Request instead, because
// sends and receives issued in order on one thread must not wait for each other (batch_isend_irecv).
#pragma once

#include "topology.h"
#include "types.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace chainermn {

// A point-to-point operation in flight.
class Request {
 public:
  virtual ~Request() = default;
  // True once the operation has completed. Never blocks. Throws if it failed.
  virtual bool test() = 0;
  // For a receive from any source, the rank it matched (valid after test() returned true).
  virtual int source() const {
    return -1;
  }
  // Asks for `wake` to be called once test() may return true, from whichever thread learns it (a
  // library that progresses in threads of its own), so the caller need not poll in the meantime.
  // Returns whether it will be (or already was) called. Requests that progress only when tested
  // return false: they are polled. A transport's requests all wake, or none do.
  virtual bool wakeWhenReady(std::function<void()> /*wake*/) {
    return false;
  }
};
using RequestPtr = std::unique_ptr<Request>;

// One request for several: done when all are (the first failure throws). Each is tested until done.
RequestPtr allOf(std::vector<RequestPtr> requests);

// One send or receive of a batch (Transport::startAll).
struct Transfer {
  bool send;
  void* buf;  // read by a send, written by a receive
  int64_t count;
  c10::ScalarType dtype;
  int peer;
  int tag;
};

// A stretch of a message gathered from several buffers (Transport::sendGathered). Null `data`:
// `bytes` zero bytes (padding between aligned parts).
struct Piece {
  const void* data;
  size_t bytes;
};

// Copies the pieces' bytes, from byte `skip` of their concatenation on, into `into`.
void copyPieces(const std::vector<Piece>& pieces, uint64_t skip, char* into);

// A check a collective carries in its first exchange (Transport::carryCheck): the few bytes every
// rank compares before an op moves data (backend/agreement.h), and what to do with everyone's.
class CarriedCheck {
 public:
  virtual ~CarriedCheck() = default;
  // This rank's bytes (at most kExchangeBytes; the same size on every rank).
  virtual const void* mine() const = 0;
  virtual size_t bytes() const = 0;
  // Every rank's bytes, rank r's at r * bytes(): throws (c10::ValueError, the same on every rank)
  // when the ranks disagree. Called once per carried check, before the collective carrying it has
  // written anything its caller can see.
  virtual void verify(const void* all) = 0;
};

// Counts are in elements of `dtype`. Every rank passes the same count and dtype unless said otherwise.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The library behind this transport, for messages ("mpi", "gloo").
  virtual const char* library() const = 0;

  // In place: buf becomes the reduction of every rank's buf.
  virtual void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) = 0;
  // root's buf is copied into every rank's buf.
  virtual void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) = 0;
  // root's recv gets the reduction of every rank's send (send == recv is allowed on root); recv is
  // not touched elsewhere.
  virtual void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) = 0;
  // recv (size * count) gets rank r's send in block r.
  virtual void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) = 0;
  // As allgather, but only root's recv is written.
  virtual void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) = 0;
  // Block r of root's send (size * count) goes to rank r's recv.
  virtual void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) = 0;
  // send holds size blocks of count; rank r's recv gets the reduction of every rank's block r.
  virtual void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) = 0;
  // Block p of send (sendCounts[p] elements, blocks back to back) goes to rank p, which receives it
  // as block r of its recv (recvCounts[r] elements, back to back).
  virtual void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                         const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) = 0;
  // Whether a message carries its count and dtype, so that a receive expecting others fails naming
  // both (its buffer untouched) and the pair stays usable. Transports that do not need the header
  // messages of backend/checked_transfers.h in front of every message.
  virtual bool checksMessages() const {
    return false;
  }
  virtual RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) = 0;
  // Whether sendGathered is available. It may then be called from any thread while nothing else
  // calls this transport, its requests in flight aside (the caller's, when the worker is idle).
  virtual bool sendsGathered() const {
    return false;
  }
  // One message of bytes, `pieces` back to back, received as one (recvAnySize). The pieces may change
  // as soon as this returns: what is not in the ring yet is copied. Only where sendsGathered().
  virtual RequestPtr sendGathered(const std::vector<Piece>& pieces, int peer, int tag);
  // peer may be kAnySource; the Request's source() then tells which rank sent.
  virtual RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) = 0;
  // A receive of whatever message comes from `peer` on `tag`: it lands in `allocate(count, dtype)`,
  // called once the message's count and dtype are known. Only where checksMessages() (the message
  // carries them); backend/checked_transfers.h reads them from its headers on the other transports.
  using Allocate = std::function<void*(int64_t count, c10::ScalarType dtype)>;
  virtual RequestPtr recvAnySize(int peer, int tag, Allocate allocate);
  virtual void barrier() = 0;
  // Starts every transfer of a batch as one (torch's batch_isend_irecv): a receive listed before the
  // send its peer waits for must not hold that send back. Libraries whose transfers progress
  // independently start them in order (this default); NCCL, whose transfers on one stream run in
  // order, groups them.
  virtual RequestPtr startAll(const std::vector<Transfer>& transfers);

  // Every rank's `bytes` (at most kExchangeBytes) at `mine` into `all`, rank r's at r * bytes: the
  // few bytes of bookkeeping the ranks compare before a collective (backend/agreement.h). An
  // allgather unless the library has something cheaper.
  virtual void exchange(const void* mine, void* all, size_t bytes) {
    allgather(mine, all, static_cast<int64_t>(bytes), c10::ScalarType::Byte);
  }
  // Folds `check` into the next call's first exchange instead of an exchange of its own, where the
  // transport can (shared memory: a small collective's one barrier carries it; any other call sends
  // it alone first, as exchange() would). Returns false, keeping nothing, where it cannot. Every
  // rank's first barrier of that call then carries its bytes, whichever call it is, so ranks that
  // disagree on the op still meet there and all fail it. `check` must live until it is verified or
  // dropped: settleCheck() sends and verifies one that no call took (the op moved nothing here), and
  // carryCheck(nullptr) drops it (the op failed before it reached the transport).
  virtual bool carryCheck(CarriedCheck* /*check*/) {
    return false;
  }
  virtual void settleCheck() {}
  // How many carried checks rode in a collective's own exchange, costing no exchange of their own.
  virtual uint64_t checksCarried() const {
    return 0;
  }

  // Transports whose calls return before the data has moved (NCCL: a call queues kernels on a
  // stream) can fail after returning. asyncError() says so: "" while healthy, else the library's
  // report (ncclCommGetAsyncError). abort() ends the transport for good: work it queued stops
  // (kernels waiting on a dead peer return), a call waiting for a peer throws (shared memory: a
  // collective run on its caller's thread must be freed when the group breaks) and later calls
  // throw. Both are called from the watchdog's thread, never throw, and cost nothing elsewhere
  // (MPI and Gloo cannot end a call in progress: no op runs on a caller over them).
  virtual std::string asyncError() {
    return "";
  }
  virtual void abort() {}
  // Ends a healthy transport once the process group has waited for the work it queued: NCCL
  // flushes and frees its communicator (ncclCommFinalize, ncclCommDestroy), which abort() must not
  // be used for (it drops queued work). Bounded; later calls throw. Never throws.
  virtual void close() {}

  // Whether every rank of this transport is on this rank's node (makeTransportSet says so): its
  // calls are the phase "within the node" on the profiler's timeline, else "between nodes" (phase.h).
  bool withinNode() const {
    return withinNode_;
  }
  void setWithinNode(bool withinNode) {
    withinNode_ = withinNode;
  }

 private:
  bool withinNode_ = false;
};

// The bytes of blocks of `counts` elements of `dtype` (what an alltoallv sends).
inline int64_t bytesOf(const std::vector<int64_t>& counts, c10::ScalarType dtype) {
  int64_t total = 0;
  for (const int64_t count : counts) {
    total += count;
  }
  return total * static_cast<int64_t>(c10::elementSize(dtype));
}

constexpr size_t kExchangeBytes = 128;

using TransportPtr = std::shared_ptr<Transport>;

// The transports of one process group. When a level is the whole group (one node, or one rank
// per node) it is the world transport itself.
struct TransportSet {
  TransportPtr world;  // every rank of the group
  TransportPtr intra;  // the ranks of this node, ordered by rank
  TransportPtr inter;  // the ranks with this intra rank, one per node that has one
};

// Makes the transport of one level (see topology.h); collective over the level's ranks.
using TransportFactory = std::function<TransportPtr(const Level&)>;

// A group's transports from one factory: world first, then this node, then this intra rank across
// nodes, in the same order on every rank (creating a transport is collective). A level that spans
// the whole group is not made again: the world transport serves it.
TransportSet makeTransportSet(const Topology& topology, const TransportFactory& make);

}  // namespace chainermn
