#include "strategies/strategy.h"

#include "strategies/all.h"

#include <c10/util/Exception.h>

namespace chainermn {

void Strategy::allreduceMany(
    TransportSet& transports,
    Scratch& scratch,
    const std::vector<FlatBuffer>& bufs,
    ReduceKind op) {
  if (bufs.empty()) {
    return;
  }
  const auto dtype = bufs[0].dtype;
  int64_t total = 0;
  for (const auto& buf : bufs) {
    total += buf.count;
  }
  // Slot 0 holds the pack (one pass; one kernel launch on CUDA); strategies use slot 1 for their own
  // staging.
  void* packed = scratch.get(0, total * c10::elementSize(dtype));
  scratch.pack(bufs, packed, dtype, 1.0);
  allreduce(transports, scratch, FlatBuffer{packed, total, dtype}, op);
  scratch.unpack(packed, dtype, bufs, 1.0);
}

bool singleLevel(TransportSet& transports, const FlatBuffer& buf, ReduceKind op) {
  // One node, or one rank per node: one of the two levels is a single rank, so the whole reduction
  // is one allreduce on the other level.
  if (transports.inter->size() == transports.world->size() || transports.intra->size() == transports.world->size()) {
    transports.world->allreduce(buf.data, buf.count, buf.dtype, op);
    return true;
  }
  return false;
}

const std::vector<std::string>& strategyNames() {
  static const std::vector<std::string> names{
      "naive", "flat", "hierarchical", "two_dimensional", "single_node", "pure_nccl"};
  return names;
}

std::unique_ptr<Strategy> makeStrategy(const std::string& name, const Topology& topology) {
  if (name == "naive") {
    return makeNaive();
  }
  if (name == "flat") {
    return makeFlat();
  }
  if (name == "hierarchical") {
    return makeHierarchical();
  }
  if (name == "two_dimensional") {
    return makeTwoDimensional(topology);
  }
  if (name == "single_node") {
    return makeSingleNode(topology);
  }
  if (name == "pure_nccl") {
    return makePureNccl();
  }
  std::string allowed;
  for (const auto& known : strategyNames()) {
    allowed += (allowed.empty() ? "" : ", ") + known;
  }
  TORCH_CHECK_VALUE(false, "unknown chainermn communicator '", name, "' (choose from: ", allowed, ")");
}

} // namespace chainermn
