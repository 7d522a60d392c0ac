// How a c10d::ReduceOp is carried out on the transports: the kind they reduce with, the dtype they
// reduce, and the scaling before and after (AVG, PREMUL_SUM). Checked on the caller's thread, with
// the other checks (validate.h), before anything is queued.
#pragma once

#include "strategies/strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace chainermn {

// How a c10d::ReduceOp is carried out on a transport for one dtype.
struct Reduction {
  ReduceKind kind;          // what the transport reduces with
  at::ScalarType wireType;  // what the transport reduces (bool travels as uint8)
  Scaling scaling;          // PREMUL_SUM's factor before; AVG's 1/size before (16-bit) or after
  // PREMUL_SUM's factor when it is a tensor on a GPU: applied there (premultiply), since reading it
  // into scaling.before (.item()) would make the caller wait for the GPU on every op.
  at::Tensor factor;
  // AVG of integers, as NCCL computes it: the sum, then divided by the group's size (truncating).
  int64_t integerDivisor = 1;
};

// AVG of integers: `result` (the sum) divided by the group's size in place, truncating toward zero,
// on the current stream for CUDA tensors. Nothing for any other reduction.
void divideIntegerAverage(const Reduction& plan, const at::Tensor& result);

// PREMUL_SUM's device factor, if any, applied in place to `count` elements of plan.wireType at
// `data` on `device` (on the current stream: the group's, in an op's body).
void premultiply(const Reduction& plan, void* data, int64_t count, at::Device device);

// Whether the op scales its input where it lies before reducing (PREMUL_SUM's factor, a 16-bit AVG's
// 1/size, on a tensor reduced in place): a check folded into its first exchange would come after
// that write, so its check goes first (OpSpec::checkFolds).
inline bool scalesInPlaceFirst(const Reduction& plan) {
  return plan.scaling.before != 1.0 || plan.factor.defined();
}

// Throws ValueError when the op is not defined for the dtype (bitwise ops on floats, AVG on bool, ...).
Reduction planReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype, int size);

// ChainerMN's mean over `size` ranks of values reduced as `wire`: float16/bfloat16 are scaled by 1/size
// before the sum (their sum could overflow where the mean fits), wider dtypes after it. The one
// place that rule lives: AVG and mean_coalesced both take it from here.
Scaling meanScaling(at::ScalarType wire, int size);

// Bitwise reductions need transports that have them: NCCL has none, so CUDA tensors are refused
// them unless the group's CUDA transport stages through the host (bool's SUM/MAX and PRODUCT/MIN are
// carried as MAX/MIN and pass).
void checkDeviceReduction(const char* op, const Reduction& plan, const at::Tensor& tensor, bool cudaBitwise);

}  // namespace chainermn
