// Open MPI as a transport: the process-wide MPI runtime and the adapter that maps Transport
// calls onto nonblocking MPI collectives. Compiled only when mpicc was found at build time
// (CHAINERMN_WITH_MPI).
#pragma once

#include "comm/transport.h"
#include "topology.h"

#include <string>
#include <vector>

namespace chainermn::mpi {

// True when this process was started by mpiexec/mpirun (Open MPI, PMIx or PMI environment).
bool launchedByMpiexec();

// Initialise MPI once per process, asking for MPI_THREAD_MULTIPLE (each process group runs its
// collectives on its own worker thread). Safe to call again, and after mpi4py initialised MPI.
void initialize();

// The thread level MPI provides; the transport needs MPI_THREAD_MULTIPLE.
bool threadMultiple();

int worldRank();
int worldSize();

// Rank 0's text, on every rank (blocking, in the calling thread). Used to agree on the store's
// address at launch, before any process group exists.
std::string broadcastString(const std::string& text, int root);

// MPI_Finalize, if this library initialised MPI and no operation was abandoned after a timeout
// (finalising with operations in flight could block the exit forever).
void finalize();

// Ends every process of the MPI job (MPI_Abort on MPI_COMM_WORLD): the global except hook's last word.
[[noreturn]] void abortJob(int code);

// Marks that an operation was left in flight after a timeout; see finalize().
void noteAbandonedRequest();

// The world, intra-node and inter-node transports of a group over the given MPI_COMM_WORLD ranks
// (in that order). Collective over those ranks only.
TransportSet createTransports(const std::vector<int64_t>& worldRanks, const Topology& topology);

} // namespace chainermn::mpi
