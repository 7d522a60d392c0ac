// What a group's ranks tell each other through the store when something goes wrong, so that a
// failure seen by one rank reaches every rank, naming the rank at fault rather than the messenger.
//
// - Each rank publishes who it is (host, pid) when the group is made.
// - A rank whose op fails (a peer died, a transport error) or times out publishes an abort with its
//   reason; the first reason wins. Every rank whose op has waited over a second polls for it
//   (twice a second) and fails with it, and the group becomes unusable everywhere at once.
// - A rank whose op has waited over a second says so, so that a rank that times out can tell which
//   ranks waited in the op and which never reached it.
// - A rank that leaves the group on purpose (shutdown(), the interpreter's exit) says how many
//   collectives it issued on it: a peer waiting over a second in a later one fails at once, naming it,
//   while the collectives it did take part in still complete.
// Store operations happen only on these slow paths, never per op, and never wait more than a couple
// of seconds (runtime/store_courier.h): a rank cut off from the store's host says so and names the
// ranks of the other nodes instead of waiting for TCP to give up.
#pragma once

#include "runtime/store_courier.h"
#include "runtime/worker.h"
#include "topology.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace chainermn {

class GroupHealth : public Monitor {
 public:
  // Publishes this rank's host and pid. `collectivesIssued`: how many collectives this rank has
  // issued on the group so far (what leaving() tells the peers); called only while the group lives.
  GroupHealth(c10::intrusive_ptr<c10d::Store> store, const Topology& topology,
              std::function<uint64_t()> collectivesIssued);

  std::string peerAbort(const WorkChainerMN& waiter) override;
  void abort(const std::string& reason) override;
  void waiting(const WorkChainerMN& work) override;
  std::string whoIsWhere(const WorkChainerMN& work) override;
  std::string deadRanks() override;
  void leaving() override;

 private:
  // The values of `keys` ("" where absent), or nothing when the store did not answer in time.
  std::optional<std::vector<std::string>> read(std::vector<std::string> keys);
  std::vector<std::string> whoAndGoneKeys() const;  // every rank's who key, then every rank's gone key
  // The entry a rank published, "<host> <pid>", split (parts it lacks are "").
  struct Who {
    std::string host;
    std::string pid;
  };
  static Who parseWho(const std::string& entry);
  // "rank 2 (host a, pid 7)" from the entry rank 2 published ("" if unknown: no pid then).
  std::string who(int rank, const std::string& entry) const;
  // From the values of whoAndGoneKeys() (more may follow): the ranks that said they were leaving,
  // and those that lived on this host and are gone without saying so.
  std::string deadAmong(const std::vector<std::string>& whoAndGone) const;
  // "ranks 2,3 (host b)": ranks grouped by node.
  std::string byNode(const std::vector<int>& ranks) const;
  // From the values of whoAndGoneKeys(): the first peer that left the group before `waiter` (a
  // collective) was issued, said as the reason it will never complete, or "".
  std::string leftBefore(const std::vector<std::string>& whoAndGone, const WorkChainerMN& waiter) const;

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const std::string host_;               // this machine's host name: processes are checked here only
  std::vector<std::string> nodeOfRank_;  // the node names ranks are known by (topology.h)
  StoreCourier courier_;
  std::function<uint64_t()> collectivesIssued_;
};

}  // namespace chainermn
