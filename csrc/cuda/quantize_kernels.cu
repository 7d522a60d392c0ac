// Gradient compression's kernels on CUDA (see quantize_kernels.h; kernels/quantize.h says what a
// block is).
//
// One thread per value, grid-stride, in a loop whose condition is the same in every lane of a warp,
// so that all 32 lanes take part in the ballots that build the words: a warp covers 32 consecutive
// values (its first one a multiple of 32), which are exactly one 1-bit sign word (the ballot of
// r >= 0) or two 2-bit words (the ballots of r >= t and r <= -t, each half's bits interleaved). The
// values are read and written coalesced; the words (1/16 or 1/32 of the traffic) are stored by lanes
// 0 and 1 of each warp. Words past the last value's are zeroed by the same launch.
//
// 1-bit's scale, mean |r| over the chunk, is summed in double by a first launch (per thread, then per
// block); with more than one block, each block's sum goes to two of the block's sign words (nothing
// else is free to hold it), a one-block launch adds them up in a fixed order and writes the scale
// into word 0, and the sign launch reads it there and overwrites those sign words. The sum is thus
// deterministic for a given count and chunk, but not in the CPU's index order.
#include "cuda/quantize_kernels.h"
#include "kernels/code.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace chainermn::cuda {

namespace {

constexpr int kThreads = 256;  // a multiple of 32: the loops below are warp-uniform
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxParts = 1024;  // blocks of the 1-bit sum: enough to fill any current GPU

int blocksFor(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  // Grid-stride beyond this (as the pack kernels).
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}

// r = residual + add, exactly as the CPU computes it (+ 0.0f included: it turns -0 into +0).
__device__ __forceinline__ float loadValue(const float* add, const float* residual, int64_t i) {
  return residual[i] + (add ? add[i] : 0.0f);
}

// The 16 low bits of x at the even bit positions (bit k at bit 2k).
__device__ __forceinline__ uint32_t spreadBits(uint32_t x) {
  x &= 0xffffu;
  x = (x | (x << 8)) & 0x00ff00ffu;
  x = (x | (x << 4)) & 0x0f0f0f0fu;
  x = (x | (x << 2)) & 0x33333333u;
  x = (x | (x << 1)) & 0x55555555u;
  return x;
}

// `written`: the words the value loop stores (two per warp that has values, at most `words`); the
// rest of the block is zeroed.
__global__ void quantize2bitKernel(const float* add, float* residual, uint32_t* block, int64_t count, int64_t words,
                                   int64_t written, float t) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // i - lane is the warp's first value, the same in every lane.
  for (int64_t i = first; i - lane < count; i += stride) {
    uint32_t pos = 0;
    uint32_t neg = 0;
    if (i < count) {
      float r = loadValue(add, residual, i);
      pos = r >= t;
      neg = r <= -t;
      r -= pos ? t : 0.0f;
      r += neg ? t : 0.0f;
      residual[i] = r;
    }
    const uint32_t posBits = __ballot_sync(kFullMask, pos);
    const uint32_t negBits = __ballot_sync(kFullMask, neg);
    if (lane < 2) {
      // Lane 0: the warp's values 0..15, word (i - lane) / 16; lane 1: values 16..31, the next word.
      const int64_t w = ((i - lane) >> 4) + lane;
      const int shift = 16 * lane;
      if (w < words) {
        block[w] = spreadBits(posBits >> shift) | (spreadBits(negBits >> shift) << 1);
      }
    }
  }
  for (int64_t w = written + first; w < words; w += stride) {
    block[w] = 0;
  }
}

// The sum of `v` over the block, in thread 0. Called once per kernel, by every thread.
__device__ double blockSum(double v) {
  __shared__ double warps[32];
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_down_sync(kFullMask, v, offset);
  }
  if (lane == 0) {
    warps[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>((blockDim.x + 31) / 32) ? warps[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) {
      v += __shfl_down_sync(kFullMask, v, offset);
    }
  }
  return v;
}

__device__ __forceinline__ void storeScale(uint32_t* block, double magnitude, int64_t count) {
  block[0] = __float_as_uint(static_cast<float>(magnitude / static_cast<double>(count)));
}

// Sum of |r| over the chunk (count > 0). One block: the scale into word 0. Several: block b's sum
// into words 1 + 2b (low half) and 2 + 2b (high half), which the caller made sure exist.
__global__ void magnitudeKernel(const float* add, const float* residual, uint32_t* block, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double sum = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    sum += fabsf(loadValue(add, residual, i));
  }
  sum = blockSum(sum);
  if (threadIdx.x == 0) {
    if (gridDim.x == 1) {
      storeScale(block, sum, count);
    } else {
      const auto bits = static_cast<unsigned long long>(__double_as_longlong(sum));
      block[1 + 2 * static_cast<int64_t>(blockIdx.x)] = static_cast<uint32_t>(bits);
      block[2 + 2 * static_cast<int64_t>(blockIdx.x)] = static_cast<uint32_t>(bits >> 32);
    }
  }
}

// The `parts` block sums of magnitudeKernel, added up in a fixed order, as the scale into word 0.
// One block.
__global__ void scaleKernel(uint32_t* block, int parts, int64_t count) {
  double sum = 0.0;
  for (int p = static_cast<int>(threadIdx.x); p < parts; p += static_cast<int>(blockDim.x)) {
    const unsigned long long bits =
        static_cast<unsigned long long>(block[1 + 2 * p]) | (static_cast<unsigned long long>(block[2 + 2 * p]) << 32);
    sum += __longlong_as_double(static_cast<long long>(bits));
  }
  sum = blockSum(sum);
  if (threadIdx.x == 0) {
    storeScale(block, sum, count);
  }
}

