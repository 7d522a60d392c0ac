#include "comm/staged.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <numeric>

namespace chainermn::staged {
namespace {

// One pinned host buffer that only grows.
class Pinned {
 public:
  ~Pinned() {
    if (data_) {
      cudaFreeHost(data_);
    }
  }
  // `stream` may still copy out of the old buffer: it is waited for before that buffer is freed.
  void* get(size_t bytes, cudaStream_t stream) {
    if (bytes > capacity_) {
      if (data_) {
        C10_CUDA_CHECK(cudaStreamSynchronize(stream));
        C10_CUDA_CHECK(cudaFreeHost(data_));
        data_ = nullptr;
      }
      const size_t capacity = std::max<size_t>({bytes, capacity_ + capacity_ / 2, 4096});
      C10_CUDA_CHECK(cudaMallocHost(&data_, capacity));
      capacity_ = capacity;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

class StagedTransport : public Transport {
 public:
  StagedTransport(TransportPtr host, c10::DeviceIndex device, cudaStream_t stream)
      : host_(std::move(host)), device_(device), stream_(stream) {}

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
    void* staged = in_.get(bytes, stream_);
    toHost(staged, buf, bytes);
    host_->allreduce(staged, count, dtype, op);
    toDevice(buf, staged, bytes);
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* staged = in_.get(bytes, stream_);
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
    void* stagedSend = in_.get(bytes, stream_);
    void* stagedRecv = out_.get(bytes, stream_);
    toHost(stagedSend, send, bytes);
    host_->reduce(stagedSend, stagedRecv, count, dtype, op, root);
    if (rank() == root) {
      toDevice(recv, stagedRecv, bytes);
    }
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes, stream_);
    void* stagedRecv = out_.get(bytes * size(), stream_);
    toHost(stagedSend, send, bytes);
    host_->allgather(stagedSend, stagedRecv, count, dtype);
    toDevice(recv, stagedRecv, bytes * size());
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes, stream_);
    void* stagedRecv = rank() == root ? out_.get(bytes * size(), stream_) : nullptr;
    toHost(stagedSend, send, bytes);
    host_->gather(stagedSend, stagedRecv, count, dtype, root);
    if (rank() == root) {
      toDevice(recv, stagedRecv, bytes * size());
    }
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = nullptr;
    void* stagedRecv = out_.get(bytes, stream_);
    if (rank() == root) {
      stagedSend = in_.get(bytes * size(), stream_);
      toHost(stagedSend, send, bytes * size());
    } else {
      settle();
    }
    host_->scatter(stagedSend, stagedRecv, count, dtype, root);
    toDevice(recv, stagedRecv, bytes);
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    const size_t bytes = bytesOf(count, dtype);
    void* stagedSend = in_.get(bytes * size(), stream_);
    void* stagedRecv = out_.get(bytes, stream_);
    toHost(stagedSend, send, bytes * size());
    host_->reduceScatter(stagedSend, stagedRecv, count, dtype, op);
    toDevice(recv, stagedRecv, bytes);
  }

  void alltoallv(
      const void* send,
      const std::vector<int64_t>& sendCounts,
      void* recv,
      const std::vector<int64_t>& recvCounts,
      c10::ScalarType dtype) override {
    const size_t sendBytes = bytesOf(std::accumulate(sendCounts.begin(), sendCounts.end(), int64_t{0}), dtype);
    const size_t recvBytes = bytesOf(std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0}), dtype);
    void* stagedSend = in_.get(sendBytes, stream_);
    void* stagedRecv = out_.get(recvBytes, stream_);
    toHost(stagedSend, send, sendBytes);
    host_->alltoallv(stagedSend, sendCounts, stagedRecv, recvCounts, dtype);
    toDevice(recv, stagedRecv, recvBytes);
  }

  RequestPtr send(const void*, int64_t, c10::ScalarType, int peer, int) override {
    TORCH_CHECK(false, "chainermn: point-to-point on CUDA tensors over staged ", library(), " is not supported");
  }
  RequestPtr recv(void*, int64_t, c10::ScalarType, int peer, int) override {
    TORCH_CHECK(false, "chainermn: point-to-point on CUDA tensors over staged ", library(), " is not supported");
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
};

} // namespace

TransportPtr createTransport(TransportPtr host, c10::DeviceIndex device, void* stream) {
  return std::make_shared<StagedTransport>(std::move(host), device, static_cast<cudaStream_t>(stream));
}

} // namespace chainermn::staged
