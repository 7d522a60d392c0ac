// Top-k sparsification on CUDA (see topk_kernels.h; kernels/topk.h says what a row is).
//
// encode: one warp per code block, as the block codes' (block_scale.cuh). The warp reads its block
// once for r and the largest |r|, then finds which values to send by a radix select over |r|'s bits
// from the top, one bit a pass over the block (from L1/L2, each lane its own values, counts summed
// through shuffles): after a pass the values whose bits above it beat the prefix chosen so far are
// sent, those below are not, and the select goes on among the equal ones only while more of them
// remain than are still to be sent. A last pass in index order, 32 values at a time, sends the
// values above the prefix and the first `need` equal ones (ties go to the lower index, as on the
// CPU); ballots give each sent value its slot, so the slots fill in increasing index order without
// shared memory. decode: one warp per block of an output row (or, with `sum`, of the output, the rows
// added in row order): zeros, then each slot's code x scale at its index.
#include "cuda/topk_kernels.h"
#include "kernels/code.h"

#include "cuda/block_scale.cuh"
#include "kernels/int8.h"
#include "kernels/topk.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

namespace chainermn::cuda {

namespace {

constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ uint32_t magnitudeBits(float x) {
  return __float_as_uint(x) & 0x7FFFFFFFu;  // non-negative floats order as their bits do; -0 ties +0
}

__device__ __forceinline__ int warpSum(int value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullWarp, value, offset);
  }
  return value;
}

__global__ void encodeTopkKernel(const float* values, float* residual, uint8_t* wire, int64_t rowBytes, int64_t count,
                                 int64_t block, int64_t keep, int64_t blocksPerRow, int64_t totalBlocks) {
  const WarpBlock w = warpBlock(values, residual, wire, rowBytes, count, block, blocksPerRow, totalBlocks);
  if (!w.valid) {
    return;  // the whole warp: its shuffles and ballots below need every lane
  }
  const int lane = w.lane;
  const int n = static_cast<int>(w.n);  // <= kTopkMaxBlock (kernels/codes.h checks it)
  float* kept = w.kept;
  const float largest = warpBlockLargest(w.values, kept, n, lane);
  const float* r = kept ? kept : w.values;

  // The radix select. Values whose bits above `shift` exceed prefix's are sent; of those equal to
  // it (`tied` of them), the first `need` in index order. Bit 31 of |r| is 0: every value starts tied.
  uint32_t prefix = 0;
  int shift = 31;
  int need = static_cast<int>(keep < n ? keep : n);
  int tied = n;
  while (shift > 0 && tied > need) {
    --shift;
    const uint32_t high = (prefix >> shift) | 1u;  // the tied values with bit `shift` set
    int ones = 0;
    for (int i = lane; i < n; i += 32) {
      ones += (magnitudeBits(r[i]) >> shift) == high;
    }
    ones = warpSum(ones);
    if (ones >= need) {
      prefix |= 1u << shift;  // the select goes on among them; the rest of the tied are not sent
      tied = ones;
    } else {
      need -= ones;  // all of them are sent; it goes on among the others
      tied -= ones;
    }
  }
  const uint32_t boundary = prefix >> shift;

  uint8_t* out = w.row + w.index * topkBlockBytes(keep);
  auto* indices = reinterpret_cast<uint16_t*>(out + topkIndicesOffset());
  auto* codes = reinterpret_cast<int8_t*>(out + topkCodesOffset(keep));
  const float scale = __fdiv_rn(largest, kInt8Levels);
  const float inverse = largest > 0.0f ? __fdiv_rn(kInt8Levels, largest) : 0.0f;  // int8Inverse
  const unsigned lanesBelow = (1u << lane) - 1u;
  int slots = 0, ties = 0;  // slots filled and tied values seen, in the chunks before this one
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const float x = i < n ? r[i] : 0.0f;
    const uint32_t bits = magnitudeBits(x) >> shift;
    const bool above = i < n && bits > boundary;
    const bool equal = i < n && bits == boundary;
    const unsigned equals = __ballot_sync(kFullWarp, equal);
    const bool send = above || (equal && ties + __popc(equals & lanesBelow) < need);
    const unsigned sent = __ballot_sync(kFullWarp, send);
    if (send) {
      const int slot = slots + __popc(sent & lanesBelow);
      const int q = max(-127, min(127, __float2int_rn(__fmul_rn(x, inverse))));
      indices[slot] = static_cast<uint16_t>(i);
      codes[slot] = static_cast<int8_t>(q);
      if (kept) {
        kept[i] = __fsub_rn(x, __fmul_rn(static_cast<float>(q), scale));
      }
    }
    ties += __popc(equals);
    slots += __popc(sent);
  }
  for (int64_t j = slots + lane; j < keep; j += 32) {  // a short block's unused slots
    indices[j] = kTopkUnused;
    codes[j] = 0;
  }
  for (int64_t at = topkCodesOffset(keep) + keep + lane; at < topkBlockBytes(keep); at += 32) {
    out[at] = 0;  // the zero bytes to the next block's scale
  }
  if (lane == 0) {
    *reinterpret_cast<float*>(out) = scale;
  }
}

