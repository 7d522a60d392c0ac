// Open MPI as a transport: the adapter that maps Transport calls onto MPI collectives over one
// communicator per level. Compiled only when mpicc was found at build time (CHAINERMN_WITH_MPI).
// The process-wide runtime (initialisation, finalisation, abort) is comm/mpi_runtime.h.
#pragma once

#include "comm/transport.h"
#include "topology.h"

#include <cstdint>
#include <vector>

namespace chainermn::mpi {

// The transport of one level of a group whose group rank r is MPI_COMM_WORLD rank worldRanks[r]:
// a communicator over the level's ranks, in the level's order. Collective over those ranks only
// (MPI_Comm_create_group), so a group's set is
//   makeTransportSet(topology, [&](const Level& l) { return createTransport(worldRanks, l); })
// and every rank creates world, then intra, then inter: a level's creation only waits for ranks
// that have finished the levels before it, so no rank can wait for one stuck behind it.
TransportPtr createTransport(const std::vector<int64_t>& worldRanks, const Level& level);

}  // namespace chainermn::mpi
