// The "int2" code on CUDA: kernels/int2.h's layout and arithmetic, bit for bit (IEEE products and
// quotients, round half to even, no fused multiply-add), added to its descriptor (kernels/int2.cpp).
//
// encode: one warp per quantisation block, as int8's and 4-bit's: the block is read once for its
// largest |r| (reduced through shuffles), then each lane codes four values into a whole byte (a block
// starts on a byte: its length is a multiple of 4). decode: one thread per output value, the rows
// added in row order from row 0's value (or from what out holds, with `accumulate`), as the CPU does.
// Launches on `stream` only: no allocation, no host synchronisation.
#include "cuda/block_scale.cuh"
#include "kernels/code.h"
#include "kernels/int2.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace chainermn::cuda {

namespace {

constexpr int kThreads = kBlockCodeThreads;

__device__ __forceinline__ uint32_t bitsOf(float x, float inverse, float scale, float* kept) {
  const int q = max(-1, min(1, __float2int_rn(__fmul_rn(x, inverse))));
  if (kept) {
    *kept = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
  }
  return static_cast<uint32_t>(q) & 0x3u;
}

__global__ void encodeInt2Kernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
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
  const float scale = __fdiv_rn(largest, kInt2Levels);
  const float inverse = largest > 0.0f ? __fdiv_rn(kInt2Levels, largest) : 0.0f;  // int2Inverse
  for (int64_t quad = lane; 4 * quad < n; quad += 32) {
    uint32_t byte = 0;
    for (int k = 0; k < 4 && 4 * quad + k < n; ++k) {
      const int64_t i = 4 * quad + k;
      byte |= bitsOf(kept ? kept[i] : v[i], inverse, scale, kept ? kept + i : nullptr) << (2 * k);
    }
    out[(begin + 4 * quad) / 4] = static_cast<uint8_t>(byte);
  }
  if (lane == 0) {
    reinterpret_cast<float*>(out + int2ScalesOffset(count))[b] = scale;
  }
  const int64_t codeBytes = (count + 3) / 4;
  if (b == blocksPerRow - 1 && lane < int2ScalesOffset(count) - codeBytes) {
    out[codeBytes + lane] = 0;  // the zero bytes before the scales
  }
}

__global__ void decodeInt2Kernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                                 int64_t block, bool sum, bool accumulate) {
  const int64_t total = sum ? count : rows * count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t scalesOffset = int2ScalesOffset(count);
  for (int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < total; at += stride) {
    const int64_t first = sum ? 0 : at / count;
    const int64_t last = sum ? rows : first + 1;
    const int64_t i = sum ? at : at % count;
    float value = accumulate ? out[at] : 0.0f;
    for (int64_t r = first; r < last; ++r) {
      const uint8_t* row = wire + r * rowBytes;
      const uint32_t bits = (row[i / 4] >> (2 * (i % 4))) & 0x3u;
      const int code = static_cast<int>(bits ^ 2u) - 2;
      const float piece =
          __fmul_rn(static_cast<float>(code), reinterpret_cast<const float*>(row + scalesOffset)[i / block]);
      value = r == first && !accumulate ? piece : __fadd_rn(value, piece);
    }
    out[at] = value;
  }
}

void encodeInt2(const CodeSettings& settings, const float* values, float* residual, uint8_t* wire, int64_t rows,
                int64_t rowBytes, int64_t count, void* rawStream) {
  const BlockCodeLaunch launch = blockCodeLaunch("encodeInt2", rows, count, settings.block);
  if (launch.totalBlocks == 0) {
    return;
  }
  encodeInt2Kernel<<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, settings.block, launch.blocksPerRow, launch.totalBlocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decodeInt2(const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
                int64_t count, bool sum, bool accumulate, void* rawStream) {
  const int64_t total = sum ? count : rows * count;
  if (total == 0 || rows == 0) {
    return;
  }
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, 65535)));
  decodeInt2Kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(wire, rows, rowBytes, out, count,
                                                                                  settings.block, sum, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The "int2" code's CUDA kernels, added to its descriptor (kernels/int2.cpp) in the CUDA build.
const CudaCodeRegistration registered{"int2", encodeInt2, decodeInt2};

}  // namespace

}  // namespace chainermn::cuda
