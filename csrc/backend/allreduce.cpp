// The allreduce family: one flow (pack with cast and scale -> the group's strategy -> unpack), for
// all_reduce, all_reduce_coalesced and the gradient mean the hooks and functions use. The sparse
// all_reduce is in sparse.cpp, the compressed mean in compression.cpp.
#include "backend/process_group.h"

#include "backend/reduction.h"
#include "backend/validate.h"

#include <c10/util/Exception.h>

namespace chainermn {

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  if (tensors.size() == 1 && tensors[0].is_sparse()) {
    return allreduceSparse(tensors[0], opts);  // sparse.cpp
  }
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    at::Tensor tensor = single(op, "tensor", tensors, Layout::Dense);
    checkStrategyHandles(op, *context_->strategy, tensor);
    const Reduction plan = planReduction(op, opts.reduceOp, tensor.scalar_type(), size_);
    checkDeviceReduction(op, plan, tensor, plan_.cuda.bitwise);
    return post({c10d::OpType::ALLREDUCE,
                 op,
                 {tensor},
                 {},
                 opts.timeout,
                 withReduce(agreeOn({tensor}), opts.reduceOp),
                 !opts.asyncOp,
                 !scalesInPlaceFirst(plan)},
                [tensor, plan](DeviceContext& on) {
                  premultiply(plan, tensor.data_ptr(), tensor.numel(),
                              tensor.device());  // in place: the result replaces it
                  on.strategy.allreduceParts(on.transports, on.scratch, flatParts({tensor}, plan.wireType),
                                             plan.wireType, plan.kind, plan.scaling);
                  divideIntegerAverage(plan, tensor);
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduce_coalesced(std::vector<at::Tensor>& tensors,
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
    checkDeviceReduction(op, plan, tensors[0], plan_.cuda.bitwise);
    return post({c10d::OpType::ALLREDUCE_COALESCED,
                 op,
                 tensors,
                 {},
                 opts.timeout,
                 withReduce(agreeOn(tensors), opts.reduceOp),
                 !opts.asyncOp,
                 !scalesInPlaceFirst(plan)},
                [tensors, plan](DeviceContext& on) {
                  for (const auto& tensor : tensors) {
                    premultiply(plan, tensor.data_ptr(), tensor.numel(), tensor.device());
                  }
                  on.strategy.allreduceParts(on.transports, on.scratch, flatParts(tensors, plan.wireType),
                                             plan.wireType, plan.kind, plan.scaling);
                  for (const auto& tensor : tensors) {
                    divideIntegerAverage(plan, tensor);
                  }
                  return RequestPtr();
                });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::meanCoalesced(std::vector<at::Tensor>& tensors,
                                                                    std::optional<at::ScalarType> wireDtype) {
  const char* op = "mean_coalesced";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    checkTensors(op, "tensors", tensors);
    std::optional<at::ScalarType> widest;
    for (const auto& tensor : tensors) {
      TORCH_CHECK_VALUE(at::isFloatingType(tensor.scalar_type()), op, ": gradients must be floating point, got ",
                        tensor.scalar_type());
      checkStrategyHandles(op, *context_->strategy, tensor);
      widest = widest ? at::promoteTypes(*widest, tensor.scalar_type()) : tensor.scalar_type();
    }
    // The wire dtype: the caller's, else the group's allreduce_grad_dtype, else the widest given.
    const at::ScalarType wire = wireDtype.value_or(options_.allreduceGradDtype.value_or(widest.value_or(at::kFloat)));
    TORCH_CHECK_VALUE(at::isFloatingType(wire), op, ": the wire dtype must be floating point, got ", wire);
    const Scaling scaling = meanScaling(wire, size_);
    Agreement agreement = agreeOn(tensors);
    agreement.dtype = wire;  // the tensors may mix dtypes: the ranks must agree on the wire's
    return post({c10d::OpType::ALLREDUCE_COALESCED, op, tensors, {}, c10d::kUnsetTimeout, agreement},
                [tensors, wire, scaling](DeviceContext& on) {
                  on.strategy.allreduceParts(on.transports, on.scratch, flatParts(tensors), wire, ReduceKind::Sum,
                                             scaling);
                  return RequestPtr();
                });
  });
}

}  // namespace chainermn
