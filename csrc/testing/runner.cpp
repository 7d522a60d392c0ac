#include "testing/runner.h"

#include "comm/shm.h"
#include "testing/threads.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <thread>

namespace chainermn::testing {

void runRanks(const std::vector<std::string>& nodeNames, const RunOptions& options,
              const std::function<void(RankGroup&)>& perRank) {
  TORCH_CHECK_VALUE(!nodeNames.empty(), "runRanks: at least one rank is needed");
  const int size = static_cast<int>(nodeNames.size());
  auto run = std::make_shared<Run>(options.timeout);
  // The store only the shared-memory transports use (to pass the segment's name), as a group's
  // c10d store would; a HashStore's waits are bounded by its timeout.
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(options.timeout);

  auto rankMain = [&](int rank) {
    try {
      RankGroup group;
      group.topology = topologyFromNames(nodeNames, rank);
      group.transports =
          makeTransportSet(group.topology, [&](const Level& level) { return createThreadTransport(run, level); });
      const Topology& t = group.topology;
      if (options.sharedMemory && t.intraSize > 1) {
        const bool wholeGroup = t.interSize == 1;  // as backend/host_transports.cpp
        auto shared = shm::createTransport(*store, "chainermn/shm/" + std::to_string(t.interRank),
                                           group.transports.intra, options.timeout, wholeGroup, options.shmChunkBytes);
        group.transports.world = wholeGroup ? shared : group.transports.world;
        group.transports.intra = shared;
      }
      perRank(group);
    } catch (...) {
      run->abort(std::current_exception(), "rank " + std::to_string(rank));
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back(rankMain, rank);
  }
  // Every wait of every rank is bounded, so these joins are too.
  for (auto& thread : threads) {
    thread.join();
  }
  run->rethrowFirstError();
}

}  // namespace chainermn::testing
