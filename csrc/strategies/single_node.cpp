// single_node: one allreduce among the ranks of the node; for groups that live on one node.
#include "strategies/all.h"

#include <c10/util/Exception.h>

namespace chainermn {
namespace {

class SingleNode : public Strategy {
 public:
  const char* name() const override {
    return "single_node";
  }
  void allreduce(TransportSet& transports, Scratch&, const FlatBuffer& buf, ReduceKind op) override {
    transports.intra->allreduce(buf.data, buf.count, buf.dtype, op);
  }
};

}  // namespace

std::unique_ptr<Strategy> makeSingleNode(const Topology& topology) {
  TORCH_CHECK_VALUE(
      topology.interSize == 1,
      "chainermn communicator 'single_node' needs every rank of the group on one node, but the group spans ",
      topology.interSize, " nodes (use 'hierarchical' or 'two_dimensional')");
  return std::make_unique<SingleNode>();
}

}  // namespace chainermn
