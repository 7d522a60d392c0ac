// ProcessGroupChainerMN: the `chainermn` torch.distributed backend.
//
// The c10d surface: every call is validated on the caller's thread (validate.h), described, and
// posted through one funnel to the group's FIFO worker, which runs it on the transports of its
// tensors' device (transport_plan.h). The caller gets a WorkChainerMN at once; its Future completes
// with the output tensors. Collectives' bodies are in collectives.cpp and point to point in
// point_to_point.cpp; the allreduce family in allreduce.cpp (the compressed mean: compression.cpp).
#pragma once

#include "backend/agreement.h"
#include "backend/device_context.h"
#include "backend/group_context.h"
#include "backend/options.h"
#include "backend/transport_plan.h"
#include "backend/watched_transports.h"
#include "runtime/worker.h"
#include "strategies/compressed.h"
#include "strategies/strategy.h"
#include "topology.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>

namespace chainermn {

struct TracedGroup;  // runtime/flight_recorder.h

// An op as the funnel sees it: what it is, what it returns, and what it reads.
struct OpSpec {
  c10d::OpType type;
  const char* name;
  std::vector<at::Tensor> outputs;                          // the Work's result (fut.value())
  std::vector<at::Tensor> inputs;                           // read by the op: kept alive until it is done
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;  // the group's unless set
  Agreement agree;  // what every rank must pass the same (collectives; see agreement.h)
  // The caller waits for the op at once (torch's async_op=False, the options' asyncOp): running it on
  // the caller's thread takes nothing from it (runsOnCaller).
  bool callerWaits = false;
  // The body writes nothing its caller sees before its first call on the world transport: the
  // cross-rank check may ride in that call's first exchange (GroupContext::carryAgreement).
  bool checkFolds = false;
  int peer = -1;  // a send's destination, a receive's source: the flight recorder names it
};

class ProcessGroupChainerMN : public c10d::Backend {
 public:
  // Collective over the group: plans its transports and builds the CPU ones (transport_plan.h).
  ProcessGroupChainerMN(const GroupSetup& setup, GroupOptions options);
  ~ProcessGroupChainerMN() override;

