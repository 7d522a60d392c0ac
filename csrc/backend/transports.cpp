#include "backend/transports.h"

#include "comm/shm.h"

#ifdef CHAINERMN_WITH_CUDA
#include "comm/nccl.h"
#include "comm/staged.h"
#endif

#include <algorithm>

namespace chainermn {

TransportSet buildHostTransports(const GroupSetup& setup, bool sharedMemory) {
  TransportSet set = makeTransportSet(setup.topology, setup.makeHost);
  if (sharedMemory && setup.topology.intraSize > 1) {
    const Level node = intraLevel(setup.topology);
    auto shared = shm::createTransport(*setup.store, "chainermn/shm/" + node.key, set.intra, setup.timeout);
    if (set.world == set.intra) {
      set.world = shared;
    }
    set.intra = shared;
  }
  return set;
}

const std::vector<std::string>& cudaTransportNames() {
  static const std::vector<std::string> names{"nccl", "nccl_intra", "staged"};
  return names;
}

bool cudaTransportHasBitwise(const std::string& cudaTransport) {
  return cudaTransport == "staged";
}

void WatchedTransports::watch(const TransportSet& set) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : {set.world, set.intra, set.inter}) {
    if (transport && std::find(transports_.begin(), transports_.end(), transport) == transports_.end()) {
      transports_.push_back(transport);
    }
  }
}

std::string WatchedTransports::asyncError() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    std::string error = transport->asyncError();
    if (!error.empty()) {
      return error;
    }
  }
  return "";
}

void WatchedTransports::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    transport->abort();
  }
}

#ifdef CHAINERMN_WITH_CUDA
TransportSet buildCudaTransports(
    c10d::Store& store,
    const Topology& topology,
    const std::string& cudaTransport,
    const TransportSet& host,
    c10::DeviceIndex device,
    void* stream) {
  auto nccl = [&](const Level& level) {
    return nccl::createTransport(store, level.key, level.index, static_cast<int>(level.ranks.size()), device, stream);
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
  // nccl_intra: NCCL within the node, staged between nodes. Made in the same order on every rank.
  const bool oneNode = topology.interSize == 1;
  set.world = oneNode ? nccl(worldLevel(topology)) : staged(host.world);
  set.intra = oneNode ? set.world : nccl(intraLevel(topology));
  set.inter = topology.interSize == topology.size ? set.world : staged(host.inter);
  return set;
}
#endif

} // namespace chainermn
