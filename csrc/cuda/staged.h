// A host transport (MPI, Gloo, shared memory) for CUDA buffers, staged through pinned host memory:
// device -> pinned copy on the stream, wait for the stream, the host collective, pinned -> device
// copy on the stream. ChainerMN's `non_cuda_aware` inter-node step, and the fallback where NCCL
// cannot be used. Holds no algorithm: one call in, one host call out. The pinned buffers grow and
// are reused. Built only with CHAINERMN_WITH_CUDA.
#pragma once

#include "comm/transport.h"

#include <c10/core/Device.h>

namespace chainermn::staged {

// `stream` is a cudaStream_t on `device`; every copy is ordered on it.
TransportPtr createTransport(TransportPtr host, c10::DeviceIndex device, void* stream);

}  // namespace chainermn::staged
