// A group's transports for CUDA buffers, one per level (topology.h), as CHAINERMN_CUDA_TRANSPORT says:
//   "nccl"       NCCL on every level;
//   "nccl_intra" NCCL within a node, the host transport staged through pinned memory between nodes
//                (ChainerMN's non_cuda_aware);
//   "staged"     the host transports staged through pinned memory on every level.
// CUDA builds only; backend/device_context.cpp is the door the rest of the backend uses.
#pragma once

#include "comm/transport.h"

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace chainermn::cuda {

// Collective over the group, in the same order on every rank. `host` is the group's CPU transports
// (what staging goes through); `stream` the group's cudaStream_t on `device`; `timeout` bounds NCCL's
// init and calls.
TransportSet buildTransports(
    c10d::Store& store,
    const Topology& topology,
    std::chrono::milliseconds timeout,
    const std::string& cudaTransport,
    const TransportSet& host,
    c10::DeviceIndex device,
    void* stream);

} // namespace chainermn::cuda
