#include "backend/process_group.h"

#include "runtime/health.h"
#include "backend/transports.h"
#include "backend/reduction.h"
#include "backend/validate.h"

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
  const auto known = std::find(cudaTransportNames().begin(), cudaTransportNames().end(), options_.cudaTransport);
  TORCH_CHECK_VALUE(
      known != cudaTransportNames().end(),
      "chainermn: unknown CUDA transport '",
      options_.cudaTransport,
      "' (choose from nccl, nccl_intra, staged)");
  cudaTransport_ = known->c_str();  // a static name, as transport_ is: Works may outlive the group
  cudaBitwise_ = cudaTransportHasBitwise(options_.cudaTransport);
  context_->strategy = makeStrategy(options_.communicator, topology_);
  context_->store = setup.store;
  context_->rank = rank_;
  context_->checks = size_ > 1 ? options_.checks : CheckLevel::Off;
  // From the whole group's topology, so that every rank takes the same path.
  const auto& nodes = topology_.ranksOfNode;
  context_->checkThroughLevels = nodes.size() > 1 && nodes.front().size() > 1 &&
      std::all_of(nodes.begin(), nodes.end(), [&](const auto& node) { return node.size() == nodes.front().size(); });

  TransportSet host = buildHostTransports(setup, options_.sharedMemory);
  TORCH_CHECK(
      host.world->rank() == rank_ && host.world->size() == size_,
      "chainermn: the ",
      host.world->library(),
      " transport has rank ",
      host.world->rank(),
      " of ",
      host.world->size(),
      " but the group has rank ",
      rank_,
      " of ",
      size_);
  sharedMemory_ = options_.sharedMemory && topology_.intraSize > 1;
  // The library between ranks, whether or not shared memory serves the node: the inter level is
  // never shared memory (on one node it is a one-rank transport of the host library).
  transport_ = host.inter->library();
  context_->cpu = std::make_unique<DeviceContext>(*context_->strategy, at::kCPU);
  context_->cpu->transports = host;
  deviceComms_ = std::make_shared<WatchedTransports>();
  context_->buildCuda = cudaTransportsBuilder(setup, options_.cudaTransport, host, deviceComms_);
  launchOnCaller_ = cudaTransportsAllNccl(options_.cudaTransport, topology_);
  std::shared_ptr<Monitor> health;
  if (size_ > 1) {
    health = std::make_shared<GroupHealth>(setup.store, topology_);
  }
  worker_ = std::make_unique<Worker>(setup.name, std::move(health), deviceComms_);
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

c10::intrusive_ptr<c10d::Backend> ProcessGroupChainerMN::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  TORCH_CHECK(splitter_, "split_group: this chainermn group was not made by torch_chainermn's creator (rank ",
              rank_, ")");
  std::vector<int> sorted(ranks);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i] >= 0 && sorted[i] < size_, "split_group: ranks holds ", sorted[i],
                      ", not a rank of the group (size ", size_, "), on rank ", rank_);
    TORCH_CHECK_VALUE(i == 0 || sorted[i] != sorted[i - 1], "split_group: ranks holds ", sorted[i],
                      " twice, on rank ", rank_);
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
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  TORCH_CHECK(splitter_, "shrink_group: this chainermn group was not made by torch_chainermn's creator (rank ",
              rank_, ")");
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
  auto store = c10::make_intrusive<c10d::PrefixStore>("chainermn/shrink/" + std::to_string(shrinks_++) + "/",
                                                      context_->store);
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
    deviceComms_->close();
  } else {
    deviceComms_->abort();
  }
}

// c10d's abort: everything pending on this rank fails at once, and so does every op issued later;
// the peers' ops fail naming this rank within about a second (their watchdogs ask the store once an
// op has waited a second), not at their timeout. The group stays unusable (as after a timeout).
void ProcessGroupChainerMN::abort() {
  worker_->abortGroup("rank " + std::to_string(rank_) + " aborted the group (ProcessGroup.abort())");
}

// ---- the funnel ---------------------------------------------------------------------------------

void ProcessGroupChainerMN::setSequenceNumberForGroup() {}  // numbered from the group's creation

uint64_t ProcessGroupChainerMN::getSequenceNumberForGroup() {
  return sequence_.load();
}

