#include "testing/threads.h"

#include "kernels/reduce.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <numeric>

namespace chainermn::testing {
namespace {

void copyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) {
    std::memcpy(dst, src, bytes);
  }
}

// A send or receive posted to the hub: done once the hub has matched it with its other side.
class ThreadRequest : public Request {
 public:
  ThreadRequest(std::shared_ptr<Run> run, Hub& hub, std::shared_ptr<Transfer> transfer, std::string what)
      : run_(std::move(run)),
        hub_(hub),
        transfer_(std::move(transfer)),
        what_(std::move(what)),
        deadline_(std::chrono::steady_clock::now() + run_->timeout()) {}

  // A request dropped before it is matched never moves its buffer, which its owner may free now.
  ~ThreadRequest() override {
    hub_.cancel(transfer_);
  }

  bool test() override {
    if (finished()) {
      return true;
    }
    // test() never blocks, so the caller polls; this bounds the polling as the hub bounds its waits.
    const bool late = std::chrono::steady_clock::now() > deadline_;
    if (!late && !run_->aborted()) {
      return false;
    }
    // Out of the hub before throwing: the caller may free the buffer as soon as it has the error.
    hub_.cancel(transfer_);
    if (finished()) {
      return true;  // matched just before the cancel
    }
    if (run_->aborted()) {
      run_->throwAborted(what_);
    }
    const std::string message = what_ + " was not matched within " + std::to_string(run_->timeout().count()) + " ms";
    try {
      C10_THROW_ERROR(DistBackendError, message);
    } catch (...) {
      run_->abort(std::current_exception(), what_);
      throw;
    }
  }

  int source() const override {
    return transfer_->source;
  }

 private:
  bool finished() const {
    const int state = transfer_->state.load(std::memory_order_acquire);
    if (state == kFailed) {
      C10_THROW_ERROR(DistBackendError, what_ + ": " + transfer_->error);
    }
    return state == kDone;
  }

  std::shared_ptr<Run> run_;
  Hub& hub_;
  std::shared_ptr<Transfer> transfer_;
  const std::string what_;
  const std::chrono::steady_clock::time_point deadline_;
};

class ThreadTransport : public Transport {
 public:
  ThreadTransport(std::shared_ptr<Run> run, Hub& hub, int index) : run_(std::move(run)), hub_(hub), index_(index) {}

