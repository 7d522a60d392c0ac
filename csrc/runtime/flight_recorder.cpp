// Recording into the flight recorder's ring (flight_recorder.h); the dump is flight_recorder_dump.cpp.
#include "runtime/flight_recorder.h"

#include <torch/csrc/distributed/c10d/Utils.hpp>  // getCvarInt: torch's reading of its settings

#include <pthread.h>

#include <algorithm>
#include <cstring>

namespace chainermn {

namespace {

// torch's FlightRecorder default (FlightRecorder.hpp), and its settings, read as torch reads them.
constexpr int kDefaultEntries = 2000;

// The name torch's analyzer knows an op by (its COLLECTIVES and P2P sets, which follow
// ProcessGroupNCCL's profiling titles), after "chainermn:". Several of the backend's ops are one of
// torch's (all_gather_into_tensor is torch's _all_gather_base, as nccl records it).
const char* analyzerName(c10d::OpType type, const char* name) {
  switch (type) {
    case c10d::OpType::BROADCAST:
      return "broadcast";
    case c10d::OpType::ALLREDUCE:
      return "all_reduce";
    case c10d::OpType::ALLREDUCE_COALESCED:
      return "allreduce_coalesced";
    case c10d::OpType::REDUCE:
      return "reduce";
    case c10d::OpType::ALLGATHER:
      return "all_gather";
    case c10d::OpType::_ALLGATHER_BASE:
      return "_all_gather_base";
    case c10d::OpType::ALLGATHER_COALESCED:
      return "ALLGATHER_coalesced";
    case c10d::OpType::GATHER:
      return "gather";
    case c10d::OpType::SCATTER:
      return "scatter";
    case c10d::OpType::REDUCE_SCATTER:
      return "reduce_scatter";
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return "_reduce_scatter_base";
    case c10d::OpType::ALLTOALL_BASE:
    case c10d::OpType::ALLTOALL:
      return "all_to_all";
    case c10d::OpType::BARRIER:
      return "barrier";
    case c10d::OpType::COALESCED:
      // all_gather_into_tensor_coalesced and reduce_scatter_tensor_coalesced are torch's names too; a
      // batch of sends and receives is one "coalesced" entry.
      return std::strcmp(name, "batch_isend_irecv") == 0 ? "coalesced" : name;
    default:
      return name;  // a refusal (UNKNOWN) stands for the op refused, named as posted
  }
}

// The posting thread's name, read once per thread (a system call).
const char* threadName() {
  thread_local char name[16] = {};
  thread_local bool read = false;
  if (!read) {
    pthread_getname_np(pthread_self(), name, sizeof(name));
    read = true;
  }
  return name;
}

void appendSizes(std::vector<int64_t>& sizes, std::vector<int64_t>& dims, std::vector<c10::ScalarType>& dtypes,
                 const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    const auto shape = tensor.sizes();
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    dims.push_back(static_cast<int64_t>(shape.size()));
    dtypes.push_back(tensor.scalar_type());
  }
}

// A list of equal tensors as the one stacked tensor ProcessGroupNCCL flattens them into and records
// (an all_gather's outputs, a reduce_scatter's inputs): the analyzer checks sizes against it.
void appendStacked(std::vector<int64_t>& sizes, std::vector<int64_t>& dims, std::vector<c10::ScalarType>& dtypes,
                   const std::vector<at::Tensor>& tensors) {
  const auto shape = tensors.front().sizes();
  sizes.push_back(static_cast<int64_t>(tensors.size()));
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  dims.push_back(static_cast<int64_t>(shape.size()) + 1);
  dtypes.push_back(tensors.front().scalar_type());
}

}  // namespace

FlightRecorder& FlightRecorder::get() {
  // Never destroyed: groups record into it until the process ends.
  static auto* recorder = new FlightRecorder(static_cast<size_t>(
      std::max(0, c10d::getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, kDefaultEntries))));
  return *recorder;
}

FlightRecorder::FlightRecorder(size_t capacity) : slots_(capacity) {}

TracedGroup* FlightRecorder::addGroup(std::vector<int64_t> globalRanks, int groupRank, std::string fallbackName) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto group = std::make_unique<TracedGroup>();
  group->id = groups_.size();
  group->name = std::move(fallbackName);
  if (groupRank >= 0 && groupRank < static_cast<int>(globalRanks.size())) {
    if (groups_.empty()) {
      globalRank_.store(globalRanks[groupRank], std::memory_order_relaxed);
    }
  }
  group->globalRanks = std::move(globalRanks);
  groups_.push_back(std::move(group));
  return groups_.back().get();
}

void FlightRecorder::lock(Slot& slot) {
  while (slot.busy.exchange(true, std::memory_order_acquire)) {
    while (slot.busy.load(std::memory_order_relaxed)) {
      std::this_thread::yield();  // held for a few stores, or for a dump's copy of the entry
    }
  }
}

