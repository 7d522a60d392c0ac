#include "backend/validate.h"

#include "backend/device_context.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <numeric>

namespace chainermn {

void checkTensor(const char* op, const char* argument, const at::Tensor& tensor, Layout layout) {
  TORCH_CHECK_VALUE(tensor.defined(), op, ": ", argument, " is an undefined tensor");
  if (!tensor.device().is_cpu()) {
    TORCH_CHECK_VALUE(cudaBuilt() && tensor.device().is_cuda(), op, ": ", argument, " is on ", tensor.device(),
                      "; this build of the chainermn backend handles CPU tensors only");
  }
  TORCH_CHECK_VALUE(tensor.layout() == at::kStrided, op, ": ", argument, " must be a dense tensor, got layout ",
                    tensor.layout());
  if (layout == Layout::Dense) {
    TORCH_CHECK_VALUE(
        tensor.is_non_overlapping_and_dense(), op, ": ", argument,
        " must be contiguous or dense and non-overlapping, as channels_last is (call .contiguous() on it first)");
  } else {
    TORCH_CHECK_VALUE(tensor.is_contiguous(), op, ": ", argument,
                      " must be contiguous (call .contiguous() on it first)");
  }
}

void checkTensors(const char* op, const char* argument, const std::vector<at::Tensor>& tensors, Layout layout) {
  for (const auto& tensor : tensors) {
    checkTensor(op, argument, tensor, layout);
  }
}

at::Tensor& single(const char* op, const char* argument, std::vector<at::Tensor>& tensors, Layout layout) {
  TORCH_CHECK_VALUE(tensors.size() == 1, op, ": expects exactly one tensor in ", argument,
                    " (one device per process), got ", tensors.size());
  checkTensor(op, argument, tensors[0], layout);
  return tensors[0];
}

void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    TORCH_CHECK_VALUE(tensor.device() == tensors.front().device(), op, ": all tensors must be on one device, got ",
                      tensors.front().device(), " and ", tensor.device());
  }
}

void checkGroupDevice(const char* op, std::atomic<int>& bound, const at::Tensor& tensor) {
  if (!tensor.device().is_cuda()) {
    return;
  }
  int expected = -1;
  const int index = tensor.device().index();
  if (bound.compare_exchange_strong(expected, index) || expected == index) {
    return;
  }
  TORCH_CHECK_VALUE(false, op, ": the group works on cuda:", expected,
                    " (its first CUDA tensor was there) and cannot take a tensor on cuda:", index,
                    "; use one GPU per process");
}

void checkSameKind(const char* op, const char* argument, const at::Tensor& tensor, const at::Tensor& like) {
  checkTensor(op, argument, tensor);
  TORCH_CHECK_VALUE(tensor.device() == like.device(), op, ": all tensors must be on one device, got ", argument, " on ",
                    tensor.device(), " and the input on ", like.device());
  TORCH_CHECK_VALUE(tensor.scalar_type() == like.scalar_type(), op, ": ", argument, " has dtype ",
                    dtypeName(tensor.scalar_type()), " but the input has ", dtypeName(like.scalar_type()));
  TORCH_CHECK_VALUE(tensor.numel() == like.numel(), op, ": ", argument, " has ", tensor.numel(),
                    " elements but the input has ", like.numel());
}

void checkSameDtype(const char* op, const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors) {
    TORCH_CHECK_VALUE(tensor.scalar_type() == tensors.front().scalar_type(), op,
                      ": all tensors must have the same dtype, got ", dtypeName(tensors.front().scalar_type()), " and ",
                      dtypeName(tensor.scalar_type()));
  }
}

void checkListSize(const char* op, const char* argument, size_t actual, int size) {
  TORCH_CHECK_VALUE(static_cast<int>(actual) == size, op, ": ", argument, " must hold one tensor per rank (", size,
                    "), got ", actual);
}

