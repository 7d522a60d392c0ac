#include "backend/process_group.h"

#include "backend/validate.h"
#include "comm/shm.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>

namespace chainermn {

namespace {

size_t bytesOf(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

// Copies the tensors back to back into `destination`.
void pack(const std::vector<at::Tensor>& tensors, void* destination) {
  auto* out = static_cast<char*>(destination);
  for (const auto& tensor : tensors) {
    std::memcpy(out, tensor.data_ptr(), bytesOf(tensor));
    out += bytesOf(tensor);
  }
}

// Fills the tensors, in order, from consecutive bytes of `source`.
void unpack(const void* source, std::vector<at::Tensor>& tensors) {
  const auto* in = static_cast<const char*>(source);
  for (auto& tensor : tensors) {
    std::memcpy(tensor.data_ptr(), in, bytesOf(tensor));
    in += bytesOf(tensor);
  }
}

std::vector<FlatBuffer> flatBuffers(const std::vector<at::Tensor>& tensors) {
  std::vector<FlatBuffer> parts;
  parts.reserve(tensors.size());
  for (const auto& tensor : tensors) {
    parts.push_back(FlatBuffer{tensor.data_ptr(), tensor.numel(), tensor.scalar_type()});
  }
  return parts;
}

void applyScaleBefore(at::Tensor& tensor, const Reduction& plan) {
  if (plan.scaleBefore) {
    tensor.mul_(*plan.scaleBefore);
  }
}

void applyDivideAfter(at::Tensor& tensor, const Reduction& plan) {
  if (plan.divideAfter) {
    tensor.div_(*plan.divideAfter);
  }
}

// `source` scaled into scratch when the reduction scales first, else `source` itself: the caller's
// input is never modified.
const void* scaledInput(GroupContext& ctx, const at::Tensor& source, const Reduction& plan) {
  if (!plan.scaleBefore) {
    return source.data_ptr();
  }
  at::Tensor staged = ctx.scratch.tensor(0, source.numel(), source.scalar_type());
  at::mul_out(staged, source, *plan.scaleBefore);
  return staged.data_ptr();
}

// Elements per first-dimension row, also for tensors whose first dimension is 0.
int64_t rowElements(const at::Tensor& tensor) {
  int64_t row = 1;
  for (int64_t d = 1; d < tensor.dim(); ++d) {
    row *= tensor.size(d);
  }
  return row;
}

std::vector<int64_t> splitCounts(
    const char* op,
    const char* argument,
    const at::Tensor& tensor,
    const std::vector<int64_t>& splits,
    int size) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, op, ": ", argument, " must have at least one dimension");
  const int64_t rows = tensor.size(0);
  std::vector<int64_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(
        rows % size == 0,
        op,
        ": ",
        argument,
        " has ",
        rows,
        " rows, which do not split evenly among ",
        size,
        " ranks; pass split sizes");
    std::fill(counts.begin(), counts.end(), rows / size * rowElements(tensor));
    return counts;
  }
  TORCH_CHECK_VALUE(
      static_cast<int>(splits.size()) == size,
      op,
      ": ",
      argument,
      " split sizes has ",
      splits.size(),
      " entries for a group of ",
      size);
  int64_t total = 0;
  for (int i = 0; i < size; ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, op, ": ", argument, " split sizes must be non-negative");
    total += splits[i];
    counts[i] = splits[i] * rowElements(tensor);
  }
  TORCH_CHECK_VALUE(
      total == rows, op, ": ", argument, " split sizes add up to ", total, " but the tensor has ", rows, " rows");
  return counts;
}

void checkSameDtype(const char* op, const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    TORCH_CHECK_VALUE(
        tensor.scalar_type() == tensors.front().scalar_type(), op, ": all tensors must have the same dtype");
  }
}

void checkListSize(const char* op, const char* argument, size_t actual, int size) {
  TORCH_CHECK_VALUE(
      static_cast<int>(actual) == size,
      op,
      ": ",
      argument,
      " must hold one tensor per rank (",
      size,
      "), got ",
      actual);
}

} // namespace

