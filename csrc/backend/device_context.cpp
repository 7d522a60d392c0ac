#include "backend/device_context.h"

#include <c10/util/Exception.h>

#ifdef CHAINERMN_WITH_CUDA
#include "comm/nccl.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>
#endif

namespace chainermn {

#ifndef CHAINERMN_WITH_CUDA

bool cudaBuilt() {
  return false;
}

std::string ncclVersion() {
  return "";
}

std::shared_ptr<void> markCallerStream(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu(), "chainermn: this build handles CPU tensors only");
  return nullptr;
}

DeviceContext& enterCuda(
    std::unique_ptr<DeviceContext>&, Strategy&, const CudaTransportsBuilder&, at::Device device, const std::shared_ptr<void>&) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only, got one on ", device);
}

void keepUntilDone(DeviceContext&, const std::vector<at::Tensor>&) {}

RequestPtr markDeviceEnd(DeviceContext&) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only");
}

#else

namespace {

// Events are reused: creating one per operation would be a driver call (and an allocation) on the
// hot path. An event belongs to the device that was current when it was created, hence one free list
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

// A mark on the caller's stream: a pooled event recorded there (ATen's CUDAEvent would pull in
// cuBLAS/cuSPARSE headers). Re-recording a pooled event is safe once this mark is gone: the group's
// stream has already been made to wait on it (cudaStreamWaitEvent captures the event's state then).
struct CallerEvent {
  CallerEvent(c10::DeviceIndex device, cudaStream_t stream)
      : device(device), event(EventPool::instance().acquire(device)) {
    C10_CUDA_CHECK(cudaEventRecord(event, stream));
  }
  ~CallerEvent() {
    EventPool::instance().release(device, event);
  }
  CallerEvent(const CallerEvent&) = delete;
  CallerEvent& operator=(const CallerEvent&) = delete;
  c10::DeviceIndex device;
  cudaEvent_t event = nullptr;
};

// The end of an op's kernels on the group's stream: a pooled event recorded there after them.
class DeviceEnd : public Request {
 public:
  DeviceEnd(c10::DeviceIndex device, cudaStream_t stream)
      : device_(device), event_(EventPool::instance().acquire(device)) {
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~DeviceEnd() override {
    EventPool::instance().release(device_, event_);
  }
  bool test() override {
    const cudaError_t state = cudaEventQuery(event_);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: cleared so that later checks do not see it
      return false;
    }
    C10_CUDA_CHECK(state);  // a sticky error: the context is lost
    return true;
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_;
};

struct CudaContext : DeviceContext {
  CudaContext(Strategy& strategy, at::Device device, c10::cuda::CUDAStream stream)
      : DeviceContext(strategy, device), stream(stream) {}
  c10::cuda::CUDAStream stream;
};

} // namespace

bool cudaBuilt() {
  return true;
}

std::string ncclVersion() {
  return nccl::version();
}

std::shared_ptr<void> markCallerStream(const at::Tensor& tensor) {
  if (!tensor.device().is_cuda()) {
    return nullptr;
  }
  const c10::DeviceIndex device = tensor.device().index();
  return std::make_shared<CallerEvent>(device, c10::cuda::getCurrentCUDAStream(device).stream());
}

DeviceContext& enterCuda(
    std::unique_ptr<DeviceContext>& slot,
    Strategy& strategy,
    const CudaTransportsBuilder& build,
    at::Device device,
    const std::shared_ptr<void>& callerMark) {
  const c10::DeviceIndex index = device.index();
  c10::cuda::set_device(index);
  if (!slot) {
    auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
    auto context = std::make_unique<CudaContext>(strategy, device, stream);
    context->transports = build(index, stream.stream());
    slot = std::move(context);
  }
  auto& context = static_cast<CudaContext&>(*slot);
  TORCH_CHECK(
      context.scratch.device() == device,
      "chainermn: the group works on ", context.scratch.device(), " and cannot also use ", device);
  c10::cuda::setCurrentCUDAStream(context.stream);
  if (callerMark) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(context.stream.stream(), static_cast<CallerEvent*>(callerMark.get())->event, 0));
  }
  return context;
}

RequestPtr markDeviceEnd(DeviceContext& context) {
  auto& cuda = static_cast<CudaContext&>(context);
  return std::make_unique<DeviceEnd>(cuda.stream.device_index(), cuda.stream.stream());
}

void keepUntilDone(DeviceContext& context, const std::vector<at::Tensor>& tensors) {
  auto& cuda = static_cast<CudaContext&>(context);
  for (const auto& tensor : tensors) {
    if (tensor.defined() && tensor.is_cuda() && tensor.storage().data_ptr()) {
      c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), cuda.stream);
    }
  }
}

#endif

} // namespace chainermn
