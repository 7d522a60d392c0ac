#include "os/process.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

namespace chainermn {

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

std::string hostName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) {
    return "?";
  }
  return host;
}

}  // namespace chainermn
