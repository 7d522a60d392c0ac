// How NCCL is told what to move or reduce: its data type and count for a tensor dtype, and its
// reduction for a ReduceKind. Mapped before any ncclGroupStart, so that a refusal never leaves a
// group open. CUDA builds only.
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nccl.h>

#include <optional>

namespace chainermn::nccl {

// NCCL's own type for a dtype it can reduce; nullopt for the others (int16, the unsigned types but
// uint8, float8, complex), which it can still move as bytes.
inline std::optional<ncclDataType_t> nativeType(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return ncclUint8;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Long:
      return ncclInt64;
    default:
      return std::nullopt;
  }
}

// What NCCL is told to move: `count` elements of `type`. Data movement takes any dtype, as bytes
// when NCCL has no type for it; only reductions need NCCL's type (validation refuses the others on
// the caller's thread: backend/reduction.cpp).
struct Wire {
  ncclDataType_t type;
  size_t count;
};

inline Wire moved(int64_t count, c10::ScalarType dtype) {
  if (auto type = nativeType(dtype)) {
    return {*type, static_cast<size_t>(count)};
  }
  return {ncclUint8, static_cast<size_t>(count) * c10::elementSize(dtype)};
}

inline Wire reduced(int64_t count, c10::ScalarType dtype) {
  auto type = nativeType(dtype);
  TORCH_CHECK_VALUE(type.has_value(), "chainermn: NCCL cannot reduce dtype ", dtype);
  return {*type, static_cast<size_t>(count)};
}

inline ncclRedOp_t toNccl(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum:
      return ncclSum;
    case ReduceKind::Product:
      return ncclProd;
    case ReduceKind::Min:
      return ncclMin;
    case ReduceKind::Max:
      return ncclMax;
    default:
      // Validation refuses bitwise reductions of CUDA tensors over NCCL before anything is queued.
      TORCH_CHECK_VALUE(false, "chainermn: NCCL has no ", reduceKindName(op), " reduction");
  }
}

}  // namespace chainermn::nccl
