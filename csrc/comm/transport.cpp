#include "comm/transport.h"

#include <algorithm>
#include <cstring>

namespace chainermn {

namespace {
class AllOf : public Request {
 public:
  explicit AllOf(std::vector<RequestPtr> requests) : pending_(std::move(requests)) {}
  bool test() override {
    for (auto it = pending_.begin(); it != pending_.end();) {
      it = (*it)->test() ? pending_.erase(it) : it + 1;
    }
    return pending_.empty();
  }
  bool wakeWhenReady(std::function<void()> wake) override {
    bool all = true;
    for (auto& request : pending_) {
      all = request->wakeWhenReady(wake) && all;
    }
    return all;
  }

 private:
  std::vector<RequestPtr> pending_;
};
}  // namespace

RequestPtr allOf(std::vector<RequestPtr> requests) {
  return std::make_unique<AllOf>(std::move(requests));
}

RequestPtr Transport::recvAnySize(int /*peer*/, int /*tag*/, Allocate /*allocate*/) {
  TORCH_CHECK(false, "chainermn: this transport cannot receive a message of unknown size");
}

void copyPieces(const std::vector<Piece>& pieces, uint64_t skip, char* into) {
  uint64_t at = 0;  // where the piece starts in the concatenation
  for (const Piece& piece : pieces) {
    const uint64_t from = std::max(at, skip), end = at + piece.bytes;
    if (from < end) {
      if (piece.data) {
        std::memcpy(into, static_cast<const char*>(piece.data) + (from - at), end - from);
      } else {
        std::memset(into, 0, end - from);
      }
      into += end - from;
    }
    at = end;
  }
}

RequestPtr Transport::sendGathered(const std::vector<Piece>& /*pieces*/, int /*peer*/, int /*tag*/) {
  TORCH_CHECK(false, "chainermn: this transport cannot send a gathered message");
}

RequestPtr Transport::startAll(const std::vector<Transfer>& transfers) {
  std::vector<RequestPtr> requests;
  requests.reserve(transfers.size());
  for (const auto& t : transfers) {
    requests.push_back(t.send ? send(t.buf, t.count, t.dtype, t.peer, t.tag)
                              : recv(t.buf, t.count, t.dtype, t.peer, t.tag));
  }
  return allOf(std::move(requests));
}

TransportSet makeTransportSet(const Topology& topology, const TransportFactory& make) {
  TransportSet set;
  set.world = make(worldLevel(topology));
  // Every rank takes the same branches: they depend on the whole group's topology only.
  set.intra = topology.interSize == 1 ? set.world : make(intraLevel(topology));
  set.inter = topology.interSize == topology.size ? set.world : make(interLevel(topology));
  // The world is within the node when the group is one node; the intra level always is.
  set.world->setWithinNode(topology.interSize == 1);
  set.intra->setWithinNode(true);
  if (set.inter != set.world) {
    set.inter->setWithinNode(false);
  }
  return set;
}

}  // namespace chainermn
