// The one place a group's transports are built, for each device, from the group's setup and options.
//
//   CPU:  the host library (MPI or Gloo) on every level; with shared memory on, the node's ranks
//         reduce through a shared-memory segment (on a single node that is the whole group).
//   CUDA: "nccl"       NCCL on every level;
//         "nccl_intra" NCCL within a node, the host transport staged through pinned memory between
//                      nodes (ChainerMN's non_cuda_aware);
//         "staged"     the host transports staged through pinned memory on every level.
// The levels' members come from topology (Level), computed once for every library.
#pragma once

#include "backend/device_context.h"
#include "backend/options.h"
#include "runtime/worker.h"
#include "comm/transport.h"

#include <c10/core/Device.h>

#include <mutex>
#include <string>
#include <vector>

namespace chainermn {

// Collective over the group. The factory in `setup` is called once per level, in the same order on
// every rank.
TransportSet buildHostTransports(const GroupSetup& setup, bool sharedMemory);

// The names CHAINERMN_CUDA_TRANSPORT / Options.cuda_transport take.
const std::vector<std::string>& cudaTransportNames();

// Whether the CUDA transport can reduce with bitwise ops (NCCL cannot; the host libraries can).
bool cudaTransportHasBitwise(const std::string& cudaTransport);

// Whether every level of the group's CUDA transports is NCCL ("nccl"; "nccl_intra" on one node):
// then CUDA work is launched on the caller's thread (nothing host-side in it), and a receive from
// any source is impossible.
bool cudaTransportsAllNccl(const std::string& cudaTransport, const Topology& topology);

// A group's device transports as the watchdog sees them (DeviceComms): the CUDA transports are
// added when the group's first CUDA op builds them; asked and aborted from the watchdog's thread.
class WatchedTransports : public DeviceComms {
 public:
  void watch(const TransportSet& set);
  std::string asyncError() override;
  void abort() override;
  // Each once their work is done (Transport::close), from the thread shutting the group down.
  void close();

 private:
  std::mutex mutex_;
  std::vector<TransportPtr> transports_;  // each once, though levels may share one
};

// The builder of a group's CUDA transports (collective over the group, at its first CUDA op, on
// the thread that launches its CUDA work): `host` is the group's CPU transports (what "staged"
// stages through); what it builds is added to `watched`. Null in a build without CUDA. Defined in
// device_context.cpp, the backend's one door to csrc/cuda/.
CudaTransportsBuilder cudaTransportsBuilder(
    const GroupSetup& setup,
    const std::string& cudaTransport,
    const TransportSet& host,
    std::shared_ptr<WatchedTransports> watched);

} // namespace chainermn