__global__ void decodeTopkKernel(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count,
                                 int64_t block, int64_t keep, int64_t blocksPerRow, int64_t totalBlocks, bool sum,
                                 bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t id = static_cast<int64_t>(blockIdx.x) * kBlockCodeWarps + (threadIdx.x >> 5);
  if (id >= totalBlocks) {
    return;  // the whole warp
  }
  const int64_t b = id % blocksPerRow;
  const int64_t first = sum ? 0 : id / blocksPerRow;
  const int64_t last = sum ? rows : first + 1;
  const int64_t begin = b * block;
  const int64_t n = min(block, count - begin);
  const int64_t slots = min(keep, n);
  float* into = out + (sum ? 0 : first * count) + begin;
  if (!accumulate || !sum) {
    for (int64_t i = lane; i < n; i += 32) {
      into[i] = 0.0f;
    }
  }
  // Each row's indices are distinct, so its lanes write different values; __syncwarp orders the
  // rows' writes (and the zeros before them) between lanes, so each value adds the rows in row order.
  // A decoded value is never -0 (0 x a scale >= 0 is +0): added into a zero it is itself, bit for bit.
  __syncwarp();
  for (int64_t r = first; r < last; ++r) {
    const uint8_t* at = wire + r * rowBytes + b * topkBlockBytes(keep);
    const float scale = *reinterpret_cast<const float*>(at);
    const auto* indices = reinterpret_cast<const uint16_t*>(at + topkIndicesOffset());
    const auto* codes = reinterpret_cast<const int8_t*>(at + topkCodesOffset(keep));
    for (int64_t j = lane; j < slots; j += 32) {
      const int64_t i = indices[j];
      if (i < n) {  // a slot that names no value of the block (a corrupt row) writes nothing
        into[i] = __fadd_rn(into[i], __fmul_rn(static_cast<float>(codes[j]), scale));
      }
    }
    __syncwarp();
  }
}

}  // namespace

void encodeTopk(const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes, int64_t count,
                int64_t block, int64_t keep, void* rawStream) {
  TORCH_CHECK(block <= kTopkMaxBlock && keep >= 1 && keep <= block, "chainermn: encodeTopk: keep ", keep,
              " of blocks of ", block);
  const BlockCodeLaunch launch = blockCodeLaunch("encodeTopk", rows, count, block);
  if (launch.totalBlocks == 0) {
    return;
  }
  encodeTopkKernel<<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      values, residual, wire, rowBytes, count, block, keep, launch.blocksPerRow, launch.totalBlocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decodeTopk(const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, int64_t block,
                int64_t keep, bool sum, bool accumulate, void* rawStream) {
  // A warp per block of each output row: with `sum` the output is one row.
  const BlockCodeLaunch launch = blockCodeLaunch("decodeTopk", sum ? 1 : rows, count, block);
  if (launch.totalBlocks == 0 || rows == 0) {
    return;
  }
  decodeTopkKernel<<<launch.grid, kBlockCodeThreads, 0, static_cast<cudaStream_t>(rawStream)>>>(
      wire, rows, rowBytes, out, count, block, keep, launch.blocksPerRow, launch.totalBlocks, sum, accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

// The "topk" code's CUDA kernels, added to its descriptor (kernels/topk.cpp) in the CUDA build.
const CudaCodeRegistration registered{
    "topk",
    [](const CodeSettings& s, const float* values, float* residual, uint8_t* wire, int64_t rows, int64_t rowBytes,
       int64_t count,
       void* stream) { encodeTopk(values, residual, wire, rows, rowBytes, count, s.block, s.keep, stream); },
    [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out, int64_t count, bool sum,
       bool accumulate,
       void* stream) { decodeTopk(wire, rows, rowBytes, out, count, s.block, s.keep, sum, accumulate, stream); }};

}  // namespace

}  // namespace chainermn::cuda
