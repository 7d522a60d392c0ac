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
  void allreduceParts(TransportSet& transports, Scratch& scratch, const std::vector<FlatBuffer>& parts,
                      c10::ScalarType wire, ReduceKind op, Scaling scaling) override {
    for (const auto& part : parts) {
      Strategy::allreduceParts(transports, scratch, {part}, wire, op, scaling);
    }
  }
};

}  // namespace

std::unique_ptr<Strategy> makeNaive() {
  return std::make_unique<Naive>();
}

}  // namespace chainermn
