// ProcessGroupChainerMN's life: creation (the transport plan, the host transports, the worker),
// split and shrink into new groups, the timeout, shutdown and abort.
#include "backend/process_group.h"

#include "runtime/flight_recorder.h"
#include "runtime/health.h"
#include "backend/host_transports.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>

namespace chainermn {

ProcessGroupChainerMN::ProcessGroupChainerMN(const GroupSetup& setup, GroupOptions options)
    : c10d::Backend(setup.rank, setup.size),
      context_(std::make_shared<GroupContext>()),
      topology_(setup.topology),
      options_(std::move(options)),
      timeoutMs_(setup.timeout.count()) {
  plan_ = planTransports(options_, topology_, setup.hostLibrary);
  context_->strategy = makeStrategy(options_.communicator, topology_);
  context_->store = setup.store;
  context_->rank = rank_;
  context_->checks = size_ > 1 ? options_.checks : CheckLevel::Off;
  std::vector<std::string> nodeOfRank;
  for (const int node : topology_.nodeOfRank) {
    nodeOfRank.push_back(topology_.nodeNames[node]);
  }
  context_->stragglers = std::make_unique<Stragglers>(rank_, std::move(nodeOfRank), setup.name, setup.stragglers);
  // From the whole group's topology, so that every rank takes the same path.
  const auto& nodes = topology_.ranksOfNode;
  context_->checkThroughLevels =
      nodes.size() > 1 && nodes.front().size() > 1 &&
      std::all_of(nodes.begin(), nodes.end(), [&](const auto& node) { return node.size() == nodes.front().size(); });

  TransportSet host = buildHostTransports(setup, plan_);
  TORCH_CHECK(host.world->rank() == rank_ && host.world->size() == size_, "chainermn: the ", host.world->library(),
              " transport has rank ", host.world->rank(), " of ", host.world->size(), " but the group has rank ", rank_,
              " of ", size_);
  context_->cpu = std::make_unique<DeviceContext>(*context_->strategy, at::kCPU);
  context_->cpu->transports = host;
  watched_ = std::make_shared<WatchedTransports>();
  watched_->watch(host);  // a caller's op waiting in shared memory ends when the group breaks
  collectivesOnCaller_ = plan_.sharedMemory && topology_.ranksOfNode.size() == 1;
  context_->buildCuda = cudaTransportsBuilder(setup, plan_.cuda, host, watched_);
  std::shared_ptr<Monitor> health;
  if (size_ > 1) {
    health = std::make_shared<GroupHealth>(setup.store, topology_, [this] { return sequence_.load(); });
  }
  worker_ = std::make_unique<Worker>(setup.name, std::move(health), watched_);
  FlightRecorder& recorder = FlightRecorder::get();  // reads torch's settings: a bad value fails here
  if (recorder.enabled()) {
    std::vector<int64_t> members = setup.globalRanks;
    if (members.empty()) {
      for (int r = 0; r < size_; ++r) {
        members.push_back(r);
      }
    }
    traced_ = recorder.addGroup(std::move(members), rank_, setup.name);
  }
}

// Without shutdown() first (destroy_process_group calls it), as ProcessGroupNCCL's destructor: what is
// still queued is not waited for (the destroying thread may hold the GIL, which a worker releasing
// a tensor may need), and NCCL's communicators are aborted by their transports.
ProcessGroupChainerMN::~ProcessGroupChainerMN() {
  worker_.reset();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupChainerMN::getBackendOptions() {
  return c10::make_intrusive<BackendOptions>(options_, std::chrono::milliseconds(timeoutMs_.load()));
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupChainerMN::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                               const std::vector<int>& ranks,
                                                               const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  TORCH_CHECK(splitter_, "split_group: this chainermn group was not made by torch_chainermn's creator (rank ", rank_,
              ")");
  std::vector<int> sorted(ranks);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i] >= 0 && sorted[i] < size_, "split_group: ranks holds ", sorted[i],
                      ", not a rank of the group (size ", size_, "), on rank ", rank_);
    TORCH_CHECK_VALUE(i == 0 || sorted[i] != sorted[i - 1], "split_group: ranks holds ", sorted[i], " twice, on rank ",
                      rank_);
  }
  const auto mine = std::lower_bound(sorted.begin(), sorted.end(), rank_);
  if (mine == sorted.end() || *mine != rank_) {
    return nullptr;
  }
  const auto* chainermnOptions = dynamic_cast<const BackendOptions*>(opts.get());
  const auto timeout = opts ? opts->timeout : std::chrono::milliseconds(timeoutMs_.load());
  return splitter_(store, static_cast<int>(mine - sorted.begin()), sorted, timeout, opts ? opts->group_name : "",
                   chainermnOptions ? chainermnOptions->group : options_);
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupChainerMN::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  TORCH_CHECK(splitter_, "shrink_group: this chainermn group was not made by torch_chainermn's creator (rank ", rank_,
              ")");
  std::vector<int> survivors;
  for (int r = 0; r < size_; ++r) {
    if (std::find(ranksToExclude.begin(), ranksToExclude.end(), r) == ranksToExclude.end()) {
      survivors.push_back(r);
    }
  }
  const auto mine = std::find(survivors.begin(), survivors.end(), rank_);
  TORCH_CHECK_VALUE(mine != survivors.end(), "shrink_group: rank ", rank_, " is among ranks_to_exclude");
  constexpr int kShrinkAbort = 1;  // torch.distributed.SHRINK_ABORT
  if (shrinkFlags & kShrinkAbort) {
    worker_->abortGroup("rank " + std::to_string(rank_) + " shrank the group (shrink_group with SHRINK_ABORT)");
  }
  // Only the survivors meet under this prefix: the excluded ranks, dead or not, are never waited for.
  auto store =
      c10::make_intrusive<c10d::PrefixStore>("chainermn/shrink/" + std::to_string(shrinks_++) + "/", context_->store);
  const auto* chainermnOptions = dynamic_cast<const BackendOptions*>(opts.get());
  const auto timeout = opts ? opts->timeout : std::chrono::milliseconds(timeoutMs_.load());
  return splitter_(store, static_cast<int>(mine - survivors.begin()), survivors, timeout, "shrunk",
                   chainermnOptions ? chainermnOptions->group : options_);
}

void ProcessGroupChainerMN::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_.store(timeout.count());
}

// destroy_process_group: waits for what was issued, the GPU's work included (bounded by the ops'
// deadlines), then ends the device transports: a healthy group's NCCL communicators are finalized and
// destroyed, so that work still queued is flushed, not dropped; a broken group's were aborted already.
void ProcessGroupChainerMN::shutdown() {
  worker_->announceLeaving();  // first, as at the interpreter's exit: a peer failing meanwhile is told
  worker_->drain();
  if (worker_->brokenReason().empty()) {
    watched_->close();
  } else {
    watched_->abort();
  }
}

// c10d's abort: everything pending on this rank fails at once, and so does every op issued later;
// the peers' ops fail naming this rank within about a second (their watchdogs ask the store once an
// op has waited a second), not at their timeout. The group stays unusable (as after a timeout).
void ProcessGroupChainerMN::abort() {
  worker_->abortGroup("rank " + std::to_string(rank_) + " aborted the group (ProcessGroup.abort())");
}

}  // namespace chainermn
