#include "comm/shm_mailbox.h"

#include "comm/shm_mailbox_state.h"
#include "os/linger.h"
#include "os/spin.h"
#include "os/thread_name.h"
#include "types.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace chainermn::shm {
namespace {

constexpr uint16_t kMagic = 0x4d42;  // "MB"
// The progress thread re-checks whether it is being stopped this often.
constexpr auto kSleepSlice = std::chrono::milliseconds(100);
// It looks for more work this long before it sleeps: a reply is often microseconds away.
constexpr auto kLinger = std::chrono::microseconds(50);

}  // namespace

void Mailboxes::State::finish(Status& status, std::string error) {
  if (status.done.load(std::memory_order_relaxed)) {
    return;
  }
  status.error = std::move(error);
  status.done.store(true, std::memory_order_release);
  if (status.wake) {
    wakes.push_back(std::move(status.wake));
  }
}

void Mailboxes::State::refuse(Status& status, std::string error) {
  status.mismatch = true;
  finish(status, std::move(error));
}

void Mailboxes::State::progressSends(int to) {
  auto& queue = outgoing[to];
  while (!queue.empty()) {
    Outgoing& out = queue.front();
    if (out.headerWritten < sizeof(FrameHeader)) {
      const auto* header = reinterpret_cast<const char*>(&out.header);
      const size_t n = rings.write(to, header + out.headerWritten, sizeof(FrameHeader) - out.headerWritten);
      out.headerWritten += n;
      if (n == 0) {
        return;
      }
    } else if (out.written < out.bytes) {
      const size_t n = rings.write(to, out.data + (out.written - out.dataOffset), out.bytes - out.written);
      out.written += n;
      if (n == 0) {
        return;
      }
    } else {
      finish(*out.status, "");
      queue.pop_front();
    }
  }
}

bool Mailboxes::State::writeFrom(int to, const char* from, uint64_t n, uint64_t& done) {
  static const char zeros[256] = {};
  while (done < n) {
    const size_t want = from ? n - done : std::min<uint64_t>(n - done, sizeof zeros);
    const size_t wrote = rings.write(to, from ? from + done : zeros, want);
    if (wrote == 0) {
      return false;
    }
    done += wrote;
  }
  return true;
}

void Mailboxes::State::enqueueGathered(const StatusPtr& status, int to, const FrameHeader& header,
                                       const std::vector<Piece>& pieces) {
  Outgoing out{status, nullptr, header, header.bytes()};
  auto& queue = outgoing[to];
  if (queue.empty()) {  // nothing ahead of it: straight into the ring, no copy of its own
    uint64_t headerDone = 0;
    bool room = writeFrom(to, reinterpret_cast<const char*>(&header), sizeof header, headerDone);
    out.headerWritten = headerDone;
    for (size_t i = 0; room && i < pieces.size(); ++i) {
      uint64_t done = 0;
      room = writeFrom(to, static_cast<const char*>(pieces[i].data), pieces[i].bytes, done);
      out.written += done;
    }
    if (room) {
      finish(*status, "");
      return;
    }
  }
  // The rest, copied now: the caller may change the pieces once the send returns.
  out.owned.resize(out.bytes - out.written);
  copyPieces(pieces, out.written, out.owned.data());
  out.dataOffset = out.written;
  out.data = out.owned.data();
  queue.push_back(std::move(out));
}

void Mailboxes::State::progressReceives(int from) {
  Incoming& in = incoming[from];
  while (true) {
    if (!in.active) {
      if (rings.readable(from) < sizeof(FrameHeader)) {
        return;
      }
      FrameHeader header;
      rings.read(from, reinterpret_cast<char*>(&header), sizeof header, false);
      TORCH_CHECK(header.magic == kMagic, "shared memory: a corrupt message from rank ", from, " to rank ", rank);
      begin(in, from, header);
    } else if (in.waiting) {
      if (keepInRing(in, from)) {
        return;
      }
      stash(in, from);
    } else if (in.taken < in.bytes) {
      const size_t n = rings.read(from, in.dest == nullptr ? nullptr : in.dest + in.taken, in.bytes - in.taken, true);
      in.taken += n;
      if (n == 0) {
        return;
      }
    } else {
      end(in);
    }
  }
}

void Mailboxes::State::progressAll() {
  if (closed) {
    return;
  }
  for (int peer = 0; peer < size; ++peer) {
    progressSends(peer);
    progressReceives(peer);
  }
}

void Mailboxes::State::runWakes(std::vector<std::function<void()>>& taken) {
  for (auto& wake : taken) {
    wake();
  }
  taken.clear();
}

