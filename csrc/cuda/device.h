// The CUDA device unit: the group's streams, the pooled events that mark points on them, the ends
// of queued work the watchdog polls, the tensors' protection from the caching allocator, and the
// order NCCL submissions keep on a device. Everything here follows ProcessGroupNCCL and NCCL's rules:
//   - every CUDA call runs under a guard for the tensor's device (8 GPUs per node is the norm);
//   - a thread that polls events (the watchdog) sets its device first and uses thread-local capture
//     mode, so that it neither creates a context on GPU 0 nor breaks another thread's graph capture;
//   - NCCL calls for one device are submitted from one thread at a time, in program order.
// CUDA builds only (csrc/cuda/); backend/device_context.cpp is its one user outside csrc/cuda/.
#pragma once

#include "comm/transport.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

namespace chainermn::cuda {

// Held while a thread submits a device's NCCL work: one submitter at a time per device, process wide
// (NCCL forbids concurrent calls to communicators of one device from several threads).
std::mutex& launchLock(c10::DeviceIndex device);

// A point on a stream: a pooled event recorded there (creating an event per op would be a driver call
// on the hot path). Released to the pool with the mark: a stream that waited on it has captured it.
class StreamMark {
 public:
  StreamMark(c10::DeviceIndex device, cudaStream_t stream);
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;
  cudaEvent_t event() const {
    return event_;
  }
  // Whether the stream has passed the mark. Safe on any thread (device guard, thread-local capture
  // mode); throws on a sticky CUDA error (the context is lost).
  bool reached() const;

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_;
};

// The caller's current stream on `device`, marked now.
std::unique_ptr<StreamMark> markCurrentStream(c10::DeviceIndex device);

// The end of everything queued on `stream` so far, as a Request the watchdog polls.
RequestPtr markEnd(const c10::cuda::CUDAStream& stream);

// While alive, this thread works on `stream`'s device with `stream` as its current stream (the
// caching allocator, the pack kernels and Future::markCompleted all use the current stream), and
// `stream` is ordered after `after` when given. Restores the thread's device and stream.
class OnStream {
 public:
  OnStream(const c10::cuda::CUDAStream& stream, const StreamMark* after);

 private:
  c10::cuda::CUDAGuard device_;
  c10::cuda::CUDAStreamGuard stream_;
};

// The tensors' memory is in use by `stream` until the work queued there so far is done: the caching
// allocator will not hand it out earlier even if the caller drops the tensors (recordStream).
void recordUse(const std::vector<at::Tensor>& tensors, const c10::cuda::CUDAStream& stream);

// Pinned host memory from torch's caching host allocator, never cudaMallocHost/cudaFreeHost (nor
// device memory from cudaMalloc/cudaFree: the caching allocator serves it): cudaFree and
// cudaFreeHost synchronize the whole device, so on a thread of ours they would wait for every
// kernel of every process group, one of which can be an NCCL kernel of another group waiting for a
// peer that waits for this process: a deadlock. ProcessGroupNCCL takes its memory from torch's
// allocators for the same reason. The block is marked as used by `stream` (markUsedBy): once
// released, the allocator records an event there and hands the block out again only after the
// stream has passed it, so a copy still queued out of or into it never touches reused memory, and
// releasing it never waits.
at::Tensor pinnedFor(size_t bytes, const c10::cuda::CUDAStream& stream);
void markUsedBy(const at::Tensor& pinned, const c10::cuda::CUDAStream& stream);

}  // namespace chainermn::cuda
