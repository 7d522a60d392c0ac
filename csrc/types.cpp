#include "types.h"

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

} // namespace chainermn
