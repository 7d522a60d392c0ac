// A Transport whose ranks are threads of this process (the harness's stand-in for MPI or Gloo).
//
// Every method does what comm/transport.h promises, for any dtype, with kernels/reduce.h's
// reductions (so results match the other transports bit for bit), and checks what a real library
// would only get wrong silently or hang on: the ranks must agree on op, count, dtype, reduction and
// root; buffers may alias only where transport.h allows it; point-to-point sizes must match. Any
// failure aborts the whole run (see hub.h), so no rank is left waiting for one that gave up.
#pragma once

#include "comm/transport.h"
#include "testing/hub.h"
#include "topology.h"

#include <memory>

namespace chainermn::testing {

// This thread's transport at `level` (rank level.index of level.ranks), over the run's hub for it.
TransportPtr createThreadTransport(const std::shared_ptr<Run>& run, const Level& level);

}  // namespace chainermn::testing
