// The transports and staging buffers of one device of a group, as the worker sees them, and the
// stream ordering of CUDA work. The CPU context is built with the group; the CUDA one on the worker
// thread at the group's first CUDA operation (collective: every rank issues its ops in the same
// order), by a builder the group keeps (backend/transports.h).
//
// This header names no CUDA type, so the process group compiles the same with and without CUDA;
// device_context.cpp holds the CUDA side; in a CPU-only build its functions refuse CUDA with an
// error, a path validation already closes by refusing CUDA tensors before anything is queued.
#pragma once

#include "comm/transport.h"
#include "kernels/scratch.h"
#include "strategies/strategy.h"

#include <ATen/ATen.h>
#include <functional>
#include <memory>
#include <string>

namespace chainermn {

// What an op runs on: the group's strategy, and the transports and staging buffers of the device
// its tensors are on. Every op's body is written against this, whatever the device.
struct DeviceContext {
  DeviceContext(Strategy& strategy, at::Device device) : strategy(strategy), scratch(device) {}
  virtual ~DeviceContext() = default;
  Strategy& strategy;
  TransportSet transports;  // world, intra and inter transports for buffers on this device
  Scratch scratch;
};

// Makes a CUDA device's transports, given the device and the group's stream there (a cudaStream_t).
using CudaTransportsBuilder = std::function<TransportSet(c10::DeviceIndex device, void* stream)>;

// True when this build handles CUDA tensors (compiled with CHAINERMN_WITH_CUDA).
bool cudaBuilt();
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
    Strategy& strategy,
    const CudaTransportsBuilder& build,
    at::Device device,
    const std::shared_ptr<void>& callerMark);

// Worker thread, after a CUDA collective's body queued its kernels: a mark on the group's stream,
// reached once the device has run them (a pooled event). The watchdog polls it.
RequestPtr markDeviceEnd(DeviceContext& context);

// Worker thread, after a CUDA op's body queued its work: the tensors' memory is marked as in use by
// the group's stream, so the caching allocator does not hand it out again before that work is done
// even if the caller drops the tensors at once (as ProcessGroupNCCL does with recordStream).
void keepUntilDone(DeviceContext& context, const std::vector<at::Tensor>& tensors);

} // namespace chainermn
