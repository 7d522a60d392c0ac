// Point to point and barrier. A send or receive body only starts its transfer and returns the
// Request; the worker starts transfers in issue order and completes them later (worker.h), so a
// send and a receive issued in order never wait for each other (batch_isend_irecv).
#include "backend/process_group.h"

#include "backend/validate.h"

namespace chainermn {

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const char* op = "send";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "dst", dstRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::SEND, op, {tensor}, {}}, [tensor, dstRank, tag](DeviceContext& on) {
    return on.transports.world->send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "src", srcRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::RECV, op, {tensor}, {}}, [tensor, srcRank, tag](DeviceContext& on) {
    return on.transports.world->recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), srcRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkTag(op, tag);
  return post({c10d::OpType::RECVANYSOURCE, op, {tensor}, {}}, [tensor, tag](DeviceContext& on) {
    return on.transports.world->recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), kAnySource, tag);
  });
}

// On the host transports: a barrier orders processes, not streams.
c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::barrier(const c10d::BarrierOptions& opts) {
  return post({c10d::OpType::BARRIER, "barrier", {}, {}, opts.timeout}, [](DeviceContext& on) {
    on.transports.world->barrier();
    return RequestPtr();
  });
}

} // namespace chainermn
