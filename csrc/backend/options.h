// What a group is created from. GroupOptions mirrors torch_chainermn.Options field for field (the
// Python side reads the environment, in one function; C++ reads only what it is given). GroupSetup
// is what torch hands a backend's creator plus what the ranks agreed on before creating it.
#pragma once

#include "backend/stragglers.h"
#include "comm/shm.h"
#include "comm/transport.h"
#include "topology.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace chainermn {

// How deep the cross-rank checks of every collective go (backend/agreement.h): Off, the fingerprint
// (Info, the default), or the fingerprint with every tensor's shape (Detail). Python sets it from
// TORCH_DISTRIBUTED_DEBUG: OFF when set explicitly, unset or INFO, DETAIL.
enum class CheckLevel : int { Off = 0, Info = 1, Detail = 2 };

// "off", "info", "detail": torch's names for the debug levels.
inline const char* checkLevelName(CheckLevel level) {
  return level == CheckLevel::Off ? "off" : level == CheckLevel::Detail ? "detail" : "info";
}
inline CheckLevel checkLevelNamed(const std::string& name) {
  if (name == "off") {
    return CheckLevel::Off;
  }
  if (name == "detail") {
    return CheckLevel::Detail;
  }
  TORCH_CHECK_VALUE(name == "info", "checks must be one of off, info, detail, got '", name, "'");
  return CheckLevel::Info;
}

struct GroupOptions {
  std::string communicator = "hierarchical";         // the allreduce strategy (ChainerMN's communicator)
  std::optional<at::ScalarType> allreduceGradDtype;  // gradients' wire dtype; none: their own
  std::string transport = "auto";                    // the host library asked for: auto, mpi or gloo
  bool sharedMemory = true;                          // intra-node CPU collectives through shared memory
  std::string cudaTransport = "nccl";                // how CUDA buffers travel: nccl, nccl_intra, staged
  CheckLevel checks = CheckLevel::Info;              // cross-rank checks before every collective
};

// A group's options as torch sees them (Backend.options, getBackendOptions): torch's fields (timeout,
// name) and the group's own. torch.distributed's split_group deep-copies them and hands the copy back
// to split(), so a child made from them has exactly its parent's options.
struct BackendOptions : c10d::Backend::Options {
  BackendOptions(GroupOptions group, std::chrono::milliseconds timeout)
      : c10d::Backend::Options("chainermn", timeout), group(std::move(group)) {}
  GroupOptions group;
};

struct GroupSetup {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string name;
  Topology topology;
  TransportFactory makeHost;     // the host library every rank agreed on (MPI or Gloo), one level at a time
  const char* hostLibrary = "";  // its name, "mpi" or "gloo" (set with makeHost)
  size_t shmChunkBytes = shm::kDefaultChunkBytes;  // the shared-memory collectives' chunk (CHAINERMN_SHM_CHUNK_BYTES)
  StragglerSettings stragglers;                    // the stragglers' window and warning (CHAINERMN_STRAGGLER_*)
  std::vector<int64_t> globalRanks;                // the group's members by global rank (torch's); empty: 0 .. size-1
};

}  // namespace chainermn
