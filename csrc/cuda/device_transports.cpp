#include "cuda/device_transports.h"

#include "cuda/nccl.h"
#include "cuda/staged.h"

namespace chainermn::cuda {

TransportSet buildTransports(
    c10d::Store& store,
    const Topology& topology,
    std::chrono::milliseconds timeout,
    const std::string& cudaTransport,
    const TransportSet& host,
    c10::DeviceIndex device,
    void* stream) {
  auto nccl = [&](const Level& level) {
    return nccl::createTransport(store, level.key, level.index, static_cast<int>(level.ranks.size()), device, stream, timeout);
  };
  auto staged = [&](const TransportPtr& hostLevel) { return staged::createTransport(hostLevel, device, stream); };
  if (cudaTransport == "nccl") {
    return makeTransportSet(topology, nccl);
  }
  TransportSet set;
  if (cudaTransport == "staged") {
    set.world = staged(host.world);
    set.intra = host.intra == host.world ? set.world : staged(host.intra);
    set.inter = host.inter == host.world ? set.world : staged(host.inter);
    return set;
  }
  // nccl_intra across nodes (on one node it is "nccl"): NCCL within the node, staged between nodes.
  set.world = staged(host.world);
  set.intra = nccl(intraLevel(topology));
  set.inter = topology.interSize == topology.size ? set.world : staged(host.inter);
  return set;
}

} // namespace chainermn::cuda
