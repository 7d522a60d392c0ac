// The process group's gradient-compression op: validation on the caller's thread, then the
// compressed mean (strategies/compressed.h) queued like every collective.
#include "backend/process_group.h"
#include "backend/validate.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>

namespace chainermn {

namespace {

// A residual the caller keeps: float32, contiguous, on the gradients' device, `expected` values.
void checkResidual(const char* op, const char* argument, const at::Tensor& residual, int64_t expected, at::Device device) {
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

// Every setting of the spec, each a field of its own that every rank must pass the same: the codes
// mean nothing to a rank that decodes them with another code, threshold, block or keep. A setting neither
// phase's code reads is left out (1-bit's threshold may differ: nothing reads it). compress_result is
// 0, or 1 + the sums' code.
Agreement withSpec(Agreement agreement, const CompressionSpec& spec) {
  const CodeInfo& code = codeInfo(spec.code);
  agreement = withSetting(std::move(agreement), SettingName::Code, static_cast<int32_t>(spec.code));
  if (code.usesThreshold) {  // the sums' codes (int8, 4-bit) read no threshold
    int32_t thresholdBits = 0;
    std::memcpy(&thresholdBits, &spec.settings.threshold, sizeof(thresholdBits));
    agreement = withSetting(std::move(agreement), SettingName::Threshold, thresholdBits);
  }
  if (usesBlock(spec)) {
    agreement = withSetting(std::move(agreement), SettingName::Block, static_cast<int32_t>(spec.settings.block));
  }
  if (code.usesKeep) {  // a row's length and layout: ranks that keep more per block read past each other's
    agreement = withSetting(std::move(agreement), SettingName::Keep, static_cast<int32_t>(spec.settings.keep));
  }
  agreement = withSetting(std::move(agreement), SettingName::CompressResult,
                          spec.compressResult ? 1 + static_cast<int32_t>(spec.resultCode) : 0);
  return withSetting(std::move(agreement), SettingName::ResultDtype, static_cast<int32_t>(spec.resultWire));
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::compressedMean(
    std::vector<at::Tensor>& tensors,
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
    checkCodeSettings(spec.code, spec.settings, op);
    if (spec.compressResult && spec.resultCode != spec.code) {
      TORCH_CHECK_VALUE(spec.resultCode == Code::Int8 || spec.resultCode == Code::FourBit, op,
                        ": the sums' code (compress_result) must be the code itself, 'int8' or '4bit', got '",
                        codeName(spec.resultCode), "'");
      checkCodeSettings(spec.resultCode, spec.settings, op);
    }
    TORCH_CHECK_VALUE(spec.resultWire == at::kFloat || spec.resultWire == at::kHalf || spec.resultWire == at::kBFloat16,
                      op, ": result_dtype must be torch.float32, torch.float16 or torch.bfloat16, got ",
                      dtypeName(spec.resultWire));
    const ResidualShape shape = compressionResiduals(spec, count);
    const at::Device device = tensors.front().device();
    checkResidual(op, "residual", residual, shape.first, device);
    checkResidual(op, "second_residual", secondResidual, shape.second, device);

    Agreement agreement = agreeOn(tensors);
    agreement.dtype = at::kFloat;  // the tensors may mix floating dtypes: the sums are float32
    agreement = withSpec(std::move(agreement), spec);
    std::vector<at::Tensor> kept;  // updated by the op: kept alive (and, on CUDA, from reuse) until it is done
    for (const auto* held : {&residual, &secondResidual}) {
      if (held->defined() && held->numel() > 0) {
        kept.push_back(*held);
      }
    }
    float* first = shape.first > 0 ? residual.data_ptr<float>() : nullptr;
    float* second = shape.second > 0 ? secondResidual.data_ptr<float>() : nullptr;
    return post(
        {c10d::OpType::ALLREDUCE_COALESCED, op, tensors, std::move(kept), c10d::kUnsetTimeout, agreement},
        [tensors, spec, first, second, topology = topology_](DeviceContext& on) {
          chainermn::compressedMean(on.transports, on.scratch, topology, flatParts(tensors), spec, first, second);
          return RequestPtr();
        });
  });
}

} // namespace chainermn
