// two_dimensional: the buffer is cut into one block per local rank. A reduce-scatter within the node
// leaves local rank r with the node's sum of block r; every rank then allreduces its block with the
// ranks of the same local rank on the other nodes (all links busy at once); an allgather within
// the node reassembles the buffer. Needs nodes of equal size (the blocks must line up across nodes):
// with unequal nodes it runs as hierarchical.
#include "strategies/all.h"

namespace chainermn {
namespace {

class TwoDimensional : public Strategy {
 public:
  const char* name() const override {
    return "two_dimensional";
  }
  void allreduce(TransportSet& transports, Scratch& scratch, const FlatBuffer& buf, ReduceKind op) override {
    if (singleLevel(transports, buf, op)) {
      return;
    }
    const int local = transports.intra->size();
    const size_t width = c10::elementSize(buf.dtype);
    const int64_t block = (buf.count + local - 1) / local;
    const bool padded = block * local != buf.count;
    // A buffer that does not split evenly is staged into a padded copy (the pad is reduced and dropped).
    char* whole = static_cast<char*>(buf.data);
    if (padded) {
      whole = static_cast<char*>(scratch.get(Slot::StrategyWhole, block * local * width));
      scratch.copy(whole, buf.data, buf.count * width);
    }
    // The reduced block gets its own memory: a reduce-scatter may not write into its own input.
    void* mine = scratch.get(Slot::StrategyBlock, block * width);
    transports.intra->reduceScatter(whole, mine, block, buf.dtype, op);
    transports.inter->allreduce(mine, block, buf.dtype, op);
    transports.intra->allgather(mine, whole, block, buf.dtype);
    if (padded) {
      scratch.copy(buf.data, whole, buf.count * width);
    }
  }
};

}  // namespace

std::unique_ptr<Strategy> makeTwoDimensional(const Topology& topology) {
  for (const auto& node : topology.ranksOfNode) {
    if (node.size() != topology.ranksOfNode.front().size()) {
      return makeHierarchical();
    }
  }
  return std::make_unique<TwoDimensional>();
}

}  // namespace chainermn
