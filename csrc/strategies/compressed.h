// Gradient compression between nodes (any code of kernels/codes.h: block int8 and 4-bit, MXNet's 2-bit,
// 1-bit sign with a scale, top-k; with error feedback): the mean of a set of gradients where only the links
// between nodes carry compressed values.
//
//   1. within each node, the ranks' gradients are summed at full precision (float32) on the node's
//      first rank (its leader);
//   2. each leader adds the sum to its residual and encodes it (kernels/codes.h), chunk by chunk: one
//      chunk per node, a whole number of the code's blocks or words;
//   3. the leaders exchange chunks all-to-all (node j receives every node's chunk j) and node j sums
//      its chunk from the codes;
//   4. the chunk sums are all-gathered: as float32 (or resultWire), or, with compressResult,
//      encoded again (in resultCode: the code itself, or a finer block code, e.g. 4-bit there and
//      int8 back) against a second residual (the two-stage error feedback of 1-bit Adam);
//   5. each leader broadcasts the sum within its node; every rank writes sum / world size.
// Both exchanges move (nodes - 1) / nodes of the compressed buffer per leader, whatever the number
// of nodes. With one node nothing is compressed: the mean is a plain float32 allreduce.
#pragma once

#include "comm/transport.h"
#include "kernels/code_spec.h"
#include "buffers/scratch.h"
#include "topology.h"
#include "types.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace chainermn {

// The residuals one rank keeps for a buffer of `count` values: a node's leader keeps `first`
// (every value), and with compressResult `second` (its node's chunk of the sums, which is
// first[secondOffset, secondOffset + secondCount)); every other rank keeps none. All zero with one node.
struct ResidualShape {
  int64_t first = 0;
  int64_t second = 0;
  int64_t secondOffset = 0;
  int64_t secondCount = 0;
};
ResidualShape residualShape(const Topology& topology, const CompressionSpec& spec, int64_t count);

// Values per node chunk: count split over `nodes`, rounded up to whole words of codes (32 values)
// and, for a block code, whole blocks.
int64_t compressionChunk(int64_t count, int nodes, const CompressionSpec& spec);

// Every part (floating dtypes) becomes the mean over the group of what the nodes sent. `residual` and
// `secondResidual` are float32 on the scratch's device, as residualShape gives them (null when none).
void compressedMean(TransportSet& transports, Scratch& scratch, const Topology& topology,
                    const std::vector<FlatBuffer>& parts, const CompressionSpec& spec, float* residual,
                    float* secondResidual);

}  // namespace chainermn