  const std::string getBackendName() const override {
    return "chainermn";
  }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  // ProcessGroup.abort() (torchft ends a failed replica's group so): see process_group.cpp.
  void abort() override;
  // Why the group is unusable ("" while it is not): a timeout, a dead or aborting peer, an abort here.
  std::string brokenReason() const {
    return worker_->brokenReason();
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  // torch sends sparse CUDA tensors here (sparse CPU ones to allreduce): both go to allreduceSparse.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    return allreduceSparse(onlyTensor(tensors), opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                           std::vector<at::Tensor>& inputTensors,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& outputBuffer, at::Tensor& inputBuffer,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputTensorLists, std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                        std::vector<at::Tensor>& inputTensors,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputTensors,
                                         std::vector<std::vector<at::Tensor>>& inputTensors,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputTensors, std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& outputBuffer, at::Tensor& inputBuffer,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputTensors, std::vector<at::Tensor>& inputTensors,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  // A receive of whatever CPU message srcRank sent on `tag` with send (any size and dtype): the
  // Work's result() is it, one flat tensor. What the model-parallel functions' messages use: one
  // message per transfer, its header inside (torch_chainermn/messages/tensors.py).
  c10::intrusive_ptr<c10d::Work> recvMessage(int srcRank, int tag);
  // A send of one CPU message of `bytes` bytes, part i (contiguous, on the CPU) at byte offsets[i] and
  // zeros between: what recvMessage receives. The parts may change once this returns (what has not
  // gone yet is copied). Within a node over shared memory it is written straight from the parts into
  // the ring on this thread when the worker is idle (no pack, no thread hop); else packed and posted.
  c10::intrusive_ptr<c10d::Work> sendMessage(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& offsets,
                                             int64_t bytes, int dstRank, int tag);
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // torch's coalescing manager, as batch_isend_irecv uses it: the sends and receives issued between
  // startCoalescing() and endCoalescing() on this thread start together, as one op (over NCCL, one
  // ncclGroupStart/End, so their order in the list cannot deadlock), and all return the batch's
  // Work. Collectives issued meanwhile run as usual.
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // torch's monitored_barrier, through the store on the caller's thread: rank 0 waits for every
  // rank's arrival and names the ranks that did not come within the timeout (all of them with
  // waitAllRanks); every rank raises then.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  // torch's split_group (ProcessGroup::splitGroup calls it on each of a group's backends): a new
  // chainermn group of this group's `ranks`, with the options in `opts` when they are a chainermn
  // group's (BackendOptions), else this group's; made by the splitter this group was created with
  // (Python's creator: it agrees on the host library and builds the transports as for any group).
  // Null on a rank not in `ranks`. Collective over `ranks`.
  using Splitter = std::function<c10::intrusive_ptr<c10d::Backend>(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,                       // in the child
      const std::vector<int>& ranks,  // this group's ranks that form the child, ascending
      std::chrono::milliseconds timeout, const std::string& name, const GroupOptions& options)>;
  void setSplitter(Splitter splitter) {
    splitter_ = std::move(splitter);
  }
  bool supportsSplitting() const override {
    return static_cast<bool>(splitter_);
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  // torch's shrink_group: the ranks not in `ranksToExclude` (dead or not) make a new chainermn group,
  // renumbered in order, with this group's options (or those in `opts`, as split()). Collective over
  // the survivors. SHRINK_ABORT aborts this group first (abort()), so that its pending ops fail now
  // and torch's destroy of this group does not wait for them.
  bool supportsShrinking() const override {
    return static_cast<bool>(splitter_);
  }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                           const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;

  // torch's sequence numbers (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a checker that
  // reads them): the number of collectives this rank has issued to the group.
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  // ChainerMN's mean of gradients: every tensor becomes its mean over the group. The tensors are
  // packed into one reused buffer of `wireDtype` (cast, and for 16-bit wire dtypes scaled by 1/size,
  // in the same pass), reduced by the group's strategy, and unpacked with the cast back (and the
  // 1/size scale of wider dtypes) in one pass. Tensors may mix floating dtypes; std::nullopt means the
  // group's Options.allreduce_grad_dtype, and where that is unset too, the widest of their dtypes.
  c10::intrusive_ptr<c10d::Work> meanCoalesced(std::vector<at::Tensor>& tensors,
                                               std::optional<at::ScalarType> wireDtype);

  // Gradient compression's mean (strategies/compressed.h): every tensor becomes the mean over the
  // group of what the nodes sent, compressed between nodes. `residual` and `secondResidual` are this
  // rank's float32 residuals on the tensors' device, shaped as compressionResiduals(count) says
  // (empty tensors where none); they are read and updated by the op. In compression.cpp.
  c10::intrusive_ptr<c10d::Work> compressedMean(std::vector<at::Tensor>& tensors, const at::Tensor& residual,
                                                const at::Tensor& secondResidual, const CompressionSpec& spec);
  // The residuals this rank keeps for `count` gradient values under `spec`.
  ResidualShape compressionResiduals(const CompressionSpec& spec, int64_t count) const {
    return residualShape(topology_, spec, count);
  }

  const Topology& topology() const {
    return topology_;
  }
  // The library between ranks ("mpi" or "gloo"), whether or not shared memory serves the node.
  const char* transport() const {
    return plan_.hostLibrary;
  }
  bool sharedMemory() const {
    return plan_.sharedMemory;
  }
  // How CUDA tensors travel: "nccl", "nccl_intra" or "staged" (see transport_plan.h).
  const char* cudaTransport() const {
    return plan_.cuda.name;
  }
  const TransportPlan& transportPlan() const {
    return plan_;
  }
  const GroupOptions& options() const {
    return options_;
  }
  // The algorithm all_reduce runs (two_dimensional runs as hierarchical on nodes of unequal size).
  const char* algorithm() const {
    return context_->strategy->name();
  }
  // How many ops ran on their caller's thread rather than the group's worker: blocking collectives
  // over shared memory (runsOnCaller) and messages written straight into the ring (sendMessage).
  uint64_t opsRunOnCaller() const {
    return opsOnCaller_.load(std::memory_order_relaxed);
  }
  // How many collectives' cross-rank checks rode in the op's own first exchange (carryAgreement).
  uint64_t checksCarried() const {
    return context_->cpu->transports.world->checksCarried();
  }
  // Bytes of staging memory held (grows to the largest call, then stays).
  // What the group's ops moved and how long their phases took (counters.h).
  Counters& counters() {
    return context_->counters;
  }
  // Who arrived last at its recent collectives (stragglers.h).
  Stragglers& stragglers() {
    return *context_->stragglers;
  }
  size_t scratchBytes() const {
    return context_->cpu->scratch.bytesHeld() + (context_->cuda ? context_->cuda->scratch.bytesHeld() : 0);
  }

 private:
  // An op's work on the worker thread, written against the transports and scratch of its tensors'
  // device. Collectives return null; point to point returns its Request (see worker.h).
  using Body = std::function<RequestPtr(DeviceContext&)>;

  // The one funnel every op goes through: the tensors' device is found (one per op, one GPU per
  // group), a Work is numbered in issue order, and the body is queued behind everything issued
  // before it. On CUDA, the body runs on the group's stream after the caller's current stream, the
  // op's tensors are kept from the caching allocator until that work is done, and the Work's future
  // is device-aware (wait() and then() are stream-ordered rather than host-synchronised).
  c10::intrusive_ptr<c10d::Work> post(OpSpec spec, Body body, c10::intrusive_ptr<WorkChainerMN> work = nullptr);
  // Whether post() runs a CPU op on the caller's thread when the worker is idle (funnel.cpp).
  bool runsOnCaller(const OpSpec& spec) const;
  // post()'s CUDA path over NCCL alone: the body runs now, on the caller's thread.
  void launch(OpSpec& spec, const Body& body, const c10::intrusive_ptr<WorkChainerMN>& work, at::Device device,
              const std::vector<at::Tensor>& used);

  // all_reduce of a sparse COO tensor (sparse.cpp): Gloo's semantics, SUM, CPU.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(at::Tensor tensor, const c10d::AllreduceOptions& opts);
  static at::Tensor onlyTensor(std::vector<at::Tensor>& tensors) {
    TORCH_CHECK_VALUE(tensors.size() == 1, "all_reduce: expects exactly one tensor (one device per process), got ",
                      tensors.size());
    return tensors[0];
  }

  // A send or receive: posted (as `work`, if given), or added to the batch being coalesced.
  c10::intrusive_ptr<c10d::Work> postTransfer(const char* op, c10d::OpType type, const at::Tensor& tensor, int peer,
                                              int tag, c10::intrusive_ptr<WorkChainerMN> work = nullptr);
  // A transfer refused while a batch is being coalesced drops the batch: torch's coalescing manager
  // then never calls endCoalescing, and later transfers must not be gathered into a batch no one ends.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> abandonsBatch(Call&& call) {
    try {
      return call();
    } catch (...) {
      batch_.reset();
      throw;
    }
  }

  c10::intrusive_ptr<WorkChainerMN> makeWork(OpSpec& spec, at::Device device);

  // A collective's entry point: `call` validates and posts. When validation refuses the call on this
  // rank, a refusal takes the op's place in the group's sequence, so that the peers fail this op at
  // once naming this rank and its reason (agreement.h), and the error propagates here.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> refusable(const char* op, Call&& call) {
    try {
      return call();
    } catch (const c10::Error& error) {
      postRefusal(op, error.what_without_backtrace());
      throw;
    }
  }
  void postRefusal(const char* op, const std::string& reason);

