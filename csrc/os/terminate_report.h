// What the process says when C++ ends it with std::terminate: which thread, and where.
#pragma once

namespace chainermn {

// Installs (once) a std::terminate handler that writes "chainermn: std::terminate on thread <name>"
// and the native stack to stderr, then hands over to the handler it replaced (which aborts). A
// terminate in one of the backend's threads (cmn-worker, cmn-shm-p2p, cmn-gloo-wait, ...) at exit
// otherwise prints only "terminate called without an active exception", naming nothing.
void installTerminateReport();

}  // namespace chainermn