void Mailboxes::State::progress(bool onlyIfFree) {
  std::unique_lock<std::mutex> lock(mutex, std::defer_lock);
  if (onlyIfFree) {
    if (!lock.try_lock()) {
      return;
    }
  } else {
    lock.lock();
  }
  progressAllOrFail();
  std::vector<std::function<void()>> taken;
  taken.swap(wakes);
  lock.unlock();
  runWakes(taken);
}

void Mailboxes::State::progressAllOrFail() {
  try {
    progressAll();
  } catch (const std::exception& e) {
    failEverything(e.what());
  }
}

StatusPtr Mailboxes::State::post(std::function<void(const StatusPtr&)> enqueue) {
  auto status = std::make_shared<Status>();
  std::unique_lock<std::mutex> lock(mutex);
  if (closed) {
    finish(*status, "shared memory: the group's transport is closed");
  } else {
    enqueue(status);
    progressAllOrFail();  // a message already there, or room for this one: done without a thread hop
  }
  std::vector<std::function<void()>> taken;
  taken.swap(wakes);
  lock.unlock();
  runWakes(taken);
  return status;
}

void Mailboxes::State::cancel(const StatusPtr& status) {
  std::lock_guard<std::mutex> lock(mutex);
  if (status->done.load(std::memory_order_relaxed)) {
    return;
  }
  status->wake = nullptr;
  for (auto& queue : outgoing) {
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if (it->status != status) {
        continue;
      }
      if (it->headerWritten == 0) {
        queue.erase(it);
      } else {
        // Half in the ring: the receiver expects the rest, which is kept here.
        const uint64_t from = std::min(it->written, it->bytes);
        it->owned.assign(it->data + (from - it->dataOffset), it->data + (it->bytes - it->dataOffset));
        it->data = it->owned.data();
        it->dataOffset = from;
      }
      return;
    }
  }
  posted.erase(std::remove_if(posted.begin(), posted.end(), [&](const Posted& p) { return p.status == status; }),
               posted.end());
  for (auto& in : incoming) {
    if (in.status == status) {
      in.status.reset();
      in.dest = nullptr;
    }
  }
  for (auto& arrived : unexpected) {
    if (arrived.claimant == status) {
      arrived.drop = true;
    }
  }
}

void Mailboxes::State::close() {
  std::unique_lock<std::mutex> lock(mutex);
  failEverything("shared memory: the group's transport was closed");
  std::vector<std::function<void()>> taken;
  taken.swap(wakes);
  lock.unlock();
  runWakes(taken);
}

void Mailboxes::State::failEverything(const std::string& reason) {
  closed = true;
  for (auto& queue : outgoing) {
    for (auto& out : queue) {
      finish(*out.status, reason);
    }
    queue.clear();
  }
  for (auto& p : posted) {
    finish(*p.status, reason);
  }
  posted.clear();
  for (auto& in : incoming) {
    if (in.status) {
      finish(*in.status, reason);
    }
    in = Incoming{};
  }
  for (auto& arrived : unexpected) {
    if (arrived.claimant) {
      finish(*arrived.claimant, reason);
    }
  }
  unexpected.clear();
}

void Mailboxes::State::progressLoop() {
  LingerPolicy linger(kLinger);     // spins only while peers ring soon after it runs out of work
  std::optional<uint32_t> handled;  // the doorbell count of the last round
  while (!stopping.load(std::memory_order_acquire)) {
    const uint32_t seen = rings.doorbellCount();
    {
      // Moving what a peer rang for is work a yielding thread of this rank waits for (spin.h); a
      // round woken by the sleep slice alone is not.
      std::optional<OwnWork> working;
      if (seen != handled) {
        working.emplace();
      }
      progress(/*onlyIfFree=*/false);
    }
    if (stopping.load(std::memory_order_acquire)) {
      // A wake that progress() ran may have destroyed the Mailboxes (see ~Mailboxes), and with them
      // the segment the rings live in: nothing here may touch the rings again.
      return;
    }
    handled = seen;
    const auto idleSince = std::chrono::steady_clock::now();
    // Not on a busy machine; on a rank bound to one CPU, which this thread shares with the caller, it yields.
    Spin spin(linger.linger(), Awaited::NextEvent);
    while (rings.doorbellCount() == seen && spin.again()) {
    }
    if (rings.doorbellCount() == seen && !stopping.load(std::memory_order_acquire)) {
      rings.sleepUntilRung(seen, kSleepSlice);
    }
    linger.ended(std::chrono::steady_clock::now() - idleSince);
  }
}

namespace {

class MailboxRequest : public Request {
 public:
  MailboxRequest(std::shared_ptr<Mailboxes::State> state, StatusPtr status)
      : state_(std::move(state)), status_(std::move(status)) {}

