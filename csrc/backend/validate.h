// Validation of every call, in one place, on the calling thread and before anything is queued: a bad
// call raises ValueError on the rank that made it and never leaves other ranks waiting on a
// half-started collective. Messages name the op and the argument.
#pragma once

#include "strategies/strategy.h"
#include "types.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <atomic>
#include <optional>
#include <string>
#include <vector>

namespace chainermn {

// The memory layouts an argument may have. Contiguous: what an op that reads or writes memory in
// logical order needs. Dense: any non-overlapping, dense layout (channels_last): enough where the
// op's result does not depend on the order (elementwise reductions, broadcast) or where the op
// makes a contiguous copy first (the inputs of gathers); every rank must then use the same layout,
// which the cross-rank check compares (agreement.h).
enum class Layout { Contiguous, Dense };

// A tensor the transports can read and write: defined, strided, laid out as `layout` allows, on the
// CPU or (in a build with CUDA) on a GPU. Which ops a device serves follows from its transports, not
// from a list here.
void checkTensor(const char* op, const char* argument, const at::Tensor& tensor, Layout layout = Layout::Contiguous);
void checkTensors(const char* op, const char* argument, const std::vector<at::Tensor>& tensors,
                  Layout layout = Layout::Contiguous);

// Exactly one tensor per call (one device per process), returned for convenience.
at::Tensor& single(const char* op, const char* argument, std::vector<at::Tensor>& tensors,
                   Layout layout = Layout::Contiguous);

// The funnel's checks of every op: all its tensors on one device, and a group serves one CUDA device
// (one device per process): the first CUDA tensor it sees binds it (`bound` holds the device index,
// -1 before), and a tensor on another GPU is refused.
void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors);
void checkGroupDevice(const char* op, std::atomic<int>& bound, const at::Tensor& tensor);

// `tensor` has the device, dtype and number of elements of `like`.
void checkSameKind(const char* op, const char* argument, const at::Tensor& tensor, const at::Tensor& like);
void checkSameDtype(const char* op, const std::vector<at::Tensor>& tensors);

// A list argument holds one tensor per rank.
void checkListSize(const char* op, const char* argument, size_t actual, int size);

// The one list of a list-of-lists argument (one device per process).
std::vector<at::Tensor> onlyList(const char* op, const char* argument,
                                 const std::vector<std::vector<at::Tensor>>& lists);

// gather's gather_list / scatter's scatter_list: one tensor per rank like `like` on the root, nothing
// elsewhere. Returns the list (empty off the root).
std::vector<at::Tensor> rootList(const char* op, const char* argument,
                                 const std::vector<std::vector<at::Tensor>>& lists, bool isRoot, int size,
                                 const at::Tensor& like);

// `whole` has `part`'s dtype and world_size times its elements (all_gather_into_tensor's output,
// reduce_scatter_tensor's input); `index` names the pair in a coalesced call (-1: none).
void checkWorldBlocks(const char* op, const char* wholeName, const at::Tensor& whole, const char* partName,
                      const at::Tensor& part, int size, int index = -1, Layout partLayout = Layout::Contiguous);

// Elements per rank of an all_to_all_single buffer: even rows when `splits` is empty.
std::vector<int64_t> splitCounts(const char* op, const char* argument, const at::Tensor& tensor,
                                 const std::vector<int64_t>& splits, int size);

// The group's allreduce strategy can reduce this tensor (pure_nccl refuses CPU tensors).
void checkStrategyHandles(const char* op, const Strategy& strategy, const at::Tensor& tensor);

void checkRank(const char* op, const char* argument, int64_t rank, int size);
// Tags from 2^30 up carry the backend's message headers (point_to_point.cpp).
constexpr int kHeaderTagBit = 1 << 30;
void checkTag(const char* op, int tag);

}  // namespace chainermn
