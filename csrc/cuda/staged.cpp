#include "cuda/staged.h"

#include "cuda/device.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>

namespace chainermn::staged {
namespace {

using cuda::pinnedFor;

// One pinned host buffer that only grows.
class Pinned {
 public:
  explicit Pinned(c10::cuda::CUDAStream stream) : stream_(stream) {}

  void* get(size_t bytes) {
    const size_t current = buffer_.defined() ? buffer_.nbytes() : 0;
    if (bytes > current) {
      // The old buffer is dropped without waiting for the stream, though the last toDevice copy
      // out of it may still be queued: the host allocator keeps it until the stream is past it.
      buffer_ = pinnedFor(std::max<size_t>({bytes, current + current / 2, 4096}), stream_);
    }
    return buffer_.defined() ? buffer_.data_ptr() : nullptr;  // none yet when only 0 bytes were asked
  }

 private:
  const c10::cuda::CUDAStream stream_;  // every copy out of or into the buffer is on it
  at::Tensor buffer_;
};

// Pinned buffers for transfers in flight, several at a time (a send and a receive overlap): each
// transfer takes one at least its size and gives it back when over, so buffers are reused, not
// allocated per call. Shared with the requests, which may outlive their transport (the stream is
// one of torch's pool streams, which live as long as the process).
class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  class Lease {
   public:
    Lease(std::shared_ptr<PinnedPool> pool, at::Tensor buffer) : pool_(std::move(pool)), buffer_(std::move(buffer)) {}
    ~Lease() {
      pool_->giveBack(std::move(buffer_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    void* data() const {
      return buffer_.data_ptr();
    }

   private:
    std::shared_ptr<PinnedPool> pool_;
    at::Tensor buffer_;
  };

  explicit PinnedPool(c10::cuda::CUDAStream stream) : stream_(stream) {}

  std::unique_ptr<Lease> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto fit = free_.lower_bound(bytes);  // the smallest that holds it
      if (fit != free_.end()) {
        auto lease = std::make_unique<Lease>(shared_from_this(), std::move(fit->second));
        free_.erase(fit);
        return lease;
      }
    }
    return std::make_unique<Lease>(shared_from_this(), pinnedFor(std::max<size_t>(bytes, 4096), stream_));
  }

 private:
  // A buffer comes back once its transfer is over, copies included (StagedRequest::test waits for
  // a receive's copy to the device), so the next transfer may use it at once.
  void giveBack(at::Tensor buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t capacity = buffer.nbytes();
    free_.emplace(capacity, std::move(buffer));
  }

  const c10::cuda::CUDAStream stream_;
  std::mutex mutex_;
  std::multimap<size_t, at::Tensor> free_;  // capacity -> buffer
};

// A send staged through pinned memory: the data is already on the host; the host transfer remains.
// A receive: the host transfer, then the copy to the device (waited for, so the pinned buffer can
// go back to the pool at once).
class StagedRequest : public Request {
 public:
  StagedRequest(RequestPtr host, std::unique_ptr<PinnedPool::Lease> staged, void* device, size_t bytes,
                cudaStream_t stream)
      : host_(std::move(host)), staged_(std::move(staged)), device_(device), bytes_(bytes), stream_(stream) {}

  bool test() override {
    if (!staged_) {
      return true;
    }
    if (!host_->test()) {
      return false;
    }
    if (device_ != nullptr && bytes_ > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(device_, staged_->data(), bytes_, cudaMemcpyHostToDevice, stream_));
      C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    staged_.reset();
    return true;
  }
  int source() const override {
    return host_->source();
  }
  bool wakeWhenReady(std::function<void()> wake) override {
    return host_->wakeWhenReady(std::move(wake));
  }

 private:
  RequestPtr host_;
  std::unique_ptr<PinnedPool::Lease> staged_;  // null once over
  void* device_;                               // a receive's destination; null for a send
  size_t bytes_;
  cudaStream_t stream_;
};

class StagedTransport : public Transport {
 public:
  StagedTransport(TransportPtr host, c10::DeviceIndex device, cudaStream_t stream)
      : host_(std::move(host)),
        device_(device),
        stream_(stream),
        in_(c10::cuda::getStreamFromExternal(stream, device)),
        out_(c10::cuda::getStreamFromExternal(stream, device)),
        transfers_(std::make_shared<PinnedPool>(c10::cuda::getStreamFromExternal(stream, device))) {}

