#include "comm/transport.h"

namespace chainermn {

TransportSet makeTransportSet(const Topology& topology, const TransportFactory& make) {
  TransportSet set;
  set.world = make(worldLevel(topology));
  // Every rank takes the same branches: they depend on the whole group's topology only.
  set.intra = topology.interSize == 1 ? set.world : make(intraLevel(topology));
  set.inter = topology.interSize == topology.size ? set.world : make(interLevel(topology));
  return set;
}

} // namespace chainermn
