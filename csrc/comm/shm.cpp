#include "comm/shm.h"

#include "kernels/reduce.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace chainermn::shm {
namespace {

constexpr const char* kNamePrefix = "chainermn-";

// A hint to the core that this is a spin-wait (lets the sibling hyperthread run).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// One cache line per rank, so ranks publishing their flags do not slow each other down.
struct alignas(64) Flag {
  // The number of barriers this rank has entered. 32 bits, so that a waiter can sleep on it with a
  // futex; it wraps (after 2^32 barriers, hours of small collectives), hence reached() below.
  std::atomic<uint32_t> sequence;
  std::atomic<uint32_t> sleepers;  // ranks inside futexWait on `sequence`: the publisher must wake them
  std::atomic<int64_t> pid;        // lets a waiting rank tell a slow peer from a dead one
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "flags must be lock-free to live in shared memory");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");

// Whether a sequence number has reached `target`, across wrap-around (ranks are never more than a
// couple of barriers apart).
inline bool reached(uint32_t sequence, uint32_t target) {
  return static_cast<int32_t>(sequence - target) >= 0;
}

// The futex is shared between processes (no FUTEX_PRIVATE_FLAG). Spurious and early returns are
// fine: the caller re-checks the word.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec relative{static_cast<time_t>(seconds.count()), static_cast<long>((timeout - seconds).count() * 1000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// How a rank waits for a peer at a barrier. Peers usually arrive within microseconds (they run the
// same copies), so it spins first; ranks may outnumber cores, so then it yields; and a peer may be
// busy for seconds (a node leader inside an inter-node allreduce on a slow network), so in the end
// it sleeps on the peer's futex rather than burn a core the leader's network stack needs.
constexpr int kSpins = 256;
constexpr auto kYieldFor = std::chrono::microseconds(500);
constexpr auto kSleepSlice = std::chrono::milliseconds(20);  // re-check liveness and the timeout this often

// Alive and not a zombie (an exited child its parent has not reaped yet still answers kill(pid, 0)).
bool processAlive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    return false;
  }
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) {
    return true;  // no /proc: trust kill()
  }
  char state = '?';
  const int matched = std::fscanf(file, "%*d (%*[^)]) %c", &state);
  std::fclose(file);
  return matched != 1 || (state != 'Z' && state != 'X');
}

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// Segments are named chainermn-<creator pid>-<n>: one whose creator is gone was left by a crash
// between creation and unlinking, and nobody else can ever open it.
void reclaimOrphans() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) {
    return;
  }
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(kNamePrefix, 0) != 0) {
      continue;
    }
    const long pid = std::strtol(name.c_str() + std::strlen(kNamePrefix), nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      shm_unlink(("/" + name).c_str());
    }
  }
  closedir(dir);
}

class ShmTransport : public Transport {
 public:
  ShmTransport(TransportPtr fallback, void* base, size_t mappedBytes, size_t chunk, std::chrono::milliseconds timeout)
      : fallback_(std::move(fallback)),
        rank_(fallback_->rank()),
        size_(fallback_->size()),
        base_(static_cast<char*>(base)),
        mappedBytes_(mappedBytes),
        chunk_(chunk),
        timeout_(timeout) {
    flags_ = reinterpret_cast<Flag*>(base_);
    char* data = base_ + roundUp(sizeof(Flag) * size_, 4096);
    for (int r = 0; r < size_; ++r) {
      slots_.push_back(data + r * chunk_);
    }
    results_[0] = data + size_ * chunk_;
    results_[1] = results_[0] + chunk_;
    sources_.resize(size_);
    flags_[rank_].pid.store(getpid(), std::memory_order_release);
  }

