#include "testing/hub.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

namespace chainermn::testing {

// ---- Run -------------------------------------------------------------------------------------------

Hub& Run::hub(const std::string& key, const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& hub = hubs_[key];
  if (!hub) {
    hub = std::make_unique<Hub>(*this, key, ranks);
  }
  TORCH_CHECK(hub->ranks() == ranks, "thread transport ", key, ": the ranks disagree on who belongs to this level");
  return *hub;
}

namespace {
std::string messageOf(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}
}  // namespace

void Run::abort(std::exception_ptr error, const std::string& where) {
  std::vector<Hub*> hubs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.load(std::memory_order_relaxed)) {
      return;
    }
    why_ = where + " failed: " + messageOf(error);
    firstError_ = std::move(error);
    aborted_.store(true, std::memory_order_release);
    for (auto& entry : hubs_) {
      hubs.push_back(entry.second.get());  // hubs live as long as the run
    }
  }
  // Taking each hub's lock before notifying means a rank that checked the flag under that lock is
  // already waiting, so it cannot miss the wake-up. A hub made after this sees the flag first.
  for (Hub* hub : hubs) {
    hub->wakeAll();
  }
}

void Run::throwAborted(const std::string& where) const {
  std::lock_guard<std::mutex> lock(mutex_);
  C10_THROW_ERROR(DistBackendError, where + ": aborted because " + why_);
}

void Run::rethrowFirstError() {
  // Moved out: a Python exception kept here could hold (through its traceback) the objects that keep
  // this run alive.
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = std::exchange(firstError_, nullptr);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

// ---- Hub: collective steps -------------------------------------------------------------------------

namespace {
std::string describe(const Post& post) {
  std::ostringstream text;
  text << post.op << "(count " << post.count << ", " << post.dtype;
  if (post.reduce >= 0) {
    text << ", " << reduceKindName(static_cast<ReduceKind>(post.reduce));
  }
  if (post.root >= 0) {
    text << ", root " << post.root;
  }
  text << ")";
  return text.str();
}
}  // namespace

Hub::Hub(Run& run, std::string key, std::vector<int> ranks)
    : run_(run),
      key_(std::move(key)),
      ranks_(std::move(ranks)),
      arrived_(ranks_.size(), false),
      gaveUp_(ranks_.size(), false),
      posts_(ranks_.size()),
      sends_(ranks_.size()),
      recvs_(ranks_.size()) {}

std::string Hub::who(int index) const {
  return "rank " + std::to_string(ranks_[index]) + " (" + key_ + " index " + std::to_string(index) + ")";
}

void Hub::wakeAll() {
  std::lock_guard<std::mutex> lock(mutex_);
  changed_.notify_all();
}

bool Hub::rendezvous(std::unique_lock<std::mutex>& lock, int index, bool abortable) {
  const uint64_t step = step_;
  arrived_[index] = true;
  if (++arrivals_ == size()) {
    std::fill(arrived_.begin(), arrived_.end(), false);
    arrivals_ = 0;
    ++step_;
    changed_.notify_all();
    return true;
  }
  const auto deadline = std::chrono::steady_clock::now() + run_.timeout();
  while (step_ == step) {
    const bool timedOut = changed_.wait_until(lock, deadline) == std::cv_status::timeout && step_ == step;
    if (timedOut || (abortable && step_ == step && run_.aborted())) {
      // Leave: the step can no longer complete, so no peer will ever read this rank's buffers.
      arrived_[index] = false;
      gaveUp_[index] = true;
      --arrivals_;
      return false;
    }
  }
  return true;
}

void Hub::leave(std::unique_lock<std::mutex>& lock, int index, const char* op) {
  std::string missing;
  for (int r = 0; r < size(); ++r) {
    if (!arrived_[r] && !gaveUp_[r] && r != index) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(ranks_[r]);
    }
  }
  lock.unlock();  // abort() takes every hub's lock, this one included
  if (run_.aborted()) {
    run_.throwAborted(who(index) + " in " + op);
  }
  const std::string message = "thread transport " + key_ + ": " + who(index) + " waited " +
                              std::to_string(run_.timeout().count()) + " ms in " + op + " for rank(s) " + missing +
                              " that never came";
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    run_.abort(std::current_exception(), who(index));
    throw;
  }
}