  ~MailboxRequest() override {
    if (!status_->done.load(std::memory_order_acquire)) {
      state_->cancel(status_);
    }
  }

  bool test() override {
    if (!status_->done.load(std::memory_order_acquire)) {
      OwnWork working;  // moving this transfer on: a yielding thread of this rank waits for it (spin.h)
      state_->progress(/*onlyIfFree=*/true);
      if (!status_->done.load(std::memory_order_acquire)) {
        return false;
      }
    }
    if (status_->mismatch) {
      C10_THROW_ERROR(ValueError,
                      status_->error);  // as checked_transfers.cpp: the caller's error, the pair still usable
    }
    if (!status_->error.empty()) {
      C10_THROW_ERROR(DistBackendError, status_->error);
    }
    return true;
  }

  int source() const override {
    return status_->source;
  }

  // The node's progress thread moves the message and calls `wake` (shm_mailbox.cpp's finish).
  bool wakeWhenReady(std::function<void()> wake) override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!status_->done.load(std::memory_order_relaxed)) {
        status_->wake = std::move(wake);
        return true;
      }
    }
    wake();
    return true;
  }

 private:
  std::shared_ptr<Mailboxes::State> state_;
  StatusPtr status_;
};

}  // namespace

size_t Mailboxes::bytes(int size) {
  return Rings::bytes(size);
}

Mailboxes::Mailboxes(char* area, int rank, int size) : state_(std::make_shared<State>(area, rank, size)) {}

Mailboxes::~Mailboxes() {
  state_->close();
  if (progress_.joinable()) {
    state_->stopping.store(true, std::memory_order_release);
    state_->rings.ring(state_->rank);
    // The progress thread itself may be the one that destroys this (a wake it ran dropped the last
    // reference to the group's worker, which owns the transports): it cannot join itself (that threw
    // and aborted the process at exit). It holds the State it loops on, sees `stopping` when the wake
    // returns, and ends by itself.
    if (progress_.get_id() == std::this_thread::get_id()) {
      progress_.detach();
    } else {
      progress_.join();
    }
  }
}

void Mailboxes::startProgress() {
  std::call_once(progressStarted_, [this] {
    progress_ = std::thread([state = state_] {
      nameThisThread("cmn-shm-p2p");
      state->progressLoop();
    });
  });
}

RequestPtr Mailboxes::send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) {
  TORCH_CHECK(peer >= 0 && peer < state_->size, "shared memory: send to rank ", peer, " of ", state_->size);
  startProgress();
  const FrameHeader header{count, tag, static_cast<int16_t>(dtype), kMagic};
  auto status = state_->post([&](const StatusPtr& s) {
    state_->outgoing[peer].push_back({s, static_cast<const char*>(buf), header, header.bytes()});
  });
  return std::make_unique<MailboxRequest>(state_, std::move(status));
}

RequestPtr Mailboxes::sendGathered(const std::vector<Piece>& pieces, int peer, int tag) {
  TORCH_CHECK(peer >= 0 && peer < state_->size, "shared memory: send to rank ", peer, " of ", state_->size);
  startProgress();
  uint64_t bytes = 0;
  for (const Piece& piece : pieces) {
    bytes += piece.bytes;
  }
  const FrameHeader header{static_cast<int64_t>(bytes), tag, static_cast<int16_t>(c10::ScalarType::Byte), kMagic};
  auto status = state_->post([&](const StatusPtr& s) { state_->enqueueGathered(s, peer, header, pieces); });
  return std::make_unique<MailboxRequest>(state_, std::move(status));
}

RequestPtr Mailboxes::recvAnySize(int peer, int tag, Transport::Allocate allocate) {
  TORCH_CHECK(peer >= 0 && peer < state_->size, "shared memory: recv from rank ", peer, " of ", state_->size);
  return receive(nullptr, 0, c10::ScalarType::Byte, peer, tag, std::move(allocate));
}

RequestPtr Mailboxes::recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) {
  TORCH_CHECK(peer == kAnySource || (peer >= 0 && peer < state_->size), "shared memory: recv from rank ", peer, " of ",
              state_->size);
  return receive(buf, count, dtype, peer, tag, nullptr);
}

RequestPtr Mailboxes::receive(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag,
                              Transport::Allocate allocate) {
  startProgress();
  auto status = state_->post([&](const StatusPtr& s) {
    state_->postReceive({s, static_cast<char*>(buf), count, dtype, peer, tag, std::move(allocate)});
  });
  return std::make_unique<MailboxRequest>(state_, std::move(status));
}

}  // namespace chainermn::shm
