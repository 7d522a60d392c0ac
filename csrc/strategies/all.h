// Factories of the strategies, one per file; makeStrategy() chooses among them by name.
#pragma once

#include "strategies/strategy.h"

namespace chainermn {

std::unique_ptr<Strategy> makeNaive();
std::unique_ptr<Strategy> makeFlat();
std::unique_ptr<Strategy> makeHierarchical();
std::unique_ptr<Strategy> makeTwoDimensional(const Topology& topology);
std::unique_ptr<Strategy> makeSingleNode(const Topology& topology);
std::unique_ptr<Strategy> makePureNccl();

// For two-level strategies: when one level has a single rank (one node, or one rank per node),
// does the whole reduction as one allreduce over all ranks and returns true.
bool singleLevel(TransportSet& transports, const FlatBuffer& buf, ReduceKind op);

}  // namespace chainermn
