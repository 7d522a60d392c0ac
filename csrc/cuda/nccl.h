// NCCL as a transport for CUDA buffers (built only when torch has CUDA: CHAINERMN_WITH_CUDA).
//
// One Transport call is one NCCL call (gather, scatter and all-to-all, which NCCL lacks, are one
// ncclGroupStart/End of sends and receives), enqueued on the stream given at creation. "Completes"
// therefore means "is ordered on that stream": the caller orders later work after it on the stream
// (the process group's Work records an event there). barrier() alone waits for the stream.
// ncclResult_t errors become exceptions naming the op, the rank and the peer. Every dtype moves
// (as bytes where NCCL has no type for it); reductions take NCCL's types only.
//
// Communicators are non-blocking (ncclCommInitRankConfig, blocking = 0): each call is waited for
// until it settles, bounded by the timeout, and abort() can end any of them, the init included.
#pragma once

#include "comm/transport.h"

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace chainermn::nccl {

// Collective over the `size` ranks that call it with the same `key`: rank 0 makes the
// ncclUniqueId and publishes it in `store` under `key`; all init a communicator on `device`.
// `stream` is a cudaStream_t on that device. A peer that does not join within `timeout` makes it
// throw (naming the key and the rank), as does a call that does not settle within it.
TransportPtr createTransport(c10d::Store& store, const std::string& key, int rank, int size, c10::DeviceIndex device,
                             void* stream, std::chrono::milliseconds timeout);

// The NCCL version the library loaded at run time reports, e.g. "2.28.9".
std::string version();

}  // namespace chainermn::nccl
