#include "comm/nccl.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

namespace chainermn::nccl {
namespace {

ncclDataType_t toNccl(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return ncclUint8;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Long:
      return ncclInt64;
    default:
      TORCH_CHECK(false, "chainermn: NCCL cannot carry dtype ", dtype);
  }
}

ncclRedOp_t toNccl(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum:
      return ncclSum;
    case ReduceKind::Product:
      return ncclProd;
    case ReduceKind::Min:
      return ncclMin;
    case ReduceKind::Max:
      return ncclMax;
    default:
      // Validation refuses bitwise reductions of CUDA tensors before anything is queued.
      TORCH_CHECK(false, "chainermn: NCCL has no ", reduceKindName(op), " reduction");
  }
}

class NcclRequest : public Request {
 public:
  NcclRequest(cudaStream_t stream, int source) : source_(source) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~NcclRequest() override {
    cudaEventDestroy(event_);
  }
  bool test() override {
    const cudaError_t state = cudaEventQuery(event_);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    C10_CUDA_CHECK(state);
    return true;
  }
  int source() const override {
    return source_;
  }

 private:
  cudaEvent_t event_ = nullptr;
  int source_;
};

class NcclTransport : public Transport {
 public:
  NcclTransport(ncclComm_t comm, int rank, int size, c10::DeviceIndex device, cudaStream_t stream)
      : comm_(comm), rank_(rank), size_(size), device_(device), stream_(stream) {}