  // What every rank must pass the same for an op over `tensors`: their dtype, total elements, count
  // and (for several) each one's size.
  Agreement agreeOn(const std::vector<at::Tensor>& tensors) const;

  std::shared_ptr<GroupContext> context_;
  // Every CPU transport of the group is the node's shared-memory segment (one node, shared memory
  // on): collectives their caller waits for at once may run on its thread (runsOnCaller).
  bool collectivesOnCaller_ = false;
  std::atomic<uint64_t> opsOnCaller_{0};
  std::shared_ptr<WatchedTransports> watched_;  // the host transports, and the CUDA ones once built
  std::unique_ptr<Worker> worker_;
  at::Tensor barrierToken_;  // the one int a barrier over NCCL all-reduces
  Topology topology_;
  GroupOptions options_;
  // Which transports carry the group's ops; its names are static, so Works may outlive the group.
  TransportPlan plan_;
  std::atomic<std::chrono::milliseconds::rep> timeoutMs_;
  std::atomic<uint64_t> sequence_{0};     // collectives posted (torch's sequence number)
  std::atomic<uint64_t> p2pSequence_{0};  // sends and receives posted
  TracedGroup* traced_ = nullptr;         // the group in the flight recorder; null while it is off
  uint64_t monitoredBarriers_ = 0;        // numbers each monitored barrier's keys
  // Between startCoalescing() and endCoalescing(): the transfers gathered, and the Work they share.
  struct Batch {
    std::vector<at::Tensor> tensors;
    std::vector<bool> sends;
    std::vector<int> peers;
    std::vector<int> tags;
    c10::intrusive_ptr<WorkChainerMN> work;
  };
  std::optional<Batch> batch_;
  // The last op posted while a batch was open: what a window with no transfers returns, so that
  // waiting for it orders the caller after the window's collectives (torch's _coalescing_manager).
  c10::intrusive_ptr<WorkChainerMN> lastInWindow_;
  Splitter splitter_;                // see split()
  int shrinks_ = 0;                  // shrink()s so far: each makes its group under a key space of its own
  std::atomic<int> cudaDevice_{-1};  // the GPU this group works on, bound by its first CUDA tensor
};

}  // namespace chainermn
