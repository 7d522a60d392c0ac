#include "kernels/pack.h"

#include "kernels/cast.h"

#include <cstring>

namespace chainermn {

void packCpu(const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale) {
  auto* out = static_cast<char*>(packed);
  const size_t width = c10::elementSize(wire);
  for (const auto& part : parts) {
    if (part.dtype == wire && scale == 1.0) {
      if (out != part.data) {
        std::memcpy(out, part.data, part.count * width);
      }
    } else {
      castScale(out, wire, part.data, part.dtype, part.count, scale);
    }
    out += part.count * width;
  }
}

void unpackCpu(const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts, double scale) {
  const auto* in = static_cast<const char*>(packed);
  const size_t width = c10::elementSize(wire);
  for (const auto& part : parts) {
    if (part.dtype == wire && scale == 1.0) {
      if (in != part.data) {
        std::memcpy(part.data, in, part.count * width);
      }
    } else {
      castScale(part.data, part.dtype, in, wire, part.count, scale);
    }
    in += part.count * width;
  }
}

}  // namespace chainermn