std::vector<at::Tensor> onlyList(const char* op, const char* argument,
                                 const std::vector<std::vector<at::Tensor>>& lists) {
  TORCH_CHECK_VALUE(lists.size() == 1, op, ": expects one ", argument, ", got ", lists.size());
  return lists[0];
}

std::vector<at::Tensor> rootList(const char* op, const char* argument,
                                 const std::vector<std::vector<at::Tensor>>& lists, bool isRoot, int size,
                                 const at::Tensor& like) {
  if (!isRoot) {
    TORCH_CHECK_VALUE(lists.empty() || (lists.size() == 1 && lists[0].empty()), op, ": ", argument,
                      " must be empty on ranks other than the root");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1, op, ": the root rank needs ", argument);
  checkListSize(op, argument, lists[0].size(), size);
  for (const auto& tensor : lists[0]) {
    checkSameKind(op, argument, tensor, like);
  }
  return lists[0];
}

void checkWorldBlocks(const char* op, const char* wholeName, const at::Tensor& whole, const char* partName,
                      const at::Tensor& part, int size, int index, Layout partLayout) {
  checkTensor(op, wholeName, whole);
  checkTensor(op, partName, part, partLayout);
  const std::string which = index < 0 ? "" : " " + std::to_string(index);
  TORCH_CHECK_VALUE(whole.scalar_type() == part.scalar_type(), op, ": ", wholeName, which, " has dtype ",
                    dtypeName(whole.scalar_type()), " but ", partName, which, " has ", dtypeName(part.scalar_type()));
  TORCH_CHECK_VALUE(whole.numel() == part.numel() * size, op, ": ", wholeName, which, " must have world_size (", size,
                    ") times the ", part.numel(), " elements of ", partName, which, ", got ", whole.numel());
}

namespace {
// Elements per first-dimension row, also for tensors whose first dimension is 0.
int64_t rowElements(const at::Tensor& tensor) {
  int64_t row = 1;
  for (int64_t d = 1; d < tensor.dim(); ++d) {
    row *= tensor.size(d);
  }
  return row;
}
}  // namespace

std::vector<int64_t> splitCounts(const char* op, const char* argument, const at::Tensor& tensor,
                                 const std::vector<int64_t>& splits, int size) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1, op, ": ", argument, " must have at least one dimension");
  const int64_t rows = tensor.size(0);
  std::vector<int64_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, op, ": ", argument, " has ", rows, " rows, which do not split evenly among ",
                      size, " ranks; pass split sizes");
    std::fill(counts.begin(), counts.end(), rows / size * rowElements(tensor));
    return counts;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size, op, ": ", argument, " split sizes has ", splits.size(),
                    " entries for a group of ", size);
  for (int i = 0; i < size; ++i) {
    TORCH_CHECK_VALUE(splits[i] >= 0, op, ": ", argument, " split sizes must be non-negative");
    counts[i] = splits[i] * rowElements(tensor);
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TORCH_CHECK_VALUE(total == rows, op, ": ", argument, " split sizes add up to ", total, " but the tensor has ", rows,
                    " rows");
  return counts;
}

void checkStrategyHandles(const char* op, const Strategy& strategy, const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(!tensor.device().is_cpu() || strategy.supportsCpu(), op, ": communicator '", strategy.name(),
                    "' reduces CUDA tensors only (NCCL); for CPU tensors use 'hierarchical', 'two_dimensional', "
                    "'flat', 'naive' or 'single_node'");
}

void checkRank(const char* op, const char* argument, int64_t rank, int size) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, op, ": ", argument, " ", rank, " is not a rank of this group (size ",
                    size, ")");
}

void checkTag(const char* op, int tag) {
  TORCH_CHECK_VALUE(tag >= 0 && tag < kHeaderTagBit, op,
                    ": tag must be in [0, 2^30) (the backend uses the tags above), got ", tag);
}

}  // namespace chainermn
