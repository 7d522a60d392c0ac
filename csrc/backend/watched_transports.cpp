#include "backend/watched_transports.h"

#include <algorithm>

namespace chainermn {

void WatchedTransports::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    transport->close();
  }
}

void WatchedTransports::watch(const TransportSet& set) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : {set.world, set.intra, set.inter}) {
    if (transport && std::find(transports_.begin(), transports_.end(), transport) == transports_.end()) {
      transports_.push_back(transport);
    }
  }
}

std::string WatchedTransports::asyncError() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    std::string error = transport->asyncError();
    if (!error.empty()) {
      return error;
    }
  }
  return "";
}

void WatchedTransports::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& transport : transports_) {
    transport->abort();
  }
}

}  // namespace chainermn
