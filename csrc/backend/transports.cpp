#include "backend/transports.h"

#include "comm/shm.h"

#include <algorithm>

namespace chainermn {

TransportSet buildHostTransports(const GroupSetup& setup, bool sharedMemory) {
  TransportSet set = makeTransportSet(setup.topology, setup.makeHost);
  if (sharedMemory && setup.topology.intraSize > 1) {
    const Level node = intraLevel(setup.topology);
    // Point to point is the world transport's: through the segment when this node is the group.
    const bool wholeGroup = set.world == set.intra;
    auto shared = shm::createTransport(*setup.store, "chainermn/shm/" + node.key, set.intra, setup.timeout, wholeGroup,
                                       setup.shmChunkBytes);
    if (wholeGroup) {
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

bool cudaTransportsAllNccl(const std::string& cudaTransport, const Topology& topology) {
  return cudaTransport == "nccl" || (cudaTransport == "nccl_intra" && topology.interSize == 1);
}

void WatchedTransports::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    transport->close();
  }
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

} // namespace chainermn
