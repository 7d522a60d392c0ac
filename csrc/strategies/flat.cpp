// flat: tensors packed into one buffer, reduced by one allreduce over all ranks.
#include "strategies/all.h"

namespace chainermn {
namespace {

class Flat : public Strategy {
 public:
  const char* name() const override {
    return "flat";
  }
  void allreduce(TransportSet& transports, Scratch&, const FlatBuffer& buf, ReduceKind op) override {
    transports.world->allreduce(buf.data, buf.count, buf.dtype, op);
  }
};

}  // namespace

std::unique_ptr<Strategy> makeFlat() {
  return std::make_unique<Flat>();
}

}  // namespace chainermn
