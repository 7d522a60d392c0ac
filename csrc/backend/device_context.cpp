#include "backend/device_context.h"

#include <c10/util/Exception.h>

#ifdef CHAINERMN_WITH_CUDA
#include "cuda/nccl.h"
#include "cuda/device.h"
#include "cuda/device_transports.h"
#include "cuda/pack_kernels.h"
#endif

namespace chainermn {

#ifndef CHAINERMN_WITH_CUDA

bool cudaBuilt() {
  return false;
}

CudaTransportsBuilder cudaTransportsBuilder(const GroupSetup&, const CudaPlan&, const TransportSet&,
                                            std::shared_ptr<WatchedTransports>) {
  return nullptr;
}

std::string ncclVersion() {
  return "";
}

std::shared_ptr<void> markCallerStream(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu(), "chainermn: this build handles CPU tensors only");
  return nullptr;
}

std::unique_ptr<DeviceScope> enterCuda(std::unique_ptr<DeviceContext>&, Strategy&, const CudaTransportsBuilder&,
                                       at::Device device, const std::shared_ptr<void>&) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only, got one on ", device);
}

void keepUntilDone(DeviceContext&, const std::vector<at::Tensor>&) {}

RequestPtr markDeviceEnd(DeviceContext&) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only");
}

std::unique_lock<std::mutex> lockDeviceLaunches(at::Device device) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only, got one on ", device);
}

void synchronizeCurrentStream(at::Device device) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only, got one on ", device);
}

std::unique_ptr<Mover> moverFor(at::Device device) {
  TORCH_CHECK(device.is_cpu(), "chainermn: this build handles CPU tensors only, got one on ", device);
  return cpuMover();
}

#else

namespace {

struct CudaContext : DeviceContext {
  CudaContext(Strategy& strategy, at::Device device, c10::cuda::CUDAStream stream)
      : DeviceContext(strategy, device, cuda::makeMover(device)), stream(stream) {}
  c10::cuda::CUDAStream stream;
};

struct CudaScope : DeviceScope {
  CudaScope(const c10::cuda::CUDAStream& stream, const cuda::StreamMark* after) : on(stream, after) {}
  cuda::OnStream on;
};

}  // namespace

bool cudaBuilt() {
  return true;
}

CudaTransportsBuilder cudaTransportsBuilder(const GroupSetup& setup, const CudaPlan& plan, const TransportSet& host,
                                            std::shared_ptr<WatchedTransports> watched) {
  // Not the host factory, which may hold Python objects.
  return [store = setup.store, topology = setup.topology, timeout = setup.timeout, carriers = plan.carriers, host,
          watched](c10::DeviceIndex device, void* stream) {
    TransportSet set = cuda::buildTransports(*store, topology, timeout, carriers, host, device, stream);
    watched->watch(set);
    return set;
  };
}

std::string ncclVersion() {
  return nccl::version();
}

std::shared_ptr<void> markCallerStream(const at::Tensor& tensor) {
  if (!tensor.device().is_cuda()) {
    return nullptr;
  }
  return cuda::markCurrentStream(tensor.device().index());
}

std::unique_ptr<DeviceScope> enterCuda(std::unique_ptr<DeviceContext>& slot, Strategy& strategy,
                                       const CudaTransportsBuilder& build, at::Device device,
                                       const std::shared_ptr<void>& callerMark) {
  const c10::DeviceIndex index = device.index();
  if (!slot) {
    c10::cuda::CUDAGuard guard(index);
    auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
    auto context = std::make_unique<CudaContext>(strategy, device, stream);
    context->transports = build(index, stream.stream());
    slot = std::move(context);
  }
  auto& context = static_cast<CudaContext&>(*slot);
  TORCH_CHECK(context.scratch.device() == device, "chainermn: the group works on ", context.scratch.device(),
              " and cannot also use ", device);
  return std::make_unique<CudaScope>(context.stream, static_cast<const cuda::StreamMark*>(callerMark.get()));
}

RequestPtr markDeviceEnd(DeviceContext& context) {
  return cuda::markEnd(static_cast<CudaContext&>(context).stream);
}

void keepUntilDone(DeviceContext& context, const std::vector<at::Tensor>& tensors) {
  cuda::recordUse(tensors, static_cast<CudaContext&>(context).stream);
}

std::unique_lock<std::mutex> lockDeviceLaunches(at::Device device) {
  return std::unique_lock<std::mutex>(cuda::launchLock(device.index()));
}

void synchronizeCurrentStream(at::Device device) {
  c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
}

std::unique_ptr<Mover> moverFor(at::Device device) {
  return device.is_cpu() ? cpuMover() : cuda::makeMover(device);
}

#endif

}  // namespace chainermn
