// Runs one function per rank on threads of this process, each rank with the topology and the
// transports it would have in a real process group: the in-process harness the fast unit tests use.
#pragma once

#include "comm/shm.h"
#include "comm/transport.h"
#include "topology.h"

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace chainermn::testing {

struct RunOptions {
  // As the process group does with shared memory on: the node's ranks reduce through an shm
  // transport (over the thread transport, for what shm does not do itself), and so does the world
  // when the group is one node. Its waits are bounded by `timeout` but do not see an abort.
  bool sharedMemory = false;
  // Bounds every wait of every rank.
  std::chrono::milliseconds timeout{30000};
  // The shared-memory transport's chunk (small ones make a few thousand elements take several rounds).
  size_t shmChunkBytes = shm::kDefaultChunkBytes;
};

// What one rank's function gets.
struct RankGroup {
  Topology topology;
  TransportSet transports;
};

// `nodeNames[r]` is the node of rank r (ranks with the same name share a node). Builds every rank's
// topology (topologyFromNames) and transports (makeTransportSet over thread transports), runs
// `perRank` on one thread per rank, joins them all and rethrows the first error of any rank; the
// others, if they were waiting for it, have been woken with an error that names it.
void runRanks(const std::vector<std::string>& nodeNames, const RunOptions& options,
              const std::function<void(RankGroup&)>& perRank);

}  // namespace chainermn::testing
