// The process-wide MPI runtime: MPI's initialisation and thread level,
// the world's rank and size, the launch-time broadcast, and the end of the job (finalize, abort).
// Compiled only when mpicc was found at build time (CHAINERMN_WITH_MPI). The Transport adapter over
// MPI is comm/mpi.h.
#pragma once

#include <string>

namespace chainermn::mpi {

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

// ---- for the adapter (comm/mpi.cpp)

// Throws a DistBackendError naming the MPI call when `code` is not MPI_SUCCESS.
void check(int code, const char* call);

// Counts a blocking MPI call while it runs. One that never returns (a peer never joined, and the
// watchdog failed the op) makes MPI_Finalize and MPI_Comm_free unsafe: they would wait for it forever.
class CallInProgress {
 public:
  CallInProgress();
  ~CallInProgress();
  CallInProgress(const CallInProgress&) = delete;
  CallInProgress& operator=(const CallInProgress&) = delete;
};

// Whether MPI objects may still be freed: MPI is not finalised, no operation was abandoned and no
// blocking call is in progress on any thread.
bool quiescent();

}  // namespace chainermn::mpi