ProcessGroupChainerMN::ProcessGroupChainerMN(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    std::string groupName,
    Topology topology,
    TransportSet transports,
    GroupOptions options)
    : c10d::Backend(rank, size),
      context_(std::make_shared<GroupContext>()),
      topology_(std::move(topology)),
      options_(std::move(options)),
      timeoutMs_(timeout.count()) {
  TORCH_CHECK(transports.world && transports.intra && transports.inter, "chainermn: incomplete transports for group ", groupName);
  TORCH_CHECK(
      transports.world->rank() == rank && transports.world->size() == size,
      "chainermn: the ",
      transports.world->library(),
      " transport has rank ",
      transports.world->rank(),
      " of ",
      transports.world->size(),
      " but the group has rank ",
      rank,
      " of ",
      size);
  context_->strategy = makeStrategy(options_.communicator, topology_);
  transport_ = transports.world->library();
  if (options_.sharedMemory && topology_.intraSize > 1) {
    // The node's ranks reduce through shared memory; on a single node that is the whole group.
    auto shared = shm::createTransport(
        *store, "chainermn/shm/" + std::to_string(topology_.interRank), transports.intra, timeout);
    if (transports.world == transports.intra) {
      transports.world = shared;
    }
    transports.intra = shared;
    sharedMemory_ = true;
  }
  context_->comm = transports.world;
  context_->transports = std::move(transports);
  const auto known = std::find(cudaTransports().begin(), cudaTransports().end(), options_.cudaTransport);
  TORCH_CHECK_VALUE(
      known != cudaTransports().end(),
      "chainermn: unknown CUDA transport '",
      options_.cudaTransport,
      "' (choose from nccl, nccl_intra, staged)");
  context_->cudaSetup = CudaSetup{store, topology_, options_.cudaTransport};
  cudaTransport_ = known->c_str();  // a static name, as transport_ is: Works may outlive the group
  worker_ = std::make_unique<Worker>(std::move(groupName));
}

ProcessGroupChainerMN::~ProcessGroupChainerMN() {
  worker_.reset();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupChainerMN::getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>("chainermn", std::chrono::milliseconds(timeoutMs_.load()));
}

void ProcessGroupChainerMN::setTimeout(std::chrono::milliseconds timeout) {
  timeoutMs_.store(timeout.count());
}

void ProcessGroupChainerMN::shutdown() {
  worker_->drain();
}

