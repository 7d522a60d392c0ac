#include "strategies/strategy.h"

#include "strategies/all.h"

#include <c10/util/Exception.h>

namespace chainermn {

void Strategy::allreduceParts(TransportSet& transports, Scratch& scratch, const std::vector<FlatBuffer>& parts,
                              c10::ScalarType wire, ReduceKind op, Scaling scaling) {
  int64_t total = 0;
  for (const auto& part : parts) {
    total += part.count;
  }
  if (total == 0) {
    return;
  }
  if (parts.size() == 1 && parts[0].dtype == wire) {
    // Reduced where it lies: packing would be a copy for nothing. Scaling is a pass only when asked.
    const FlatBuffer& whole = parts[0];
    if (scaling.before != 1.0) {
      scratch.pack(parts, whole.data, wire, scaling.before);
    }
    allreduce(transports, scratch, whole, op);
    if (scaling.after != 1.0) {
      scratch.unpack(whole.data, wire, parts, scaling.after);
    }
    return;
  }
  void* packed = scratch.get(Slot::Packed, total * c10::elementSize(wire));
  scratch.pack(parts, packed, wire, scaling.before);
  allreduce(transports, scratch, FlatBuffer{packed, total, wire}, op);
  scratch.unpack(packed, wire, parts, scaling.after);
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
  static const std::vector<std::string> names{"naive",           "flat",        "hierarchical",
                                              "two_dimensional", "single_node", "pure_nccl"};
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

}  // namespace chainermn
