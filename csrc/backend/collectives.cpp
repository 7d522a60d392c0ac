// The collectives other than the allreduce family (allreduce.cpp): each validates its arguments (validate.h) and posts
// a body written against the transports and scratch of its tensors' device, so every one of them
// runs on CPU and CUDA tensors alike. Packing goes through Scratch (memcpy or one kernel launch).
#include "backend/process_group.h"

#include "backend/reduction.h"
#include "backend/validate.h"

#include <c10/util/Exception.h>

#include <numeric>

namespace chainermn {

namespace {

size_t bytesOf(const at::Tensor& tensor) {
  return static_cast<size_t>(tensor.numel()) * tensor.element_size();
}

// Tensors of any dtypes as raw bytes, so packing them is a plain copy.
std::vector<FlatBuffer> bytesOfParts(const std::vector<at::Tensor>& tensors) {
  std::vector<FlatBuffer> parts;
  parts.reserve(tensors.size());
  for (const auto& tensor : tensors) {
    parts.push_back(FlatBuffer{tensor.data_ptr(), static_cast<int64_t>(bytesOf(tensor)), at::kByte});
  }
  return parts;
}

// `source` scaled into the Packed slot when the reduction scales first, else `source` itself: the
// caller's input is never modified.
const void* scaledInput(Scratch& scratch, const at::Tensor& source, const Reduction& plan) {
  if (plan.scaling.before == 1.0 && !plan.factor.defined()) {
    return source.data_ptr();
  }
  void* staged = scratch.get(Slot::Packed, bytesOf(source));
  scratch.pack({FlatBuffer{source.data_ptr(), source.numel(), plan.wireType}}, staged, plan.wireType,
               plan.scaling.before);
  premultiply(plan, staged, source.numel(), source.device());
  return staged;
}

// The reduction's result scaled where it lies (AVG's 1/size for wide dtypes, its integer division
// for integers); no pass when nothing changes.
void scaleResult(Scratch& scratch, const at::Tensor& result, const Reduction& plan) {
  if (plan.scaling.after != 1.0) {
    const FlatBuffer whole{result.data_ptr(), result.numel(), plan.wireType};
    scratch.unpack(whole.data, plan.wireType, {whole}, plan.scaling.after);
  }
  divideIntegerAverage(plan, result);
}

// A gather's inputs in logical order: each tensor itself when contiguous, else a contiguous copy of
// its dense layout (channels_last).
std::vector<at::Tensor> contiguousInputs(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> inputs;
  inputs.reserve(tensors.size());
  for (const auto& tensor : tensors) {
    inputs.push_back(tensor.contiguous());
  }
  return inputs;
}

// all-to-all: the ranks' counts legitimately differ, so the fingerprint compares the dtype only;
// the bodies check that every sender's count is what its receiver expects (checkSplits).
Agreement splitsChecked(const at::Tensor& tensor, std::vector<int64_t> sendCounts, std::vector<int64_t> recvCounts) {
  Agreement agreement;
  agreement.dtype = tensor.scalar_type();
  agreement.sendCounts = std::move(sendCounts);
  agreement.recvCounts = std::move(recvCounts);
  return agreement;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor tensor = single(op, "tensor", tensors, Layout::Dense);
    checkRank(op, "dst", opts.rootRank, size_);
    const Reduction plan = planReduction(op, opts.reduceOp, tensor.scalar_type(), size_);
    checkDeviceReduction(op, plan, tensor, plan_.cuda.bitwise);
    const int root = static_cast<int>(opts.rootRank);
    const bool isRoot = rank_ == root;
    return post({c10d::OpType::REDUCE,
                 op,
                 {tensor},
                 {},
                 opts.timeout,
                 withReduce(withRoot(agreeOn({tensor}), "dst", root), opts.reduceOp),
                 !opts.asyncOp,
                 /*checkFolds=*/true},
                [tensor, plan, root, isRoot](DeviceContext& on) {
                  if (tensor.numel() == 0) {
                    return RequestPtr();
                  }
                  const void* input = scaledInput(on.scratch, tensor, plan);
                  if (isRoot) {
                    on.transports.world->reduce(input, tensor.data_ptr(), tensor.numel(), plan.wireType, plan.kind,
                                                root);
                    scaleResult(on.scratch, tensor, plan);
                  } else {
                    // Off the root the input stays as it was: `sink` is what a transport that reduces in place
                    // may overwrite.
                    void* sink = on.scratch.get(Slot::Received, bytesOf(tensor));
                    on.transports.world->reduce(input, sink, tensor.numel(), plan.wireType, plan.kind, root);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                                std::vector<at::Tensor>& inputTensors,
                                                                const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    // Any dense layout: gathered in logical order from a contiguous copy (none when contiguous).
    at::Tensor input = single(op, "tensor", inputTensors, Layout::Dense).contiguous();
    std::vector<at::Tensor> outputs = onlyList(op, "output list", outputTensors);
    checkListSize(op, "tensor_list", outputs.size(), size_);
    for (const auto& output : outputs) {
      checkSameKind(op, "tensor_list", output, input);
    }
    const int size = size_;
    return post({c10d::OpType::ALLGATHER,
                 op,
                 outputs,
                 {input},
                 opts.timeout,
                 agreeOn({input}),
                 !opts.asyncOp,
                 /*checkFolds=*/true},
                [input, outputs, size](DeviceContext& on) {
                  if (input.numel() > 0) {
                    void* gathered = on.scratch.get(Slot::Received, bytesOf(input) * size);
                    on.transports.world->allgather(input.data_ptr(), gathered, input.numel(), input.scalar_type());
                    on.scratch.unpack(gathered, input.scalar_type(), flatParts(outputs), 1.0);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::_allgather_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                                      const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkWorldBlocks(op, "output_tensor", outputBuffer, "input_tensor", inputBuffer, size_, -1, Layout::Dense);
    at::Tensor output = outputBuffer, input = inputBuffer.contiguous();
    return post({c10d::OpType::_ALLGATHER_BASE,
                 op,
                 {output},
                 {input},
                 opts.timeout,
                 agreeOn({input}),
                 !opts.asyncOp,
                 /*checkFolds=*/true},
                [output, input](DeviceContext& on) {
                  if (input.numel() > 0) {
                    on.transports.world->allgather(input.data_ptr(), output.data_ptr(), input.numel(),
                                                   input.scalar_type());
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists, std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkTensors(op, "input_tensor_list", inputTensors, Layout::Dense);
    checkListSize(op, "output_tensor_lists", outputTensorLists.size(), size_);
    std::vector<at::Tensor> outputs;  // rank-major, as they arrive
    for (const auto& list : outputTensorLists) {
      TORCH_CHECK_VALUE(list.size() == inputTensors.size(), op,
                        ": every output list must match the input list's length");
      for (size_t i = 0; i < list.size(); ++i) {
        checkSameKind(op, "output_tensor_lists", list[i], inputTensors[i]);
        outputs.push_back(list[i]);
      }
    }
    const std::vector<at::Tensor> inputs = contiguousInputs(inputTensors);
    const int size = size_;
    return post({c10d::OpType::ALLGATHER_COALESCED, op, outputs, inputs, opts.timeout, agreeOn(inputs), !opts.asyncOp,
                 /*checkFolds=*/true},
                [inputs, outputs, size](DeviceContext& on) {
                  const auto packedParts = bytesOfParts(inputs);
                  const int64_t bytes = std::accumulate(packedParts.begin(), packedParts.end(), int64_t{0},
                                                        [](int64_t n, const FlatBuffer& p) { return n + p.count; });
                  if (bytes == 0) {
                    return RequestPtr();
                  }
                  // Pack every input, gather the packs of all ranks in one call, unpack rank by rank.
                  void* packed = on.scratch.get(Slot::Packed, bytes);
                  void* gathered = on.scratch.get(Slot::Received, bytes * size);
                  on.scratch.pack(packedParts, packed, at::kByte, 1.0);
                  on.transports.world->allgather(packed, gathered, bytes, at::kByte);
                  on.scratch.unpack(gathered, at::kByte, bytesOfParts(outputs), 1.0);
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_into_tensor_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": needs as many outputs as inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkWorldBlocks(op, "output", outputs[i], "input", inputs[i], size_, static_cast<int>(i), Layout::Dense);
    }
    const std::vector<at::Tensor> contiguous = contiguousInputs(inputs);
    return post({c10d::OpType::COALESCED, op, outputs, contiguous, opts.timeout, agreeOn(contiguous), !opts.asyncOp,
                 /*checkFolds=*/true},
                [outputs, inputs = contiguous](DeviceContext& on) {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    if (inputs[i].numel() > 0) {
                      on.transports.world->allgather(inputs[i].data_ptr(), outputs[i].data_ptr(), inputs[i].numel(),
                                                     inputs[i].scalar_type());
                    }
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::gather(std::vector<std::vector<at::Tensor>>& outputTensors,
                                                             std::vector<at::Tensor>& inputTensors,
                                                             const c10d::GatherOptions& opts) {
  const char* op = "gather";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor input = single(op, "tensor", inputTensors, Layout::Dense).contiguous();
    checkRank(op, "dst", opts.rootRank, size_);
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> outputs = rootList(op, "gather_list", outputTensors, rank_ == root, size_, input);
    const int size = size_;
    return post({c10d::OpType::GATHER, op, outputs, {input}, opts.timeout, withRoot(agreeOn({input}), "dst", root)},
                [input, outputs, root, size](DeviceContext& on) {
                  if (input.numel() > 0) {
                    void* gathered = outputs.empty() ? nullptr : on.scratch.get(Slot::Received, bytesOf(input) * size);
                    on.transports.world->gather(input.data_ptr(), gathered, input.numel(), input.scalar_type(), root);
                    if (!outputs.empty()) {
                      on.scratch.unpack(gathered, input.scalar_type(), flatParts(outputs), 1.0);
                    }
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::scatter(std::vector<at::Tensor>& outputTensors,
                                                              std::vector<std::vector<at::Tensor>>& inputTensors,
                                                              const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor output = single(op, "tensor", outputTensors);
    checkRank(op, "src", opts.rootRank, size_);
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> inputs = rootList(op, "scatter_list", inputTensors, rank_ == root, size_, output);
    const int size = size_;
    return post({c10d::OpType::SCATTER, op, {output}, inputs, opts.timeout, withRoot(agreeOn({output}), "src", root)},
                [output, inputs, root, size](DeviceContext& on) {
                  if (output.numel() > 0) {
                    void* packed = nullptr;
                    if (!inputs.empty()) {
                      packed = on.scratch.get(Slot::Packed, bytesOf(output) * size);
                      on.scratch.pack(flatParts(inputs), packed, output.scalar_type(), 1.0);
                    }
                    on.transports.world->scatter(packed, output.data_ptr(), output.numel(), output.scalar_type(), root);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce_scatter(std::vector<at::Tensor>& outputTensors,
                                                                     std::vector<std::vector<at::Tensor>>& inputTensors,
                                                                     const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor output = single(op, "output", outputTensors);
    std::vector<at::Tensor> inputs = onlyList(op, "input list", inputTensors);
    checkListSize(op, "input_list", inputs.size(), size_);
    for (const auto& input : inputs) {
      checkSameKind(op, "input_list", input, output);
    }
    const Reduction plan = planReduction(op, opts.reduceOp, output.scalar_type(), size_);
    checkDeviceReduction(op, plan, output, plan_.cuda.bitwise);
    const int size = size_;
    return post({c10d::OpType::REDUCE_SCATTER,
                 op,
                 {output},
                 inputs,
                 opts.timeout,
                 withReduce(agreeOn({output}), opts.reduceOp),
                 !opts.asyncOp},
                [output, inputs, plan, size](DeviceContext& on) {
                  if (output.numel() > 0) {
                    // Packed with the scale in the same pass.
                    void* packed = on.scratch.get(Slot::Packed, bytesOf(output) * size);
                    on.scratch.pack(flatParts(inputs, plan.wireType), packed, plan.wireType, plan.scaling.before);
                    premultiply(plan, packed, output.numel() * size, output.device());
                    on.transports.world->reduceScatter(packed, output.data_ptr(), output.numel(), plan.wireType,
                                                       plan.kind);
                    scaleResult(on.scratch, output, plan);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::_reduce_scatter_base(at::Tensor& outputBuffer,
                                                                           at::Tensor& inputBuffer,
                                                                           const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkWorldBlocks(op, "input", inputBuffer, "output", outputBuffer, size_);
    const Reduction plan = planReduction(op, opts.reduceOp, outputBuffer.scalar_type(), size_);
    checkDeviceReduction(op, plan, outputBuffer, plan_.cuda.bitwise);
    at::Tensor output = outputBuffer, input = inputBuffer;
    return post({c10d::OpType::_REDUCE_SCATTER_BASE,
                 op,
                 {output},
                 {input},
                 opts.timeout,
                 withReduce(agreeOn({output}), opts.reduceOp),
                 !opts.asyncOp},
                [output, input, plan](DeviceContext& on) {
                  if (output.numel() > 0) {
                    const void* source = scaledInput(on.scratch, input, plan);
                    on.transports.world->reduceScatter(source, output.data_ptr(), output.numel(), plan.wireType,
                                                       plan.kind);
                    scaleResult(on.scratch, output, plan);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": needs as many outputs as inputs");
    std::vector<Reduction> plans;
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkWorldBlocks(op, "input", inputs[i], "output", outputs[i], size_, static_cast<int>(i));
      plans.push_back(planReduction(op, opts.reduceOp, outputs[i].scalar_type(), size_));
      checkDeviceReduction(op, plans.back(), outputs[i], plan_.cuda.bitwise);
    }
    return post({c10d::OpType::COALESCED, op, outputs, inputs, opts.timeout,
                 withReduce(agreeOn(outputs), opts.reduceOp), !opts.asyncOp},
                [outputs, inputs, plans](DeviceContext& on) {
                  for (size_t i = 0; i < inputs.size(); ++i) {
                    if (outputs[i].numel() > 0) {
                      const void* source = scaledInput(on.scratch, inputs[i], plans[i]);
                      on.transports.world->reduceScatter(source, outputs[i].data_ptr(), outputs[i].numel(),
                                                         plans[i].wireType, plans[i].kind);
                      scaleResult(on.scratch, outputs[i], plans[i]);
                    }
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::alltoall_base(at::Tensor& outputBuffer, at::Tensor& inputBuffer,
                                                                    std::vector<int64_t>& outputSplitSizes,
                                                                    std::vector<int64_t>& inputSplitSizes,
                                                                    const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkTensor(op, "output", outputBuffer);
    checkTensor(op, "input", inputBuffer);
    checkSameDtype(op, {outputBuffer, inputBuffer});
    auto sendCounts = splitCounts(op, "input", inputBuffer, inputSplitSizes, size_);
    auto recvCounts = splitCounts(op, "output", outputBuffer, outputSplitSizes, size_);
    at::Tensor output = outputBuffer, input = inputBuffer;
    return post({c10d::OpType::ALLTOALL_BASE,
                 op,
                 {output},
                 {input},
                 opts.timeout,
                 splitsChecked(input, sendCounts, recvCounts)},
                [output, input, sendCounts, recvCounts](DeviceContext& on) {
                  on.transports.world->alltoallv(input.data_ptr(), sendCounts, output.data_ptr(), recvCounts,
                                                 input.scalar_type());
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::alltoall(std::vector<at::Tensor>& outputTensors,
                                                               std::vector<at::Tensor>& inputTensors,
                                                               const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
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
    return post(
        {c10d::OpType::ALLTOALL, op, outputs, inputs, opts.timeout, splitsChecked(inputs[0], sendCounts, recvCounts)},
        [outputs, inputs, sendCounts, recvCounts](DeviceContext& on) {
          const auto dtype = inputs[0].scalar_type();
          const size_t width = c10::elementSize(dtype);
          const int64_t sendTotal = std::accumulate(sendCounts.begin(), sendCounts.end(), int64_t{0});
          const int64_t recvTotal = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
          void* packed = on.scratch.get(Slot::Packed, sendTotal * width);
          void* received = on.scratch.get(Slot::Received, recvTotal * width);
          on.scratch.pack(flatParts(inputs), packed, dtype, 1.0);
          on.transports.world->alltoallv(packed, sendCounts, received, recvCounts, dtype);
          on.scratch.unpack(received, dtype, flatParts(outputs), 1.0);
          return RequestPtr();
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::broadcast(std::vector<at::Tensor>& tensors,
                                                                const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor tensor = single(op, "tensor", tensors, Layout::Dense);
    checkRank(op, "src", opts.rootRank, size_);
    const int root = static_cast<int>(opts.rootRank);
    return post({c10d::OpType::BROADCAST,
                 op,
                 {tensor},
                 {},
                 opts.timeout,
                 withRoot(agreeOn({tensor}), "src", root),
                 !opts.asyncOp,
                 /*checkFolds=*/true},
                [tensor, root](DeviceContext& on) {
                  if (tensor.numel() > 0) {
                    on.transports.world->broadcast(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), root);
                  }
                  return RequestPtr();
                });
  });
}

}  // namespace chainermn