c10::intrusive_ptr<WorkChainerMN> ProcessGroupChainerMN::makeWork(
    c10d::OpType type,
    const char* name,
    const char* transport,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout,
    std::vector<c10::Device> devices) {
  const uint64_t sequence = ++sequence_;
  if (timeout == c10d::kUnsetTimeout) {
    timeout = std::chrono::milliseconds(timeoutMs_.load());
  }
  return c10::make_intrusive<WorkChainerMN>(
      type,
      WorkChainerMN::Label{name, transport, rank_, size_, timeout},
      sequence,
      std::move(outputs),
      Clock::now() + timeout,
      std::move(devices));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::enqueue(
    c10d::OpType type,
    const char* name,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout,
    Body body) {
  auto work = makeWork(type, name, transport_, std::move(outputs), timeout);
  worker_->enqueue(work, [context = context_, body = std::move(body)]() { return body(*context); });
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::enqueueOn(
    const at::Tensor& device,
    c10d::OpType type,
    const char* name,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout,
    DeviceBody body) {
  if (device.device().is_cpu()) {
    return enqueue(type, name, std::move(outputs), timeout, [body = std::move(body)](GroupContext& ctx) {
      return body(ctx, Target{ctx.transports, ctx.scratch});
    });
  }
  // CUDA: the caller's current stream is marked now, on the caller's thread; the worker orders the
  // group's stream after it before running the body there.
  auto work = makeWork(type, name, cudaTransport_, std::move(outputs), timeout, {device.device()});
  auto mark = markCallerStream(device);
  std::vector<at::Tensor> used = work->result();
  used.push_back(device);
  worker_->enqueue(
      work,
      [context = context_, body = std::move(body), mark = std::move(mark), where = device.device(), used]() {
        auto& cuda = enterCuda(context->cuda, context->cudaSetup, context->transports, where, mark);
        RequestPtr request = body(*context, Target{cuda.transports, cuda.scratch});
        keepUntilDone(cuda, used);
        return request;
      });
  return work;
}

// ---- collectives ------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  at::Tensor tensor = single("broadcast", "tensor", tensors, Devices::CpuOrCuda);
  checkGroupDevice("broadcast", cudaDevice_, tensor);
  checkRank("broadcast", "src", opts.rootRank, size_);
  const int root = static_cast<int>(opts.rootRank);
  return enqueueOn(
      tensor, c10d::OpType::BROADCAST, "broadcast", {tensor}, opts.timeout, [tensor, root](GroupContext&, Target on) {
        if (tensor.numel() > 0) {
          on.transports.world->broadcast(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), root);
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  at::Tensor tensor = single("all_reduce", "tensor", tensors, Devices::CpuOrCuda);
  checkGroupDevice("all_reduce", cudaDevice_, tensor);
  checkStrategyHandles("all_reduce", *context_->strategy, tensor);
  const Reduction plan = planReduction("all_reduce", opts.reduceOp, tensor.scalar_type(), size_);
  checkDeviceReduction("all_reduce", plan, tensor);
  return enqueueOn(
      tensor, c10d::OpType::ALLREDUCE, "all_reduce", {tensor}, opts.timeout, [tensor, plan](GroupContext& ctx, Target on) mutable {
        if (tensor.numel() > 0) {
          applyScaleBefore(tensor, plan);
          ctx.strategy->allreduce(
              on.transports, on.scratch, FlatBuffer{tensor.data_ptr(), tensor.numel(), plan.wireType}, plan.kind);
          applyDivideAfter(tensor, plan);
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "all_reduce_coalesced";
  TORCH_CHECK_VALUE(!tensors.empty(), op, ": needs at least one tensor");
  checkTensors(op, "tensors", tensors, Devices::CpuOrCuda);
  checkSameDevice(op, tensors);
  checkGroupDevice(op, cudaDevice_, tensors[0]);
  checkSameDtype(op, tensors);
  const Reduction plan = planReduction(op, opts.reduceOp, tensors[0].scalar_type(), size_);
  checkDeviceReduction(op, plan, tensors[0]);
  int64_t total = 0;
  for (const auto& tensor : tensors) {
    total += tensor.numel();
  }
  for (const auto& tensor : tensors) {
    checkStrategyHandles(op, *context_->strategy, tensor);
  }
  return enqueueOn(
      tensors[0],
      c10d::OpType::ALLREDUCE_COALESCED,
      op,
      tensors,
      opts.timeout,
      [tensors, plan, total](GroupContext& ctx, Target on) mutable {
        if (total == 0) {
          return RequestPtr();
        }
        for (auto& tensor : tensors) {
          applyScaleBefore(tensor, plan);
        }
        std::vector<FlatBuffer> bufs;
        bufs.reserve(tensors.size());
        for (auto& tensor : tensors) {
          bufs.push_back(FlatBuffer{tensor.data_ptr(), tensor.numel(), plan.wireType});
        }
        ctx.strategy->allreduceMany(on.transports, on.scratch, bufs, plan.kind);
        for (auto& tensor : tensors) {
          applyDivideAfter(tensor, plan);
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  at::Tensor tensor = single("reduce", "tensor", tensors);
  checkRank("reduce", "dst", opts.rootRank, size_);
  const Reduction plan = planReduction("reduce", opts.reduceOp, tensor.scalar_type(), size_);
  const int root = static_cast<int>(opts.rootRank);
  const bool isRoot = rank_ == root;
  return enqueue(
      c10d::OpType::REDUCE, "reduce", {tensor}, opts.timeout, [tensor, plan, root, isRoot](GroupContext& ctx) mutable {
        if (tensor.numel() == 0) {
          return RequestPtr();
        }
        if (isRoot) {
          applyScaleBefore(tensor, plan);
          ctx.comm->reduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), plan.wireType, plan.kind, root);
          applyDivideAfter(tensor, plan);
        } else {
          // Off the root the input stays as it was: scaling goes to scratch, and `sink` is what a
          // transport that reduces in place may overwrite.
          const void* input = scaledInput(ctx, tensor, plan);
          void* sink = ctx.scratch.get(1, bytesOf(tensor));
          ctx.comm->reduce(input, sink, tensor.numel(), plan.wireType, plan.kind, root);
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather";
  at::Tensor input = single(op, "tensor", inputTensors, Devices::CpuOrCuda);
  checkGroupDevice(op, cudaDevice_, input);
  TORCH_CHECK_VALUE(outputTensors.size() == 1, op, ": expects one output list, got ", outputTensors.size());
  std::vector<at::Tensor> outputs = outputTensors[0];
  checkListSize(op, "tensor_list", outputs.size(), size_);
  for (const auto& output : outputs) {
    checkSameKind(op, "tensor_list", output, input, Devices::CpuOrCuda);
  }
  const int size = size_;
  return enqueueOn(
      input, c10d::OpType::ALLGATHER, op, outputs, opts.timeout, [input, outputs, size](GroupContext&, Target on) mutable {
        if (input.numel() == 0) {
          return RequestPtr();
        }
        void* gathered = on.scratch.get(0, bytesOf(input) * size);
        on.transports.world->allgather(input.data_ptr(), gathered, input.numel(), input.scalar_type());
        if (input.is_cpu()) {
          unpack(gathered, outputs);
        } else {
          on.scratch.unpack(gathered, input.scalar_type(), flatBuffers(outputs), 1.0);  // one launch
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  checkTensor(op, "input_tensor", inputBuffer, Devices::CpuOrCuda);
  checkTensor(op, "output_tensor", outputBuffer, Devices::CpuOrCuda);
  checkSameDevice(op, {inputBuffer, outputBuffer});
  checkGroupDevice(op, cudaDevice_, inputBuffer);
  TORCH_CHECK_VALUE(
      outputBuffer.scalar_type() == inputBuffer.scalar_type(), op, ": output and input dtypes differ");
  TORCH_CHECK_VALUE(
      outputBuffer.numel() == inputBuffer.numel() * size_,
      op,
      ": output_tensor must have world_size (",
      size_,
      ") times the input's ",
      inputBuffer.numel(),
      " elements, got ",
      outputBuffer.numel());
  at::Tensor output = outputBuffer, input = inputBuffer;
  return enqueueOn(
      input, c10d::OpType::_ALLGATHER_BASE, op, {output}, opts.timeout, [output, input](GroupContext&, Target on) {
        if (input.numel() > 0) {
          on.transports.world->allgather(input.data_ptr(), output.data_ptr(), input.numel(), input.scalar_type());
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  checkTensors(op, "input_tensor_list", inputTensors);
  checkListSize(op, "output_tensor_lists", outputTensorLists.size(), size_);
  std::vector<at::Tensor> outputs;  // rank-major, as they arrive
  for (const auto& list : outputTensorLists) {
    TORCH_CHECK_VALUE(
        list.size() == inputTensors.size(), op, ": every output list must match the input list's length");
    for (size_t i = 0; i < list.size(); ++i) {
      checkSameKind(op, "output_tensor_lists", list[i], inputTensors[i]);
      outputs.push_back(list[i]);
    }
  }
  size_t bytes = 0;
  for (const auto& input : inputTensors) {
    bytes += bytesOf(input);
  }
  std::vector<at::Tensor> inputs = inputTensors;
  const int size = size_;
  return enqueue(
      c10d::OpType::ALLGATHER_COALESCED, op, outputs, opts.timeout, [inputs, outputs, bytes, size](GroupContext& ctx) mutable {
        if (bytes == 0) {
          return RequestPtr();
        }
        // Pack every input, gather the packs of all ranks in one call, unpack rank by rank.
        void* packed = ctx.scratch.get(0, bytes);
        void* gathered = ctx.scratch.get(1, bytes * size);
        pack(inputs, packed);
        ctx.comm->allgather(packed, gathered, static_cast<int64_t>(bytes), at::kByte);
        unpack(gathered, outputs);
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": needs as many outputs as inputs");
  checkTensors(op, "inputs", inputs);
  checkTensors(op, "outputs", outputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(
        outputs[i].scalar_type() == inputs[i].scalar_type() && outputs[i].numel() == inputs[i].numel() * size_,
        op,
        ": output ",
        i,
        " must have the input's dtype and world_size times its elements");
  }
  return enqueue(
      c10d::OpType::COALESCED, op, outputs, opts.timeout, [outputs, inputs](GroupContext& ctx) {
        for (size_t i = 0; i < inputs.size(); ++i) {
          if (inputs[i].numel() > 0) {
            ctx.comm->allgather(inputs[i].data_ptr(), outputs[i].data_ptr(), inputs[i].numel(), inputs[i].scalar_type());
          }
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::gather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  at::Tensor input = single(op, "tensor", inputTensors);
  checkRank(op, "dst", opts.rootRank, size_);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outputs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputTensors.size() == 1, op, ": the destination rank needs gather_list");
    outputs = outputTensors[0];
    checkListSize(op, "gather_list", outputs.size(), size_);
    for (const auto& output : outputs) {
      checkSameKind(op, "gather_list", output, input);
    }
  } else {
    TORCH_CHECK_VALUE(
        outputTensors.empty() || (outputTensors.size() == 1 && outputTensors[0].empty()),
        op,
        ": gather_list must be empty on ranks other than dst");
  }
  const int size = size_;
  return enqueue(c10d::OpType::GATHER, op, outputs, opts.timeout, [input, outputs, root, size](GroupContext& ctx) mutable {
    if (input.numel() == 0) {
      return RequestPtr();
    }
    void* gathered = outputs.empty() ? nullptr : ctx.scratch.get(0, bytesOf(input) * size);
    ctx.comm->gather(input.data_ptr(), gathered, input.numel(), input.scalar_type(), root);
    if (!outputs.empty()) {
      unpack(gathered, outputs);
    }
    return RequestPtr();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  at::Tensor output = single(op, "tensor", outputTensors);
  checkRank(op, "src", opts.rootRank, size_);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> inputs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputTensors.size() == 1, op, ": the source rank needs scatter_list");
    inputs = inputTensors[0];
    checkListSize(op, "scatter_list", inputs.size(), size_);
    for (const auto& input : inputs) {
      checkSameKind(op, "scatter_list", input, output);
    }
  } else {
    TORCH_CHECK_VALUE(
        inputTensors.empty() || (inputTensors.size() == 1 && inputTensors[0].empty()),
        op,
        ": scatter_list must be empty on ranks other than src");
  }
  const int size = size_;
  return enqueue(c10d::OpType::SCATTER, op, {output}, opts.timeout, [output, inputs, root, size](GroupContext& ctx) {
    if (output.numel() == 0) {
      return RequestPtr();
    }
    void* packed = nullptr;
    if (!inputs.empty()) {
      packed = ctx.scratch.get(0, bytesOf(output) * size);
      pack(inputs, packed);
    }
    ctx.comm->scatter(packed, output.data_ptr(), output.numel(), output.scalar_type(), root);
    return RequestPtr();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  at::Tensor output = single(op, "output", outputTensors);
  TORCH_CHECK_VALUE(inputTensors.size() == 1, op, ": expects one input list, got ", inputTensors.size());
  std::vector<at::Tensor> inputs = inputTensors[0];
  checkListSize(op, "input_list", inputs.size(), size_);
  for (const auto& input : inputs) {
    checkSameKind(op, "input_list", input, output);
  }
  const Reduction plan = planReduction(op, opts.reduceOp, output.scalar_type(), size_);
  const int size = size_;
  return enqueue(
      c10d::OpType::REDUCE_SCATTER, op, {output}, opts.timeout, [output, inputs, plan, size](GroupContext& ctx) mutable {
        if (output.numel() == 0) {
          return RequestPtr();
        }
        at::Tensor packed = ctx.scratch.tensor(0, output.numel() * size, output.scalar_type());
        pack(inputs, packed.data_ptr());
        applyScaleBefore(packed, plan);
        ctx.comm->reduceScatter(packed.data_ptr(), output.data_ptr(), output.numel(), plan.wireType, plan.kind);
        applyDivideAfter(output, plan);
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  checkTensor(op, "output", outputBuffer);
  checkTensor(op, "input", inputBuffer);
  TORCH_CHECK_VALUE(outputBuffer.scalar_type() == inputBuffer.scalar_type(), op, ": output and input dtypes differ");
  TORCH_CHECK_VALUE(
      inputBuffer.numel() == outputBuffer.numel() * size_,
      op,
      ": input must have world_size (",
      size_,
      ") times the output's ",
      outputBuffer.numel(),
      " elements, got ",
      inputBuffer.numel());
  const Reduction plan = planReduction(op, opts.reduceOp, outputBuffer.scalar_type(), size_);
  at::Tensor output = outputBuffer, input = inputBuffer;
  return enqueue(
      c10d::OpType::_REDUCE_SCATTER_BASE, op, {output}, opts.timeout, [output, input, plan](GroupContext& ctx) mutable {
        if (output.numel() > 0) {
          const void* source = scaledInput(ctx, input, plan);
          ctx.comm->reduceScatter(source, output.data_ptr(), output.numel(), plan.wireType, plan.kind);
          applyDivideAfter(output, plan);
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": needs as many outputs as inputs");
  std::vector<Reduction> plans;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(op, "outputs", outputs[i]);
    checkTensor(op, "inputs", inputs[i]);
    TORCH_CHECK_VALUE(
        inputs[i].scalar_type() == outputs[i].scalar_type() && inputs[i].numel() == outputs[i].numel() * size_,
        op,
        ": input ",
        i,
        " must have the output's dtype and world_size times its elements");
    plans.push_back(planReduction(op, opts.reduceOp, outputs[i].scalar_type(), size_));
  }
  return enqueue(
      c10d::OpType::COALESCED, op, outputs, opts.timeout, [outputs, inputs, plans](GroupContext& ctx) mutable {
        for (size_t i = 0; i < inputs.size(); ++i) {
          if (outputs[i].numel() > 0) {
            const void* source = scaledInput(ctx, inputs[i], plans[i]);
            ctx.comm->reduceScatter(
                source, outputs[i].data_ptr(), outputs[i].numel(), plans[i].wireType, plans[i].kind);
            applyDivideAfter(outputs[i], plans[i]);
          }
        }
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  checkTensor(op, "output", outputBuffer);
  checkTensor(op, "input", inputBuffer);
  TORCH_CHECK_VALUE(outputBuffer.scalar_type() == inputBuffer.scalar_type(), op, ": output and input dtypes differ");
  auto sendCounts = splitCounts(op, "input", inputBuffer, inputSplitSizes, size_);
  auto recvCounts = splitCounts(op, "output", outputBuffer, outputSplitSizes, size_);
  at::Tensor output = outputBuffer, input = inputBuffer;
  return enqueue(
      c10d::OpType::ALLTOALL_BASE,
      op,
      {output},
      opts.timeout,
      [output, input, sendCounts, recvCounts](GroupContext& ctx) {
        ctx.comm->alltoallv(input.data_ptr(), sendCounts, output.data_ptr(), recvCounts, input.scalar_type());
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::alltoall(
    std::vector<at::Tensor>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  checkListSize(op, "output_tensor_list", outputTensors.size(), size_);
  checkListSize(op, "input_tensor_list", inputTensors.size(), size_);
  checkTensors(op, "output_tensor_list", outputTensors);
  checkTensors(op, "input_tensor_list", inputTensors);
  std::vector<at::Tensor> all(inputTensors);
  all.insert(all.end(), outputTensors.begin(), outputTensors.end());
  checkSameDtype(op, all);
  std::vector<int64_t> sendCounts, recvCounts;
  for (int r = 0; r < size_; ++r) {
    sendCounts.push_back(inputTensors[r].numel());
    recvCounts.push_back(outputTensors[r].numel());
  }
  std::vector<at::Tensor> outputs = outputTensors, inputs = inputTensors;
  return enqueue(
      c10d::OpType::ALLTOALL,
      op,
      outputs,
      opts.timeout,
      [outputs, inputs, sendCounts, recvCounts](GroupContext& ctx) mutable {
        const auto dtype = inputs[0].scalar_type();
        const size_t width = c10::elementSize(dtype);
        const int64_t sendTotal = std::accumulate(sendCounts.begin(), sendCounts.end(), int64_t{0});
        const int64_t recvTotal = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
        void* packed = ctx.scratch.get(0, sendTotal * width);
        void* received = ctx.scratch.get(1, recvTotal * width);
        pack(inputs, packed);
        ctx.comm->alltoallv(packed, sendCounts, received, recvCounts, dtype);
        unpack(received, outputs);
        return RequestPtr();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "barrier", {}, opts.timeout, [](GroupContext& ctx) {
    ctx.comm->barrier();
    return RequestPtr();
  });
}

// ---- ChainerMN's gradient mean -----------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::meanCoalesced(
    std::vector<at::Tensor>& tensors,
    std::optional<at::ScalarType> wireDtype) {
  const char* op = "mean_coalesced";
  checkTensors(op, "tensors", tensors, Devices::CpuOrCuda);
  checkSameDevice(op, tensors);
  if (!tensors.empty()) {
    checkGroupDevice(op, cudaDevice_, tensors[0]);
  }
  at::ScalarType widest = at::kHalf;
  int64_t total = 0;
  for (const auto& tensor : tensors) {
    TORCH_CHECK_VALUE(
        at::isFloatingType(tensor.scalar_type()), op, ": gradients must be floating point, got ", tensor.scalar_type());
    checkStrategyHandles(op, *context_->strategy, tensor);
    widest = at::promoteTypes(widest, tensor.scalar_type());
    total += tensor.numel();
  }
  const at::ScalarType wire = wireDtype.value_or(widest);
  TORCH_CHECK_VALUE(at::isFloatingType(wire), op, ": the wire dtype must be floating point, got ", wire);
  // ChainerMN's mean: 16-bit sums could overflow before the division, so they are scaled first.
  const bool prescale = wire == at::kHalf || wire == at::kBFloat16;
  const double scale = 1.0 / size_;
  // One tensor already in the wire dtype (a DDP bucket with no compression) is reduced where it
  // lies: packing it would be a copy for nothing.
  const bool inPlace = tensors.size() == 1 && tensors[0].scalar_type() == wire;
  if (tensors.empty()) {
    return enqueue(c10d::OpType::ALLREDUCE_COALESCED, op, tensors, c10d::kUnsetTimeout, [](GroupContext&) {
      return RequestPtr();
    });
  }
  return enqueueOn(
      tensors[0],
      c10d::OpType::ALLREDUCE_COALESCED,
      op,
      tensors,
      c10d::kUnsetTimeout,
      [tensors, wire, total, prescale, scale, inPlace](GroupContext& ctx, Target on) mutable {
        if (total == 0) {
          return RequestPtr();
        }
        const double before = prescale ? scale : 1.0;
        const double after = prescale ? 1.0 : scale;
        const std::vector<FlatBuffer> parts = flatBuffers(tensors);
        if (inPlace) {
          // Scaled where it lies (a pass only when there is a scale).
          const FlatBuffer whole{tensors[0].data_ptr(), total, wire};
          if (before != 1.0) {
            on.scratch.pack(parts, whole.data, wire, before);
          }
          ctx.strategy->allreduce(on.transports, on.scratch, whole, ReduceKind::Sum);
          if (after != 1.0) {
            on.scratch.unpack(whole.data, wire, parts, after);
          }
          return RequestPtr();
        }
        // One pass in (cast + prescale), one pass out (cast back + postscale): one kernel each on CUDA.
        void* packed = on.scratch.get(0, total * c10::elementSize(wire));
        on.scratch.pack(parts, packed, wire, before);
        ctx.strategy->allreduce(on.transports, on.scratch, FlatBuffer{packed, total, wire}, ReduceKind::Sum);
        on.scratch.unpack(packed, wire, parts, after);
        return RequestPtr();
      });
}

// ---- point to point: the worker starts the transfer in issue order and completes it later ---------

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  at::Tensor tensor = single("send", "tensor", tensors);
  checkRank("send", "dst", dstRank, size_);
  checkTag("send", tag);
  return enqueue(c10d::OpType::SEND, "send", {tensor}, c10d::kUnsetTimeout, [tensor, dstRank, tag](GroupContext& ctx) {
    return ctx.comm->send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  at::Tensor tensor = single("recv", "tensor", tensors);
  checkRank("recv", "src", srcRank, size_);
  checkTag("recv", tag);
  return enqueue(c10d::OpType::RECV, "recv", {tensor}, c10d::kUnsetTimeout, [tensor, srcRank, tag](GroupContext& ctx) {
    return ctx.comm->recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), srcRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor tensor = single("recv", "tensor", tensors);
  checkTag("recv", tag);
  return enqueue(c10d::OpType::RECVANYSOURCE, "recv", {tensor}, c10d::kUnsetTimeout, [tensor, tag](GroupContext& ctx) {
    return ctx.comm->recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), kAnySource, tag);
  });
}

} // namespace chainermn
