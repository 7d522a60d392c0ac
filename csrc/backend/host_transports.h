// A group's CPU transports, one per level (topology.h), as its transport plan says: the host library
// (MPI or Gloo) on every level; with shared memory in the plan, the node's level is a shared-memory
// segment over the host library's (on a single node that is the whole group).
#pragma once

#include "backend/options.h"
#include "backend/transport_plan.h"
#include "comm/transport.h"

namespace chainermn {

// Collective over the group: the factory in `setup` is called once per level, in the same order on
// every rank.
TransportSet buildHostTransports(const GroupSetup& setup, const TransportPlan& plan);

}  // namespace chainermn
