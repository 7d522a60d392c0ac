// One-launch pack/unpack of many tensors on CUDA (kernels/pack.h says what a pack is), and the Mover
// that gives a CUDA Scratch its copies, packs and unpacks on the current stream. CUDA builds only.
#pragma once

#include "kernels/pack.h"
#include "buffers/scratch.h"

#include <c10/core/Device.h>

#include <memory>
#include <vector>

namespace chainermn {
namespace cuda {

// The parts' table (their chunks: pointer, dtype, place in the packed buffer) in device memory,
// uploaded through a ring of pinned host copies so that a call rarely waits for the GPU (only when
// the upload eight calls back is still queued). The memory comes from torch's caching allocators (no
// cudaMalloc/cudaFree on the worker thread: cudaFree synchronizes the device and can deadlock against another group's
// NCCL kernel); it only grows and is reused, so nothing is allocated per call once warmed up. One
// device, one stream (the group's) in normal use; another stream gets its own device table.
class PartTable {
 public:
  PartTable();
  ~PartTable();
  PartTable(const PartTable&) = delete;
  PartTable& operator=(const PartTable&) = delete;

  size_t bytesHeld() const;

  struct State;
  std::unique_ptr<State> state;
};

// Floating dtypes only (float16, bfloat16, float32, float64), parts of any mix of them. One kernel
// launch on `stream` (a cudaStream_t); the parts and `packed` must be on the current device.
void pack(PartTable& table, const std::vector<FlatBuffer>& parts, void* packed, c10::ScalarType wire, double scale,
          void* stream);
void unpack(PartTable& table, const void* packed, c10::ScalarType wire, const std::vector<FlatBuffer>& parts,
            double scale, void* stream);

}  // namespace cuda

namespace cuda {
// A Scratch's moves on `device`, on the current stream (the group's, in an op's scope).
std::unique_ptr<Mover> makeMover(at::Device device);
}  // namespace cuda

}  // namespace chainermn
