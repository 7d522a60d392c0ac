// Block-quantised int8 on CUDA (see int8_kernels.h; kernels/int8.h says what a row is).
//
// encode: one thread block per quantisation block. Its threads read the block's values once
// (coalesced; with a residual, r = residual + value is written back), reduce the largest |r| through
// warp shuffles, then read r again (from L1/L2) for the codes and the new residual. decode: one
// thread per output value, grid-stride; with `sum` it adds the rows' values in row order, starting
// from row 0's value as the CPU does (so -0 stays -0).
#include "cuda/int8_kernels.h"

#include "kernels/int8.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

namespace chainermn::cuda {

namespace {

constexpr int kMaxThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// The largest of `v` over the thread block, in every thread.
__device__ float blockMax(float v) {
  __shared__ float warps[kMaxThreads / 32];
  __shared__ float result;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_down_sync(kFullMask, v, offset));
  }
  if (lane == 0) {
    warps[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) / 32) ? warps[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) {
      v = fmaxf(v, __shfl_down_sync(kFullMask, v, offset));
    }
    if (lane == 0) {
      result = v;
    }
  }
  __syncthreads();
  return result;
}

__global__ void encodeInt8Kernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
                                 int64_t block, int64_t blocksPerRow) {
  const int64_t row = blockIdx.x / blocksPerRow;
  const int64_t b = blockIdx.x % blocksPerRow;
  const int64_t begin = b * block;
  const int n = static_cast<int>(min(block, count - begin));
  const float* v = values + row * count + begin;
  float* kept = residual ? residual + row * count + begin : nullptr;
  uint8_t* out = wire + row * rowBytes;
  float largest = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
    float r = v[i];
    if (kept) {
      r = __fadd_rn(kept[i], r);
      kept[i] = r;
    }
    largest = fmaxf(largest, fabsf(r));
  }
  largest = blockMax(largest);
  const float scale = __fdiv_rn(largest, kInt8Levels);
  const float inverse = largest > 0.0f ? __fdiv_rn(kInt8Levels, largest) : 0.0f;  // int8Inverse
  auto* codes = reinterpret_cast<int8_t*>(out) + begin;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
    const float x = kept ? kept[i] : v[i];
    const int q = max(-127, min(127, __float2int_rn(__fmul_rn(x, inverse))));
    codes[i] = static_cast<int8_t>(q);
    if (kept) {
      kept[i] = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
    }
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<float*>(out + int8ScalesOffset(count))[b] = scale;
  }
  if (b == blocksPerRow - 1 && static_cast<int64_t>(threadIdx.x) < int8ScalesOffset(count) - count) {
    out[count + threadIdx.x] = 0;  // the zero bytes before the scales
  }
}

__global__ void decodeInt8Kernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                                 int64_t block, bool sum) {
  const int64_t total = sum ? count : rows * count;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t scalesOffset = int8ScalesOffset(count);
  for (int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; at < total; at += stride) {
    const int64_t first = sum ? 0 : at / count;
    const int64_t last = sum ? rows : first + 1;
    const int64_t i = sum ? at : at % count;
    float value = 0.0f;
    for (int64_t r = first; r < last; ++r) {
      const uint8_t* row = wire + r * rowBytes;
      const float scale = reinterpret_cast<const float*>(row + scalesOffset)[i / block];
      const float piece = __fmul_rn(static_cast<float>(reinterpret_cast<const int8_t*>(row)[i]), scale);
      value = r == first ? piece : __fadd_rn(value, piece);
    }
    out[at] = value;
  }
}

} // namespace

void encodeInt8(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, void* rawStream) {
  TORCH_CHECK(rows >= 0 && count >= 0 && block >= 1, "chainermn: encodeInt8 of ", rows, " x ", count, " in blocks of ",
              block);
  const int64_t blocksPerRow = (count + block - 1) / block;
  if (rows == 0 || count == 0) {
    return;
  }
  TORCH_CHECK(rows * blocksPerRow <= std::numeric_limits<int>::max(), "chainermn: encodeInt8: ", rows * blocksPerRow,
              " blocks of ", block, " values, more than one launch takes: use a larger block");
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (block + 31) / 32 * 32));
  encodeInt8Kernel<<<static_cast<int>(rows * blocksPerRow), threads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, block, blocksPerRow);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decodeInt8(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block, bool sum,
                void* rawStream) {
  const int64_t total = sum ? count : rows * count;
  if (total == 0 || rows == 0) {
    return;
  }
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + kMaxThreads - 1) / kMaxThreads, 65535)));
  decodeInt8Kernel<<<blocks, kMaxThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(wire, rows, rowBytes, out, count,
                                                                                    block, sum);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace chainermn::cuda
