#include "comm/gloo.h"

#include "comm/waiter_pool.h"
#include "phase.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <cstring>

namespace chainermn::gloo {
namespace {

// Gloo's send and receive Works only learn that they finished inside wait(), which blocks. Each
// transfer therefore gets a thread of the transport's WaiterPool that waits for it (one thread for all
// would deliver completions in issue order, and a receive that must wait for the user's next send
// could then hold back the completion of a send that already finished: a deadlock). The transfer
// itself progresses in Gloo's own threads either way.
class GlooRequest : public Request {
 public:
  GlooRequest(WaiterPool& waiters, c10::intrusive_ptr<c10d::Work> work, bool isReceive)
      : state_(std::make_shared<State>()), isReceive_(isReceive) {
    state_->work = std::move(work);
    waiters.run([state = state_] {
      try {
        state->work->wait();
      } catch (...) {
        state->error = std::current_exception();
      }
      std::function<void()> wake;
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->done.store(true, std::memory_order_release);
        wake = state->wake;
      }
      if (wake) {
        wake();
      }
    });
  }

  bool wakeWhenReady(std::function<void()> wake) override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!state_->done.load(std::memory_order_acquire)) {
        state_->wake = std::move(wake);
        return true;
      }
    }
    wake();  // already done
    return true;
  }

  // A request dropped before its transfer is done leaves its waiter to finish (Gloo bounds the wait
  // by the group's timeout): the waiter holds everything it touches.

  bool test() override {
    if (!state_->done.load(std::memory_order_acquire)) {
      return false;
    }
    if (state_->error) {
      std::rethrow_exception(state_->error);
    }
    return true;
  }

  int source() const override {
    // Gloo answers only for receives (and throws for sends).
    return isReceive_ ? state_->work->sourceRank() : -1;
  }

 private:
  struct State {
    c10::intrusive_ptr<c10d::Work> work;
    std::exception_ptr error;
    std::atomic<bool> done{false};
    std::mutex mutex;            // orders `wake` with `done`
    std::function<void()> wake;  // see Request::wakeWhenReady
  };
  std::shared_ptr<State> state_;
  const bool isReceive_;
};

c10d::ReduceOp toGloo(ReduceKind op) {
  switch (op) {
    case ReduceKind::Sum:
      return c10d::ReduceOp::SUM;
    case ReduceKind::Product:
      return c10d::ReduceOp::PRODUCT;
    case ReduceKind::Min:
      return c10d::ReduceOp::MIN;
    case ReduceKind::Max:
      return c10d::ReduceOp::MAX;
    case ReduceKind::BitAnd:
      return c10d::ReduceOp::BAND;
    case ReduceKind::BitOr:
      return c10d::ReduceOp::BOR;
    case ReduceKind::BitXor:
      return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::SUM;
}

// A non-owning 1-D view of a buffer; the caller keeps the memory alive until the request completes.
at::Tensor view(const void* data, int64_t count, c10::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(data), {count}, at::TensorOptions().dtype(dtype));
}

// Moving data needs no types: Gloo sees bytes, so every dtype moves, including those it cannot reduce.
at::Tensor bytes(const void* data, int64_t count, c10::ScalarType dtype) {
  return view(data, count * static_cast<int64_t>(c10::elementSize(dtype)), c10::ScalarType::Byte);
}

// `size` consecutive views of equal length over `whole` (empty views when it is empty).
std::vector<at::Tensor> blocks(const at::Tensor& whole, int size) {
  const int64_t length = whole.numel() / size;
  std::vector<at::Tensor> views;
  views.reserve(size);
  for (int i = 0; i < size; ++i) {
    views.push_back(whole.narrow(0, i * length, length));
  }
  return views;
}

class GlooTransport : public Transport {
 public:
  explicit GlooTransport(c10::intrusive_ptr<c10d::Backend> backend) : backend_(std::move(backend)) {}

