// naive: every tensor is reduced on its own over all ranks. No packing, one call per tensor.
#include "strategies/all.h"

namespace chainermn {
namespace {

class Naive : public Strategy {
 public:
  const char* name() const override {
    return "naive";
  }
  void allreduce(TransportSet& transports, Scratch&, const FlatBuffer& buf, ReduceKind op) override {
    transports.world->allreduce(buf.data, buf.count, buf.dtype, op);
  }
  void allreduceMany(TransportSet& transports, Scratch& scratch, const std::vector<FlatBuffer>& bufs, ReduceKind op)
      override {
    for (const auto& buf : bufs) {
      allreduce(transports, scratch, buf, op);
    }
  }
};

} // namespace

std::unique_ptr<Strategy> makeNaive() {
  return std::make_unique<Naive>();
}

} // namespace chainermn
