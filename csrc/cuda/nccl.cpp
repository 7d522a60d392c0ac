#include "cuda/nccl.h"
#include "cuda/nccl_types.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

namespace chainermn::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// A send or receive queued on the stream: over as far as the caller is concerned (the process
// group watches the stream's end, as for a collective).
class Queued : public Request {
 public:
  explicit Queued(int source) : source_(source) {}
  bool test() override {
    return true;
  }
  int source() const override {
    return source_;
  }

 private:
  int source_;
};

std::string describe(ncclResult_t result, ncclComm_t comm) {
  // After an abort the communicator is freed: only the thread's last error can be asked.
  const char* detail = ncclGetLastError(comm);
  return std::string(ncclGetErrorString(result)) + (detail && *detail ? std::string(" (") + detail + ")" : "");
}

// Non-blocking communicators (so that an abort can end any call, init included) answer
// ncclInProgress until a call has settled: this polls until it has, up to `deadline`, or until
// `stop` says the communicator is being aborted. Returns the final state.
template <typename Stop>
ncclResult_t settle(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline, Stop&& stop) {
  while (result == ncclInProgress) {
    if (stop() || Clock::now() > deadline) {
      return ncclInProgress;
    }
    std::this_thread::yield();
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm, &state);
    result = asked != ncclSuccess ? asked : state;
  }
  return result;
}

class NcclTransport : public Transport {
 public:
  NcclTransport(ncclComm_t comm, int rank, int size, c10::DeviceIndex device, cudaStream_t stream,
                std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), device_(device), stream_(stream), timeout_(timeout) {}

