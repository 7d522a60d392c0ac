#include "backend/host_transports.h"

#include "comm/shm.h"

namespace chainermn {

TransportSet buildHostTransports(const GroupSetup& setup, const TransportPlan& plan) {
  TransportSet set = makeTransportSet(setup.topology, setup.makeHost);
  if (plan.sharedMemory) {
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

}  // namespace chainermn
