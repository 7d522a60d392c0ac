// The block-scaled signed-integer codes, one family written once and templated on the bit width
// (kernels/int4.h: 4 bits, kernels/int2.h: 2 bits; each code's own files name its width and register
// its descriptor): the row's layout and the CPU encode and decode here, the CUDA kernels in
// cuda/block_int_kernels.cuh, the same layout and arithmetic, bit for bit.
//
// With Bits bits a value, a byte holds 8 / Bits values and a side has L = 2^(Bits - 1) - 1 levels
// (4 bits: 7, 2 bits: 1). A row of `count` float32 values travels as BlockInt<Bits>::rowBytes(count,
// block) bytes: ceil(count / (8 / Bits)) bytes of codes (value i in bits Bits x (i % (8 / Bits)) of
// byte i / (8 / Bits), in two's complement), zero bytes up to a multiple of 4, then one float32 scale
// per block of `block` values (a multiple of 8 / Bits, so that no byte holds values of two blocks;
// the last block may be short). As int8 (kernels/int8.h) with L levels a side: with m the block's
// largest |r|, its scale is m / L; value i travels as round_half_even(r x (L / m)), from -L to L (0
// where m is 0), and comes back as code x scale.
//
// With a residual (error feedback, for gradients) r = residual + value and the residual keeps
// r - code x scale; without one r = value.
//
// On the CPU, block by block: a block's values are read once for its largest magnitude (and kept in
// the residual: kernels/block_scale.h) and again, from the L1 cache, for their codes; IEEE products,
// rounding half to even (std::nearbyint under the default rounding mode), as the CUDA kernels do. The
// width is a template argument: the inner loops' shifts and masks are constants, as in code written
// for one width.
#pragma once

#include "kernels/block_scale.h"
#include "kernels/code.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace chainermn {

// The layout and the constants of the codes of `Bits` bits a value (host and device: constexpr).
template <int Bits>
struct BlockInt {
  static_assert(Bits >= 2 && Bits <= 8 && 8 % Bits == 0, "a value's bits: 2, 4 or 8 (whole values a byte)");
  static constexpr int kBits = Bits;
  static constexpr int kPerByte = 8 / Bits;
  static constexpr uint32_t kMask = (1u << Bits) - 1u;
  static constexpr uint32_t kSignBit = 1u << (Bits - 1);
  static constexpr int32_t kMaxCode = (1 << (Bits - 1)) - 1;  // codes from -kMaxCode to kMaxCode
  static constexpr float kLevels = static_cast<float>(kMaxCode);

  static constexpr int64_t codeBytes(int64_t count) {
    return (count + kPerByte - 1) / kPerByte;
  }
  static constexpr int64_t scalesOffset(int64_t count) {
    return (codeBytes(count) + 3) / 4 * 4;
  }
  static constexpr int64_t rowBytes(int64_t count, int64_t block) {
    return scalesOffset(count) + 4 * ((count + block - 1) / block);
  }
  // Where value `at` of a row sits in its byte.
  static constexpr int shiftOf(int64_t at) {
    return Bits * static_cast<int>(at % kPerByte);
  }
  // A field in two's complement back to -kMaxCode..kMaxCode (-kMaxCode - 1, never written, reads as
  // itself).
  static constexpr int32_t valueOf(uint32_t field) {
    return static_cast<int32_t>(field ^ kSignBit) - static_cast<int32_t>(kSignBit);
  }
};

// What a block's values are multiplied by to give their codes: L / its largest |r| (0 for 0).
template <int Bits>
inline float blockIntInverse(float largest) {
  return largest > 0.0f ? BlockInt<Bits>::kLevels / largest : 0.0f;
}

// r's code, from -L to L.
template <int Bits>
inline int32_t blockIntCodeOf(float r, float inverse) {
  constexpr int32_t most = BlockInt<Bits>::kMaxCode;
  return std::max(-most, std::min(most, static_cast<int32_t>(std::nearbyint(r * inverse))));
}

template <int Bits>
int64_t blockIntRowBytes(int64_t count, const CodeSettings& settings) {
  return BlockInt<Bits>::rowBytes(count, settings.block);
}

// One row: `row` gets the codes and scales of values (+ residual, updated in place when not null).
template <int Bits>
void encodeBlockIntRow(const CodeSettings& settings, const float* values, float* residual, uint8_t* row,
                       int64_t count) {
  using B = BlockInt<Bits>;
  const int64_t block = settings.block;
  auto* scales = reinterpret_cast<float*>(row + B::scalesOffset(count));
  std::memset(row, 0, static_cast<size_t>(B::scalesOffset(count)));
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    float* blockResidual = residual ? residual + begin : nullptr;
    const float largest = loadBlock(values + begin, blockResidual, n);
    const float scale = largest / B::kLevels;
    const float inverse = blockIntInverse<Bits>(largest);
    scales[b] = scale;
    const float* r = blockResidual ? blockResidual : values + begin;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t code = blockIntCodeOf<Bits>(r[i], inverse);
      const int64_t at = begin + i;
      row[at / B::kPerByte] |= static_cast<uint8_t>((static_cast<uint32_t>(code) & B::kMask) << B::shiftOf(at));
      if (blockResidual) {
        blockResidual[i] = r[i] - static_cast<float>(code) * scale;
      }
    }
  }
}

// out (+)= code x scale of one row; with `sum`, the sum over `rowCount` rows (`rowBytes` apart) into
// one out, else row r into out + r * count. `accumulate`: added to what out holds (with `sum` only).
template <int Bits>
void decodeBlockIntRows(const CodeSettings& settings, const uint8_t* rows, int64_t rowCount, int64_t rowBytes,
                        float* out, int64_t count, bool sum, bool accumulate) {
  using B = BlockInt<Bits>;
  const int64_t block = settings.block;
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    for (int64_t r = 0; r < rowCount; ++r) {
      const uint8_t* row = rows + r * rowBytes;
      float scale;
      std::memcpy(&scale, row + B::scalesOffset(count) + 4 * b, sizeof(float));
      float* into = (sum ? out : out + r * count) + begin;
      const bool add = sum && (r > 0 || accumulate);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = begin + i;
        const float value =
            static_cast<float>(B::valueOf((row[at / B::kPerByte] >> B::shiftOf(at)) & B::kMask)) * scale;
        into[i] = add ? into[i] + value : value;
      }
    }
  }
}

// A code of the family, described (kernels/code.h): its name and its one-line summary, and what the
// family's codes share: they read the block, a block starts on a byte (a multiple of 8 / Bits
// values), and their row and CPU kernels are the above. The code's own file registers it
// (CodeRegistration), with whatever else it is.
template <int Bits>
CodeDescriptor blockIntDescriptor(const char* name, const char* summary) {
  CodeDescriptor code;
  code.name = name;
  code.summary = summary;
  code.readsBlock = true;
  code.blockMultiple = BlockInt<Bits>::kPerByte;
  code.rowBytes = blockIntRowBytes<Bits>;
  code.encodeRow = encodeBlockIntRow<Bits>;
  code.decodeRows = decodeBlockIntRows<Bits>;
  return code;
}

}  // namespace chainermn