  ~ShmTransport() override {
    munmap(base_, mappedBytes_);
  }

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  const char* library() const override {
    return "shm";
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    reduceChunks(buf, buf, count, dtype, op, /*root=*/-1);
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root)
      override {
    reduceChunks(send, recv, count, dtype, op, root);
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    const size_t width = c10::elementSize(dtype);
    const int64_t step = chunk_ / width;
    auto* data = static_cast<char*>(buf);
    for (int64_t offset = 0; offset < count; offset += step) {
      const size_t bytes = std::min(step, count - offset) * width;
      if (rank_ == root) {
        std::memcpy(slots_[root], data + offset * width, bytes);
      }
      sync();
      if (rank_ != root) {
        std::memcpy(data + offset * width, slots_[root], bytes);
      }
      sync();  // the root may not refill its slot while others still read it
    }
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    const size_t width = c10::elementSize(dtype);
    const int64_t step = chunk_ / width;
    for (int64_t offset = 0; offset < count; offset += step) {
      const size_t bytes = std::min(step, count - offset) * width;
      std::memcpy(slots_[rank_], static_cast<const char*>(send) + offset * width, bytes);
      sync();
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<char*>(recv) + (r * count + offset) * width, slots_[r], bytes);
      }
      sync();
    }
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    // Each slot holds one piece of every block; rank r reduces block r's pieces into its output.
    const size_t width = c10::elementSize(dtype);
    const int64_t step = std::max<int64_t>(1, chunk_ / width / size_);
    for (int64_t offset = 0; offset < count; offset += step) {
      const int64_t n = std::min(step, count - offset);
      for (int block = 0; block < size_; ++block) {
        std::memcpy(
            slots_[rank_] + block * n * width,
            static_cast<const char*>(send) + (block * count + offset) * width,
            n * width);
      }
      sync();
      for (int r = 0; r < size_; ++r) {
        sources_[r] = slots_[r] + rank_ * n * width;
      }
      reduceBuffers(static_cast<char*>(recv) + offset * width, sources_.data(), size_, n, dtype, op);
      sync();
    }
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    fallback_->gather(send, recv, count, dtype, root);
  }
  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    fallback_->scatter(send, recv, count, dtype, root);
  }
  void alltoallv(
      const void* send,
      const std::vector<int64_t>& sendCounts,
      void* recv,
      const std::vector<int64_t>& recvCounts,
      c10::ScalarType dtype) override {
    fallback_->alltoallv(send, sendCounts, recv, recvCounts, dtype);
  }
  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    return fallback_->send(buf, count, dtype, peer, tag);
  }
  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    return fallback_->recv(buf, count, dtype, peer, tag);
  }
  void barrier() override {
    sync();
  }

 private:
  // allreduce (root < 0: everyone gets the result) or reduce to root. Every rank reduces its own
  // slice of each chunk from all slots into a result buffer; the two result buffers alternate, so a
  // rank may start the next chunk while others still copy the last result out.
  void reduceChunks(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) {
    const size_t width = c10::elementSize(dtype);
    const int64_t step = chunk_ / width;
    const auto* input = static_cast<const char*>(send);
    for (int64_t offset = 0; offset < count; offset += step) {
      const int64_t n = std::min(step, count - offset);
      const int64_t slice = (n + size_ - 1) / size_;
      const int64_t begin = std::min(n, rank_ * slice);
      const int64_t end = std::min(n, begin + slice);
      const char* mine = input + offset * width;
      // Only the peers read this rank's slot, and none of them reads its own slice: that part stays
      // where it is, and is reduced straight from the input.
      std::memcpy(slots_[rank_], mine, begin * width);
      std::memcpy(slots_[rank_] + end * width, mine + end * width, (n - end) * width);
      sync();
      char* result = results_[parity_];
      if (end > begin) {
        for (int r = 0; r < size_; ++r) {
          sources_[r] = (r == rank_ ? mine : slots_[r]) + begin * width;
        }
        reduceBuffers(result + begin * width, sources_.data(), size_, end - begin, dtype, op);
      }
      sync();
      if (root < 0 || rank_ == root) {
        std::memcpy(static_cast<char*>(recv) + offset * width, result, n * width);
      }
      parity_ ^= 1;
    }
  }

  // A barrier of this node's ranks: publish our sequence number, wait for everyone's.
  void sync() {
    const uint32_t target = ++sequence_;
    Flag& mine = flags_[rank_];
    // seq_cst on both sides (here and in waitFor): either the sleeper sees the new sequence before
    // it sleeps, or this rank sees the sleeper and wakes it.
    mine.sequence.store(target, std::memory_order_seq_cst);
    if (mine.sleepers.load(std::memory_order_seq_cst) != 0) {
      futexWakeAll(&mine.sequence);
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_) {
        waitFor(r, target);
      }
    }
  }

  void waitFor(int r, uint32_t target) {
    Flag& peer = flags_[r];
    for (int spin = 0; spin < kSpins; ++spin) {
      if (reached(peer.sequence.load(std::memory_order_acquire), target)) {
        return;
      }
      cpuRelax();
    }
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      const uint32_t seen = peer.sequence.load(std::memory_order_acquire);
      if (reached(seen, target)) {
        return;
      }
      const auto now = std::chrono::steady_clock::now();
      checkPeer(r, start, now);
      if (now - start < kYieldFor) {
        sched_yield();
        continue;
      }
      peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!reached(peer.sequence.load(std::memory_order_seq_cst), target)) {
        futexWait(&peer.sequence, seen, kSleepSlice);
      }
      peer.sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Fails fast when the peer's process is gone, and at the timeout when it is only absent.
  void checkPeer(int r, std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point now) {
    if (watchPids_ && now - lastLivenessCheck_ > std::chrono::milliseconds(50)) {
      lastLivenessCheck_ = now;
      const int64_t pid = flags_[r].pid.load(std::memory_order_acquire);
      if (pid > 0 && !processAlive(pid)) {
        C10_THROW_ERROR(
            DistBackendError,
            "shared memory: local rank " + std::to_string(r) + " of this node (pid " + std::to_string(pid) +
                ") died");
      }
    }
    if (now - start > timeout_) {
      C10_THROW_ERROR(
          DistBackendError,
          "shared memory: local rank " + std::to_string(r) + " of this node did not arrive within " +
              std::to_string(timeout_.count()) + " ms");
    }
  }

 public:
  // After every rank has published its pid: watch them only if this process can see them all (ranks
  // in other PID namespaces would look dead).
  void startWatchingPeers() {
    watchPids_ = true;
    for (int r = 0; r < size_; ++r) {
      const int64_t pid = flags_[r].pid.load(std::memory_order_acquire);
      watchPids_ = watchPids_ && pid > 0 && kill(static_cast<pid_t>(pid), 0) == 0;
    }
  }

 private:
  TransportPtr fallback_;
  const int rank_;
  const int size_;
  char* base_;
  const size_t mappedBytes_;
  const size_t chunk_;
  const std::chrono::milliseconds timeout_;
  Flag* flags_ = nullptr;
  std::vector<char*> slots_;
  char* results_[2] = {nullptr, nullptr};
  std::vector<const void*> sources_;  // reused: no allocation per chunk
  uint32_t sequence_ = 0;
  int parity_ = 0;
  bool watchPids_ = false;
  std::chrono::steady_clock::time_point lastLivenessCheck_{};
};

} // namespace

