// Facts about processes on this host, for telling a dead peer from a slow one.
#pragma once

#include <cstdint>
#include <string>

namespace chainermn {

// Alive and not a zombie (an exited child its parent has not reaped yet still answers kill(pid, 0)).
bool processAlive(int64_t pid);

// This host's name, as gethostname() gives it.
std::string hostName();

}  // namespace chainermn
