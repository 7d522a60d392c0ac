// A group's transports as the watchdog sees them (AbortableComms, runtime/worker.h): the host
// transports from the start, the CUDA ones when the group's first CUDA op builds them; asked and
// aborted from the watchdog's thread.
#pragma once

#include "comm/transport.h"
#include "runtime/worker.h"

#include <mutex>
#include <string>
#include <vector>

namespace chainermn {

class WatchedTransports : public AbortableComms {
 public:
  void watch(const TransportSet& set);
  std::string asyncError() override;
  void abort() override;
  // Each once their work is done (Transport::close), from the thread shutting the group down.
  void close();

 private:
  std::mutex mutex_;
  std::vector<TransportPtr> transports_;  // each once, though levels may share one
};

}  // namespace chainermn
