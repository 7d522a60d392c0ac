// Block-quantised int8 on CUDA (see int8_kernels.h; kernels/int8.h says what a row is).
//
// encode: one warp per quantisation block, 8 blocks per thread block. A warp reads its block once
// (coalesced, lane k takes values k, k + 32, ...; with a residual, r = residual + value is written
// back), reduces the largest |r| through shuffles (no shared memory, no block-wide barrier), then
// reads r again (from L1/L2, each lane its own values) for the codes and the new residual.
// decode: one thread per 4 consecutive values of an output (one 4-byte load of codes per row, one
// 16-byte store) where the row length allows, else per value; with `sum` it adds the rows' values
// in row order, starting from row 0's value as the CPU does (so -0 stays -0), or with `accumulate`
// from what out holds.
#include "cuda/int8_kernels.h"
#include "kernels/code.h"

#include "cuda/block_scale.cuh"
#include "kernels/int8.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace chainermn::cuda {

namespace {

constexpr int kThreads = kBlockCodeThreads;

__global__ void encodeInt8Kernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
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
  const float scale = __fdiv_rn(largest, kInt8Levels);
  const float inverse = largest > 0.0f ? __fdiv_rn(kInt8Levels, largest) : 0.0f;  // int8Inverse
  auto* codes = reinterpret_cast<int8_t*>(out) + begin;
  for (int64_t i = lane; i < n; i += 32) {
    const float x = kept ? kept[i] : v[i];
    const int q = max(-127, min(127, __float2int_rn(__fmul_rn(x, inverse))));
    codes[i] = static_cast<int8_t>(q);
    if (kept) {
      kept[i] = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
    }
  }
  if (lane == 0) {
    reinterpret_cast<float*>(out + int8ScalesOffset(count))[b] = scale;
  }
  if (b == blocksPerRow - 1 && lane < int8ScalesOffset(count) - count) {
    out[count + lane] = 0;  // the zero bytes before the scales
  }
}

// Value i of row r, as code x scale.
__device__ __forceinline__ float decoded(const uint8_t* row, int8_t code, int64_t scalesOffset, int64_t i,
                                         int64_t block) {
  return __fmul_rn(static_cast<float>(code), reinterpret_cast<const float*>(row + scalesOffset)[i / block]);
}

// `Width` (1 or 4) consecutive values from i of one output row: row `first` alone, or rows [first,
// last) summed.
template <int Width>
__device__ __forceinline__ void decodeAt(const uint8_t* wire, int64_t first, int64_t last, int64_t rowBytes,
                                         int64_t scalesOffset, int64_t i, int64_t block, float* out, bool accumulate) {
  float value[Width];
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    value[k] = accumulate ? out[k] : 0.0f;
  }
  for (int64_t r = first; r < last; ++r) {
    const uint8_t* row = wire + r * rowBytes;
    int8_t code[Width];
    if (Width == 4) {
      const char4 four = *reinterpret_cast<const char4*>(row + i);  // i is a multiple of 4, rows 4-aligned
      code[0] = four.x, code[1 % Width] = four.y, code[2 % Width] = four.z, code[3 % Width] = four.w;
    } else {
      code[0] = reinterpret_cast<const int8_t*>(row)[i];
    }
#pragma unroll
    for (int k = 0; k < Width; ++k) {
      const float piece = decoded(row, code[k], scalesOffset, i + k, block);
      value[k] = r == first && !accumulate ? piece : __fadd_rn(value[k], piece);
    }
  }
  if (Width == 4) {
    *reinterpret_cast<float4*>(out) = make_float4(value[0], value[1 % Width], value[2 % Width], value[3 % Width]);
  } else {
    out[0] = value[0];
  }
}

// Width 4: count is a multiple of 4 (every output row starts 16-byte aligned), one thread per 4 values.
template <int Width>
__global__ void decodeInt8Kernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                                 int64_t block, bool sum, bool accumulate) {
  const int64_t total = (sum ? count : rows * count) / Width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t scalesOffset = int8ScalesOffset(count);
  for (int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < total; at += stride) {
    const int64_t flat = at * Width;
    const int64_t first = sum ? 0 : flat / count;
    decodeAt<Width>(wire, first, sum ? rows : first + 1, rowBytes, scalesOffset, sum ? flat : flat % count, block,
                    out + flat, sum && accumulate);
  }
}

}  // namespace

void encodeInt8(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, void* rawStream) {
  const BlockCodeLaunch launch = blockCodeLaunch("encodeInt8", rows, count, block);
  if (launch.totalBlocks == 0) {
    return;
  }
  encodeInt8Kernel<<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, block, launch.blocksPerRow, launch.totalBlocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decodeInt8(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block, bool sum,
                bool accumulate, void* rawStream) {
  const int64_t total = sum ? count : rows * count;
  if (total == 0 || rows == 0) {
    return;
  }
  const bool four = count % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t threads = four ? total / 4 : total;
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, 65535)));
  auto stream = static_cast<cudaStream_t>(rawStream);
  if (four) {
    decodeInt8Kernel<4><<<blocks, kThreads, 0, stream>>>(wire, rows, rowBytes, out, count, block, sum, accumulate);
  } else {
    decodeInt8Kernel<1><<<blocks, kThreads, 0, stream>>>(wire, rows, rowBytes, out, count, block, sum, accumulate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// The "int8" code's CUDA kernels, added to its descriptor (kernels/int8.cpp) in the CUDA build.
const CudaCodeRegistration registered{
    "int8",
    [](const CodeSettings& s, const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes,
       int64_t count, void* stream) { encodeInt8(values, residual, wire, rows, rowBytes, count, s.block, stream); },
    [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, bool sum,
       bool accumulate,
       void* stream) { decodeInt8(wire, rows, rowBytes, out, count, s.block, sum, accumulate, stream); }};

}  // namespace

}  // namespace chainermn::cuda