  ~NcclTransport() override {
    // A communicator neither closed nor aborted (the process is exiting without destroying the
    // group): the driver may be going away; abort rather than finalize, which could wait.
    if (!ended_.load()) {
      onOwnDevice([this] { ncclCommAbort(comm_); });
    }
  }

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  const char* library() const override {
    return "nccl";
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    const Wire w = reduced(count, dtype);
    const ncclRedOp_t how = toNccl(op);
    Call call(*this, "allreduce");
    call.check(-1, ncclAllReduce(buf, buf, w.count, w.type, how, call.comm, stream_));
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    const Wire w = moved(count, dtype);
    Call call(*this, "broadcast");
    call.check(root, ncclBroadcast(buf, buf, w.count, w.type, root, call.comm, stream_));
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    const Wire w = reduced(count, dtype);
    const ncclRedOp_t how = toNccl(op);
    Call call(*this, "reduce");
    call.check(root, ncclReduce(send, recv, w.count, w.type, how, root, call.comm, stream_));
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    const Wire w = moved(count, dtype);
    Call call(*this, "allgather");
    call.check(-1, ncclAllGather(send, recv, w.count, w.type, call.comm, stream_));
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const Wire w = moved(count, dtype);
    const size_t bytes = count * c10::elementSize(dtype);
    Call call(*this, "gather");
    Group group(call, root);
    if (rank_ == root) {
      for (int peer = 0; peer < size_; ++peer) {
        call.queue(peer, ncclRecv(static_cast<char*>(recv) + peer * bytes, w.count, w.type, peer, call.comm, stream_));
      }
    }
    call.queue(root, ncclSend(send, w.count, w.type, root, call.comm, stream_));
    group.end();
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const Wire w = moved(count, dtype);
    const size_t bytes = count * c10::elementSize(dtype);
    Call call(*this, "scatter");
    Group group(call, root);
    if (rank_ == root) {
      for (int peer = 0; peer < size_; ++peer) {
        call.queue(peer,
                   ncclSend(static_cast<const char*>(send) + peer * bytes, w.count, w.type, peer, call.comm, stream_));
      }
    }
    call.queue(root, ncclRecv(recv, w.count, w.type, root, call.comm, stream_));
    group.end();
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    const Wire w = reduced(count, dtype);
    const ncclRedOp_t how = toNccl(op);
    Call call(*this, "reduce_scatter");
    call.check(-1, ncclReduceScatter(send, recv, w.count, w.type, how, call.comm, stream_));
  }

  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    const size_t width = c10::elementSize(dtype);
    const ncclDataType_t type = moved(1, dtype).type;
    const size_t per = moved(1, dtype).count;  // NCCL elements per tensor element
    Call call(*this, "alltoall");
    Group group(call, -1);
    size_t sendAt = 0, recvAt = 0;
    for (int peer = 0; peer < size_; ++peer) {
      call.queue(peer, ncclSend(static_cast<const char*>(send) + sendAt, sendCounts[peer] * per, type, peer, call.comm,
                                stream_));
      call.queue(peer,
                 ncclRecv(static_cast<char*>(recv) + recvAt, recvCounts[peer] * per, type, peer, call.comm, stream_));
      sendAt += sendCounts[peer] * width;
      recvAt += recvCounts[peer] * width;
    }
    group.end();
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    const Wire w = moved(count, dtype);
    Call call(*this, "send");
    call.check(peer, ncclSend(buf, w.count, w.type, peer, call.comm, stream_));
    return std::make_unique<Queued>(-1);
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    // The process group refuses a receive from any source over NCCL on the caller's thread.
    TORCH_CHECK_VALUE(peer != kAnySource, "chainermn: NCCL cannot receive from any source");
    const Wire w = moved(count, dtype);
    Call call(*this, "recv");
    call.check(peer, ncclRecv(buf, w.count, w.type, peer, call.comm, stream_));
    return std::make_unique<Queued>(peer);
  }

  RequestPtr startAll(const std::vector<Transfer>& transfers) override {
    std::vector<Wire> wires;
    wires.reserve(transfers.size());
    for (const auto& t : transfers) {
      TORCH_CHECK_VALUE(t.peer != kAnySource, "chainermn: NCCL cannot receive from any source");
      wires.push_back(moved(t.count, t.dtype));
    }
    Call call(*this, "batch_isend_irecv");
    Group group(call, -1);
    for (size_t i = 0; i < transfers.size(); ++i) {
      const auto& t = transfers[i];
      call.queue(t.peer, t.send ? ncclSend(t.buf, wires[i].count, wires[i].type, t.peer, call.comm, stream_)
                                : ncclRecv(t.buf, wires[i].count, wires[i].type, t.peer, call.comm, stream_));
    }
    group.end();
    return std::make_unique<Queued>(-1);
  }

  // Ordered on the stream like every call here (the process group's barrier over NCCL all-reduces
  // a token and waits for the stream itself, as ProcessGroupNCCL's does).
  void barrier() override {
    Call call(*this, "barrier");
    if (!token_.defined()) {
      token_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    }
    call.check(-1, ncclAllReduce(token_.data_ptr(), token_.data_ptr(), 1, ncclInt32, ncclSum, call.comm, stream_));
  }

  std::string asyncError() override {
    if (ended_.load()) {
      return "";  // closed, or aborted: whoever aborted said why
    }
    // Thread safe by NCCL's contract: this is how a watchdog polls a communicator others enqueue on.
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
    if (asked != ncclSuccess) {
      state = asked;
    }
    if (state == ncclSuccess || state == ncclInProgress) {
      return "";
    }
    return "NCCL reported an asynchronous error on rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           ": " + describe(state, comm_);
  }

  void abort() override {
    if (abortStarted_.exchange(true)) {
      return;
    }
    // A call settling (polling a non-blocking communicator) sees abortStarted_ and lets go; one
    // being enqueued finishes first. Either way the communicator is freed under the lock only.
    std::unique_lock<std::timed_mutex> lock(mutex_, std::defer_lock);
    (void)lock.try_lock_for(kAbortWait);
    if (!ended_.exchange(true)) {
      onOwnDevice([this] { ncclCommAbort(comm_); });  // the watchdog's thread: not a context on GPU 0
    }
  }

  void close() override {
    std::unique_lock<std::timed_mutex> lock(mutex_);
    if (ended_.load() || abortStarted_.load()) {
      return;
    }
    ended_.store(true);
    // The process group waited for the work it queued; finalize flushes what NCCL still holds,
    // then destroy frees it. A finalize that does not settle in time (a peer gone) is aborted.
    onOwnDevice([this] {
      const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout_, kFinalizeLimit);
      const ncclResult_t flushed =
          settle(comm_, ncclCommFinalize(comm_), deadline, [this] { return abortStarted_.load(); });
      if (flushed == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    });
  }

 private:
  // Runs `end` (the NCCL calls that end the communicator, on the watchdog's or a destroying thread)
  // with its device current. Never throws: with the runtime gone (process exit), `end` runs anyway.
  template <typename End>
  void onOwnDevice(End&& end) noexcept {
    std::optional<c10::cuda::CUDAGuard> guard;
    try {
      guard.emplace(device_);
    } catch (...) {
    }
    end();
  }

  static constexpr auto kAbortWait = std::chrono::seconds(2);
  // The process group has waited for its work before close(): what finalize flushes then is NCCL's
  // own bookkeeping. A process on its way out does not wait the group timeout for a gone peer.
  static constexpr auto kFinalizeLimit = std::chrono::milliseconds(10000);

  // One Transport call: holds the communicator (abort() waits for the call), refuses one that was
  // aborted, waits for a non-blocking call to settle, and turns NCCL's result codes into errors
  // naming the op, the rank and the peer.
  class Call {
   public:
    Call(NcclTransport& transport, const char* op) : transport_(transport), op_(op), lock_(transport.mutex_) {
      TORCH_CHECK(!transport.ended_.load(), "NCCL ", op, " on rank ", transport.rank_, " of ", transport.size_,
                  ": the communicator was aborted after an earlier failure of this group, or closed");
      comm = transport.comm_;
    }
    void check(int peer, ncclResult_t result) const {
      result =
          settle(comm, result, Clock::now() + transport_.timeout_, [this] { return transport_.abortStarted_.load(); });
      if (result == ncclSuccess) {
        return;
      }
      TORCH_CHECK(false, "NCCL ", op_, " failed on rank ", transport_.rank_, " of ", transport_.size_,
                  peer >= 0 ? " (peer/root " + std::to_string(peer) + ")" : std::string(), ": ",
                  result == ncclInProgress ? std::string("did not settle (aborted, or past the group timeout)")
                                           : describe(result, transport_.abortStarted_.load() ? nullptr : comm));
    }
    // A call between ncclGroupStart and ncclGroupEnd: only queued (it settles with the group's end).
    void queue(int peer, ncclResult_t result) const {
      check(peer, result == ncclInProgress ? ncclSuccess : result);
    }
    ncclComm_t comm = nullptr;

   private:
    NcclTransport& transport_;
    const char* op_;
    std::unique_lock<std::timed_mutex> lock_;
  };

  // ncclGroupStart .. ncclGroupEnd of one Call. A throw in between still ends the group: a group
  // left open on this thread would hold back every later NCCL call from it, forever (torch's
  // AutoNcclGroup).
  class Group {
   public:
    Group(const Call& call, int peer) : call_(call), peer_(peer) {
      call_.check(peer_, ncclGroupStart());
    }
    ~Group() {
      if (open_) {
        (void)ncclGroupEnd();
      }
    }
    void end() {
      open_ = false;
      call_.check(peer_, ncclGroupEnd());
    }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;

   private:
    const Call& call_;
    int peer_;
    bool open_ = true;
  };

  ncclComm_t comm_;
  const int rank_;
  const int size_;
  const c10::DeviceIndex device_;
  cudaStream_t stream_;
  const std::chrono::milliseconds timeout_;
  at::Tensor token_;        // barrier's one int
  std::timed_mutex mutex_;  // held by each Call; abort() and close() free the communicator under it
  std::atomic<bool> abortStarted_{false};
  std::atomic<bool> ended_{false};  // aborted or closed: the communicator is gone
};

}  // namespace

