// all_reduce of a sparse COO tensor, with Gloo's semantics: every rank's coalesced indices and values
// are gathered, and every rank sums them into a coalesced sparse result that replaces its tensor
// (ReduceOp.SUM only, CPU only).
#include "backend/process_group.h"
#include "backend/reduction.h"
#include "backend/validate.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace chainermn {

namespace {

// The op's name in the cross-rank check: a rank that passes a dense tensor where another passes a
// sparse one must not be paired with it (their bodies move different data).
constexpr const char* kSparseOp = "all_reduce (sparse)";

// Every rank's rows of `rows` (count x width bytes, count from `counts`), padded to the most any
// rank has, gathered in one call; returns them as one tensor of rank r's rows in order.
at::Tensor gatherRows(Transport& world, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  const int64_t count = rows.size(0);
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = most;
  at::Tensor padded = at::zeros(shape, rows.options());
  padded.narrow(0, 0, count).copy_(rows);
  shape.insert(shape.begin(), world.size());
  at::Tensor gathered = at::empty(shape, rows.options());
  const int64_t rowBytes = most > 0 ? padded.numel() / most * padded.element_size() : 0;
  if (rowBytes > 0) {
    world.allgather(padded.data_ptr(), gathered.data_ptr(), most * rowBytes, at::kByte);
  }
  std::vector<at::Tensor> parts;
  for (int r = 0; r < world.size(); ++r) {
    parts.push_back(gathered[r].narrow(0, 0, counts[r]));
  }
  return at::cat(parts);
}

void sumSparse(Transport& world, const at::Tensor& tensor) {
  const at::Tensor input = tensor.coalesce();
  const at::Tensor indices = input._indices().t().contiguous();  // nnz x sparse_dim
  const at::Tensor values = input._values().contiguous();        // nnz x the dense dimensions
  int64_t nnz = input._nnz();
  std::vector<int64_t> counts(world.size());
  world.allgather(&nnz, counts.data(), 1, at::kLong);
  const at::Tensor allIndices = gatherRows(world, indices, counts).t();
  const at::Tensor allValues = gatherRows(world, values, counts);
  tensor.copy_(at::sparse_coo_tensor(allIndices, allValues, tensor.sizes(), tensor.options()).coalesce());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::allreduceSparse(at::Tensor tensor,
                                                                      const c10d::AllreduceOptions& opts) {
  const char* op = "all_reduce";
  return refusable(kSparseOp, [&]() -> c10::intrusive_ptr<c10d::Work> {
    TORCH_CHECK_VALUE(tensor.layout() == at::kSparse, op, ": tensor must be a dense or sparse COO tensor, got layout ",
                      tensor.layout());
    TORCH_CHECK_VALUE(tensor.device().is_cpu(), op,
                      ": sparse tensors must be on the CPU with the chainermn backend, "
                      "got one on ",
                      tensor.device(), " (NCCL has no sparse reduction; use a dense tensor)");
    TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, op, ": sparse tensors reduce with ReduceOp.SUM only");
    (void)planReduction(op, opts.reduceOp, tensor.scalar_type(), size_);  // the dtype's check
    Agreement agreement = withReduce(agreeOn({tensor}), opts.reduceOp);
    agreement.layout = layoutOf({tensor}, /*shapes=*/true);  // sizes, and so the sparse/dense split
    return post({c10d::OpType::ALLREDUCE, kSparseOp, {tensor}, {}, opts.timeout, agreement, !opts.asyncOp},
                [tensor](DeviceContext& on) {
                  sumSparse(*on.transports.world, tensor);
                  return RequestPtr();
                });
  });
}

}  // namespace chainermn
