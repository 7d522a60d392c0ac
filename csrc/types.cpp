#include "types.h"

#include <algorithm>
#include <cctype>

namespace chainermn {

const char* reduceKindName(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::Sum:
      return "SUM";
    case ReduceKind::Product:
      return "PRODUCT";
    case ReduceKind::Min:
      return "MIN";
    case ReduceKind::Max:
      return "MAX";
    case ReduceKind::BitAnd:
      return "BAND";
    case ReduceKind::BitOr:
      return "BOR";
    case ReduceKind::BitXor:
      return "BXOR";
  }
  return "?";
}

std::string dtypeName(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Half:
      return "torch.float16";
    case c10::ScalarType::BFloat16:
      return "torch.bfloat16";
    case c10::ScalarType::Float:
      return "torch.float32";
    case c10::ScalarType::Double:
      return "torch.float64";
    case c10::ScalarType::Char:
      return "torch.int8";
    case c10::ScalarType::Byte:
      return "torch.uint8";
    case c10::ScalarType::Short:
      return "torch.int16";
    case c10::ScalarType::Int:
      return "torch.int32";
    case c10::ScalarType::Long:
      return "torch.int64";
    case c10::ScalarType::Bool:
      return "torch.bool";
    case c10::ScalarType::ComplexHalf:
      return "torch.complex32";
    case c10::ScalarType::ComplexFloat:
      return "torch.complex64";
    case c10::ScalarType::ComplexDouble:
      return "torch.complex128";
    default: {
      // c10 spells the rest as torch does, but capitalised ("UInt32", "Float8_e4m3fn").
      std::string name = c10::toString(dtype);
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      return "torch." + name;
    }
  }
}

}  // namespace chainermn