  ~NcclTransport() override {
    // At process exit the driver may be gone; a communicator left with work in flight (after a
    // timeout) is aborted rather than destroyed, which could wait for that work.
    if (!aborted_.load()) {
      ncclCommAbort(comm_);
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
    Call call(*this, "allreduce");
    call.check(-1, ncclAllReduce(buf, buf, count, toNccl(dtype), toNccl(op), call.comm, stream_));
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    Call call(*this, "broadcast");
    call.check(root, ncclBroadcast(buf, buf, count, toNccl(dtype), root, call.comm, stream_));
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    Call call(*this, "reduce");
    call.check(root, ncclReduce(send, recv, count, toNccl(dtype), toNccl(op), root, call.comm, stream_));
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    Call call(*this, "allgather");
    call.check(-1, ncclAllGather(send, recv, count, toNccl(dtype), call.comm, stream_));
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = count * c10::elementSize(dtype);
    const auto type = toNccl(dtype);
    Call call(*this, "gather");
    call.check(root, ncclGroupStart());
    if (rank_ == root) {
      for (int peer = 0; peer < size_; ++peer) {
        call.check(peer, ncclRecv(static_cast<char*>(recv) + peer * bytes, count, type, peer, call.comm, stream_));
      }
    }
    call.check(root, ncclSend(send, count, type, root, call.comm, stream_));
    call.check(root, ncclGroupEnd());
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = count * c10::elementSize(dtype);
    const auto type = toNccl(dtype);
    Call call(*this, "scatter");
    call.check(root, ncclGroupStart());
    if (rank_ == root) {
      for (int peer = 0; peer < size_; ++peer) {
        call.check(peer, ncclSend(static_cast<const char*>(send) + peer * bytes, count, type, peer, call.comm, stream_));
      }
    }
    call.check(root, ncclRecv(recv, count, type, root, call.comm, stream_));
    call.check(root, ncclGroupEnd());
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    Call call(*this, "reduce_scatter");
    call.check(-1, ncclReduceScatter(send, recv, count, toNccl(dtype), toNccl(op), call.comm, stream_));
  }

  void alltoallv(
      const void* send,
      const std::vector<int64_t>& sendCounts,
      void* recv,
      const std::vector<int64_t>& recvCounts,
      c10::ScalarType dtype) override {
    const size_t width = c10::elementSize(dtype);
    const auto type = toNccl(dtype);
    Call call(*this, "alltoall");
    call.check(-1, ncclGroupStart());
    size_t sendAt = 0, recvAt = 0;
    for (int peer = 0; peer < size_; ++peer) {
      call.check(peer, ncclSend(static_cast<const char*>(send) + sendAt, sendCounts[peer], type, peer, call.comm, stream_));
      call.check(peer, ncclRecv(static_cast<char*>(recv) + recvAt, recvCounts[peer], type, peer, call.comm, stream_));
      sendAt += sendCounts[peer] * width;
      recvAt += recvCounts[peer] * width;
    }
    call.check(-1, ncclGroupEnd());
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    {
      Call call(*this, "send");
      call.check(peer, ncclSend(buf, count, toNccl(dtype), peer, call.comm, stream_));
    }
    return std::make_unique<NcclRequest>(stream_, -1);
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    TORCH_CHECK(peer != kAnySource, "chainermn: NCCL cannot receive from any source");
    {
      Call call(*this, "recv");
      call.check(peer, ncclRecv(buf, count, toNccl(dtype), peer, call.comm, stream_));
    }
    return std::make_unique<NcclRequest>(stream_, peer);
  }

  RequestPtr startAll(const std::vector<Transfer>& transfers) override {
    {
      Call call(*this, "batch_isend_irecv");
      call.check(-1, ncclGroupStart());
      for (const auto& t : transfers) {
        TORCH_CHECK(t.peer != kAnySource, "chainermn: NCCL cannot receive from any source");
        call.check(t.peer, t.send ? ncclSend(t.buf, t.count, toNccl(t.dtype), t.peer, call.comm, stream_)
                                  : ncclRecv(t.buf, t.count, toNccl(t.dtype), t.peer, call.comm, stream_));
      }
      call.check(-1, ncclGroupEnd());
    }
    return std::make_unique<NcclRequest>(stream_, -1);
  }

  void barrier() override {
    {
      Call call(*this, "barrier");
      if (!token_) {
        C10_CUDA_CHECK(cudaMalloc(&token_, sizeof(int32_t)));
        C10_CUDA_CHECK(cudaMemsetAsync(token_, 0, sizeof(int32_t), stream_));
      }
      call.check(-1, ncclAllReduce(token_, token_, 1, ncclInt32, ncclSum, call.comm, stream_));
    }
    // Outside the call: if a peer never comes, the watchdog's abort() ends the kernel and this returns.
    C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  std::string asyncError() override {
    if (aborted_.load()) {
      return "";  // the group already failed: whoever aborted said why
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
    // Let a call being enqueued finish with the communicator before it is freed. A call that does
    // not return in time is blocked on a peer (connecting to a dead one): the abort is what ends it,
    // as with torch's NCCL watchdog, so it goes ahead under that call.
    std::unique_lock<std::timed_mutex> lock(mutex_, std::defer_lock);
    (void)lock.try_lock_for(kAbortWait);
    aborted_.store(true);
    ncclCommAbort(comm_);
  }

 private:
  static constexpr auto kAbortWait = std::chrono::seconds(2);

  static std::string describe(ncclResult_t result, ncclComm_t comm) {
    const char* detail = ncclGetLastError(comm);
    return std::string(ncclGetErrorString(result)) + (detail && *detail ? std::string(" (") + detail + ")" : "");
  }

  // One Transport call: holds the communicator (abort() waits for the call), refuses one that was
  // aborted, and turns NCCL's result codes into errors naming the op, the rank and the peer.
  class Call {
   public:
    Call(NcclTransport& transport, const char* op) : transport_(transport), op_(op), lock_(transport.mutex_) {
      TORCH_CHECK(
          !transport.aborted_.load(),
          "NCCL ", op, " on rank ", transport.rank_, " of ", transport.size_,
          ": the communicator was aborted after an earlier failure of this group");
      comm = transport.comm_;
    }
    void check(int peer, ncclResult_t result) const {
      if (result == ncclSuccess || result == ncclInProgress) {
        return;
      }
      TORCH_CHECK(
          false,
          "NCCL ",
          op_,
          " failed on rank ",
          transport_.rank_,
          " of ",
          transport_.size_,
          peer >= 0 ? " (peer/root " + std::to_string(peer) + ")" : std::string(),
          ": ",
          describe(result, comm));
    }
    ncclComm_t comm = nullptr;

   private:
    NcclTransport& transport_;
    const char* op_;
    std::unique_lock<std::timed_mutex> lock_;
  };

  ncclComm_t comm_;
  const int rank_;
  const int size_;
  const c10::DeviceIndex device_;
  cudaStream_t stream_;
  void* token_ = nullptr;  // barrier's one int (never freed: it may be in use at teardown)
  std::timed_mutex mutex_;  // held by each Call; abort() frees the communicator under it
  std::atomic<bool> abortStarted_{false};
  std::atomic<bool> aborted_{false};  // set under mutex_ (or after abort's wait); Calls check it
};

} // namespace

TransportPtr createTransport(
    c10d::Store& store,
    const std::string& key,
    int rank,
    int size,
    c10::DeviceIndex device,
    void* stream) {
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
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRank(&comm, size, id, rank);
  TORCH_CHECK(
      result == ncclSuccess,
      "NCCL ncclCommInitRank failed for ",
      key,
      " on rank ",
      rank,
      " of ",
      size,
      " (cuda:",
      static_cast<int>(device),
      "): ",
      ncclGetErrorString(result),
      " ",
      ncclGetLastError(nullptr),
      ". Several ranks on one GPU need a distinct NCCL_HOSTID each (with NCCL_SOCKET_IFNAME=lo, "
      "NCCL_IB_DISABLE=1), or CHAINERMN_CUDA_TRANSPORT=staged");
  return std::make_shared<NcclTransport>(comm, rank, size, device, static_cast<cudaStream_t>(stream));
}

std::string version() {
  int code = 0;
  ncclGetVersion(&code);
  // NCCL >= 2.9: major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

} // namespace chainermn::nccl
