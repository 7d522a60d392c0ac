#include "kernels/codes.h"

#include "kernels/int4.h"
#include "kernels/int8.h"
#include "kernels/quantize.h"
#include "kernels/topk.h"
#include "phase.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>

namespace chainermn {

namespace {

// Every code, once, in Code's order.
constexpr CodeInfo kCodes[] = {
    {Code::Int8, "int8", /*needsResidual=*/false, /*usesThreshold=*/false, /*usesBlock=*/true, /*usesKeep=*/false},
    {Code::TwoBit, "2bit", true, true, false, false},
    {Code::OneBit, "1bit", true, false, false, false},
    {Code::FourBit, "4bit", false, false, true, false},
    {Code::TopK, "topk", false, false, true, true},
};

std::string knownNames() {
  std::string names;
  for (const auto& info : kCodes) {
    names += std::string(names.empty() ? "" : ", ") + "'" + info.name + "'";
  }
  return names;
}

} // namespace

const CodeInfo& codeInfo(Code code) {
  const auto index = static_cast<size_t>(code);
  TORCH_CHECK(index < sizeof(kCodes) / sizeof(kCodes[0]), "unknown code ", index);
  return kCodes[index];
}

const char* codeName(Code code) {
  return codeInfo(code).name;
}

Code codeNamed(const std::string& name, const char* op) {
  for (const auto& info : kCodes) {
    if (name == info.name) {
      return info.code;
    }
  }
  TORCH_CHECK_VALUE(false, op, ": code must be one of ", knownNames(), ", got '", name, "'");
}

void checkCodeSettings(Code code, const CodeSettings& settings, const char* op) {
  const CodeInfo& info = codeInfo(code);
  if (info.usesThreshold) {
    TORCH_CHECK_VALUE(settings.threshold > 0.0f && std::isfinite(settings.threshold), op,
                      ": threshold must be a positive finite number, got ", settings.threshold);
  }
  if (info.usesBlock) {
    TORCH_CHECK_VALUE(settings.block >= 1, op, ": block must be >= 1, got ", settings.block);
    TORCH_CHECK_VALUE(settings.block <= (int64_t{1} << 30), op, ": block must be at most 2**30, got ", settings.block);
    // 4-bit: two values a byte, and a block starts on a byte (no byte holds values of two blocks).
    TORCH_CHECK_VALUE(code != Code::FourBit || settings.block % 2 == 0, op, ": block must be even for the 4bit code, got ",
                      settings.block);
    // top-k: a kept value's place in its block travels as 16 bits.
    TORCH_CHECK_VALUE(code != Code::TopK || settings.block <= kTopkMaxBlock, op, ": block must be at most ",
                      kTopkMaxBlock, " for the topk code (16-bit indices), got ", settings.block);
  }
  if (info.usesKeep) {
    TORCH_CHECK_VALUE(settings.keep >= 1 && settings.keep <= settings.block, op,
                      ": keep must be >= 1 and <= block (", settings.block, "), got ", settings.keep);
  }
}

int64_t wireRowBytes(Code code, int64_t count, const CodeSettings& settings) {
  switch (code) {
    case Code::Int8:
      return int8RowBytes(count, settings.block);
    case Code::FourBit:
      return int4RowBytes(count, settings.block);
    case Code::TopK:
      return topkRowBytes(count, settings.block, settings.keep);
    case Code::TwoBit:
    case Code::OneBit:
      return 4 * blockWords(code, count);
  }
  TORCH_CHECK(false, "unknown code");
}

void encodeCpu(Code code, const CodeSettings& settings, const float* values, float* residual, uint8_t* wire,
               int64_t rows, int64_t rowBytes, int64_t count) {
  // In: the rows' float32 values; out: their coded rows.
  PhaseSpan phase(phase::kEncode, codeName(code),
                  Moved{rows * rowBytes, rows * rowBytes, rows * count * static_cast<int64_t>(sizeof(float))});
  TORCH_CHECK(values != nullptr || rows * count == 0 || (residual != nullptr && !codeInfo(code).usesBlock), "encode (",
              codeName(code),
              "): the values are needed (2-bit and 1-bit may take them from the residual)");
  const int64_t used = wireRowBytes(code, count, settings);
  for (int64_t r = 0; r < rows; ++r) {
    const float* rowValues = values ? values + r * count : nullptr;
    float* rowResidual = residual ? residual + r * count : nullptr;
    uint8_t* row = wire + r * rowBytes;
    switch (code) {
      case Code::Int8:
        encodeInt8Cpu(rowValues, rowResidual, row, count, settings.block);
        break;
      case Code::FourBit:
        encodeInt4Cpu(rowValues, rowResidual, row, count, settings.block);
        break;
      case Code::TopK:
        encodeTopkCpu(rowValues, rowResidual, row, count, settings.block, settings.keep);
        break;
      case Code::TwoBit:
      case Code::OneBit:
        quantizeCpu(code, rowValues, rowResidual, reinterpret_cast<uint32_t*>(row), count, count, settings.threshold);
        break;
    }
    std::memset(row + used, 0, static_cast<size_t>(rowBytes - used));
  }
}

void decodeCpu(Code code, const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
               int64_t count, bool sum, bool accumulate) {
  // In: the coded rows; out: their float32 values (one row of them when the rows are summed).
  PhaseSpan phase(phase::kDecode, codeName(code),
                  Moved{rows * rowBytes, (sum ? 1 : rows) * count * static_cast<int64_t>(sizeof(float)), rows * rowBytes});
  switch (code) {
    case Code::Int8:
      decodeInt8Cpu(wire, rows, rowBytes, out, count, settings.block, sum, accumulate);
      return;
    case Code::FourBit:
      decodeInt4Cpu(wire, rows, rowBytes, out, count, settings.block, sum, accumulate);
      return;
    case Code::TopK:
      decodeTopkCpu(wire, rows, rowBytes, out, count, settings.block, settings.keep, sum, accumulate);
      return;
    case Code::TwoBit:
    case Code::OneBit:
      for (int64_t r = 0; r < rows; ++r) {
        dequantizeCpu(code, reinterpret_cast<const uint32_t*>(wire + r * rowBytes), sum ? out : out + r * count, count,
                      settings.threshold, sum && (r > 0 || accumulate));
      }
      return;
  }
}

} // namespace chainermn
