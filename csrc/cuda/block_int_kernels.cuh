// The block-scaled integer codes on CUDA, written once for every width (kernels/block_int.h says
// what a row is; int4_kernels.cu and int2_kernels.cu name their width and register these kernels):
// the CPU's layout and arithmetic, bit for bit (IEEE products and quotients, round half to even, no
// fused multiply-add).
//
// encode: one warp per quantisation block, as int8's (block_scale.cuh): the block is read once for
// its largest |r| (reduced through shuffles), then each lane codes 8 / Bits values into a whole byte
// (a block starts on a byte: its length is a multiple of 8 / Bits). decode: one thread per output
// value, the rows added in row order from row 0's value (or from what out holds, with `accumulate`),
// as the CPU does. Launches on `stream` (a cudaStream_t) only: no allocation, no host
// synchronisation.
#pragma once

#include "cuda/block_scale.cuh"
#include "kernels/block_int.h"
#include "kernels/code.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace chainermn::cuda {

namespace block_int {

// Value x's code in its field (the residual at `kept`, when not null, keeps x - code x scale).
template <int Bits>
__device__ __forceinline__ uint32_t fieldOf(float x, float inverse, float scale, float* kept) {
  using B = BlockInt<Bits>;
  const int q = max(-B::kMaxCode, min(B::kMaxCode, __float2int_rn(__fmul_rn(x, inverse))));
  if (kept) {
    *kept = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
  }
  return static_cast<uint32_t>(q) & B::kMask;
}

template <int Bits>
__global__ void encodeKernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
                             int64_t block, int64_t blocksPerRow, int64_t totalBlocks) {
  using B = BlockInt<Bits>;
  const WarpBlock w = warpBlock(values, residual, wire, rowBytes, count, block, blocksPerRow, totalBlocks);
  if (!w.valid) {
    return;  // the whole warp: its shuffles below need every lane
  }
  const float largest = warpBlockLargest(w.values, w.kept, w.n, w.lane);
  const float scale = __fdiv_rn(largest, B::kLevels);
  const float inverse = largest > 0.0f ? __fdiv_rn(B::kLevels, largest) : 0.0f;  // blockIntInverse
  for (int64_t group = w.lane; B::kPerByte * group < w.n; group += 32) {
    const int64_t first = B::kPerByte * group;
    uint32_t byte = 0;
#pragma unroll
    for (int k = 0; k < B::kPerByte; ++k) {
      const int64_t i = first + k;
      if (i < w.n) {
        float* kept = w.kept ? w.kept + i : nullptr;
        byte |= fieldOf<Bits>(kept ? *kept : w.values[i], inverse, scale, kept) << (Bits * k);
      }
    }
    w.row[(w.begin + first) / B::kPerByte] = static_cast<uint8_t>(byte);
  }
  if (w.lane == 0) {
    reinterpret_cast<float*>(w.row + B::scalesOffset(count))[w.index] = scale;
  }
  const int64_t codeBytes = B::codeBytes(count);
  if (w.index == blocksPerRow - 1 && w.lane < B::scalesOffset(count) - codeBytes) {
    w.row[codeBytes + w.lane] = 0;  // the zero bytes before the scales
  }
}

template <int Bits>
__global__ void decodeKernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                             int64_t block, bool sum, bool accumulate) {
  using B = BlockInt<Bits>;
  const int64_t total = sum ? count : rows * count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t scalesOffset = B::scalesOffset(count);
  for (int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < total; at += stride) {
    const int64_t first = sum ? 0 : at / count;
    const int64_t last = sum ? rows : first + 1;
    const int64_t i = sum ? at : at % count;
    float value = accumulate ? out[at] : 0.0f;
    for (int64_t r = first; r < last; ++r) {
      const uint8_t* row = wire + r * rowBytes;
      const int code = B::valueOf((row[i / B::kPerByte] >> B::shiftOf(i)) & B::kMask);
      const float piece =
          __fmul_rn(static_cast<float>(code), reinterpret_cast<const float*>(row + scalesOffset)[i / block]);
      value = r == first && !accumulate ? piece : __fadd_rn(value, piece);
    }
    out[at] = value;
  }
}

}  // namespace block_int

// The CPU's encodeBlockIntRow for `rows` rows at once (kernels/code.h's EncodeRowsCuda): row r's
// values at values + r * count (residual likewise, may be null), its wire row at wire + r * rowBytes.
// One launch.
template <int Bits>
void encodeBlockIntCuda(const CodeSettings& settings, const float* values, float* residual, uint8_t* wire, int64_t rows,
                        int64_t rowBytes, int64_t count, void* rawStream) {
  constexpr int kPerByte = BlockInt<Bits>::kPerByte;
  TORCH_CHECK(settings.block % kPerByte == 0, "chainermn: encode of ", Bits,
              "-bit codes: the block must be a multiple of ", kPerByte, ", got ", settings.block);
  const BlockCodeLaunch launch = blockCodeLaunch("a block-scaled integer encode", rows, count, settings.block);
  if (launch.totalBlocks == 0) {
    return;
  }
  block_int::encodeKernel<Bits><<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, settings.block, launch.blocksPerRow, launch.totalBlocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// decodeBlockIntRows (DecodeRowsCuda): out = each row's values ([rows, count]), or with `sum` their
// sum ([count]), added to what out holds with `accumulate`. One launch.
template <int Bits>
void decodeBlockIntCuda(const CodeSettings& settings, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
                        int64_t count, bool sum, bool accumulate, void* rawStream) {
  const int64_t total = sum ? count : rows * count;
  if (total == 0 || rows == 0) {
    return;
  }
  const int64_t threads = kBlockCodeThreads;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + threads - 1) / threads, 65535)));
  block_int::decodeKernel<Bits><<<blocks, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      wire, rows, rowBytes, out, count, settings.block, sum, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace chainermn::cuda
