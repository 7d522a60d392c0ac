#include "os/terminate_report.h"

#include <execinfo.h>
#include <pthread.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <mutex>

namespace chainermn {
namespace {

std::terminate_handler gReplaced = nullptr;

// Only async-signal-safe calls (write, backtrace_symbols_fd): the process may be in any state.
void writeAll(const char* text) {
  const size_t length = std::strlen(text);
  size_t written = 0;
  while (written < length) {
    const ssize_t n = ::write(STDERR_FILENO, text + written, length - written);
    if (n <= 0) {
      return;
    }
    written += static_cast<size_t>(n);
  }
}

void report() {
  char name[16] = "?";
  pthread_getname_np(pthread_self(), name, sizeof(name));
  writeAll("chainermn: std::terminate on thread ");
  writeAll(name);
  writeAll(std::current_exception() ? " (an exception escaped)"
                                    : " (no exception: a joinable std::thread destroyed, or a thread ended by "
                                      "pthread_exit inside a destructor)");
  writeAll("; its native stack:\n");
  void* frames[64];
  const int depth = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  if (gReplaced != nullptr) {
    gReplaced();  // libstdc++'s verbose handler: prints the exception, then aborts
  }
  std::abort();
}

}  // namespace

void installTerminateReport() {
  static std::once_flag installed;
  std::call_once(installed, [] { gReplaced = std::set_terminate(report); });
}

}  // namespace chainermn
