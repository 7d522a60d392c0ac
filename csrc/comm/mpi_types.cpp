#include "comm/mpi_types.h"

#include "comm/mpi_runtime.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace chainermn::mpi {
namespace {

MPI_Datatype gHalfType = MPI_DATATYPE_NULL;
MPI_Datatype gBFloat16Type = MPI_DATATYPE_NULL;

template <typename T, typename Combine>
void combineInto(void* in, void* inout, int* len, Combine combine) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = static_cast<T>(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename T>
struct HalfOps {
  static void sum(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return a + b; });
  }
  static void product(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return a * b; });
  }
  static void min(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return std::min(a, b); });
  }
  static void max(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return std::max(a, b); });
  }
};

// [dtype 0 = Half, 1 = BFloat16][Sum, Product, Min, Max]
MPI_Op gHalfOps[2][4];

MPI_Datatype twoBytes() {
  MPI_Datatype type;
  check(MPI_Type_contiguous(2, MPI_BYTE, &type), "Type_contiguous");
  check(MPI_Type_commit(&type), "Type_commit");
  return type;
}

// Contiguous runs of bytes of the element's size, made once per size.
MPI_Datatype opaqueType(size_t elementSize) {
  static std::mutex mutex;
  static std::unordered_map<size_t, MPI_Datatype> types;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = types.find(elementSize);
  if (it != types.end()) {
    return it->second;
  }
  MPI_Datatype type;
  check(MPI_Type_contiguous(static_cast<int>(elementSize), MPI_BYTE, &type), "Type_contiguous");
  check(MPI_Type_commit(&type), "Type_commit");
  types.emplace(elementSize, type);
  return type;
}

}  // namespace

void createTypes() {
  static std::once_flag once;
  std::call_once(once, [] {
    gHalfType = twoBytes();
    gBFloat16Type = twoBytes();
    MPI_User_function* half[4] = {HalfOps<c10::Half>::sum, HalfOps<c10::Half>::product, HalfOps<c10::Half>::min,
                                  HalfOps<c10::Half>::max};
    MPI_User_function* bf16[4] = {HalfOps<c10::BFloat16>::sum, HalfOps<c10::BFloat16>::product,
                                  HalfOps<c10::BFloat16>::min, HalfOps<c10::BFloat16>::max};
    for (int i = 0; i < 4; ++i) {
      check(MPI_Op_create(half[i], /*commute=*/1, &gHalfOps[0][i]), "Op_create");
      check(MPI_Op_create(bf16[i], /*commute=*/1, &gHalfOps[1][i]), "Op_create");
    }
  });
}

MPI_Datatype mpiType(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Half:
      return gHalfType;
    case c10::ScalarType::BFloat16:
      return gBFloat16Type;
    case c10::ScalarType::Char:
      return MPI_INT8_T;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return MPI_UINT8_T;
    case c10::ScalarType::Short:
      return MPI_INT16_T;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    default:
      return opaqueType(c10::elementSize(dtype));
  }
}

MPI_Op mpiOp(ReduceKind op, c10::ScalarType dtype) {
  const bool half = dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16;
  if (half) {
    const int which = dtype == c10::ScalarType::Half ? 0 : 1;
    switch (op) {
      case ReduceKind::Sum:
        return gHalfOps[which][0];
      case ReduceKind::Product:
        return gHalfOps[which][1];
      case ReduceKind::Min:
        return gHalfOps[which][2];
      case ReduceKind::Max:
        return gHalfOps[which][3];
      default:
        TORCH_CHECK(false, "chainermn: ", reduceKindName(op), " is not defined for ", dtype);
    }
  }
  switch (op) {
    case ReduceKind::Sum:
      return MPI_SUM;
    case ReduceKind::Product:
      return MPI_PROD;
    case ReduceKind::Min:
      return MPI_MIN;
    case ReduceKind::Max:
      return MPI_MAX;
    case ReduceKind::BitAnd:
      return MPI_BAND;
    case ReduceKind::BitOr:
      return MPI_BOR;
    case ReduceKind::BitXor:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

}  // namespace chainermn::mpi
