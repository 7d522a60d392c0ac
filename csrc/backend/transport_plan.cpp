#include "backend/transport_plan.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace chainermn {

namespace {

using cuda::Carrier;

// The CUDA transports, as ChainerMN's communicators offer them.
constexpr CudaTransportKind kCudaTransports[] = {
    {"nccl", Carrier::Nccl, Carrier::Nccl},          // NCCL on every level
    {"nccl_intra", Carrier::Nccl, Carrier::Staged},  // ChainerMN's non_cuda_aware: staged between nodes
    {"staged", Carrier::Staged, Carrier::Staged},    // the host library through pinned memory
};

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "" : ", ") + name;
  }
  return text;
}

}  // namespace

std::vector<std::string> cudaTransportNames() {
  std::vector<std::string> names;
  for (const auto& kind : kCudaTransports) {
    names.emplace_back(kind.name);
  }
  return names;
}

TransportPlan planTransports(const GroupOptions& options, const Topology& topology, const char* hostLibrary) {
  TransportPlan plan;
  TORCH_CHECK_VALUE(options.transport == "auto" || options.transport == hostLibrary,
                    "chainermn: Options.transport is '", options.transport, "' but the ranks agreed on '", hostLibrary,
                    "'");
  plan.hostLibrary = hostLibrary;
  plan.sharedMemory = options.sharedMemory && topology.intraSize > 1;

  const CudaTransportKind* kind = nullptr;
  for (const auto& row : kCudaTransports) {
    if (options.cudaTransport == row.name) {
      kind = &row;
    }
  }
  TORCH_CHECK_VALUE(kind != nullptr, "chainermn: unknown CUDA transport '", options.cudaTransport, "' (choose from ",
                    joined(cudaTransportNames()), ")");
  CudaPlan& cuda = plan.cuda;
  cuda.name = kind->name;
  // On one node there is no link between nodes: the node's carrier serves the (one-rank) inter level.
  cuda.carriers.intra = kind->withinNode;
  cuda.carriers.inter = topology.interSize == 1 ? kind->withinNode : kind->betweenNodes;
  cuda.allNccl = cuda.carriers.intra == Carrier::Nccl && cuda.carriers.inter == Carrier::Nccl;
  // The whole group's level is NCCL only when every level is: it spans both kinds of link.
  cuda.carriers.world = cuda.allNccl ? Carrier::Nccl : Carrier::Staged;
  cuda.someNccl = kind->withinNode == Carrier::Nccl || kind->betweenNodes == Carrier::Nccl;
  cuda.bitwise = !cuda.someNccl;
  return plan;
}

}  // namespace chainermn