const std::vector<Post>& Hub::exchange(int index, const Post& mine) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Checked under the lock that completes a step: either the step completes, and every rank goes on
  // to read and to close(), or it never does, and every rank leaves it.
  if (run_.aborted()) {
    lock.unlock();
    run_.throwAborted(who(index) + " in " + mine.op);
  }
  posts_[index] = mine;
  if (!rendezvous(lock, index, /*abortable=*/true)) {
    leave(lock, index, mine.op);
  }
  return posts_;
}

void Hub::checkAgreement() const {
  // Every rank compares every post with the first, so all of them reach the same verdict.
  const Post& first = posts_[0];
  for (int r = 1; r < size(); ++r) {
    const Post& other = posts_[r];
    const char* field = std::strcmp(other.op, first.op) != 0 ? "op"
                        : other.count != first.count         ? "count"
                        : other.dtype != first.dtype         ? "dtype"
                        : other.reduce != first.reduce       ? "reduction"
                        : other.root != first.root           ? "root"
                                                             : nullptr;
    if (field != nullptr) {
      C10_THROW_ERROR(DistBackendError, "thread transport " + key_ + ": the ranks disagree on the " + field +
                                            " of a collective: " + who(0) + " calls " + describe(first) + ", " +
                                            who(r) + " calls " + describe(other));
    }
  }
}

void Hub::close(int index, const char* op) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Not abortable: the peers are past exchange(), so they only read (no waits) before they come, and
  // leaving early would let this rank's caller free the buffers they are reading.
  if (!rendezvous(lock, index, /*abortable=*/false)) {
    leave(lock, index, op);
  }
}

// ---- Hub: point to point ---------------------------------------------------------------------------

void Hub::complete(Pending& send, Pending& recv, int sender) {
  if (send.count != recv.count || send.dtype != recv.dtype) {
    std::ostringstream message;
    message << "thread transport: a send of " << send.count << " " << send.dtype << " (tag " << send.tag
            << ") met a receive of " << recv.count << " " << recv.dtype;
    for (Pending* side : {&send, &recv}) {
      side->transfer->error = message.str();
      side->transfer->state.store(kFailed, std::memory_order_release);
    }
    return;
  }
  const size_t bytes = static_cast<size_t>(send.count) * c10::elementSize(send.dtype);
  if (bytes > 0) {
    std::memcpy(recv.recvBuf, send.sendBuf, bytes);
  }
  recv.transfer->source = sender;
  send.transfer->source = sender;
  recv.transfer->state.store(kDone, std::memory_order_release);
  send.transfer->state.store(kDone, std::memory_order_release);
}

std::shared_ptr<Transfer> Hub::send(int from, int to, int tag, const void* buf, int64_t count, c10::ScalarType dtype) {
  TORCH_CHECK(to >= 0 && to < size() && to != from, "thread transport ", key_, ": ", who(from), " cannot send to ", to);
  Pending mine{from, tag, buf, nullptr, count, dtype, std::make_shared<Transfer>()};
  std::lock_guard<std::mutex> lock(mutex_);
  auto& posted = recvs_[to];
  const auto match = std::find_if(posted.begin(), posted.end(), [&](const Pending& recv) {
    return (recv.peer == from || recv.peer == kAnySource) && recv.tag == tag;
  });
  if (match == posted.end()) {
    sends_[to].push_back(mine);
  } else {
    complete(mine, *match, from);
    posted.erase(match);
  }
  return mine.transfer;
}

std::shared_ptr<Transfer> Hub::recv(int at, int from, int tag, void* buf, int64_t count, c10::ScalarType dtype) {
  TORCH_CHECK(from == kAnySource || (from >= 0 && from < size() && from != at), "thread transport ", key_, ": ",
              who(at), " cannot receive from ", from);
  Pending mine{from, tag, nullptr, buf, count, dtype, std::make_shared<Transfer>()};
  std::lock_guard<std::mutex> lock(mutex_);
  auto& waiting = sends_[at];
  const auto match = std::find_if(waiting.begin(), waiting.end(), [&](const Pending& send) {
    return (from == kAnySource || send.peer == from) && send.tag == tag;
  });
  if (match == waiting.end()) {
    recvs_[at].push_back(mine);
  } else {
    complete(*match, mine, match->peer);
    waiting.erase(match);
  }
  return mine.transfer;
}

void Hub::cancel(const std::shared_ptr<Transfer>& transfer) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& queue : *queues) {
      queue.erase(std::remove_if(queue.begin(), queue.end(), [&](const Pending& p) { return p.transfer == transfer; }),
                  queue.end());
    }
  }
}

}  // namespace chainermn::testing
