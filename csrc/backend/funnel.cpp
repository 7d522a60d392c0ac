// The funnel every op goes through (process_group.h, post()): numbered in issue order, its device
// found, then queued on the group's worker, or launched on the caller's thread when the transport
// plan says every CUDA level is NCCL; and the fingerprint every collective's ranks agree on.
#include "backend/process_group.h"

#include "backend/validate.h"
#include "runtime/op_span.h"
#include "runtime/flight_recorder.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace chainermn {

namespace {
// A body whose cross-rank check rides in its first exchange (GroupContext::carryAgreement): sent
// alone if the body made no call on the world transport (nothing to move), dropped if it threw
// before one, so that no later op carries it.
template <typename Body>
RequestPtr runCarryingCheck(DeviceContext& cpu, const Body& body) {
  Transport& world = *cpu.transports.world;
  RequestPtr request;
  try {
    request = body(cpu);
  } catch (...) {
    world.carryCheck(nullptr);
    throw;
  }
  world.settleCheck();
  return request;
}
}  // namespace

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
  // Every op's one span on the profiler's timeline, with its tensors' shapes (null when not profiled).
  std::shared_ptr<OpSpan> span = OpSpan::ifProfiled(spec.name, spec.inputs, spec.outputs);
  // Its entry in the flight recorder (none while the recorder is off).
  FlightRecorder::Id trace = FlightRecorder::kNotRecorded;
  if (traced_ != nullptr) {
    const bool collective = spec.agree.collective;
    trace = FlightRecorder::get().record(
        *traced_, getGroupUid(), getGroupDesc(),
        PostedOp{spec.type, spec.name, collective, collective ? sequence : sequence_.load(),
                 collective ? p2pSequence_.load() : sequence, rank_, spec.peer, timeout, spec.inputs, spec.outputs});
  }
  auto work = c10::make_intrusive<WorkChainerMN>(
      spec.type,
      WorkChainerMN::Label{spec.name, device.is_cuda() ? plan_.cuda.name : plan_.hostLibrary, rank_, size_, timeout,
                           spec.agree.collective},
      sequence, std::move(spec.outputs), Clock::now() + timeout, std::move(devices));
  work->setSpan(std::move(span));
  work->setTrace(trace);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::post(OpSpec spec, Body body,
                                                           c10::intrusive_ptr<WorkChainerMN> work) {
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
    const bool onCaller = runsOnCaller(spec);
    Worker::Body run = [context = context_, body = std::move(body), op = spec.name, agreement = std::move(spec.agree),
                        folds = spec.checkFolds, span = work->span()]() -> Pending {
      OpSpan::Running running(span.get());
      CountingScope counting(context->counters);
      if (!agreement.collective) {
        return body(*context->cpu);
      }
      CollectiveTimer timer(*context->stragglers);
      RequestPtr request;
      if (folds && context->carryAgreement(op, agreement)) {
        request = runCarryingCheck(*context->cpu, body);
      } else {
        context->agree(op, agreement);
        request = body(*context->cpu);
      }
      timer.done();
      return request;
    };
    if (onCaller && worker_->runIfIdle(work, run)) {
      opsOnCaller_.fetch_add(1, std::memory_order_relaxed);
      return work;
    }
    worker_->enqueue(work, std::move(run));
    return work;
  }
  if (plan_.cuda.allNccl) {
    launch(spec, body, work, device, used);
    return work;
  }
  // Staged through the host transports: on the worker, in the group's order. The caller's current
  // stream is marked now, on the caller's thread; the worker orders the group's stream after it.
  const bool nccl = plan_.cuda.someNccl;
  auto mark = markCallerStream(used.front());
  worker_->enqueue(work, [context = context_, body = std::move(body), mark = std::move(mark), device,
                          used = std::move(used), op = spec.name, agreement = std::move(spec.agree), nccl,
                          span = work->span()]() {
    OpSpan::Running running(span.get());
    CountingScope counting(context->counters);
    std::optional<CollectiveTimer> timer;
    if (agreement.collective) {
      timer.emplace(*context->stragglers);
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
    if (timer) {
      timer->done();  // the host's part: staging through the host transports, waits included
    }
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

// A collective the caller waits for at once (async_op=False), carried by the shared-memory segment
// alone, runs on the caller's thread when the worker is idle: the hop to the worker and back (two
// thread switches, on one core when the rank is bound to it; a scheduler slice when the machine is
// busy and the worker asleep) costs more than a small op, and the caller would only wait meanwhile.
// An async op stays on the worker: its caller may do anything before it waits, the peers' arrival
// included. The segment is the only host transport that the watchdog can end a wait in
// (AbortableComms, runtime/worker.h); gather, scatter and all-to-all go to the host library beside it.
bool ProcessGroupChainerMN::runsOnCaller(const OpSpec& spec) const {
  if (!collectivesOnCaller_ || batch_ || !spec.callerWaits || !spec.agree.collective) {
    return false;
  }
  switch (spec.type) {
    case c10d::OpType::ALLREDUCE:
    case c10d::OpType::ALLREDUCE_COALESCED:
    case c10d::OpType::BROADCAST:
    case c10d::OpType::REDUCE:
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE:
    case c10d::OpType::ALLGATHER_COALESCED:
    case c10d::OpType::REDUCE_SCATTER:
    case c10d::OpType::_REDUCE_SCATTER_BASE:
    case c10d::OpType::COALESCED:  // all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced
    case c10d::OpType::BARRIER:
      return true;
    default:
      return false;
  }
}

// Over NCCL alone: on the caller's thread, at once, as ProcessGroupNCCL does. The cross-rank check
// runs beside the kernels, on the worker; the Work completes once both the device and the check are
// through (worker.h).
void ProcessGroupChainerMN::launch(OpSpec& spec, const Body& body, const c10::intrusive_ptr<WorkChainerMN>& work,
                                   at::Device device, const std::vector<at::Tensor>& used) {
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
    auto scope =
        enterCuda(context_->cuda, *context_->strategy, context_->buildCuda, device, markCallerStream(used.front()));
    DeviceContext& cuda = *context_->cuda;
    keepUntilDone(cuda, used);  // before anything is queued: a throw below leaves kernels behind
    OpSpan::Running running(work->span().get());
    FlightRecorder::get().started(work->trace());
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
        spec.type, WorkChainerMN::Label{spec.name, plan_.hostLibrary, rank_, size_, timeout, true},
        work->getSequencenumber(), std::vector<at::Tensor>{}, work->deadline());
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
  const bool denseLayout = std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
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

}  // namespace chainermn