void FlightRecorder::unlock(Slot& slot) {
  slot.busy.store(false, std::memory_order_release);
}

FlightRecorder::Locked::Locked(FlightRecorder& recorder, Id id) {
  if (id == kNotRecorded || recorder.slots_.empty()) {
    return;
  }
  slot_ = &recorder.slots_[id % recorder.slots_.size()];
  lock(*slot_);
  if (slot_->entry.id == id) {
    entry_ = &slot_->entry;
  }
}

FlightRecorder::Locked::~Locked() {
  if (slot_ != nullptr) {
    unlock(*slot_);
  }
}

FlightRecorder::Id FlightRecorder::record(TracedGroup& group, const std::string& groupName,
                                          const std::string& groupDesc, const PostedOp& op) {
  if (!enabled()) {
    return kNotRecorded;
  }
  const tick_clock::Ticks now = tick_clock::now();
  const char* thread = threadName();
  if (!group.named.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);  // once per group, before the dump may read its name
    if (!group.named.load(std::memory_order_relaxed)) {
      if (!groupName.empty()) {
        group.name = groupName;
      }
      group.desc = groupDesc.empty() ? "undefined" : groupDesc;  // torch's description of an undescribed group
      group.named.store(true, std::memory_order_release);
    }
  }
  const Id id = next_.fetch_add(1, std::memory_order_relaxed);
  Slot& held = slots_[id % slots_.size()];
  lock(held);
  Entry& slot = held.entry;
  slot.id = id;
  slot.group = &group;
  slot.collectiveSeq = op.collectiveSeq;
  slot.p2pSeq = op.p2pSeq;
  slot.opId = group.ops.fetch_add(1, std::memory_order_relaxed) + 1;
  slot.collective = op.collective;
  slot.isP2P = !op.collective;
  slot.retired = false;
  const bool send = op.type == c10d::OpType::SEND;
  const bool receive = op.type == c10d::OpType::RECV || op.type == c10d::OpType::RECVANYSOURCE;
  slot.op = send ? "send" : receive ? "recv" : analyzerName(op.type, op.name);
  slot.direction = send ? "->" : receive ? "<-" : nullptr;
  slot.rank = op.rank;
  slot.peer = op.peer;
  slot.created = now;
  slot.started = 0;
  slot.completed = 0;
  slot.timeoutMs = op.timeout.count();
  slot.thread = std::this_thread::get_id();
  std::memcpy(slot.threadName, thread, sizeof(slot.threadName));
  slot.sizes.clear();
  slot.inputDims.clear();
  slot.outputDims.clear();
  slot.inputDtypes.clear();
  slot.outputDtypes.clear();
  // An op in place (all_reduce, broadcast, a send, a receive) reads and writes its outputs: torch
  // records them as both.
  const auto& inputs = op.inputs.empty() ? op.outputs : op.inputs;
  if (op.type == c10d::OpType::REDUCE_SCATTER && !inputs.empty()) {
    appendStacked(slot.sizes, slot.inputDims, slot.inputDtypes, inputs);
  } else {
    appendSizes(slot.sizes, slot.inputDims, slot.inputDtypes, inputs);
  }
  if (op.type == c10d::OpType::ALLGATHER && !op.outputs.empty()) {
    appendStacked(slot.sizes, slot.outputDims, slot.outputDtypes, op.outputs);
  } else {
    appendSizes(slot.sizes, slot.outputDims, slot.outputDtypes, op.outputs);
  }
  unlock(held);
  if (op.collective) {
    group.lastEnqueued.store(static_cast<int64_t>(op.collectiveSeq), std::memory_order_relaxed);
  }
  return id;
}

void FlightRecorder::started(Id id) {
  if (id == kNotRecorded) {
    return;
  }
  const tick_clock::Ticks now = tick_clock::now();
  Locked slot(*this, id);
  if (!slot || slot->started != 0) {
    return;
  }
  slot->started = now;
  if (slot->collective) {
    slot->group->lastStarted.store(static_cast<int64_t>(slot->collectiveSeq), std::memory_order_relaxed);
  }
}

void FlightRecorder::ended(Id id, bool completed) {
  if (id == kNotRecorded) {
    return;
  }
  const tick_clock::Ticks now = tick_clock::now();
  Locked slot(*this, id);
  if (!slot || slot->retired) {
    return;
  }
  slot->retired = true;
  if (!completed) {
    return;
  }
  if (slot->started == 0) {
    slot->started = now;  // completed without being seen to start (a batch's empty window)
  }
  slot->completed = now;
  if (slot->collective) {
    slot->group->lastCompleted.store(static_cast<int64_t>(slot->collectiveSeq), std::memory_order_relaxed);
  }
}

}  // namespace chainermn
