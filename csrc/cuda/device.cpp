#include "cuda/device.h"

// torch's header pads its locks with std::hardware_destructive_interference_size, which GCC 12+
// warns about in every includer; the value is torch's business, not ours.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#endif
#include <ATen/core/CachingHostAllocator.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic pop
#endif
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <unordered_map>

namespace chainermn::cuda {

namespace {

// Events are reused. An event belongs to the device current when it was created, hence a free list
// per device. Never destroyed: at process exit the driver may already be gone.
class EventPool {
 public:
  cudaEvent_t acquire(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[device];
      if (!free.empty()) {
        cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    c10::cuda::CUDAGuard guard(device);
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }

  void release(c10::DeviceIndex device, cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[device].push_back(event);
  }

  static EventPool& instance() {
    static auto* pool = new EventPool();
    return *pool;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<c10::DeviceIndex, std::vector<cudaEvent_t>> free_;
};

class EndOfStream : public Request {
 public:
  EndOfStream(c10::DeviceIndex device, cudaStream_t stream) : mark_(device, stream) {}
  bool test() override {
    return mark_.reached();
  }

 private:
  StreamMark mark_;
};

}  // namespace

std::mutex& launchLock(c10::DeviceIndex device) {
  static std::mutex guard;
  static auto* locks = new std::unordered_map<c10::DeviceIndex, std::unique_ptr<std::mutex>>();
  std::lock_guard<std::mutex> lock(guard);
  auto& slot = (*locks)[device];
  if (!slot) {
    slot = std::make_unique<std::mutex>();
  }
  return *slot;
}

StreamMark::StreamMark(c10::DeviceIndex device, cudaStream_t stream)
    : device_(device), event_(EventPool::instance().acquire(device)) {
  c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaEventRecord(event_, stream));
}

StreamMark::~StreamMark() {
  EventPool::instance().release(device_, event_);
}

bool StreamMark::reached() const {
  c10::cuda::CUDAGuard guard(device_);
  // A query from the watchdog must not invalidate a graph being captured on another thread.
  c10::cuda::CUDAStreamCaptureModeGuard capture(cudaStreamCaptureModeThreadLocal);
  const cudaError_t state = cudaEventQuery(event_);
  if (state == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: cleared so that later checks do not see it
    return false;
  }
  C10_CUDA_CHECK(state);
  return true;
}

std::unique_ptr<StreamMark> markCurrentStream(c10::DeviceIndex device) {
  return std::make_unique<StreamMark>(device, c10::cuda::getCurrentCUDAStream(device).stream());
}

RequestPtr markEnd(const c10::cuda::CUDAStream& stream) {
  return std::make_unique<EndOfStream>(stream.device_index(), stream.stream());
}

OnStream::OnStream(const c10::cuda::CUDAStream& stream, const StreamMark* after)
    : device_(stream.device_index()), stream_(stream) {
  if (after != nullptr) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), after->event(), 0));
  }
}

void recordUse(const std::vector<at::Tensor>& tensors, const c10::cuda::CUDAStream& stream) {
  for (const auto& tensor : tensors) {
    if (tensor.defined() && tensor.is_cuda() && tensor.storage().data_ptr()) {
      c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream);
    }
  }
}

void markUsedBy(const at::Tensor& pinned, const c10::cuda::CUDAStream& stream) {
  const bool recorded = at::getHostAllocator(at::kCUDA)->record_event(
      pinned.data_ptr(), pinned.storage().data_ptr().get_context(), stream.unwrap());
  TORCH_CHECK(recorded, "chainermn: pinned memory that torch's CUDA host allocator does not know");
}

at::Tensor pinnedFor(size_t bytes, const c10::cuda::CUDAStream& stream) {
  at::Tensor pinned =
      at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  markUsedBy(pinned, stream);
  return pinned;
}

}  // namespace chainermn::cuda