c10::intrusive_ptr<WorkChainerMN> ProcessGroupChainerMN::makeWork(OpSpec& spec, at::Device device) {
  const uint64_t sequence = spec.agree.collective ? ++sequence_ : ++p2pSequence_;
  auto timeout = spec.timeout;
  if (timeout == c10d::kUnsetTimeout) {
    timeout = std::chrono::milliseconds(timeoutMs_.load());
  }
  std::vector<c10::Device> devices;
  if (device.is_cuda()) {
    devices.push_back(device);
  }
  return c10::make_intrusive<WorkChainerMN>(
      spec.type,
      WorkChainerMN::Label{spec.name, device.is_cuda() ? cudaTransport_ : transport_, rank_, size_, timeout},
      sequence,
      std::move(spec.outputs),
      Clock::now() + timeout,
      std::move(devices));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::post(OpSpec spec, Body body, c10::intrusive_ptr<WorkChainerMN> work) {
  std::vector<at::Tensor> used = spec.inputs;
  used.insert(used.end(), spec.outputs.begin(), spec.outputs.end());
  checkSameDevice(spec.name, used);
  const at::Device device = used.empty() ? at::Device(at::kCPU) : used.front().device();
  if (!used.empty()) {
    checkGroupDevice(spec.name, cudaDevice_, used.front());
  }
  if (!work) {
    work = makeWork(spec, device);
  }
  if (batch_) {
    lastInWindow_ = work;  // what an empty coalescing window returns (endCoalescing)
  }
  if (device.is_cpu()) {
    worker_->enqueue(work, [context = context_, body = std::move(body), op = spec.name, agreement = std::move(spec.agree)]() {
      if (agreement.collective) {
        context->agree(op, agreement);
      }
      return body(*context->cpu);
    });
    return work;
  }
  if (launchOnCaller_) {
    launch(spec, body, work, device, used);
    return work;
  }
  // Staged through the host transports: on the worker, in the group's order. The caller's current
  // stream is marked now, on the caller's thread; the worker orders the group's stream after it.
  const bool nccl = options_.cudaTransport == "nccl_intra";
  auto mark = markCallerStream(used.front());
  worker_->enqueue(
      work,
      [context = context_, body = std::move(body), mark = std::move(mark), device, used = std::move(used),
       op = spec.name, agreement = std::move(spec.agree), nccl]() {
        if (agreement.collective) {
          context->agree(op, agreement);  // over the host transports: this body uses them anyway
        }
        std::unique_lock<std::mutex> launching;
        if (nccl) {
          launching = lockDeviceLaunches(device);  // NCCL within the node: one submitter per device
        }
        std::shared_ptr<DeviceScope> scope = enterCuda(context->cuda, *context->strategy, context->buildCuda, device, mark);
        DeviceContext& cuda = *context->cuda;
        keepUntilDone(cuda, used);  // before anything is queued: a throw below leaves kernels behind
        RequestPtr request = body(cuda);
        if (request) {
          return Pending(std::move(request));  // point to point: the Work completes with the transfer
        }
        // A collective: done once queued, but the watchdog watches its kernels end (worker.h).
        Pending queued(markDeviceEnd(cuda));
        queued.onDevice = true;
        queued.scope = std::move(scope);  // the Work completes on the group's stream
        return queued;
      });
  if (nccl) {
    // Its NCCL kernels are submitted by the worker: the caller goes on once they are, so that this
    // process submits to the device in its program's order.
    work->waitQueued();
  }
  return work;
}

// Over NCCL alone: on the caller's thread, at once, as ProcessGroupNCCL does. The cross-rank check
// runs beside the kernels, on the worker; the Work completes once both the device and the check are
// through (worker.h).
void ProcessGroupChainerMN::launch(
    OpSpec& spec,
    const Body& body,
    const c10::intrusive_ptr<WorkChainerMN>& work,
    at::Device device,
    const std::vector<at::Tensor>& used) {
  const bool check = spec.agree.collective && context_->checks != CheckLevel::Off;
  const std::string broken = worker_->brokenReason();
  if (!broken.empty()) {
    work->fail(backendError("chainermn " + work->description() + ": not run, " + broken));
    return;
  }
  // The launch and the check's place in the worker's queue under one lock: ops posted from several
  // threads keep one order for both.
  auto launching = lockDeviceLaunches(device);
  try {
    auto scope = enterCuda(context_->cuda, *context_->strategy, context_->buildCuda, device, markCallerStream(used.front()));
    DeviceContext& cuda = *context_->cuda;
    keepUntilDone(cuda, used);  // before anything is queued: a throw below leaves kernels behind
    (void)body(cuda);  // NCCL's sends and receives are over once queued, as its collectives are
    RequestPtr end = markDeviceEnd(cuda);
    work->completeQueued();  // inside the scope: the future's event is on the group's stream
    worker_->watchOnDevice(work, std::move(end), check);
  } catch (const std::exception& error) {
    worker_->launchFailed(work, error);
  }
  if (check) {
    // Numbered like every collective's check, so the ranks stay in step even if this launch failed.
    const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(work->deadline() - work->issued());
    auto checkWork = c10::make_intrusive<WorkChainerMN>(
        spec.type,
        WorkChainerMN::Label{spec.name, transport_, rank_, size_, timeout},
        work->getSequencenumber(),
        std::vector<at::Tensor>{},
        work->deadline());
    worker_->enqueueCheck(checkWork, work, [context = context_, op = spec.name, agreement = std::move(spec.agree)] {
      context->agree(op, agreement);
    });
  }
}

Agreement ProcessGroupChainerMN::agreeOn(const std::vector<at::Tensor>& tensors) const {
  Agreement agreement;
  agreement.tensors = static_cast<int64_t>(tensors.size());
  agreement.count = 0;
  for (const auto& tensor : tensors) {
    agreement.count += tensor.numel();
  }
  if (!tensors.empty()) {
    agreement.dtype = tensors.front().scalar_type();
  }
  const bool detail = options_.checks == CheckLevel::Detail;
  const bool denseLayout =
      std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
        return t.layout() == at::kStrided && !t.is_contiguous();
      });
  if (tensors.size() > 1 || detail || denseLayout) {
    agreement.layout = layoutOf(tensors, detail);
  }
  return agreement;
}

