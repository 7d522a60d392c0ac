// ChainerMN's allreduce communicators, each written once against Transport.
//
// A strategy reduces one flat buffer in place across the group by composing collectives on the
// group's `world`, `intra` (ranks of this node) and `inter` (ranks of the same intra rank on every
// node) transports. It never names a library, so every strategy runs over MPI, Gloo, shared
// memory and NCCL alike, and is tested on the CPU. The caller hands it the transports and the
// Scratch of the buffer's device (for CUDA: NCCL or host transports staged through pinned memory),
// and it moves bytes only through the Scratch (memcpy on the CPU, the group's stream on CUDA).
#pragma once

#include "buffers/scratch.h"
#include "comm/transport.h"
#include "kernels/pack.h"
#include "topology.h"

#include <memory>
#include <string>
#include <vector>

namespace chainermn {

// How a reduction scales its parts: each input is multiplied by `before` as it is packed, each
// result by `after` as it is unpacked (1 means no pass). ChainerMN's mean is 1/size before the sum
// for 16-bit wire dtypes (so the sum cannot overflow) and after it otherwise; PREMUL_SUM scales before.
struct Scaling {
  double before = 1.0;
  double after = 1.0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual const char* name() const = 0;
  // False for strategies that only exist for CUDA tensors (pure_nccl).
  virtual bool supportsCpu() const {
    return true;
  }

  // buf becomes the reduction of every rank's buf (every rank passes the same count and dtype).
  virtual void allreduce(TransportSet& transports, Scratch& scratch, const FlatBuffer& buf, ReduceKind op) = 0;

  // The one reduction flow every caller uses (all_reduce, all_reduce_coalesced, mean_coalesced):
  // the parts (any mix of floating dtypes, or all of `wire`) are packed back to back into one buffer
  // of `wire` (cast and scaled by `before` in the same pass: one kernel launch on CUDA), reduced by
  // allreduce(), and unpacked (cast back, scaled by `after`). A single part already of `wire` is
  // reduced where it lies. `naive` runs this flow part by part instead of packing.
  virtual void allreduceParts(TransportSet& transports, Scratch& scratch, const std::vector<FlatBuffer>& parts,
                              c10::ScalarType wire, ReduceKind op, Scaling scaling);
};

// The communicator names users choose from.
const std::vector<std::string>& strategyNames();

// The named strategy for a group with this topology; throws ValueError for an unknown name or a
// topology the strategy cannot serve (single_node over several nodes).
std::unique_ptr<Strategy> makeStrategy(const std::string& name, const Topology& topology);

}  // namespace chainermn
