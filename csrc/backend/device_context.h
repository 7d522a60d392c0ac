// The transports and staging buffers of one device of a group, as an op's body sees them, and the
// stream ordering of CUDA work. The CPU context is built with the group; the CUDA one at the group's
// first CUDA operation (collective: every rank issues its ops in the same order), by a builder the
// group keeps (cudaTransportsBuilder below), on the thread that launches the group's CUDA work.
//
// Where CUDA work is launched (process_group.h): over NCCL alone, on the caller's thread, as
// ProcessGroupNCCL does, under the device's launch lock; through host transports (staged), on the
// group's worker. Either way the body runs inside enterCuda's scope.
//
// This header names no CUDA type, so the process group compiles the same with and without CUDA;
// device_context.cpp holds the CUDA side over the device unit (cuda/device.h); in a CPU-only build
// its functions refuse CUDA with an error, a path validation already closes by refusing CUDA tensors
// before anything is queued.
#pragma once

#include "backend/options.h"
#include "backend/transport_plan.h"
#include "backend/watched_transports.h"
#include "comm/transport.h"
#include "buffers/scratch.h"
#include "strategies/strategy.h"

#include <ATen/ATen.h>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace chainermn {

// What an op runs on: the group's strategy, and the transports and staging buffers of the device
// its tensors are on. Every op's body is written against this, whatever the device.
struct DeviceContext {
  // `mover`: how the scratch moves bytes on `device` (null: the CPU's).
  DeviceContext(Strategy& strategy, at::Device device, std::unique_ptr<Mover> mover = nullptr)
      : strategy(strategy), scratch(device, std::move(mover)) {}
  virtual ~DeviceContext() = default;
  Strategy& strategy;
  TransportSet transports;  // world, intra and inter transports for buffers on this device
  Scratch scratch;
};

// Makes a CUDA device's transports, given the device and the group's stream there (a cudaStream_t).
using CudaTransportsBuilder = std::function<TransportSet(c10::DeviceIndex device, void* stream)>;

// The builder of a group's CUDA transports (collective over the group, at its first CUDA op, on
// the thread that launches its CUDA work), each level carried as `plan` says: `host` is the group's
// CPU transports (what staging goes through); what it builds is added to `watched`. Null in a build
// without CUDA.
CudaTransportsBuilder cudaTransportsBuilder(const GroupSetup& setup, const CudaPlan& plan, const TransportSet& host,
                                            std::shared_ptr<WatchedTransports> watched);

// True when this build handles CUDA tensors (compiled with CHAINERMN_WITH_CUDA).
bool cudaBuilt();
// The NCCL version linked in ("" without CUDA).
std::string ncclVersion();

// Caller thread, when a CUDA op is posted: a mark of the caller's current stream on the tensor's
// device. Null for CPU tensors.
std::shared_ptr<void> markCallerStream(const at::Tensor& tensor);

// A CUDA op's scope on the thread that launches it: the group's device and stream are current (the
// caching allocator, the pack kernels and the Work's completion use the current stream), and the
// group's stream is ordered after the caller's mark. Restores the thread's device and stream.
class DeviceScope {
 public:
  virtual ~DeviceScope() = default;
};

// The group's context for a CUDA device (created on first use, in `slot`), entered: its stream is
// made to wait for `callerMark`. The context is *slot while the scope lives.
std::unique_ptr<DeviceScope> enterCuda(std::unique_ptr<DeviceContext>& slot, Strategy& strategy,
                                       const CudaTransportsBuilder& build, at::Device device,
                                       const std::shared_ptr<void>& callerMark);

// Inside the scope, after a CUDA op's body queued its work: a mark on the group's stream, reached
// once the device has run it. The watchdog polls it (on its own thread: the mark sets its device).
RequestPtr markDeviceEnd(DeviceContext& context);

// Inside the scope, BEFORE the body queues anything: the tensors' memory is marked as in use by the
// group's stream, so the caching allocator does not hand it out again before that work is done, even
// if the caller drops the tensors at once, or the body throws after queueing kernels (recordStream).
void keepUntilDone(DeviceContext& context, const std::vector<at::Tensor>& tensors);

// How a Scratch moves bytes and runs the compression kernels on `device` (the CPU's, or a GPU's on
// the current stream): for harnesses that run kernels outside a group.
std::unique_ptr<Mover> moverFor(at::Device device);

// Blocks the host until this thread's current stream on `device` has run what was queued on it.
void synchronizeCurrentStream(at::Device device);

// Held while this thread submits NCCL work for `device`: one submitter per device at a time,
// process wide, so that every rank submits in its program's order.
std::unique_lock<std::mutex> lockDeviceLaunches(at::Device device);

}  // namespace chainermn
