// What a group's ranks tell each other through the store when something goes wrong, so that a
// failure seen by one rank reaches every rank, naming the rank at fault rather than the messenger.
//
// - Each rank publishes who it is (host, pid) when the group is made.
// - A rank whose op fails (a peer died, a transport error) or times out publishes an abort with its
//   reason; the first reason wins. Every rank whose op has waited over a second polls for it
//   (twice a second) and fails with it, and the group becomes unusable everywhere at once.
// - A rank whose op has waited over a second says so, so that a rank that times out can tell which
//   ranks waited in the op and which never reached it.
// Store operations happen only on these slow paths, never per op.
#pragma once

#include "backend/worker.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace chainermn {

class GroupHealth : public Monitor {
 public:
  // Publishes this rank's host and pid.
  GroupHealth(c10::intrusive_ptr<c10d::Store> store, int rank, int size);

  std::string peerAbort() override;
  void abort(const std::string& reason) override;
  void waiting(const WorkChainerMN& work) override;
  std::string whoIsWhere(const WorkChainerMN& work) override;
  std::string deadRanks() override;

 private:
  std::string read(const std::string& key);  // "" when absent or the store is unreachable
  std::string who(int rank);                 // "rank 2 (host a, pid 7)"

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const std::string host_;
};

} // namespace chainermn
