// A group's transport plan: which library carries each level (topology.h) of each device's
// transports, and what follows from it, decided once per group from its options and topology. Every
// other place (the host transports' builder, the CUDA transports' builder, the funnel's launch path,
// the reduction checks, point to point) asks the plan and decides nothing itself.
//
//   CPU:  the host library (MPI or Gloo, agreed on by the ranks in Python: _backend.py) on every
//         level; with shared memory on, the node's ranks reduce through a shared-memory segment (on
//         a single node that is the whole group).
//   CUDA: one row of kCudaTransports: how buffers travel within a node and between nodes.
#pragma once

#include "backend/options.h"
#include "cuda/device_transports.h"
#include "topology.h"

#include <string>
#include <vector>

namespace chainermn {

// A CUDA transport a user can name (Options.cuda_transport, CHAINERMN_CUDA_TRANSPORT). Adding one is
// a row of the table in transport_plan.cpp (and a carrier in cuda/device_transports.cpp if it is new).
struct CudaTransportKind {
  const char* name;
  cuda::Carrier withinNode;
  cuda::Carrier betweenNodes;
};

// The names of the table's rows, in its order (what Options accepts).
std::vector<std::string> cudaTransportNames();

struct CudaPlan {
  const char* name = "nccl";     // the transport asked for (a static name: Works may outlive the group)
  cuda::LevelCarriers carriers;  // what carries each level; on one node the node's carrier serves all
  // Every level NCCL: CUDA work is launched on the caller's thread (nothing host-side in it), and a
  // receive from any source is impossible.
  bool allNccl = true;
  // Some level NCCL: whoever submits the group's CUDA work holds the device's launch lock, so that
  // every rank submits NCCL work in its program's order.
  bool someNccl = true;
  // The transports reduce with bitwise ops (NCCL cannot; the host libraries can).
  bool bitwise = false;
};

struct TransportPlan {
  const char* hostLibrary = "";  // "mpi" or "gloo": between nodes, and within them without shared memory
  bool sharedMemory = false;     // the node's ranks meet in a shared-memory segment (asked, and >1 on the node)
  CudaPlan cuda;
};

// Refuses (ValueError) an unknown CUDA transport, or a host library other than the one asked for.
// `hostLibrary` is the library the ranks agreed on (GroupSetup::hostLibrary).
TransportPlan planTransports(const GroupOptions& options, const Topology& topology, const char* hostLibrary);

}  // namespace chainermn