size_t chunkBytes() {
  if (const char* text = std::getenv("CHAINERMN_SHM_CHUNK_BYTES"); text != nullptr && *text != '\0') {
    const long long bytes = std::atoll(text);
    TORCH_CHECK_VALUE(bytes >= 4096, "CHAINERMN_SHM_CHUNK_BYTES must be at least 4096, got '", text, "'");
    return roundUp(static_cast<size_t>(bytes), 64);
  }
  return size_t{1} << 20;
}

TransportPtr createTransport(
    c10d::Store& store,
    const std::string& key,
    TransportPtr fallback,
    std::chrono::milliseconds timeout) {
  static std::atomic<int> created{0};
  const int size = fallback->size();
  const size_t chunk = chunkBytes();
  const size_t bytes = roundUp(sizeof(Flag) * size, 4096) + (size + 2) * chunk;

  std::string name;
  int fd = -1;
  if (fallback->rank() == 0) {
    reclaimOrphans();
    name = "/" + std::string(kNamePrefix) + std::to_string(getpid()) + "-" + std::to_string(created++);
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "chainermn: shm_open(", name, ") failed: ", std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int error = errno;
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(false, "chainermn: cannot size the shared-memory segment to ", bytes, " bytes: ", std::strerror(error));
    }
    // tmpfs hands out pages on first touch, and a full /dev/shm then kills the process with SIGBUS in
    // the middle of a collective. Reserving them now turns that into an error here.
    const int reserve = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (reserve != 0 && reserve != EOPNOTSUPP && reserve != EINVAL) {
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(
          false, "chainermn: /dev/shm has no room for the ", bytes, "-byte shared-memory segment of this node (",
          std::strerror(reserve), "); enlarge /dev/shm (docker run --shm-size), lower CHAINERMN_SHM_CHUNK_BYTES, "
          "or set CHAINERMN_SHM=0");
    }
    store.set(key, std::vector<uint8_t>(name.begin(), name.end()));
  } else {
    const auto value = store.get(key);
    name.assign(value.begin(), value.end());
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    TORCH_CHECK(
        fd >= 0,
        "chainermn: cannot open the shared-memory segment ",
        name,
        " of this node (",
        std::strerror(errno),
        "); are all the ranks that report the same host name really on one host?");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapError = errno;
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "chainermn: mmap of ", name, " failed: ", std::strerror(mapError));
  auto comm = std::make_shared<ShmTransport>(std::move(fallback), base, bytes, chunk, timeout);
  // Once every rank has mapped the segment its name is no longer needed: unlinking it now means the
  // memory goes away with the last process, however the processes end.
  comm->barrier();
  comm->startWatchingPeers();
  if (comm->rank() == 0) {
    shm_unlink(name.c_str());
  }
  return comm;
}

} // namespace chainermn::shm
