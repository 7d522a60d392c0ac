// Point to point and barrier. A send or receive body only starts its transfer and returns the
// Request; the worker starts transfers in issue order and completes them later (worker.h), so a
// send and a receive issued in order never wait for each other (batch_isend_irecv).
//
// On the host transports every message is preceded by a header with its size and dtype, so a
// receive that does not match the send fails on the receiving rank with an error that says so,
// instead of overrunning its buffer (Gloo aborts the process then) or returning reinterpreted bytes.
#include "backend/process_group.h"

#include "backend/validate.h"

namespace chainermn {

namespace {
// Sends and receives pair by peer and tag, not by their place in the group's sequence.
const Agreement kPointToPoint{/*collective=*/false};

// Headers travel on their own tags, so that a header is never matched by the receive of an earlier
// message's data from the same peer and tag (user tags are below kHeaderTagBit: validate.h).
int headerTag(int tag) {
  return tag | kHeaderTagBit;
}

struct Header {
  int64_t count = 0;
  int32_t dtype = 0;
  int32_t magic = 0x43484d4e;  // "CHMN": a message of this protocol
};

std::string described(int64_t count, int32_t dtype) {
  return std::to_string(count) + " " + dtypeName(static_cast<at::ScalarType>(dtype)) + " elements";
}

// The header, then the data; done when both are.
class CheckedSend : public Request {
 public:
  CheckedSend(Transport& transport, const at::Tensor& tensor, int peer, int tag) {
    header_.count = tensor.numel();
    header_.dtype = static_cast<int32_t>(tensor.scalar_type());
    header = transport.send(&header_, sizeof(Header), at::kByte, peer, headerTag(tag));
    data = transport.send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  bool test() override {
    return header->test() && data->test();
  }

 private:
  Header header_;
  RequestPtr header, data;
};

// The header first; then the data into the caller's tensor when they match, or else into a
// buffer of the sender's size (so the sender's message is consumed and the pair stays usable) and
// the receive fails naming both sizes.
class CheckedReceive : public Request {
 public:
  CheckedReceive(Transport& transport, const at::Tensor& tensor, int peer, int tag, int self)
      : transport_(transport), tensor_(tensor), peer_(peer), tag_(tag), self_(self) {
    header_ = transport.recv(&received_, sizeof(Header), at::kByte, peer, headerTag(tag));
  }

  bool test() override {
    if (!data_) {
      if (!header_->test()) {
        return false;
      }
      source_ = peer_ == kAnySource ? header_->source() : peer_;
      TORCH_CHECK(received_.magic == Header{}.magic, "recv: rank ", source_, " sent a message without a header");
      const int64_t count = tensor_.numel();
      const auto dtype = static_cast<int32_t>(tensor_.scalar_type());
      if (received_.count == count && received_.dtype == dtype) {
        data_ = transport_.recv(tensor_.data_ptr(), count, tensor_.scalar_type(), source_, tag_);
      } else {
        mismatch_ = "recv on rank " + std::to_string(self_) + " expected " + described(count, dtype) + " from rank " +
            std::to_string(source_) + " (tag " + std::to_string(tag_) + "), which sent " +
            described(received_.count, received_.dtype) + "; the tensor was not written";
        const auto width = c10::elementSize(static_cast<at::ScalarType>(received_.dtype));
        drain_.resize(static_cast<size_t>(received_.count) * width);
        data_ = transport_.recv(drain_.data(), received_.count, static_cast<at::ScalarType>(received_.dtype), source_, tag_);
      }
    }
    if (!data_->test()) {
      return false;
    }
    TORCH_CHECK_VALUE(mismatch_.empty(), mismatch_);
    return true;
  }

  int source() const override {
    return source_;
  }

 private:
  Transport& transport_;
  at::Tensor tensor_;
  const int peer_;
  const int tag_;
  const int self_;
  Header received_;
  RequestPtr header_, data_;
  int source_ = -1;
  std::string mismatch_;
  std::vector<char> drain_;  // only when the sizes differ
};

// The header protocol on host transports; CUDA tensors go as they are (NCCL does not abort on a
// mismatch, and a header would cost a host round trip per message).
RequestPtr sendChecked(Transport& transport, const at::Tensor& tensor, int peer, int tag) {
  if (tensor.is_cuda()) {
    return transport.send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  return std::make_unique<CheckedSend>(transport, tensor, peer, tag);
}

RequestPtr recvChecked(Transport& transport, const at::Tensor& tensor, int peer, int tag) {
  if (tensor.is_cuda()) {
    return transport.recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  return std::make_unique<CheckedReceive>(transport, tensor, peer, tag, transport.rank());
}

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const char* op = "send";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "dst", dstRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::SEND, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, dstRank, tag](DeviceContext& on) {
    return sendChecked(*on.transports.world, tensor, dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "src", srcRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::RECV, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, srcRank, tag](DeviceContext& on) {
    return recvChecked(*on.transports.world, tensor, srcRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkTag(op, tag);
  return post({c10d::OpType::RECVANYSOURCE, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, tag](DeviceContext& on) {
    return recvChecked(*on.transports.world, tensor, kAnySource, tag);
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
