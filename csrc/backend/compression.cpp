// The process group's gradient-compression op: validation on the caller's thread, then the
// compressed mean (strategies/compressed.h) queued like every collective.
#include "backend/process_group.h"
#include "backend/validate.h"

#include <c10/util/Exception.h>

namespace chainermn {

namespace {

// A residual the caller keeps: float32, contiguous, on the gradients' device, `expected` values.
void checkResidual(const char* op, const char* argument, const at::Tensor& residual, int64_t expected,
                   at::Device device) {
  if (expected == 0) {
    TORCH_CHECK_VALUE(!residual.defined() || residual.numel() == 0, op, ": ", argument,
                      " must be empty on this rank (only a node's first rank keeps residuals), got ", residual.numel(),
                      " values");
    return;
  }
  TORCH_CHECK_VALUE(residual.defined() && residual.numel() == expected, op, ": ", argument, " must hold ", expected,
                    " values, got ", residual.defined() ? residual.numel() : 0);
  TORCH_CHECK_VALUE(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.device() == device, op,
                    ": ", argument, " must be a contiguous float32 tensor on ", device, ", got ",
                    dtypeName(residual.scalar_type()), " on ", residual.device());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::compressedMean(std::vector<at::Tensor>& tensors,
                                                                     const at::Tensor& residual,
                                                                     const at::Tensor& secondResidual,
                                                                     const CompressionSpec& spec) {
  const char* op = "gradient_compression";
  return refusable(op, [&]() -> c10::intrusive_ptr<c10d::Work> {
    TORCH_CHECK_VALUE(!tensors.empty(), op, ": needs at least one gradient");
    checkTensors(op, "tensors", tensors);
    checkSameDevice(op, tensors);
    int64_t count = 0;
    for (const auto& tensor : tensors) {
      TORCH_CHECK_VALUE(at::isFloatingType(tensor.scalar_type()), op, ": gradients must be floating point, got ",
                        dtypeName(tensor.scalar_type()));
      count += tensor.numel();
    }
    TORCH_CHECK_VALUE(spec.code != nullptr && spec.named != nullptr, op,
                      ": the spec must come from compressionSpec (it checks the settings once)");
    const ResidualShape shape = compressionResiduals(spec, count);
    const at::Device device = tensors.front().device();
    checkResidual(op, "residual", residual, shape.first, device);
    checkResidual(op, "second_residual", secondResidual, shape.second, device);

    Agreement agreement = agreeOn(tensors);
    agreement.dtype = at::kFloat;     // the tensors may mix floating dtypes: the sums are float32
    agreement.settings = spec.named;  // the code and every setting it reads, compared across ranks
    std::vector<at::Tensor> kept;     // updated by the op: kept alive (and, on CUDA, from reuse) until it is done
    for (const auto* held : {&residual, &secondResidual}) {
      if (held->defined() && held->numel() > 0) {
        kept.push_back(*held);
      }
    }
    float* first = shape.first > 0 ? residual.data_ptr<float>() : nullptr;
    float* second = shape.second > 0 ? secondResidual.data_ptr<float>() : nullptr;
    return post({c10d::OpType::ALLREDUCE_COALESCED, op, tensors, std::move(kept), c10d::kUnsetTimeout, agreement},
                [tensors, spec, first, second, topology = topology_](DeviceContext& on) {
                  chainermn::compressedMean(on.transports, on.scratch, topology, flatParts(tensors), spec, first,
                                            second);
                  return RequestPtr();
                });
  });
}

}  // namespace chainermn
