// Validation of every call, in one place, on the calling thread and before anything is queued: a bad
// call raises ValueError on the rank that made it and never leaves other ranks waiting on a
// half-started collective. Messages name the op and the argument.
#pragma once

#include "comm/transport.h"
#include "strategies/strategy.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <optional>
#include <vector>

namespace chainermn {

// Where an op's tensors may live. Ops that take CUDA tensors (in a build with CUDA) say so; the
// others refuse them here, naming the op.
enum class Devices { Cpu, CpuOrCuda };

// A tensor the transports can read and write: defined, dense, contiguous, on a device the op takes.
void checkTensor(const char* op, const char* argument, const at::Tensor& tensor, Devices devices = Devices::Cpu);
void checkTensors(
    const char* op, const char* argument, const std::vector<at::Tensor>& tensors, Devices devices = Devices::Cpu);

// Exactly one tensor per call (one device per process), returned for convenience.
at::Tensor& single(
    const char* op, const char* argument, std::vector<at::Tensor>& tensors, Devices devices = Devices::Cpu);

// All tensors of one call on one device.
void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors);

// A group serves one CUDA device (one device per process): the first CUDA tensor it sees binds it
// (`bound` holds the device index, -1 before), and a tensor on another GPU is refused. CPU tensors
// pass.
void checkGroupDevice(const char* op, std::atomic<int>& bound, const at::Tensor& tensor);

// `tensor` has the device, dtype and number of elements of `like`.
void checkSameKind(
    const char* op,
    const char* argument,
    const at::Tensor& tensor,
    const at::Tensor& like,
    Devices devices = Devices::Cpu);

// The group's allreduce strategy can reduce this tensor (pure_nccl refuses CPU tensors).
void checkStrategyHandles(const char* op, const Strategy& strategy, const at::Tensor& tensor);

void checkRank(const char* op, const char* argument, int64_t rank, int size);
void checkTag(const char* op, int tag);

// How a c10d::ReduceOp is carried out on a transport for one dtype.
struct Reduction {
  ReduceKind kind;                    // what the transport reduces with
  at::ScalarType wireType;            // what the transport reduces (bool travels as uint8)
  std::optional<double> scaleBefore;  // PREMUL_SUM's factor; 1/size for AVG in 16-bit floats
  std::optional<double> divideAfter;  // size, for AVG in 32/64-bit floats
};

// Throws ValueError when the op is not defined for the dtype (bitwise ops on floats, AVG on integers, ...).
Reduction planReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype, int size);

// CUDA tensors go through NCCL, which has no bitwise reductions: refused for them (bool's SUM/MAX
// and PRODUCT/MIN are carried as MAX/MIN and pass).
void checkDeviceReduction(const char* op, const Reduction& plan, const at::Tensor& tensor);

} // namespace chainermn
