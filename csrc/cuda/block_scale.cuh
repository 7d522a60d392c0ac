// What the block codes' CUDA encoders (int8_kernels.cu, block_int_kernels.cuh, topk_kernels.cu) share, as
// kernels/block_scale.h on the CPU: their launch (a warp per quantisation block), and a warp's pass
// over one block that forms r = value (+ residual), keeps it in the residual, and returns the
// block's largest |r| on every lane.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace chainermn::cuda {

constexpr int kBlockCodeThreads = 256;
constexpr int kBlockCodeWarps = kBlockCodeThreads / 32;  // quantisation blocks per thread block

// An encoder's launch: one warp per quantisation block of `block` values, `rows` rows of `count`.
struct BlockCodeLaunch {
  int64_t blocksPerRow = 0;
  int64_t totalBlocks = 0;  // 0: nothing to launch
  int grid = 0;
};

inline BlockCodeLaunch blockCodeLaunch(const char* what, int64_t rows, int64_t count, int64_t block) {
  TORCH_CHECK(rows >= 0 && count >= 0 && block >= 1, "chainermn: ", what, " of ", rows, " x ", count, " in blocks of ",
              block);
  BlockCodeLaunch launch;
  launch.blocksPerRow = (count + block - 1) / block;
  launch.totalBlocks = rows * launch.blocksPerRow;
  const int64_t grid = (launch.totalBlocks + kBlockCodeWarps - 1) / kBlockCodeWarps;
  TORCH_CHECK(grid <= std::numeric_limits<int>::max(), "chainermn: ", what, ": ", launch.totalBlocks, " blocks of ",
              block, " values, more than one launch takes: use a larger block");
  launch.grid = static_cast<int>(grid);
  return launch;
}

// The quantisation block one warp of an encoder codes (a warp per block, kBlockCodeWarps per thread
// block): its place in its row, and where its values, residual and wire row are.
struct WarpBlock {
  bool valid;  // false past the last block (the whole warp returns: its shuffles need every lane)
  int lane;
  int64_t index, begin, n;  // the block's number in its row, its first value, its values
  const float* values;
  float* kept;  // the residual, or null
  uint8_t* row;
};

__device__ __forceinline__ WarpBlock warpBlock(const float* values, float* residual, uint8_t* wire, int64_t rowBytes,
                                               int64_t count, int64_t block, int64_t blocksPerRow,
                                               int64_t totalBlocks) {
  WarpBlock w{};
  w.lane = static_cast<int>(threadIdx.x & 31);
  const int64_t id = static_cast<int64_t>(blockIdx.x) * kBlockCodeWarps + (threadIdx.x >> 5);
  w.valid = id < totalBlocks;
  if (!w.valid) {
    return w;
  }
  const int64_t row = id / blocksPerRow;
  w.index = id % blocksPerRow;
  w.begin = w.index * block;
  w.n = min(block, count - w.begin);
  w.values = values + row * count + w.begin;
  w.kept = residual ? residual + row * count + w.begin : nullptr;
  w.row = wire + row * rowBytes;
  return w;
}

__device__ __forceinline__ float warpBlockLargest(const float* v, float* kept, int64_t n, int lane) {
  float largest = 0.0f;
  for (int64_t i = lane; i < n; i += 32) {
    float r = v[i];
    if (kept) {
      r = __fadd_rn(kept[i], r);
      kept[i] = r;
    }
    largest = fmaxf(largest, fabsf(r));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  return largest;
}

}  // namespace chainermn::cuda
