#include "comm/shm_segment.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace chainermn::shm {
namespace {

constexpr const char* kNamePrefix = "chainermn-";

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

// Creates and sizes a new segment; returns its descriptor.
int createSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
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
    TORCH_CHECK(false, "chainermn: /dev/shm has no room for the ", bytes, "-byte shared-memory segment of this node (",
                std::strerror(reserve),
                "); enlarge /dev/shm (docker run --shm-size), lower CHAINERMN_SHM_CHUNK_BYTES, "
                "or set CHAINERMN_SHM=0");
  }
  return fd;
}

}  // namespace

Segment::Segment(c10d::Store& store, const std::string& key, int rank, size_t bytes) : bytes_(bytes) {
  static std::atomic<int> created{0};
  int fd = -1;
  if (rank == 0) {
    reclaimOrphans();
    name_ = "/" + std::string(kNamePrefix) + std::to_string(getpid()) + "-" + std::to_string(created++);
    fd = createSegment(name_, bytes);
    linked_ = true;
    store.set(key, std::vector<uint8_t>(name_.begin(), name_.end()));
  } else {
    const auto value = store.get(key);
    name_.assign(value.begin(), value.end());
    fd = shm_open(name_.c_str(), O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "chainermn: cannot open the shared-memory segment ", name_, " of this node (",
                std::strerror(errno), "); are all the ranks that report the same host name really on one host?");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapError = errno;
  close(fd);
  if (base == MAP_FAILED) {
    unlinkName();
    TORCH_CHECK(false, "chainermn: mmap of ", name_, " failed: ", std::strerror(mapError));
  }
  base_ = static_cast<char*>(base);
}

Segment::~Segment() {
  munmap(base_, bytes_);
  unlinkName();
}

void Segment::unlinkName() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

}  // namespace chainermn::shm