// The signs with the scale of word 0; `written`: the sign words that hold values (the rest of the
// `signWords` are zeroed).
__global__ void quantize1bitKernel(const float* add, float* residual, uint32_t* block, int64_t count, int64_t signWords,
                                   int64_t written) {
  const float scale = __uint_as_float(block[0]);
  uint32_t* signs = block + 1;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i - lane < count; i += stride) {
    uint32_t positive = 0;
    if (i < count) {
      const float r = loadValue(add, residual, i);
      positive = r >= 0.0f;
      residual[i] = r - (positive ? scale : -scale);
    }
    const uint32_t bits = __ballot_sync(kFullMask, positive);
    if (lane == 0) {
      signs[i >> 5] = bits;
    }
  }
  for (int64_t w = written + first; w < signWords; w += stride) {
    signs[w] = 0;
  }
}

template <bool Accumulate>
__global__ void dequantize2bitKernel(const uint32_t* block, float* out, int64_t count, float t) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint32_t bits = block[i >> 4] >> (2 * static_cast<int>(i & 15));
    // As the CPU computes it; __fmul_rn keeps the products out of a fused multiply-add.
    const float value =
        __fmul_rn(static_cast<float>(bits & 1u), t) - __fmul_rn(static_cast<float>((bits >> 1) & 1u), t);
    out[i] = Accumulate ? out[i] + value : value;
  }
}

template <bool Accumulate>
__global__ void dequantize1bitKernel(const uint32_t* block, float* out, int64_t count) {
  const float scale = __uint_as_float(block[0]);
  const uint32_t* signs = block + 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float value = ((signs[i >> 5] >> static_cast<int>(i & 31)) & 1u) ? scale : -scale;
    out[i] = Accumulate ? out[i] + value : value;
  }
}

}  // namespace

void quantize(QuantizeKind kind, const float* add, float* residual, uint32_t* block, int64_t count, int64_t chunk,
              float threshold, void* rawStream) {
  TORCH_CHECK(count >= 0 && count <= chunk, "chainermn: quantize of ", count, " values in blocks of ", chunk);
  auto stream = static_cast<cudaStream_t>(rawStream);
  const int64_t words = blockWords(kind, chunk);
  if (words == 0) {
    return;
  }
  if (count == 0) {
    // No values: every word zero (for 1-bit, a scale of 0.0f as well).
    C10_CUDA_CHECK(cudaMemsetAsync(block, 0, static_cast<size_t>(words) * sizeof(uint32_t), stream));
    return;
  }
  const int blocks = blocksFor(count);
  if (kind == QuantizeKind::TwoBit) {
    const int64_t written = std::min(words, (count + 31) / 32 * 2);
    quantize2bitKernel<<<blocks, kThreads, 0, stream>>>(add, residual, block, count, words, written, threshold);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t signWords = words - 1;
  // As many block sums as fit in the sign words, two words each (one block if none fit).
  const int parts = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({(count + kThreads - 1) / kThreads, kMaxParts, signWords / 2})));
  magnitudeKernel<<<parts, kThreads, 0, stream>>>(add, residual, block, count);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (parts > 1) {
    scaleKernel<<<1, kThreads, 0, stream>>>(block, parts, count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  quantize1bitKernel<<<blocks, kThreads, 0, stream>>>(add, residual, block, count, signWords, (count + 31) / 32);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize(QuantizeKind kind, const uint32_t* block, float* out, int64_t count, float threshold, bool accumulate,
                void* rawStream) {
  TORCH_CHECK(count >= 0, "chainermn: dequantize of ", count, " values");
  if (count == 0) {
    return;
  }
  auto stream = static_cast<cudaStream_t>(rawStream);
  const int blocks = blocksFor(count);
  if (kind == QuantizeKind::TwoBit) {
    if (accumulate) {
      dequantize2bitKernel<true><<<blocks, kThreads, 0, stream>>>(block, out, count, threshold);
    } else {
      dequantize2bitKernel<false><<<blocks, kThreads, 0, stream>>>(block, out, count, threshold);
    }
  } else {
    if (accumulate) {
      dequantize1bitKernel<true><<<blocks, kThreads, 0, stream>>>(block, out, count);
    } else {
      dequantize1bitKernel<false><<<blocks, kThreads, 0, stream>>>(block, out, count);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// "2bit" and "1bit"'s CUDA kernels, added to their descriptors (kernels/quantize.cpp) in the CUDA
// build. A row is one block of codes.
template <QuantizeKind Kind>
void encodeRows(const CodeSettings& s, const float* values, float* residual, uint8_t* wire, int64_t rows,
                int64_t rowBytes, int64_t count, void* stream) {
  for (int64_t r = 0; r < rows; ++r) {
    quantize(Kind, values ? values + r * count : nullptr, residual + r * count,
             reinterpret_cast<uint32_t*>(wire + r * rowBytes), count, count, s.threshold, stream);
  }
}

template <QuantizeKind Kind>
void decodeRows(const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                bool sum, bool accumulate, void* stream) {
  for (int64_t r = 0; r < rows; ++r) {
    dequantize(Kind, reinterpret_cast<const uint32_t*>(wire + r * rowBytes), sum ? out : out + r * count, count,
               s.threshold, sum && (r > 0 || accumulate), stream);
  }
}

const CudaCodeRegistration registeredTwoBit{"2bit", encodeRows<QuantizeKind::TwoBit>, decodeRows<QuantizeKind::TwoBit>};
const CudaCodeRegistration registeredOneBit{"1bit", encodeRows<QuantizeKind::OneBit>, decodeRows<QuantizeKind::OneBit>};

}  // namespace

}  // namespace chainermn::cuda
