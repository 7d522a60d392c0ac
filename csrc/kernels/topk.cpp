#include "kernels/topk.h"
#include "kernels/code.h"

#include "kernels/block_scale.h"
#include "kernels/int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

// Block by block, one pass over memory: a block is read once for r and its largest magnitude (kept
// in the residual: kernels/block_scale.h), then twice more from the L1 cache: once to find the
// keep-th largest rank key (below), once, in index order, to send every value whose key is at least
// that one. The keys are distinct, so exactly keep values pass, already in increasing index order.
//
// Finding the keep-th largest key allocates nothing per call: a few keys of many (the usual case:
// 8 of 256) stream through a min-heap on the stack, where after the first few values almost every
// value is one comparison with the heap's least; otherwise std::nth_element over a per-thread
// buffer that grows to the largest block once. The selection alone, measured on the 2-core VM (16M
// normal values): 8 of 256, the heap 3.8 ns a value against nth_element's 8.4; 64 of 256, 12.2
// against 8.5; 64 of 4096, 2.5 against 5.3. The whole encode of 8 of 256: 3.7 ns a value (int8's: 0.4).

namespace chainermn {
namespace {

constexpr int64_t kHeapKeep = 128;  // at most this many keys in the stack heap (1 KiB)

// A value's rank: larger is sent first. |r|'s bits (non-negative floats order as their bits do;
// -0 ties +0) above the inverted in-block index (a tie goes to the lower index): distinct within a
// block. cuda/topk_kernels.cu ranks in the same order.
inline uint64_t rankKey(float r, int64_t i) {
  uint32_t bits;
  std::memcpy(&bits, &r, sizeof(bits));
  return (uint64_t{bits & 0x7FFFFFFFu} << 16) | static_cast<uint64_t>(0xFFFF - i);
}

// The keep-th largest rank key of r[0, n), 0 < keep < n.
uint64_t keepThreshold(const float* r, int64_t n, int64_t keep) {
  if (keep <= kHeapKeep && keep * 32 <= n) {
    uint64_t heap[kHeapKeep];  // a min-heap of the keep largest keys so far: the least at heap[0]
    for (int64_t i = 0; i < keep; ++i) {
      heap[i] = rankKey(r[i], i);
    }
    std::make_heap(heap, heap + keep, std::greater<>());
    for (int64_t i = keep; i < n; ++i) {
      const uint64_t key = rankKey(r[i], i);
      if (key <= heap[0]) {
        continue;
      }
      // The least leaves, `key` sifts down from the top: one walk instead of pop_heap + push_heap.
      int64_t at = 0;
      for (int64_t child = 1; child < keep; child = 2 * at + 1) {
        if (child + 1 < keep && heap[child + 1] < heap[child]) {
          ++child;  // the lesser child
        }
        if (heap[child] >= key) {
          break;
        }
        heap[at] = heap[child];
        at = child;
      }
      heap[at] = key;
    }
    return heap[0];
  }
  thread_local std::vector<uint64_t> keys;  // grows to the largest block once per thread
  if (static_cast<int64_t>(keys.size()) < n) {
    keys.resize(static_cast<size_t>(n));
  }
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = rankKey(r[i], i);
  }
  std::nth_element(keys.begin(), keys.begin() + (keep - 1), keys.begin() + n, std::greater<>());
  return keys[keep - 1];
}

}  // namespace

