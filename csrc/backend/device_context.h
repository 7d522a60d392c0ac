// The transports and staging buffers of one device of a group, as the worker sees them, and the
// stream ordering of CUDA work. The CPU context is built with the group; the CUDA one on the worker
// thread at the group's first CUDA operation (collective: every rank issues its ops in the same
// order), from a CudaSetup the group keeps.
//
// This header names no CUDA type, so the process group compiles the same with and without CUDA;
// device_context.cpp holds the CUDA side; in a CPU-only build its functions refuse CUDA with an
// error, a path validation already closes by refusing CUDA tensors before anything is queued.
#pragma once

#include "kernels/scratch.h"
#include "comm/transport.h"
#include "topology.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

namespace chainermn {

struct DeviceContext {
  explicit DeviceContext(at::Device device) : scratch(device) {}
  virtual ~DeviceContext() = default;
  TransportSet transports;  // world, intra and inter transports for buffers on this device
  Scratch scratch;
};

// How CUDA buffers travel (CHAINERMN_CUDA_TRANSPORT):
//   "nccl"       NCCL on every level;
//   "nccl_intra" NCCL within a node, the host transport staged through pinned memory between nodes
//                (ChainerMN's non_cuda_aware);
//   "staged"     the host transport staged through pinned memory on every level.
struct CudaSetup {
  c10::intrusive_ptr<c10d::Store> store;
  Topology topology;
  std::string transport = "nccl";
};

// True when this build handles CUDA tensors (compiled with CHAINERMN_WITH_CUDA).
bool cudaBuilt();
const std::vector<std::string>& cudaTransports();
// The NCCL version linked in ("" without CUDA).
std::string ncclVersion();

// Caller thread, when a CUDA op is queued: a mark of the caller's current stream on the tensor's
// device (an event recorded there). Null for CPU tensors.
std::shared_ptr<void> markCallerStream(const at::Tensor& tensor);

// Worker thread: the group's context for a CUDA device (created on first use), whose stream is made
// to wait for `callerMark` and is made this thread's current stream, so that the op's kernels and
// the Work's completion events (ivalue::Future::markCompleted records on current streams) are on it.
DeviceContext& enterCuda(
    std::unique_ptr<DeviceContext>& slot,
    const CudaSetup& setup,
    const TransportSet& host,
    at::Device device,
    const std::shared_ptr<void>& callerMark);

// Worker thread, after a CUDA op's body queued its work: the tensors' memory is marked as in use by
// the group's stream, so the caching allocator does not hand it out again before that work is done
// even if the caller drops the tensors at once (as ProcessGroupNCCL does with recordStream).
void keepUntilDone(DeviceContext& context, const std::vector<at::Tensor>& tensors);

} // namespace chainermn