void ProcessGroupChainerMN::postRefusal(const char* op, const std::string& reason) {
  if (context_->checks == CheckLevel::Off) {
    return;  // the peers do not compare fingerprints: they would not read a refusal either
  }
  OpSpec spec{c10d::OpType::UNKNOWN, op, {}, {}};
  auto work = makeWork(spec, at::Device(at::kCPU));
  worker_->enqueue(work, [context = context_, op, reason]() {
    context->agree(op, Agreement{}, reason);  // throws: every rank fails this op
    return RequestPtr();
  });
}

namespace {
void checkSplitsIfAny(Transport& world, const char* op, uint64_t sequence, const Agreement& agreement) {
  if (!agreement.sendCounts.empty() && world.size() > 1) {
    checkSplits(world, op, sequence, agreement);
  }
}
} // namespace

void GroupContext::agree(const char* op, const Agreement& agreement, const std::string& refusal) {
  const uint64_t sequence = ++collectivesRun;
  Transport& world = *cpu->transports.world;
  if (checks != CheckLevel::Off) {
    Fingerprint mine = makeFingerprint(sequence, op, agreement);
    if (!refusal.empty()) {
      store->set(refusalKey(sequence, rank), std::vector<uint8_t>(refusal.begin(), refusal.end()));
      mine.refused = 1;
    }
    // Between nodes the levels are cheaper; only a disagreement (rare) needs every fingerprint to
    // say which ranks differ, and then every rank knows to ask.
    if (checkThroughLevels && fingerprints.agreeThroughLevels(cpu->transports, mine)) {
      checkSplitsIfAny(world, op, sequence, agreement);
      return;
    }
    const std::string problem = disagreement(fingerprints.all(world, mine), [&](int r) {
      const auto reason = store->get(refusalKey(sequence, r));
      return std::string(reason.begin(), reason.end());
    });
    TORCH_CHECK_VALUE(problem.empty(), "chainermn: ", problem);
  }
  checkSplitsIfAny(world, op, sequence, agreement);
}