void encodeTopkCpu(const float* values, float* residual, uint8_t* row, int64_t count, int64_t block, int64_t keep) {
  const int64_t blockBytes = topkBlockBytes(keep);
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    float* blockResidual = residual ? residual + begin : nullptr;
    const float largest = loadBlock(values + begin, blockResidual, n);
    const float* r = blockResidual ? blockResidual : values + begin;
    // Every key is at least 0: a block of keep values or fewer sends them all.
    const uint64_t least = n > keep ? keepThreshold(r, n, keep) : 0;

    uint8_t* out = row + b * blockBytes;
    auto* indices = reinterpret_cast<uint16_t*>(out + topkIndicesOffset());
    auto* codes = reinterpret_cast<int8_t*>(out + topkCodesOffset(keep));
    const float scale = largest / kInt8Levels;
    const float inverse = int8Inverse(largest);
    std::memcpy(out, &scale, sizeof(scale));
    int64_t slot = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (rankKey(r[i], i) < least) {
        continue;  // not sent: the residual keeps all of r
      }
      const float x = r[i];
      const int32_t code = std::max(-127, std::min(127, static_cast<int32_t>(std::nearbyint(x * inverse))));
      indices[slot] = static_cast<uint16_t>(i);
      codes[slot] = static_cast<int8_t>(code);
      ++slot;
      if (blockResidual) {
        blockResidual[i] = x - static_cast<float>(code) * scale;
      }
    }
    for (; slot < keep; ++slot) {  // a short block's unused slots
      indices[slot] = kTopkUnused;
      codes[slot] = 0;
    }
    std::memset(out + topkCodesOffset(keep) + keep, 0, static_cast<size_t>(blockBytes - topkCodesOffset(keep) - keep));
  }
}

void decodeTopkCpu(const uint8_t* rows, int64_t rowCount, int64_t rowBytes, float* out, int64_t count, int64_t block,
                   int64_t keep, bool sum, bool accumulate) {
  const int64_t blockBytes = topkBlockBytes(keep);
  // Block by block, every row's piece of it: with `sum` the block's out stays in the L1 cache while
  // the rows are added into it. Decoded values are never -0 (0 x a scale >= 0 is +0), so adding a
  // row into zeros gives its values bit for bit.
  for (int64_t begin = 0, b = 0; begin < count; begin += block, ++b) {
    const int64_t n = std::min(block, count - begin);
    const int64_t slots = std::min(keep, n);
    if (sum && !accumulate) {
      std::fill_n(out + begin, n, 0.0f);
    }
    for (int64_t r = 0; r < rowCount; ++r) {
      const uint8_t* at = rows + r * rowBytes + b * blockBytes;
      float scale;
      std::memcpy(&scale, at, sizeof(scale));
      const auto* indices = reinterpret_cast<const uint16_t*>(at + topkIndicesOffset());
      const auto* codes = reinterpret_cast<const int8_t*>(at + topkCodesOffset(keep));
      float* into = (sum ? out : out + r * count) + begin;
      if (!sum) {
        std::fill_n(into, n, 0.0f);
      }
      for (int64_t j = 0; j < slots; ++j) {
        if (indices[j] < n) {  // a slot that names no value of the block (a corrupt row) writes nothing
          const float value = static_cast<float>(codes[j]) * scale;
          into[indices[j]] = sum ? into[indices[j]] + value : value;
        }
      }
    }
  }
}

namespace {

// The "topk" code, described once (kernels/code.h): the registry's entry for it.
CodeDescriptor described() {
  CodeDescriptor code;
  code.name = "topk";
  code.summary = "the keep largest |x| of each block, each a 16-bit index and an int8 code; one float32 scale a block";
  code.readsBlock = true;
  code.readsKeep = true;
  code.maxBlock = kTopkMaxBlock;  // in-block indices travel as 16 bits
  code.rowBytes = [](int64_t count, const CodeSettings& s) { return topkRowBytes(count, s.block, s.keep); };
  code.encodeRow = [](const CodeSettings& s, const float* values, float* residual, uint8_t* row, int64_t count) {
    encodeTopkCpu(values, residual, row, count, s.block, s.keep);
  };
  code.decodeRows = [](const CodeSettings& s, const uint8_t* wire, int64_t rows, int64_t rowBytes, float* out,
                       int64_t count, bool sum, bool accumulate) {
    decodeTopkCpu(wire, rows, rowBytes, out, count, s.block, s.keep, sum, accumulate);
  };
  return code;
}

const CodeRegistration registered{described()};

}  // namespace

}  // namespace chainermn
