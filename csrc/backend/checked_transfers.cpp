#include "backend/checked_transfers.h"

#include "backend/validate.h"

#include <c10/util/Exception.h>

#include <functional>
#include <string>
#include <vector>

namespace chainermn {

namespace {

int headerTag(int tag) {
  return tag | kHeaderTagBit;
}

struct Header {
  int64_t count = 0;
  int32_t dtype = 0;
  int32_t magic = 0x43484d4e;  // "CHMN": a message of this protocol
  uint64_t number = 0;         // among the sender's messages to this peer on this tag
};

std::string described(int64_t count, int32_t dtype) {
  return std::to_string(count) + " " + dtypeName(static_cast<at::ScalarType>(dtype)) + " elements";
}

// The header, then the data; done when both are.
class CheckedSend : public Request {
 public:
  CheckedSend(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag) {
    header_.number = order.sent[{peer, tag}]++;
    header_.count = tensor.numel();
    header_.dtype = static_cast<int32_t>(tensor.scalar_type());
    headerSent_ = transport.send(&header_, sizeof(Header), at::kByte, peer, headerTag(tag));
    dataSent_ = transport.send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  bool test() override {
    return headerSent_->test() && dataSent_->test();
  }
  bool wakeWhenReady(std::function<void()> wake) override {
    const bool header = headerSent_->wakeWhenReady(wake);
    return dataSent_->wakeWhenReady(std::move(wake)) && header;
  }

 private:
  Header header_;
  RequestPtr headerSent_, dataSent_;
};

// The header first; then the data into the caller's tensor when they match, or else into a
// buffer of the sender's size (so the sender's message is consumed and the pair stays usable) and
// the receive fails naming both sizes. With `anySize`, the tensor is made of the sender's size and
// dtype when the header arrives.
class CheckedReceive : public Request {
 public:
  CheckedReceive(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag, int self,
                 std::shared_ptr<at::Tensor> anySize = nullptr)
      : transport_(transport),
        order_(order),
        tensor_(tensor),
        peer_(peer),
        tag_(tag),
        self_(self),
        anySize_(std::move(anySize)) {
    header_ = transport.recv(&received_, sizeof(Header), at::kByte, peer, headerTag(tag));
  }

  bool test() override {
    if (!data_) {
      if (!headerArrived_) {
        if (!header_->test()) {
          return false;
        }
        headerArrived_ = true;
        source_ = peer_ == kAnySource ? header_->source() : peer_;
        TORCH_CHECK(received_.magic == Header{}.magic, "recv: rank ", source_, " sent a message without a header");
      }
      const std::pair<int, int> pair{source_, tag_};
      uint64_t& next = order_.received[pair];
      if (received_.number != next) {
        if (wake_) {
          order_.waiting[pair].push_back(wake_);
        }
        return false;  // an earlier message's data is to be received first
      }
      ++next;
      if (auto waiting = order_.waiting.find(pair); waiting != order_.waiting.end()) {
        const auto wakes = std::move(waiting->second);
        order_.waiting.erase(waiting);
        for (const auto& wake : wakes) {
          wake();  // the next in turn may go on now
        }
      }
      if (anySize_) {
        tensor_ = at::empty({received_.count}, at::TensorOptions().dtype(static_cast<at::ScalarType>(received_.dtype)));
        *anySize_ = tensor_;
      }
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
        data_ = transport_.recv(drain_.data(), received_.count, static_cast<at::ScalarType>(received_.dtype), source_,
                                tag_);
      }
      if (wake_) {
        data_->wakeWhenReady(wake_);
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

  // The header's arrival, then the data's (the worker must test to post the data's receive, which
  // comes from the same transport: it wakes if the header's does). Asked after a first test, it
  // waits for the data once its receive is posted.
  bool wakeWhenReady(std::function<void()> wake) override {
    wake_ = wake;
    return (data_ ? data_ : header_)->wakeWhenReady(std::move(wake));
  }

 private:
  Transport& transport_;
  MessageOrder& order_;
  at::Tensor tensor_;
  const int peer_;
  const int tag_;
  const int self_;
  std::shared_ptr<at::Tensor> anySize_;
  Header received_;
  std::vector<char> drain_;  // only when the sizes differ; declared before the requests, which outlive it not
  RequestPtr header_, data_;
  bool headerArrived_ = false;
  int source_ = -1;
  std::string mismatch_;
  std::function<void()> wake_;
};

}  // namespace

RequestPtr recvCheckedAnySize(Transport& transport, MessageOrder& order, int peer, int tag,
                              std::shared_ptr<at::Tensor> received) {
  if (transport.checksMessages()) {
    return transport.recvAnySize(peer, tag, [received](int64_t count, c10::ScalarType dtype) {
      *received = at::empty({count}, at::TensorOptions().dtype(dtype));
      return received->data_ptr();
    });
  }
  return std::make_unique<CheckedReceive>(transport, order, at::Tensor(), peer, tag, transport.rank(),
                                          std::move(received));
}

RequestPtr sendChecked(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag) {
  if (tensor.is_cuda() || transport.checksMessages()) {
    return transport.send(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  return std::make_unique<CheckedSend>(transport, order, tensor, peer, tag);
}

RequestPtr recvChecked(Transport& transport, MessageOrder& order, const at::Tensor& tensor, int peer, int tag) {
  if (tensor.is_cuda() || transport.checksMessages()) {
    return transport.recv(tensor.data_ptr(), tensor.numel(), tensor.scalar_type(), peer, tag);
  }
  return std::make_unique<CheckedReceive>(transport, order, tensor, peer, tag, transport.rank());
}

}  // namespace chainermn
