#include "strategies/compressed.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>

namespace chainermn {

namespace {

constexpr c10::ScalarType kCodes = c10::ScalarType::Int;  // codes travel as 32-bit words (rows are whole words)

int64_t countOfChunk(int64_t count, int64_t chunk, int index) {
  return std::clamp<int64_t>(count - index * chunk, 0, chunk);
}

// Steps 2 to 4 on a node leader: `sum` (nodes * chunk floats of room, `count` of them used) holds the
// node's sum and becomes the sum of what every node sent, in `result` (returned: `sum`, or with a
// 16-bit result wire, a scratch buffer of that dtype).
void* exchangeBetweenNodes(Transport& inter, Scratch& scratch, float* sum, int64_t count, const CompressionSpec& spec,
                           float* residual, float* secondResidual) {
  const int nodes = inter.size();
  const int node = inter.rank();
  const int64_t chunk = compressionChunk(count, nodes, spec);
  const int64_t rowBytes = wireRowBytes(spec.code, chunk, spec.settings);  // a multiple of 4
  const int64_t words = rowBytes / 4;
  // The sums' rows (with compressResult), in their own code: room for the longer of the two.
  const int64_t resultRowBytes = spec.compressResult ? wireRowBytes(spec.resultCode, chunk, spec.settings) : 0;
  const int64_t room = std::max(rowBytes, resultRowBytes);
  auto* codes = static_cast<uint8_t*>(scratch.get(Slot::Compressed, 2 * nodes * room));
  uint8_t* received = codes + nodes * room;

  for (int i = 0; i < nodes; ++i) {
    const int64_t start = std::min<int64_t>(i * chunk, count);  // a chunk past the end is empty
    scratch.encode(spec.code, spec.settings, sum + start, residual + start, codes + i * rowBytes, 1, rowBytes,
                   countOfChunk(count, chunk, i));
  }
  const std::vector<int64_t> blocks(nodes, words);
  inter.alltoallv(codes, blocks, received, blocks, kCodes);

  // Every node's row of this node's chunk, summed in node order.
  const int64_t mine = countOfChunk(count, chunk, node);
  auto* chunkSum = static_cast<float*>(scratch.get(Slot::StrategyBlock, chunk * sizeof(float)));
  scratch.decode(spec.code, spec.settings, received, nodes, rowBytes, chunkSum, mine, /*sum=*/true,
                 /*accumulate=*/false);

  if (spec.compressResult) {
    scratch.encode(spec.resultCode, spec.settings, chunkSum, secondResidual, codes, 1, resultRowBytes, mine);
    inter.allgather(codes, received, resultRowBytes / 4, kCodes);
    for (int i = 0; i < nodes; ++i) {
      scratch.decode(spec.resultCode, spec.settings, received + i * resultRowBytes, 1, resultRowBytes, sum + i * chunk,
                     countOfChunk(count, chunk, i), /*sum=*/false, /*accumulate=*/false);
    }
    return sum;
  }
  if (spec.resultWire == c10::ScalarType::Float) {
    inter.allgather(chunkSum, sum, chunk, c10::ScalarType::Float);
    return sum;
  }
  // The sums travel in a 16-bit dtype: cast once, gathered into a buffer of that dtype.
  const size_t width = c10::elementSize(spec.resultWire);
  void* narrow = scratch.get(Slot::StrategyWhole, chunk * width);
  scratch.pack({FlatBuffer{chunkSum, chunk, c10::ScalarType::Float}}, narrow, spec.resultWire, 1.0);
  void* result = scratch.get(Slot::Received, nodes * chunk * width);
  inter.allgather(narrow, result, chunk, spec.resultWire);
  return result;
}

}  // namespace

int64_t compressionChunk(int64_t count, int nodes, const CompressionSpec& spec) {
  const int64_t even = (count + nodes - 1) / nodes;
  const int64_t words = (even + 31) / 32 * 32;
  if (!usesBlock(spec)) {
    return words;
  }
  const int64_t block = spec.settings.block;
  return (words + block - 1) / block * block;
}

ResidualShape residualShape(const Topology& topology, const CompressionSpec& spec, int64_t count) {
  ResidualShape shape;
  if (topology.interSize == 1 || topology.intraRank != 0) {
    return shape;
  }
  shape.first = count;
  if (spec.compressResult) {
    const int64_t chunk = compressionChunk(count, topology.interSize, spec);
    shape.second = chunk;
    shape.secondOffset = std::min<int64_t>(topology.interRank * chunk, count);
    shape.secondCount = countOfChunk(count, chunk, topology.interRank);
  }
  return shape;
}

void compressedMean(TransportSet& transports, Scratch& scratch, const Topology& topology,
                    const std::vector<FlatBuffer>& parts, const CompressionSpec& spec, float* residual,
                    float* secondResidual) {
  int64_t count = 0;
  for (const auto& part : parts) {
    count += part.count;
  }
  const double mean = 1.0 / topology.size;
  const int nodes = topology.interSize;
  constexpr auto kFloat = c10::ScalarType::Float;
  // A single float32 buffer (a DDP bucket) is read and written where it lies: no pack, no unpack
  // off the node's leader. Anything else is packed into float32 first.
  const bool inPlace = parts.size() == 1 && parts[0].dtype == kFloat;
  const int64_t room = nodes > 1 ? compressionChunk(count, nodes, spec) * nodes : count;
  auto* sum = static_cast<float*>(scratch.get(Slot::Packed, room * sizeof(float)));
  Transport& intra = *transports.intra;
  // A one-rank node's exchange works on its sum in scratch (room for every chunk): packed there too.
  if (!inPlace || (nodes > 1 && intra.size() == 1)) {
    scratch.pack(parts, sum, kFloat, 1.0);
  }
  float* mine = inPlace ? static_cast<float*>(parts[0].data) : sum;
  if (nodes == 1) {
    transports.world->allreduce(mine, count, kFloat, ReduceKind::Sum);
    scratch.unpack(mine, kFloat, parts, mean);
    return;
  }
  if (intra.size() > 1) {
    intra.reduce(mine, sum, count, kFloat, ReduceKind::Sum, /*root=*/0);
  }
  // Every rank of a node knows the result's dtype and place from the spec alone.
  const bool narrow = !spec.compressResult && spec.resultWire != kFloat;
  const c10::ScalarType resultType = narrow ? spec.resultWire : kFloat;
  void* result = narrow ? scratch.get(Slot::Received, room * c10::elementSize(resultType)) : sum;
  const bool leader = intra.rank() == 0;
  if (leader) {
    result = exchangeBetweenNodes(*transports.inter, scratch, sum, count, spec, residual, secondResidual);
  }
  if (inPlace && !narrow) {
    // The leader writes the mean into its buffer, which the node's other ranks receive into theirs.
    if (leader) {
      scratch.unpack(result, kFloat, parts, mean);
    }
    if (intra.size() > 1) {
      intra.broadcast(parts[0].data, count, kFloat, /*root=*/0);
    }
    return;
  }
  if (intra.size() > 1) {
    intra.broadcast(result, count, resultType, /*root=*/0);
  }
  scratch.unpack(result, resultType, parts, mean);
}

}  // namespace chainermn
