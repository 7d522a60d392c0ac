// pure_nccl: one NCCL allreduce over all ranks. NCCL reduces CUDA tensors only, so CPU tensors are
// refused before anything is queued (validate.cpp asks supportsCpu()).
#include "strategies/all.h"

#include <c10/util/Exception.h>

namespace chainermn {
namespace {

class PureNccl : public Strategy {
 public:
  const char* name() const override {
    return "pure_nccl";
  }
  bool supportsCpu() const override {
    return false;
  }
  void allreduce(TransportSet& transports, Scratch&, const FlatBuffer& buf, ReduceKind op) override {
    // The world transport of a CUDA tensor's group is NCCL's.
    transports.world->allreduce(buf.data, buf.count, buf.dtype, op);
  }
};

}  // namespace

std::unique_ptr<Strategy> makePureNccl() {
  return std::make_unique<PureNccl>();
}

}  // namespace chainermn
