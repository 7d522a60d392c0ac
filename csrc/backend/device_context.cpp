#include "backend/device_context.h"

#include <c10/util/Exception.h>

#ifdef CHAINERMN_WITH_CUDA
#include "comm/nccl.h"
#include "comm/staged.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#endif

namespace chainermn {

const std::vector<std::string>& cudaTransports() {
  static const std::vector<std::string> names{"nccl", "nccl_intra", "staged"};
  return names;
}

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
    std::unique_ptr<DeviceContext>&, const CudaSetup&, const CommunicatorSet&, at::Device device, const std::shared_ptr<void>&) {
  TORCH_CHECK(false, "chainermn: this build handles CPU tensors only, got one on ", device);
}

void keepUntilDone(DeviceContext&, const std::vector<at::Tensor>&) {}

#else

namespace {

// An event on the caller's stream (ATen's CUDAEvent would pull in cuBLAS/cuSPARSE headers).
// TODO: pool these; one cudaEventCreate per CUDA op is cheap but not free.
struct CallerEvent {
  explicit CallerEvent(cudaStream_t stream) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event, stream));
  }
  ~CallerEvent() {
    cudaEventDestroy(event);
  }
  CallerEvent(const CallerEvent&) = delete;
  CallerEvent& operator=(const CallerEvent&) = delete;
  cudaEvent_t event = nullptr;
};

struct CudaContext : DeviceContext {
  CudaContext(at::Device device, c10::cuda::CUDAStream stream) : DeviceContext(device), stream(stream) {}
  c10::cuda::CUDAStream stream;
};

// The ranks sharing this rank's intra rank, one per node that has one, and this rank's place among them.
std::pair<int, int> interPlace(const Topology& t) {
  std::vector<int> peers;
  for (const auto& node : t.ranksOfNode) {
    if (static_cast<int>(node.size()) > t.intraRank) {
      peers.push_back(node[t.intraRank]);
    }
  }
  const int index = static_cast<int>(std::find(peers.begin(), peers.end(), t.rank) - peers.begin());
  return {index, static_cast<int>(peers.size())};
}

CommunicatorSet ncclLevels(const CudaSetup& setup, c10::DeviceIndex device, void* stream, bool interToo, const CommunicatorSet& host) {
  const Topology& t = setup.topology;
  auto& store = *setup.store;
  CommunicatorSet comms;
  // Created in the same order on every rank: world, this node, this intra rank across nodes.
  const bool oneNode = t.interSize == 1;
  const bool oneRankPerNode = t.interSize == t.size;
  if (interToo || oneNode) {
    comms.world = nccl::createCommunicator(store, "world", t.rank, t.size, device, stream);
  } else {
    comms.world = staged::createCommunicator(host.world, device, stream);
  }
  comms.intra = oneNode
      ? comms.world
      : nccl::createCommunicator(store, "intra/" + std::to_string(t.interRank), t.intraRank, t.intraSize, device, stream);
  if (oneRankPerNode && interToo) {
    comms.inter = comms.world;
  } else if (interToo) {
    const auto [index, count] = interPlace(t);
    comms.inter = nccl::createCommunicator(store, "inter/" + std::to_string(t.intraRank), index, count, device, stream);
  } else {
    comms.inter = oneRankPerNode ? comms.world : staged::createCommunicator(host.inter, device, stream);
  }
  return comms;
}

CommunicatorSet stagedLevels(const CommunicatorSet& host, c10::DeviceIndex device, void* stream) {
  CommunicatorSet comms;
  comms.world = staged::createCommunicator(host.world, device, stream);
  comms.intra = host.intra == host.world ? comms.world : staged::createCommunicator(host.intra, device, stream);
  comms.inter = host.inter == host.world ? comms.world : staged::createCommunicator(host.inter, device, stream);
  return comms;
}

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
  return std::make_shared<CallerEvent>(c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream());
}

DeviceContext& enterCuda(
    std::unique_ptr<DeviceContext>& slot,
    const CudaSetup& setup,
    const CommunicatorSet& host,
    at::Device device,
    const std::shared_ptr<void>& callerMark) {
  const c10::DeviceIndex index = device.index();
  c10::cuda::set_device(index);
  if (!slot) {
    auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
    auto context = std::make_unique<CudaContext>(device, stream);
    void* raw = stream.stream();
    if (setup.transport == "staged") {
      context->comms = stagedLevels(host, index, raw);
    } else {
      context->comms = ncclLevels(setup, index, raw, /*interToo=*/setup.transport == "nccl", host);
    }
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