  int rank() const override {
    return backend_->getRank();
  }
  int size() const override {
    return backend_->getSize();
  }
  const char* library() const override {
    return "gloo";
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo", moved::allreduce(size(), count * c10::elementSize(dtype)));
    std::vector<at::Tensor> tensors{view(buf, count, dtype)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = toGloo(op);
    backend_->allreduce(tensors, opts)->wait();
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo",
                    moved::fromRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    std::vector<at::Tensor> tensors{bytes(buf, count, dtype)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    backend_->broadcast(tensors, opts)->wait();
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo",
                    moved::toRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    // Gloo reduces in place and may overwrite the input on every rank, so it works on recv; the
    // caller passes a recv that may be clobbered (scratch off the root).
    if (send != recv) {
      std::memcpy(recv, send, count * c10::elementSize(dtype));
    }
    std::vector<at::Tensor> tensors{view(recv, count, dtype)};
    c10d::ReduceOptions opts;
    opts.reduceOp = toGloo(op);
    opts.rootRank = root;
    backend_->reduce(tensors, opts)->wait();
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo", moved::allgather(size(), count * c10::elementSize(dtype)));
    std::vector<at::Tensor> inputs{bytes(send, count, dtype)};
    std::vector<std::vector<at::Tensor>> outputs{blocks(bytes(recv, count * size(), dtype), size())};
    backend_->allgather(outputs, inputs)->wait();
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo",
                    moved::toRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    std::vector<at::Tensor> inputs{bytes(send, count, dtype)};
    std::vector<std::vector<at::Tensor>> outputs;
    if (rank() == root) {
      outputs.push_back(blocks(bytes(recv, count * size(), dtype), size()));
    }
    c10d::GatherOptions opts;
    opts.rootRank = root;
    backend_->gather(outputs, inputs, opts)->wait();
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo",
                    moved::fromRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    std::vector<at::Tensor> outputs{bytes(recv, count, dtype)};
    std::vector<std::vector<at::Tensor>> inputs;
    if (rank() == root) {
      inputs.push_back(blocks(bytes(send, count * size(), dtype), size()));
    }
    c10d::ScatterOptions opts;
    opts.rootRank = root;
    backend_->scatter(outputs, inputs, opts)->wait();
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo", moved::reduceScatter(size(), count * c10::elementSize(dtype)));
    at::Tensor output = view(recv, count, dtype);
    at::Tensor input = view(send, count * size(), dtype);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = toGloo(op);
    backend_->_reduce_scatter_base(output, input, opts)->wait();
  }

  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    PhaseSpan phase(
        levelPhase(withinNode()), "gloo",
        moved::allToAll(bytesOf(sendCounts, dtype), bytesOf(recvCounts, dtype),
                        sendCounts[rank()] * c10::elementSize(dtype), recvCounts[rank()] * c10::elementSize(dtype)));
    const int64_t width = static_cast<int64_t>(c10::elementSize(dtype));
    std::vector<int64_t> sendSplits(sendCounts), recvSplits(recvCounts);
    int64_t sendTotal = 0, recvTotal = 0;
    for (size_t i = 0; i < sendSplits.size(); ++i) {
      sendTotal += sendSplits[i];
      recvTotal += recvSplits[i];
      sendSplits[i] *= width;
      recvSplits[i] *= width;
    }
    at::Tensor input = bytes(send, sendTotal, dtype);
    at::Tensor output = bytes(recv, recvTotal, dtype);
    backend_->alltoall_base(output, input, recvSplits, sendSplits)->wait();
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    std::vector<at::Tensor> tensors{bytes(buf, count, dtype)};
    return std::make_unique<GlooRequest>(waiters_, backend_->send(tensors, peer, tag), false);
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    std::vector<at::Tensor> tensors{bytes(buf, count, dtype)};
    if (peer == kAnySource) {
      return std::make_unique<GlooRequest>(waiters_, backend_->recvAnysource(tensors, tag), true);
    }
    return std::make_unique<GlooRequest>(waiters_, backend_->recv(tensors, peer, tag), true);
  }

  void barrier() override {
    PhaseSpan phase(levelPhase(withinNode()), "gloo", Moved{});
    backend_->barrier()->wait();
  }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
  WaiterPool waiters_;  // see GlooRequest
};

}  // namespace

TransportPtr createTransport(c10::intrusive_ptr<c10d::Backend> backend) {
  TORCH_CHECK(backend, "chainermn: no Gloo backend given");
  return std::make_shared<GlooTransport>(std::move(backend));
}

}  // namespace chainermn::gloo
