#include "backend/reduction.h"

#include "backend/validate.h"

#include <c10/util/Exception.h>

namespace chainermn {

namespace {

bool isReducible(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat:
    case at::kDouble:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      // int16 among them: Gloo cannot reduce it, and a dtype should not work on one transport only.
      return false;
  }
}

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

}  // namespace

void checkDeviceReduction(const char* op, const Reduction& plan, const at::Tensor& tensor, bool cudaBitwise) {
  const bool bitwise =
      plan.kind == ReduceKind::BitAnd || plan.kind == ReduceKind::BitOr || plan.kind == ReduceKind::BitXor;
  TORCH_CHECK_VALUE(!(tensor.device().is_cuda() && bitwise && !cudaBitwise), op, ": ReduceOp.",
                    reduceKindName(plan.kind),
                    " is not available for CUDA tensors over NCCL, which has no bitwise reductions "
                    "(CHAINERMN_CUDA_TRANSPORT=staged has them)");
}

void premultiply(const Reduction& plan, void* data, int64_t count, at::Device device) {
  if (plan.factor.defined() && count > 0) {
    auto factor = plan.factor.device() == device ? plan.factor : plan.factor.to(device);
    at::from_blob(data, {count}, at::TensorOptions().dtype(plan.wireType).device(device)).mul_(factor);
  }
}

void divideIntegerAverage(const Reduction& plan, const at::Tensor& result) {
  if (plan.integerDivisor != 1 && result.numel() > 0) {
    result.div_(plan.integerDivisor, "trunc");
  }
}

Scaling meanScaling(at::ScalarType wire, int size) {
  const double scale = 1.0 / size;
  if (wire == at::kHalf || wire == at::kBFloat16) {
    return Scaling{scale, 1.0};
  }
  return Scaling{1.0, scale};
}

Reduction planReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype, int size) {
  const auto which = reduceOp.op_;
  TORCH_CHECK_VALUE(isReducible(dtype), op, ": cannot reduce tensors of dtype ", dtypeName(dtype),
                    " (supported: float16, bfloat16, float32, float64, int8, uint8, int32, int64, bool)");
  const bool floating = at::isFloatingType(dtype);

  Reduction plan{ReduceKind::Sum, dtype, Scaling{}};
  switch (which) {
    case c10d::ReduceOp::SUM:
      plan.kind = ReduceKind::Sum;
      break;
    case c10d::ReduceOp::PRODUCT:
      plan.kind = ReduceKind::Product;
      break;
    case c10d::ReduceOp::MIN:
      plan.kind = ReduceKind::Min;
      break;
    case c10d::ReduceOp::MAX:
      plan.kind = ReduceKind::Max;
      break;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK_VALUE(!floating, op, ": ReduceOp.", reduceOpName(which), " needs an integer or bool tensor, got ",
                        dtypeName(dtype));
      plan.kind = which == c10d::ReduceOp::BAND  ? ReduceKind::BitAnd
                  : which == c10d::ReduceOp::BOR ? ReduceKind::BitOr
                                                 : ReduceKind::BitXor;
      break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(dtype != at::kBool, op, ": ReduceOp.AVG needs a numeric tensor, got ", dtypeName(dtype));
      plan.kind = ReduceKind::Sum;
      if (!floating) {
        plan.integerDivisor = size;  // as NCCL's ncclAvg: integer division of the sum
        break;
      }
      plan.scaling = meanScaling(dtype, size);
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_VALUE(floating, op, ": ReduceOp.PREMUL_SUM needs a floating-point tensor, got ", dtypeName(dtype));
      // NCCLPreMulSumSupplement: torch 2.11 knows only this name; 2.13 keeps it as an alias.
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(reduceOp.supplement_.get());
      TORCH_CHECK_VALUE(supplement != nullptr, op, ": ReduceOp.PREMUL_SUM without a factor");
      plan.kind = ReduceKind::Sum;
      const at::Tensor& factor = supplement->tensor_factor;
      if (factor.defined() && !factor.device().is_cpu()) {
        plan.factor = factor;
      } else {
        plan.scaling.before = factor.defined() ? factor.item<double>() : supplement->double_factor;
      }
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, op, ": unsupported reduce op ", reduceOpName(which));
  }

  if (dtype == at::kBool) {
    // Bool sums are logical: SUM and MAX are OR, PRODUCT and MIN are AND; XOR stays bitwise on 0/1.
    plan.wireType = at::kByte;
    if (plan.kind == ReduceKind::Sum || plan.kind == ReduceKind::BitOr) {
      plan.kind = ReduceKind::Max;
    } else if (plan.kind == ReduceKind::Product || plan.kind == ReduceKind::BitAnd) {
      plan.kind = ReduceKind::Min;
    }
  }
  return plan;
}

}  // namespace chainermn
