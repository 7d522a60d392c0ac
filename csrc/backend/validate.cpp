#include "backend/validate.h"

#include "backend/device_context.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace chainermn {

namespace {

// torch's spelling of a dtype, as users see it in Python.
std::string dtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kShort:
      return "torch.int16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kBool:
      return "torch.bool";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default: {
      // c10 spells the rest as torch does, but capitalised ("UInt32", "Float8_e4m3fn").
      std::string name = c10::toString(dtype);
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      return "torch." + name;
    }
  }
}

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

} // namespace

void checkTensor(const char* op, const char* argument, const at::Tensor& tensor, Devices devices) {
  TORCH_CHECK_VALUE(tensor.defined(), op, ": ", argument, " is an undefined tensor");
  if (!tensor.device().is_cpu()) {
    TORCH_CHECK_VALUE(
        cudaBuilt() && tensor.device().is_cuda(),
        op,
        ": ",
        argument,
        " is on ",
        tensor.device(),
        "; this build of the chainermn backend handles CPU tensors only");
    TORCH_CHECK_VALUE(
        devices == Devices::CpuOrCuda,
        op,
        ": ",
        argument,
        " is on ",
        tensor.device(),
        "; the chainermn backend takes CUDA tensors in all_reduce, all_reduce_coalesced, broadcast, all_gather, "
        "all_gather_into_tensor and mean_coalesced only (move the tensor to the CPU for ",
        op,
        ")");
  }
  TORCH_CHECK_VALUE(
      tensor.layout() == at::kStrided, op, ": ", argument, " must be a dense tensor, got layout ", tensor.layout());
  TORCH_CHECK_VALUE(
      tensor.is_contiguous(), op, ": ", argument, " must be contiguous (call .contiguous() on it first)");
}

void checkTensors(const char* op, const char* argument, const std::vector<at::Tensor>& tensors, Devices devices) {
  for (const auto& tensor : tensors) {
    checkTensor(op, argument, tensor, devices);
  }
}

at::Tensor& single(const char* op, const char* argument, std::vector<at::Tensor>& tensors, Devices devices) {
  TORCH_CHECK_VALUE(
      tensors.size() == 1,
      op,
      ": expects exactly one tensor in ",
      argument,
      " (one device per process), got ",
      tensors.size());
  checkTensor(op, argument, tensors[0], devices);
  return tensors[0];
}

void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    TORCH_CHECK_VALUE(
        tensor.device() == tensors.front().device(),
        op,
        ": all tensors must be on one device, got ",
        tensors.front().device(),
        " and ",
        tensor.device());
  }
}

void checkGroupDevice(const char* op, std::atomic<int>& bound, const at::Tensor& tensor) {
  if (!tensor.device().is_cuda()) {
    return;
  }
  int expected = -1;
  const int index = tensor.device().index();
  if (bound.compare_exchange_strong(expected, index) || expected == index) {
    return;
  }
  TORCH_CHECK_VALUE(
      false,
      op,
      ": the group works on cuda:",
      expected,
      " (its first CUDA tensor was there) and cannot take a tensor on cuda:",
      index,
      "; use one GPU per process");
}

void checkSameKind(
    const char* op,
    const char* argument,
    const at::Tensor& tensor,
    const at::Tensor& like,
    Devices devices) {
  checkTensor(op, argument, tensor, devices);
  TORCH_CHECK_VALUE(
      tensor.device() == like.device(),
      op,
      ": all tensors must be on one device, got ",
      argument,
      " on ",
      tensor.device(),
      " and the input on ",
      like.device());
  TORCH_CHECK_VALUE(
      tensor.scalar_type() == like.scalar_type(),
      op,
      ": ",
      argument,
      " has dtype ",
      dtypeName(tensor.scalar_type()),
      " but the input has ",
      dtypeName(like.scalar_type()));
  TORCH_CHECK_VALUE(
      tensor.numel() == like.numel(),
      op,
      ": ",
      argument,
      " has ",
      tensor.numel(),
      " elements but the input has ",
      like.numel());
}

void checkStrategyHandles(const char* op, const Strategy& strategy, const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(
      !tensor.device().is_cpu() || strategy.supportsCpu(),
      op,
      ": communicator '",
      strategy.name(),
      "' reduces CUDA tensors only (NCCL); for CPU tensors use 'hierarchical', 'two_dimensional', "
      "'flat', 'naive' or 'single_node'");
}

void checkDeviceReduction(const char* op, const Reduction& plan, const at::Tensor& tensor) {
  const bool bitwise =
      plan.kind == ReduceKind::BitAnd || plan.kind == ReduceKind::BitOr || plan.kind == ReduceKind::BitXor;
  TORCH_CHECK_VALUE(
      !(tensor.device().is_cuda() && bitwise),
      op,
      ": ReduceOp.",
      reduceKindName(plan.kind),
      " is not available for CUDA tensors (NCCL has no bitwise reductions)");
}

void checkRank(const char* op, const char* argument, int64_t rank, int size) {
  TORCH_CHECK_VALUE(
      rank >= 0 && rank < size, op, ": ", argument, " ", rank, " is not a rank of this group (size ", size, ")");
}

void checkTag(const char* op, int tag) {
  TORCH_CHECK_VALUE(tag >= 0, op, ": tag must be non-negative, got ", tag);
}

Reduction planReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype, int size) {
  const auto which = reduceOp.op_;
  TORCH_CHECK_VALUE(
      isReducible(dtype),
      op,
      ": cannot reduce tensors of dtype ",
      dtypeName(dtype),
      " (supported: float16, bfloat16, float32, float64, int8, uint8, int32, int64, bool)");
  const bool floating = at::isFloatingType(dtype);
  const bool sixteenBit = dtype == at::kHalf || dtype == at::kBFloat16;

  Reduction plan{ReduceKind::Sum, dtype, std::nullopt, std::nullopt};
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
      TORCH_CHECK_VALUE(
          !floating, op, ": ReduceOp.", reduceOpName(which), " needs an integer or bool tensor, got ", dtypeName(dtype));
      plan.kind = which == c10d::ReduceOp::BAND ? ReduceKind::BitAnd
          : which == c10d::ReduceOp::BOR        ? ReduceKind::BitOr
                                                : ReduceKind::BitXor;
      break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(floating, op, ": ReduceOp.AVG needs a floating-point tensor, got ", dtypeName(dtype));
      plan.kind = ReduceKind::Sum;
      // 16-bit sums can overflow before the division: scale first, as ChainerMN's mean does.
      if (sixteenBit) {
        plan.scaleBefore = 1.0 / size;
      } else {
        plan.divideAfter = static_cast<double>(size);
      }
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK_VALUE(floating, op, ": ReduceOp.PREMUL_SUM needs a floating-point tensor, got ", dtypeName(dtype));
      // NCCLPreMulSumSupplement: torch 2.11 knows only this name; 2.13 keeps it as an alias.
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(reduceOp.supplement_.get());
      TORCH_CHECK_VALUE(supplement != nullptr, op, ": ReduceOp.PREMUL_SUM without a factor");
      plan.kind = ReduceKind::Sum;
      plan.scaleBefore = supplement->tensor_factor.defined() ? supplement->tensor_factor.item<double>()
                                                             : supplement->double_factor;
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

} // namespace chainermn