  int rank() const override {
    return host_->rank();
  }
  int size() const override {
    return host_->size();
  }
  const char* library() const override {
    return host_->library();
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    const size_t bytes = bytesOf(count, dtype);
    void* staged = in_.get(bytes);
    toHost(staged, buf, bytes);
    host_->allreduce(staged, count, dtype, op);
    toDevice(buf, staged, bytes);
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* staged = in_.get(bytes);
    if (rank() == root) {
      toHost(staged, buf, bytes);
    } else {
      settle();
    }
    host_->broadcast(staged, count, dtype, root);
    if (rank() != root) {
      toDevice(buf, staged, bytes);
    }
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes);
    void* stagedRecv = out_.get(bytes);
    toHost(stagedSend, send, bytes);
    host_->reduce(stagedSend, stagedRecv, count, dtype, op, root);
    if (rank() == root) {
      toDevice(recv, stagedRecv, bytes);
    }
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes);
    void* stagedRecv = out_.get(bytes * size());
    toHost(stagedSend, send, bytes);
    host_->allgather(stagedSend, stagedRecv, count, dtype);
    toDevice(recv, stagedRecv, bytes * size());
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes);
    void* stagedRecv = rank() == root ? out_.get(bytes * size()) : nullptr;
    toHost(stagedSend, send, bytes);
    host_->gather(stagedSend, stagedRecv, count, dtype, root);
    if (rank() == root) {
      toDevice(recv, stagedRecv, bytes * size());
    }
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = nullptr;
    void* stagedRecv = out_.get(bytes);
    if (rank() == root) {
      stagedSend = in_.get(bytes * size());
      toHost(stagedSend, send, bytes * size());
    } else {
      settle();
    }
    host_->scatter(stagedSend, stagedRecv, count, dtype, root);
    toDevice(recv, stagedRecv, bytes);
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes * size());
    void* stagedRecv = out_.get(bytes);
    toHost(stagedSend, send, bytes * size());
    host_->reduceScatter(stagedSend, stagedRecv, count, dtype, op);
    toDevice(recv, stagedRecv, bytes);
  }

  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    const size_t sendBytes = bytesOf(std::accumulate(sendCounts.begin(), sendCounts.end(), int64_t{0}), dtype);
    const size_t recvBytes = bytesOf(std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0}), dtype);
    void* stagedSend = in_.get(sendBytes);
    void* stagedRecv = out_.get(recvBytes);
    toHost(stagedSend, send, sendBytes);
    host_->alltoallv(stagedSend, sendCounts, stagedRecv, recvCounts, dtype);
    toDevice(recv, stagedRecv, recvBytes);
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    const size_t bytes = bytesOf(count, dtype);
    auto staged = transfers_->take(bytes);
    toHost(staged->data(), buf, bytes);
    RequestPtr host = host_->send(staged->data(), count, dtype, peer, tag);
    return std::make_unique<StagedRequest>(std::move(host), std::move(staged), nullptr, bytes, stream_);
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    const size_t bytes = bytesOf(count, dtype);
    auto staged = transfers_->take(bytes);
    RequestPtr host = host_->recv(staged->data(), count, dtype, peer, tag);
    return std::make_unique<StagedRequest>(std::move(host), std::move(staged), buf, bytes, stream_);
  }

  void barrier() override {
    settle();
    host_->barrier();
  }

 private:
  static size_t bytesOf(int64_t count, c10::ScalarType dtype) {
    return static_cast<size_t>(count) * c10::elementSize(dtype);
  }
  // Everything queued on the stream (the producer of `buf`, and the last copy out of the pinned
  // buffers) is done.
  void settle() {
    C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void toHost(void* staged, const void* device, size_t bytes) {
    C10_CUDA_CHECK(cudaMemcpyAsync(staged, device, bytes, cudaMemcpyDeviceToHost, stream_));
    settle();
  }
  void toDevice(void* device, const void* staged, size_t bytes) {
    // Ordered on the stream; the next call settles the stream before it touches the pinned buffer.
    C10_CUDA_CHECK(cudaMemcpyAsync(device, staged, bytes, cudaMemcpyHostToDevice, stream_));
  }

  TransportPtr host_;
  const c10::DeviceIndex device_;
  cudaStream_t stream_;
  Pinned in_;
  Pinned out_;
  std::shared_ptr<PinnedPool> transfers_;  // point to point's buffers
};

}  // namespace

TransportPtr createTransport(TransportPtr host, c10::DeviceIndex device, void* stream) {
  return std::make_shared<StagedTransport>(std::move(host), device, static_cast<cudaStream_t>(stream));
}

}  // namespace chainermn::staged