TransportPtr createTransport(c10d::Store& store, const std::string& key, int rank, int size, c10::DeviceIndex device,
                             void* stream, std::chrono::milliseconds timeout) {
  c10::cuda::CUDAGuard guard(device);
  ncclUniqueId id;
  const std::string idKey = "chainermn/nccl/" + key;
  if (rank == 0) {
    ncclResult_t made = ncclGetUniqueId(&id);
    TORCH_CHECK(made == ncclSuccess, "NCCL ncclGetUniqueId failed on rank 0 for ", key, ": ", ncclGetErrorString(made));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store.set(idKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store.get(idKey);  // waits, bounded by the store's timeout
    TORCH_CHECK(bytes.size() == sizeof(id), "chainermn: malformed NCCL unique id under ", idKey);
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  // Non-blocking: the init itself can then be bounded (a peer that never joins) and aborted.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + timeout;
  ncclResult_t result = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (comm != nullptr) {
    result = settle(comm, result, deadline, [] { return false; });
  }
  if (result != ncclSuccess && comm != nullptr) {
    ncclCommAbort(comm);
  }
  TORCH_CHECK(result == ncclSuccess, "NCCL ncclCommInitRankConfig failed for ", key, " on rank ", rank, " of ", size,
              " (cuda:", static_cast<int>(device), "): ",
              result == ncclInProgress
                  ? "the peers did not all join within the group timeout (" + std::to_string(timeout.count()) + " ms)"
                  : std::string(ncclGetErrorString(result)) + " " + ncclGetLastError(nullptr),
              ". Several ranks on one GPU need a distinct NCCL_HOSTID each (with NCCL_SOCKET_IFNAME=lo, "
              "NCCL_IB_DISABLE=1), or CHAINERMN_CUDA_TRANSPORT=staged");
  return std::make_shared<NcclTransport>(comm, rank, size, device, static_cast<cudaStream_t>(stream), timeout);
}

std::string version() {
  int code = 0;
  ncclGetVersion(&code);
  // NCCL >= 2.9: major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

}  // namespace chainermn::nccl
