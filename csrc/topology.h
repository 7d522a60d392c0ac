// Who shares a node with whom. Ranks exchange host names through the group's store; ranks with the
// same name share a node. Nodes are ordered by their lowest rank, ranks within a node by rank.
// Each rank reports the node name it is given: torch_chainermn/settings.py's node_name(), where
// CHAINERMN_HOSTNAME or CHAINERMN_RANKS_PER_NODE let one machine act as several nodes.
#pragma once

#include <string>
#include <vector>

namespace c10d {
class Store;  // declared only: the strategies include this header, and need no torch beyond ScalarType
}

namespace chainermn {

struct Topology {
  int rank = 0;
  int size = 1;
  int intraRank = 0;                          // position among the ranks of this node
  int intraSize = 1;                          // ranks on this node
  int interRank = 0;                          // index of this node
  int interSize = 1;                          // number of nodes
  std::vector<int> nodeOfRank;                // node index of every rank
  std::vector<std::vector<int>> ranksOfNode;  // ranks of every node, ascending
  std::vector<std::string> nodeNames;         // name of every node (CHAINERMN_HOSTNAME, or the host's)
};

// The ranks one transport connects: the whole group, this rank's node, or the ranks with this
// rank's intra rank across nodes (one per node that has one). Computed here once for every transport
// library (MPI, Gloo, shared memory, NCCL).
struct Level {
  std::string key;          // names the level in the group's store: "world", "intra/<node>", "inter/<intra rank>"
  std::vector<int> ranks;   // group ranks, ascending
  int index = 0;            // this rank's position in `ranks`
  bool withinNode = false;  // every rank of the level is on this rank's node
};

Level worldLevel(const Topology& topology);
Level intraLevel(const Topology& topology);
Level interLevel(const Topology& topology);

// Collective over the group: every rank must call it with the same store, and its node's name.
Topology discoverTopology(c10d::Store& store, int rank, int size, const std::string& nodeName);

// Builds the topology from every rank's node name (exposed for tests of the ordering rules).
Topology topologyFromNames(const std::vector<std::string>& names, int rank);

}  // namespace chainermn
