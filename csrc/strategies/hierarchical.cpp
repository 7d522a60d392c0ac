// hierarchical: reduce within each node to its first rank, allreduce among those node leaders,
// broadcast within each node. Only one rank per node crosses the network. Nodes may differ in size.
#include "strategies/all.h"

namespace chainermn {

namespace {

class Hierarchical : public Strategy {
 public:
  const char* name() const override {
    return "hierarchical";
  }
  void allreduce(TransportSet& transports, Scratch&, const FlatBuffer& buf, ReduceKind op) override {
    if (singleLevel(transports, buf, op)) {
      return;
    }
    // In place on every rank: off the leader the buffer's contents are replaced by the broadcast.
    transports.intra->reduce(buf.data, buf.data, buf.count, buf.dtype, op, /*root=*/0);
    if (transports.intra->rank() == 0) {
      transports.inter->allreduce(buf.data, buf.count, buf.dtype, op);
    }
    transports.intra->broadcast(buf.data, buf.count, buf.dtype, /*root=*/0);
  }
};

}  // namespace

std::unique_ptr<Strategy> makeHierarchical() {
  return std::make_unique<Hierarchical>();
}

}  // namespace chainermn
