// A group's transports for CUDA buffers, one per level (topology.h), each carried as its group's
// transport plan says (backend/transport_plan.h). The builder is CUDA builds only;
// backend/device_context.cpp is the door the rest of the backend uses. The carriers are plain names,
// so the plan is made and tested in any build.
#pragma once

#include "comm/transport.h"

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace chainermn::cuda {

// How one level's CUDA buffers travel.
enum class Carrier {
  Nccl,    // NCCL, on the device
  Staged,  // the level's host transport, staged through pinned memory
};

struct LevelCarriers {
  Carrier world = Carrier::Nccl;
  Carrier intra = Carrier::Nccl;
  Carrier inter = Carrier::Nccl;
};

// Collective over the group, in the same order on every rank. `host` is the group's CPU transports
// (what staging goes through); `stream` the group's cudaStream_t on `device`; `timeout` bounds NCCL's
// init and calls.
TransportSet buildTransports(c10d::Store& store, const Topology& topology, std::chrono::milliseconds timeout,
                             const LevelCarriers& carriers, const TransportSet& host, c10::DeviceIndex device,
                             void* stream);

}  // namespace chainermn::cuda
