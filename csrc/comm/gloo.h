// Torch's own Gloo as a transport, reached through the virtual c10d::Backend interface only (so no
// Gloo headers are needed). The ProcessGroupGloo is created in Python over the group's store.
#pragma once

#include "comm/transport.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace chainermn::gloo {

TransportPtr createTransport(c10::intrusive_ptr<c10d::Backend> backend);

}  // namespace chainermn::gloo
