// What a group is created from. GroupOptions mirrors torch_chainermn.Options field for field (the
// Python side reads the environment, in one function; C++ reads only what it is given). GroupSetup
// is what torch hands a backend's creator plus what the ranks agreed on before creating it.
#pragma once

#include "comm/transport.h"
#include "topology.h"

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>

namespace chainermn {

struct GroupOptions {
  std::string communicator = "hierarchical";         // the allreduce strategy (ChainerMN's communicator)
  std::optional<at::ScalarType> allreduceGradDtype;  // gradients' wire dtype; none: their own
  std::string transport = "auto";                    // the host library asked for: auto, mpi or gloo
  bool sharedMemory = true;                          // intra-node CPU collectives through shared memory
  std::string cudaTransport = "nccl";                // how CUDA buffers travel: nccl, nccl_intra, staged
};

struct GroupSetup {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string name;
  Topology topology;
  TransportFactory makeHost;  // the host library every rank agreed on (MPI or Gloo), one level at a time
};

} // namespace chainermn
