#include "topology.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <map>
#include <numeric>

namespace chainermn {

Topology topologyFromNames(const std::vector<std::string>& names, int rank) {
  Topology topo;
  topo.rank = rank;
  topo.size = static_cast<int>(names.size());
  topo.nodeOfRank.resize(names.size());
  // Ranks are visited in ascending order, so a node's index is fixed by its lowest rank.
  std::map<std::string, int> nodeIndex;
  for (int r = 0; r < topo.size; ++r) {
    auto [it, added] = nodeIndex.emplace(names[r], static_cast<int>(topo.ranksOfNode.size()));
    if (added) {
      topo.ranksOfNode.emplace_back();
      topo.nodeNames.push_back(names[r]);
    }
    topo.nodeOfRank[r] = it->second;
    topo.ranksOfNode[it->second].push_back(r);
  }
  topo.interRank = topo.nodeOfRank[rank];
  topo.interSize = static_cast<int>(topo.ranksOfNode.size());
  const auto& mine = topo.ranksOfNode[topo.interRank];
  topo.intraSize = static_cast<int>(mine.size());
  for (int i = 0; i < topo.intraSize; ++i) {
    if (mine[i] == rank) {
      topo.intraRank = i;
    }
  }
  return topo;
}

namespace {
Level levelOf(std::string key, std::vector<int> ranks, int rank, bool withinNode) {
  const int index = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  return Level{std::move(key), std::move(ranks), index, withinNode};
}
}  // namespace

Level worldLevel(const Topology& t) {
  std::vector<int> all(t.size);
  std::iota(all.begin(), all.end(), 0);
  return levelOf("world", std::move(all), t.rank, t.interSize == 1);
}

Level intraLevel(const Topology& t) {
  return levelOf("intra/" + std::to_string(t.interRank), t.ranksOfNode[t.interRank], t.rank, true);
}

Level interLevel(const Topology& t) {
  std::vector<int> peers;
  for (const auto& node : t.ranksOfNode) {
    if (static_cast<int>(node.size()) > t.intraRank) {
      peers.push_back(node[t.intraRank]);
    }
  }
  return levelOf("inter/" + std::to_string(t.intraRank), std::move(peers), t.rank, t.interSize == 1);
}

Topology discoverTopology(c10d::Store& store, int rank, int size, const std::string& nodeName) {
  const std::string prefix = "chainermn/topology/";
  store.set(prefix + std::to_string(rank), std::vector<uint8_t>(nodeName.begin(), nodeName.end()));
  std::vector<std::string> names(size);
  for (int r = 0; r < size; ++r) {
    const auto value = store.get(prefix + std::to_string(r));
    names[r].assign(value.begin(), value.end());
  }
  return topologyFromNames(names, rank);
}

}  // namespace chainermn
