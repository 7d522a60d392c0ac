#include "cuda/device_transports.h"

#include "cuda/nccl.h"
#include "cuda/staged.h"

namespace chainermn::cuda {

TransportSet buildTransports(c10d::Store& store, const Topology& topology, std::chrono::milliseconds timeout,
                             const LevelCarriers& carriers, const TransportSet& host, c10::DeviceIndex device,
                             void* stream) {
  auto nccl = [&](const Level& level) {
    return nccl::createTransport(store, level.key, level.index, static_cast<int>(level.ranks.size()), device, stream,
                                 timeout);
  };
  auto staged = [&](const TransportPtr& hostLevel) { return staged::createTransport(hostLevel, device, stream); };
  if (carriers.world == Carrier::Nccl && carriers.intra == Carrier::Nccl && carriers.inter == Carrier::Nccl) {
    return makeTransportSet(topology, nccl);
  }
  // A staged level that spans the whole group is the world's, as the host library's is.
  TransportSet set;
  set.world = staged(host.world);
  auto level = [&](Carrier carrier, const Level& ranks, const TransportPtr& hostLevel) {
    if (carrier == Carrier::Nccl) {
      return nccl(ranks);
    }
    return hostLevel == host.world ? set.world : staged(hostLevel);
  };
  set.intra = level(carriers.intra, intraLevel(topology), host.intra);
  set.inter = level(carriers.inter, interLevel(topology), host.inter);
  return set;
}

}  // namespace chainermn::cuda
