// Names for the backend's threads, so that top -H, perf and gdb tell them apart from the Python
// thread that started them (all would show "python" otherwise).
#pragma once

#include <pthread.h>

namespace chainermn {

// Linux keeps 15 characters and the terminating NUL; a longer name is cut, not refused.
inline void nameThisThread(const char* name) {
  char cut[16] = {};
  for (int i = 0; i < 15 && name[i] != '\0'; ++i) {
    cut[i] = name[i];
  }
  pthread_setname_np(pthread_self(), cut);
}

}  // namespace chainermn
