// Point to point, barrier and monitored barrier. A send or receive body only starts its transfer
// and returns the Request; the worker starts transfers in issue order and completes them later
// (worker.h), so a send and a receive issued in order never wait for each other (batch_isend_irecv).
// Messages carry a header (checked_transfers.h).
#include "backend/process_group.h"

#include "backend/checked_transfers.h"
#include "backend/validate.h"

#include <utility>

namespace chainermn {

namespace {
// Sends and receives pair by peer and tag, not by their place in the group's sequence.
const Agreement kPointToPoint{/*collective=*/false};

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const char* op = "send";
  return abandonsBatch([&] {
    at::Tensor tensor = single(op, "tensor", tensors);
    checkRank(op, "dst", dstRank, size_);
    checkTag(op, tag);
    return postTransfer(op, c10d::OpType::SEND, tensor, dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const char* op = "recv";
  return abandonsBatch([&] {
    at::Tensor tensor = single(op, "tensor", tensors);
    checkRank(op, "src", srcRank, size_);
    checkTag(op, tag);
    return postTransfer(op, c10d::OpType::RECV, tensor, srcRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::postTransfer(const char* op, c10d::OpType type,
                                                                   const at::Tensor& tensor, int peer, int tag,
                                                                   c10::intrusive_ptr<WorkChainerMN> work) {
  const bool isSend = type == c10d::OpType::SEND;
  if (batch_) {
    if (!batch_->tensors.empty()) {
      checkSameDevice(op, {batch_->tensors.front(), tensor});  // one device per op, and a batch is one op
    }
    if (!batch_->work) {
      OpSpec spec{c10d::OpType::COALESCED, "batch_isend_irecv", {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint};
      batch_->work = makeWork(spec, tensor.device());
    }
    batch_->tensors.push_back(tensor);
    batch_->sends.push_back(isSend);
    batch_->peers.push_back(peer);
    batch_->tags.push_back(tag);
    return batch_->work;
  }
  OpSpec spec{type, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint};
  spec.peer = peer;
  return post(
      std::move(spec),
      [tensor, isSend, peer, tag, order = &context_->messages](DeviceContext& on) {
        Transport& world = *on.transports.world;
        return isSend ? sendChecked(world, *order, tensor, peer, tag) : recvChecked(world, *order, tensor, peer, tag);
      },
      std::move(work));
}

void ProcessGroupChainerMN::startCoalescing() {
  if (batch_ && batch_->work) {
    // A batch torch never ended: an error in Python (a bad peer in batch_isend_irecv's list) left
    // its coalescing manager before endCoalescing. Its transfers never started.
    batch_->work->fail(
        backendError("chainermn batch_isend_irecv: not run, the batch was abandoned (an error before its end)"));
  }
  batch_.emplace();
  lastInWindow_.reset();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::endCoalescing() {
  TORCH_CHECK_VALUE(batch_, "chainermn: endCoalescing without startCoalescing");
  Batch batch = std::move(*batch_);
  batch_.reset();
  OpSpec spec{c10d::OpType::COALESCED, "batch_isend_irecv", {}, batch.tensors, c10d::kUnsetTimeout, kPointToPoint};
  if (batch.tensors.empty()) {
    if (auto last = std::exchange(lastInWindow_, nullptr)) {
      return last;  // the window's collectives: waiting for the last orders the caller after them
    }
    return post(spec, [](DeviceContext&) { return RequestPtr(); });
  }
  lastInWindow_.reset();
  batch.work->setOutputs(batch.tensors);  // the batch's result, and over NCCL what wait() orders the caller after
  return post(
      spec,
      [batch, order = &context_->messages](DeviceContext& on) {
        Transport& world = *on.transports.world;
        if (batch.tensors.front().is_cuda()) {
          std::vector<Transfer> transfers;
          for (size_t i = 0; i < batch.tensors.size(); ++i) {
            const auto& t = batch.tensors[i];
            transfers.push_back(
                {batch.sends[i], t.data_ptr(), t.numel(), t.scalar_type(), batch.peers[i], batch.tags[i]});
          }
          return world.startAll(transfers);
        }
        // Host transfers progress independently: started in order, each with its header (checked_transfers.h).
        std::vector<RequestPtr> requests;
        for (size_t i = 0; i < batch.tensors.size(); ++i) {
          const auto& t = batch.tensors[i];
          requests.push_back(batch.sends[i] ? sendChecked(world, *order, t, batch.peers[i], batch.tags[i])
                                            : recvChecked(world, *order, t, batch.peers[i], batch.tags[i]));
        }
        return allOf(std::move(requests));
      },
      batch.work);
}

namespace {

// The receive of a message of any size: done when `inner` is, with the message as the Work's result.
class Delivering : public Request {
 public:
  Delivering(RequestPtr inner, std::shared_ptr<at::Tensor> received, c10::intrusive_ptr<WorkChainerMN> work)
      : inner_(std::move(inner)), received_(std::move(received)), work_(std::move(work)) {}
  bool test() override {
    if (!inner_->test()) {
      return false;
    }
    work_->setOutputs({*received_});  // on the worker, before it completes the Work
    return true;
  }
  bool wakeWhenReady(std::function<void()> wake) override {
    return inner_->wakeWhenReady(std::move(wake));
  }

 private:
  RequestPtr inner_;
  std::shared_ptr<at::Tensor> received_;
  c10::intrusive_ptr<WorkChainerMN> work_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvMessage(int srcRank, int tag) {
  const char* op = "recv_message";
  return abandonsBatch([&] {
    checkRank(op, "src", srcRank, size_);
    checkTag(op, tag);
    OpSpec spec{c10d::OpType::RECV, op, {}, {}, c10d::kUnsetTimeout, kPointToPoint};
    spec.peer = srcRank;
    auto work = makeWork(spec, at::Device(at::kCPU));
    return post(
        spec,
        [srcRank, tag, work, order = &context_->messages](DeviceContext& on) -> RequestPtr {
          auto received = std::make_shared<at::Tensor>();
          return std::make_unique<Delivering>(recvCheckedAnySize(*on.transports.world, *order, srcRank, tag, received),
                                              received, work);
        },
        work);
  });
}

namespace {

// The message sendMessage describes, as pieces: the parts' bytes and the zeros between them.
std::vector<Piece> messagePieces(const char* op, const std::vector<at::Tensor>& parts,
                                 const std::vector<int64_t>& offsets, int64_t bytes, int rank) {
  TORCH_CHECK_VALUE(parts.size() == offsets.size(), op, ": rank ", rank, " passed ", parts.size(), " parts and ",
                    offsets.size(), " offsets");
  std::vector<Piece> pieces;
  int64_t at = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& part = parts[i];
    TORCH_CHECK_VALUE(part.device().is_cpu() && part.is_contiguous(), op, ": parts[", i, "] on rank ", rank,
                      " must be a contiguous CPU tensor, got ", part.device(),
                      part.is_contiguous() ? "" : ", not contiguous");
    const int64_t size = part.numel() * static_cast<int64_t>(part.element_size());
    TORCH_CHECK_VALUE(offsets[i] >= at && offsets[i] + size <= bytes, op, ": parts[", i, "] on rank ", rank, " (", size,
                      " bytes at offset ", offsets[i], ") overlaps the part before it or ends past the message's ",
                      bytes, " bytes");
    if (offsets[i] > at) {
      pieces.push_back({nullptr, static_cast<size_t>(offsets[i] - at)});
    }
    pieces.push_back({part.data_ptr(), static_cast<size_t>(size)});
    at = offsets[i] + size;
  }
  if (bytes > at) {
    pieces.push_back({nullptr, static_cast<size_t>(bytes - at)});
  }
  return pieces;
}

at::Tensor packed(const std::vector<Piece>& pieces, int64_t bytes) {
  at::Tensor message = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  copyPieces(pieces, 0, static_cast<char*>(message.data_ptr()));
  return message;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::sendMessage(const std::vector<at::Tensor>& parts,
                                                                  const std::vector<int64_t>& offsets, int64_t bytes,
                                                                  int dstRank, int tag) {
  const char* op = "send_message";
  return abandonsBatch([&] {
    checkRank(op, "dst", dstRank, size_);
    checkTag(op, tag);
    std::vector<Piece> pieces = messagePieces(op, parts, offsets, bytes, rank_);
    auto world = context_->cpu->transports.world;
    if (batch_ || !world->sendsGathered()) {
      return postTransfer(op, c10d::OpType::SEND, packed(pieces, bytes), dstRank, tag);
    }
    OpSpec spec{c10d::OpType::SEND, op, {}, {}, c10d::kUnsetTimeout, kPointToPoint};
    spec.peer = dstRank;
    auto work = makeWork(spec, at::Device(at::kCPU));
    // The pieces are read (or copied) before sendGathered returns: the body holds none of them.
    Worker::Body send = [world, &pieces, dstRank, tag] { return Pending(world->sendGathered(pieces, dstRank, tag)); };
    if (worker_->runIfIdle(work, send)) {
      opsOnCaller_.fetch_add(1, std::memory_order_relaxed);
      return c10::intrusive_ptr<c10d::Work>(work);
    }
    return postTransfer(op, c10d::OpType::SEND, packed(pieces, bytes), dstRank, tag, work);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkTag(op, tag);
  TORCH_CHECK_VALUE(!(tensor.is_cuda() && plan_.cuda.allNccl), op,
                    ": a receive from any source is not available for CUDA tensors over NCCL, which needs the "
                    "source rank (CHAINERMN_CUDA_TRANSPORT=staged has it)");
  return post({c10d::OpType::RECVANYSOURCE, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint},
              [tensor, tag, order = &context_->messages](DeviceContext& on) {
                return recvChecked(*on.transports.world, *order, tensor, kAnySource, tag);
              });
}

// On the host transports, a barrier orders processes. A group that works on a GPU over NCCL does as
// ProcessGroupNCCL: it all-reduces one int on the device, and wait() blocks the host until the
// device has run it (and everything the group queued before it).
c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::barrier(const c10d::BarrierOptions& opts) {
  const int device = cudaDevice_.load();
  if (device < 0 || !plan_.cuda.allNccl) {
    return post(
        {c10d::OpType::BARRIER, "barrier", {}, {}, opts.timeout, Agreement{}, !opts.asyncOp, /*checkFolds=*/true},
        [](DeviceContext& on) {
          on.transports.world->barrier();
          return RequestPtr();
        });
  }
  if (!barrierToken_.defined()) {
    barrierToken_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
  }
  at::Tensor token = barrierToken_;
  OpSpec spec{c10d::OpType::BARRIER, "barrier", {}, {token}, opts.timeout, agreeOn({token})};
  auto work = makeWork(spec, token.device());
  work->setHostSync([on = token.device()] { synchronizeCurrentStream(on); });
  return post(
      std::move(spec),
      [token](DeviceContext& on) {
        on.transports.world->allreduce(token.data_ptr(), 1, at::kInt, ReduceKind::Sum);
        return RequestPtr();
      },
      work);
}

void ProcessGroupChainerMN::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const auto timeout =
      opts.timeout == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : opts.timeout;
  c10d::Store& store = *context_->store;
  const std::string base = "chainermn/monitored_barrier/" + std::to_string(++monitoredBarriers_) + "/";
  const std::string verdictKey = base + "verdict";
  if (rank_ != 0) {
    store.set(base + std::to_string(rank_), std::vector<uint8_t>{1});
    try {
      store.wait({verdictKey}, timeout);
    } catch (const std::exception&) {
      C10_THROW_ERROR(DistBackendError, "monitored_barrier on rank " + std::to_string(rank_) +
                                            ": rank 0 did not answer within " + std::to_string(timeout.count()) +
                                            " ms");
    }
    const auto verdict = store.get(verdictKey);
    if (!verdict.empty()) {
      C10_THROW_ERROR(DistBackendError, std::string(verdict.begin(), verdict.end()));
    }
    return;
  }
  // Rank 0: every other rank's arrival within one deadline, in rank order.
  const auto deadline = Clock::now() + timeout;
  std::vector<int> missing;
  for (int r = 1; r < size_ && (missing.empty() || waitAllRanks); ++r) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const std::string key = base + std::to_string(r);
    try {
      if (left.count() > 0) {
        store.wait({key}, left);
      } else if (!store.check({key})) {
        missing.push_back(r);
      }
    } catch (const std::exception&) {
      missing.push_back(r);
    }
  }
  std::string verdict;
  if (!missing.empty()) {
    std::string ranks;
    for (int r : missing) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    verdict = std::string(missing.size() == 1 ? "Rank " : "Ranks ") + ranks + " failed to pass monitoredBarrier in " +
              std::to_string(timeout.count()) + " ms";
  }
  store.set(verdictKey, std::vector<uint8_t>(verdict.begin(), verdict.end()));
  if (!verdict.empty()) {
    C10_THROW_ERROR(DistBackendError, verdict);
  }
}

}  // namespace chainermn