// ---- the allreduce family: one flow (pack with cast and scale -> strategy -> unpack) -------------

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  if (tensors.size() == 1 && tensors[0].is_sparse()) {
    return allreduceSparse(tensors[0], opts);  // sparse.cpp
  }
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor tensor = single(op, "tensor", tensors, Layout::Dense);
    checkStrategyHandles(op, *context_->strategy, tensor);
    const Reduction plan = planReduction(op, opts.reduceOp, tensor.scalar_type(), size_);
    checkDeviceReduction(op, plan, tensor, cudaBitwise_);
    return post({c10d::OpType::ALLREDUCE, op, {tensor}, {}, opts.timeout, withReduce(agreeOn({tensor}), opts.reduceOp)}, [tensor, plan](DeviceContext& on) {
      premultiply(plan, tensor.data_ptr(), tensor.numel(), tensor.device());  // in place: the result replaces it
      on.strategy.allreduceParts(
          on.transports, on.scratch, flatParts({tensor}, plan.wireType), plan.wireType, plan.kind, plan.scaling);
      divideIntegerAverage(plan, tensor);
      return RequestPtr();
    });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "all_reduce_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    TORCH_CHECK_VALUE(!tensors.empty(), op, ": needs at least one tensor");
    checkTensors(op, "tensors", tensors, Layout::Dense);
    checkSameDtype(op, tensors);
    for (const auto& tensor : tensors) {
      checkStrategyHandles(op, *context_->strategy, tensor);
    }
    const Reduction plan = planReduction(op, opts.reduceOp, tensors[0].scalar_type(), size_);
    checkDeviceReduction(op, plan, tensors[0], cudaBitwise_);
    return post(
        {c10d::OpType::ALLREDUCE_COALESCED, op, tensors, {}, opts.timeout, withReduce(agreeOn(tensors), opts.reduceOp)}, [tensors, plan](DeviceContext& on) {
          for (const auto& tensor : tensors) {
            premultiply(plan, tensor.data_ptr(), tensor.numel(), tensor.device());
          }
          on.strategy.allreduceParts(
              on.transports, on.scratch, flatParts(tensors, plan.wireType), plan.wireType, plan.kind, plan.scaling);
          for (const auto& tensor : tensors) {
            divideIntegerAverage(plan, tensor);
          }
          return RequestPtr();
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::meanCoalesced(
    std::vector<at::Tensor>& tensors,
    std::optional<at::ScalarType> wireDtype) {
  const char* op = "mean_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkTensors(op, "tensors", tensors);
    std::optional<at::ScalarType> widest;
    for (const auto& tensor : tensors) {
      TORCH_CHECK_VALUE(
          at::isFloatingType(tensor.scalar_type()), op, ": gradients must be floating point, got ", tensor.scalar_type());
      checkStrategyHandles(op, *context_->strategy, tensor);
      widest = widest ? at::promoteTypes(*widest, tensor.scalar_type()) : tensor.scalar_type();
    }
    // The wire dtype: the caller's, else the group's allreduce_grad_dtype, else the widest given.
    const at::ScalarType wire = wireDtype.value_or(options_.allreduceGradDtype.value_or(widest.value_or(at::kFloat)));
    TORCH_CHECK_VALUE(at::isFloatingType(wire), op, ": the wire dtype must be floating point, got ", wire);
    const Scaling scaling = meanScaling(wire, size_);
    Agreement agreement = agreeOn(tensors);
    agreement.dtype = wire;  // the tensors may mix dtypes: the ranks must agree on the wire's
    return post(
        {c10d::OpType::ALLREDUCE_COALESCED, op, tensors, {}, c10d::kUnsetTimeout, agreement},
        [tensors, wire, scaling](DeviceContext& on) {
          on.strategy.allreduceParts(on.transports, on.scratch, flatParts(tensors), wire, ReduceKind::Sum, scaling);
          return RequestPtr();
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor tensor = single(op, "tensor", tensors, Layout::Dense);
    checkRank(op, "src", opts.rootRank, size_);
    const int root = static_cast<int>(opts.rootRank);
    return post({c10d::OpType::BROADCAST, op, {tensor}, {}, opts.timeout, withRoot(agreeOn({tensor}), "src", root)}, [tensor, root](DeviceContext& on) {
      if (tensor.numel() > 0) {
        on.transports.world->broadcast(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), root);
      }
      return RequestPtr();
    });
  });
}

} // namespace chainermn
