// Block-quantised 4-bit codes on CUDA (see int4_kernels.h; kernels/int4.h says what a row is).
//
// encode: one warp per quantisation block, as int8's: the block is read once for its largest |r|
// (reduced through shuffles), then each lane codes pairs of values into whole bytes (a block starts
// on a byte: its length is even). decode: one thread per output value, the rows added in row order
// from row 0's value (or from what out holds, with `accumulate`), as the CPU does.
#include "cuda/int4_kernels.h"
#include "kernels/code.h"

#include "cuda/block_scale.cuh"
#include "kernels/int4.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace chainermn::cuda {

namespace {

constexpr int kThreads = kBlockCodeThreads;

__device__ __forceinline__ uint32_t nibbleOf(float x, float inverse, float scale, float* kept) {
  const int q = max(-7, min(7, __float2int_rn(__fmul_rn(x, inverse))));
  if (kept) {
    *kept = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
  }
  return static_cast<uint32_t>(q) & 0xFu;
}

__global__ void encodeInt4Kernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
                                 int64_t block, int64_t blocksPerRow, int64_t totalBlocks) {
  const WarpBlock w = warpBlock(values, residual, wire, rowBytes, count, block, blocksPerRow, totalBlocks);
  if (!w.valid) {
    return;  // the whole warp: its shuffles below need every lane
  }
  const int lane = w.lane;
  const int64_t b = w.index, begin = w.begin, n = w.n;
  const float* v = w.values;
  float* kept = w.kept;
  uint8_t* out = w.row;
  const float largest = warpBlockLargest(v, kept, n, lane);
  const float scale = __fdiv_rn(largest, kInt4Levels);
  const float inverse = largest > 0.0f ? __fdiv_rn(kInt4Levels, largest) : 0.0f;  // int4Inverse
  for (int64_t pair = lane; 2 * pair < n; pair += 32) {
    const int64_t i = 2 * pair;
    uint32_t byte = nibbleOf(kept ? kept[i] : v[i], inverse, scale, kept ? kept + i : nullptr);
    if (i + 1 < n) {
      byte |= nibbleOf(kept ? kept[i + 1] : v[i + 1], inverse, scale, kept ? kept + i + 1 : nullptr) << 4;
    }
    out[(begin + i) / 2] = static_cast<uint8_t>(byte);
  }
  if (lane == 0) {
    reinterpret_cast<float*>(out + int4ScalesOffset(count))[b] = scale;
  }
  const int64_t codeBytes = (count + 1) / 2;
  if (b == blocksPerRow - 1 && lane < int4ScalesOffset(count) - codeBytes) {
    out[codeBytes + lane] = 0;  // the zero bytes before the scales
  }
}

__global__ void decodeInt4Kernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                                 int64_t block, bool sum, bool accumulate) {
  const int64_t total = sum ? count : rows * count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t scalesOffset = int4ScalesOffset(count);
  for (int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < total; at += stride) {
    const int64_t first = sum ? 0 : at / count;
    const int64_t last = sum ? rows : first + 1;
    const int64_t i = sum ? at : at % count;
    float value = accumulate ? out[at] : 0.0f;
    for (int64_t r = first; r < last; ++r) {
      const uint8_t* row = wire + r * rowBytes;
      const uint32_t nibble = (row[i / 2] >> (4 * (i % 2))) & 0xFu;
      const int code = static_cast<int>(nibble ^ 8u) - 8;
      const float piece =
          __fmul_rn(static_cast<float>(code), reinterpret_cast<const float*>(row + scalesOffset)[i / block]);
      value = r == first && !accumulate ? piece : __fadd_rn(value, piece);
    }
    out[at] = value;
  }
}

}  // namespace

void encodeInt4(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, void* rawStream) {
  TORCH_CHECK(block % 2 == 0, "chainermn: encodeInt4: the block must be even, got ", block);
  const BlockCodeLaunch launch = blockCodeLaunch("encodeInt4", rows, count, block);
  if (launch.totalBlocks == 0) {
    return;
  }
  encodeInt4Kernel<<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, block, launch.blocksPerRow, launch.totalBlocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decodeInt4(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block, bool sum,
                bool accumulate, void* rawStream) {
  const int64_t total = sum ? count : rows * count;
  if (total == 0 || rows == 0) {
    return;
  }
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, 65535)));
  decodeInt4Kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(wire, rows, rowBytes, out, count,
                                                                                  block, sum, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// The "4bit" code's CUDA kernels, added to its descriptor (kernels/int4.cpp) in the CUDA build.
const CudaCodeRegistration registered{
    "4bit",
    [](const CodeSettings& s, const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes,
       int64_t count, void* stream) { encodeInt4(values, residual, wire, rows, rowBytes, count, s.block, stream); },
    [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, bool sum,
       bool accumulate,
       void* stream) { decodeInt4(wire, rows, rowBytes, out, count, s.block, sum, accumulate, stream); }};

}  // namespace

}  // namespace chainermn::cuda