  int rank() const override {
    return index_;
  }
  int size() const override {
    return hub_.size();
  }
  const char* library() const override {
    return "threads";
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    guarded("allreduce", [&] {
      // Into staging first, and into buf only once every peer is done reading it.
      step(Post{"allreduce", count, dtype, static_cast<int>(op), -1, buf, buf},
           [&](const auto& posts) { reduceBlock(posts, 0, count, dtype, op); });
      copyBytes(buf, staging_.data(), bytes(count, dtype));
    });
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    guarded("broadcast", [&] {
      checkRoot(root);
      step(Post{"broadcast", count, dtype, -1, root, buf, buf}, [&](const auto& posts) {
        if (index_ != root) {
          copyBytes(buf, posts[root].send, bytes(count, dtype));
        }
      });
    });
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    guarded("reduce", [&] {
      checkRoot(root);
      if (index_ == root && send != recv) {
        checkDisjoint("reduce", send, bytes(count, dtype), recv, bytes(count, dtype));
      }
      step(Post{"reduce", count, dtype, static_cast<int>(op), root, send, recv}, [&](const auto& posts) {
        if (index_ == root) {
          // Only the root reads, so it may write recv (even where it is send) before the others are done.
          copyBytes(recv, reduceBlock(posts, 0, count, dtype, op), bytes(count, dtype));
        }
      });
    });
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    gatherTo("allgather", send, recv, count, dtype, /*root=*/-1);
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    gatherTo("gather", send, recv, count, dtype, root);
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    guarded("scatter", [&] {
      checkRoot(root);
      const size_t block = bytes(count, dtype);
      if (index_ == root) {
        checkDisjoint("scatter", send, block * size(), recv, block);
      }
      step(Post{"scatter", count, dtype, -1, root, send, recv}, [&](const auto& posts) {
        copyBytes(recv, static_cast<const char*>(posts[root].send) + index_ * block, block);
      });
    });
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    guarded("reduceScatter", [&] {
      const size_t block = bytes(count, dtype);
      checkDisjoint("reduceScatter", send, block * size(), recv, block);
      step(Post{"reduceScatter", count, dtype, static_cast<int>(op), -1, send, recv},
           [&](const auto& posts) { copyBytes(recv, reduceBlock(posts, index_ * count, count, dtype, op), block); });
    });
  }

  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    guarded("alltoallv", [&] {
      TORCH_CHECK(static_cast<int>(sendCounts.size()) == size() && static_cast<int>(recvCounts.size()) == size(),
                  "thread transport alltoallv: ", size(), " counts expected each way");
      const size_t width = c10::elementSize(dtype);
      const int64_t sent = std::accumulate(sendCounts.begin(), sendCounts.end(), int64_t{0});
      const int64_t received = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
      checkDisjoint("alltoallv", send, sent * width, recv, received * width);
      step(Post{"alltoallv", -1, dtype, -1, -1, send, recv, &sendCounts}, [&](const auto& posts) {
        int64_t into = 0;  // where peer p's block lands in recv
        for (int p = 0; p < size(); ++p) {
          const auto& theirs = *posts[p].counts;
          // Peer p's block for this rank follows its blocks for the ranks before this one.
          const int64_t from = std::accumulate(theirs.begin(), theirs.begin() + index_, int64_t{0});
          TORCH_CHECK(theirs[index_] == recvCounts[p], "thread transport ", hub_.key(), " alltoallv: rank ",
                      hub_.ranks()[p], " sends ", theirs[index_], " elements to rank ", hub_.ranks()[index_],
                      ", which expects ", recvCounts[p]);
          copyBytes(static_cast<char*>(recv) + into * width, static_cast<const char*>(posts[p].send) + from * width,
                    recvCounts[p] * width);
          into += recvCounts[p];
        }
      });
    });
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    auto transfer = hub_.send(index_, peer, tag, buf, count, dtype);
    return std::make_unique<ThreadRequest>(run_, hub_, std::move(transfer),
                                           where("send to " + std::to_string(peer), tag));
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    auto transfer = hub_.recv(index_, peer, tag, buf, count, dtype);
    const std::string from = peer == kAnySource ? "any source" : std::to_string(peer);
    return std::make_unique<ThreadRequest>(run_, hub_, std::move(transfer), where("receive from " + from, tag));
  }

  void barrier() override {
    guarded("barrier", [&] { step(Post{"barrier"}, [](const auto&) {}); });
  }

 private:
  static size_t bytes(int64_t count, c10::ScalarType dtype) {
    return static_cast<size_t>(count) * c10::elementSize(dtype);
  }

  std::string where(const std::string& what, int tag) const {
    return "thread transport " + hub_.key() + ": rank " + std::to_string(hub_.ranks()[index_]) + " " + what + " (tag " +
           std::to_string(tag) + ")";
  }

  // A collective that fails on one rank can never complete on the others: abort the run, so they
  // fail now rather than at the timeout, whatever the caller does with the exception.
  template <typename Body>
  void guarded(const char* op, Body body) {
    try {
      body();
    } catch (...) {
      run_->abort(std::current_exception(), "rank " + std::to_string(hub_.ranks()[index_]) + " in " + op);
      throw;
    }
  }

  // One collective step: exchange posts, `read` the peers' buffers, close. A rank that fails while
  // reading still closes (its peers may be reading its buffers), then throws.
  template <typename Read>
  void step(const Post& post, Read read) {
    const auto& posts = hub_.exchange(index_, post);
    std::exception_ptr failed;
    try {
      hub_.checkAgreement();
      read(posts);
    } catch (...) {
      failed = std::current_exception();
    }
    hub_.close(index_, post.op);
    if (failed) {
      std::rethrow_exception(failed);
    }
  }

  // Rank r's send into block r of recv: on every rank (root < 0), or on the root only.
  void gatherTo(const char* op, const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) {
    guarded(op, [&] {
      const bool receives = root < 0 || index_ == root;
      const size_t block = bytes(count, dtype);
      if (root >= 0) {
        checkRoot(root);
      }
      if (receives) {
        checkDisjoint(op, send, block, recv, block * size());
      }
      step(Post{op, count, dtype, -1, root, send, recv}, [&](const auto& posts) {
        for (int r = 0; receives && r < size(); ++r) {
          copyBytes(static_cast<char*>(recv) + r * block, posts[r].send, block);
        }
      });
    });
  }

  void checkRoot(int root) const {
    TORCH_CHECK(root >= 0 && root < size(), "thread transport ", hub_.key(), ": root ", root, " out of range");
  }

  static void checkDisjoint(const char* op, const void* send, size_t sendBytes, const void* recv, size_t recvBytes) {
    const auto* a = static_cast<const char*>(send);
    const auto* b = static_cast<const char*>(recv);
    TORCH_CHECK(sendBytes == 0 || recvBytes == 0 || a + sendBytes <= b || b + recvBytes <= a, "thread transport ", op,
                ": send and recv overlap, which comm/transport.h does not allow");
  }

  // Element-wise reduction of block [offset, offset + count) of every rank's send, into staging.
  const void* reduceBlock(const std::vector<Post>& posts, int64_t offset, int64_t count, c10::ScalarType dtype,
                          ReduceKind op) {
    staging_.resize(bytes(count, dtype));
    sources_.resize(posts.size());
    for (size_t r = 0; r < posts.size(); ++r) {
      sources_[r] = static_cast<const char*>(posts[r].send) + bytes(offset, dtype);
    }
    if (count > 0) {
      reduceBuffers(staging_.data(), sources_.data(), size(), count, dtype, op);
    }
    return staging_.data();
  }

  std::shared_ptr<Run> run_;
  Hub& hub_;
  const int index_;
  std::vector<char> staging_;  // grows to the largest reduction, then is reused
  std::vector<const void*> sources_;
};

}  // namespace

TransportPtr createThreadTransport(const std::shared_ptr<Run>& run, const Level& level) {
  return std::make_shared<ThreadTransport>(run, run->hub(level.key, level.ranks), level.index);
}

}  // namespace chainermn::testing
