// Point to point, barrier and monitored barrier. A send or receive body only starts its transfer
// and returns the Request; the worker starts transfers in issue order and completes them later
// (worker.h), so a send and a receive issued in order never wait for each other (batch_isend_irecv).
// Messages carry a header (messages.h).
#include "backend/process_group.h"

#include "backend/messages.h"
#include "backend/validate.h"

namespace chainermn {

namespace {
// Sends and receives pair by peer and tag, not by their place in the group's sequence.
const Agreement kPointToPoint{/*collective=*/false};

} // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const char* op = "send";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "dst", dstRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::SEND, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, dstRank, tag, order = &context_->messages](DeviceContext& on) {
    return sendChecked(*on.transports.world, *order, tensor, dstRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkRank(op, "src", srcRank, size_);
  checkTag(op, tag);
  return post({c10d::OpType::RECV, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, srcRank, tag, order = &context_->messages](DeviceContext& on) {
    return recvChecked(*on.transports.world, *order, tensor, srcRank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const char* op = "recv";
  at::Tensor tensor = single(op, "tensor", tensors);
  checkTag(op, tag);
  return post({c10d::OpType::RECVANYSOURCE, op, {tensor}, {}, c10d::kUnsetTimeout, kPointToPoint}, [tensor, tag, order = &context_->messages](DeviceContext& on) {
    return recvChecked(*on.transports.world, *order, tensor, kAnySource, tag);
  });
}

// On the host transports: a barrier orders processes, not streams.
c10::intrusive_ptr<c10d::Work> ProcessGroupChainerMN::barrier(const c10d::BarrierOptions& opts) {
  return post({c10d::OpType::BARRIER, "barrier", {}, {}, opts.timeout}, [](DeviceContext& on) {
    on.transports.world->barrier();
    return RequestPtr();
  });
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
      C10_THROW_ERROR(
          DistBackendError,
          "monitored_barrier on rank " + std::to_string(rank_) + ": rank 0 did not answer within " +
              std::to_string(timeout.count()) + " ms");
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

} // namespace chainermn
