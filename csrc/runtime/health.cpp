#include "runtime/health.h"

#include "os/process.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace chainermn {

namespace {

// How long a failure path waits for the store before it says what it knows without it.
constexpr auto kStorePatience = std::chrono::seconds(2);
const std::string kPrefix = "chainermn/health/";
const std::string kAbort = kPrefix + "abort";

std::string whoKey(int rank) {
  return kPrefix + "who/" + std::to_string(rank);
}
std::string goneKey(int rank) {
  return kPrefix + "gone/" + std::to_string(rank);
}
std::string waitingKey(int rank) {
  return kPrefix + "waiting/" + std::to_string(rank);
}

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

}  // namespace

GroupHealth::GroupHealth(c10::intrusive_ptr<c10d::Store> store, const Topology& topology,
                         std::function<uint64_t()> collectivesIssued)
    : store_(std::move(store)),
      rank_(topology.rank),
      size_(topology.size),
      host_(hostName()),
      courier_(kStorePatience),
      collectivesIssued_(std::move(collectivesIssued)) {
  for (int r = 0; r < size_; ++r) {
    nodeOfRank_.push_back(topology.nodeNames[topology.nodeOfRank[r]]);
  }
  store_->set(whoKey(rank_), bytes(host_ + " " + std::to_string(getpid())));
}

std::optional<std::vector<std::string>> GroupHealth::read(std::vector<std::string> keys) {
  // Owned by the call: after an overrun it may still write here once this has returned.
  auto values = std::make_shared<std::vector<std::string>>(keys.size());
  const bool answered = courier_.run([store = store_, keys = std::move(keys), values] {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (store->check({keys[i]})) {
        const auto value = store->get(keys[i]);
        (*values)[i].assign(value.begin(), value.end());
      }
    }
  });
  if (!answered) {
    return std::nullopt;  // the store's host may be the rank that died, or cut off: say what is known without it
  }
  return *values;
}

std::vector<std::string> GroupHealth::whoAndGoneKeys() const {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) {
    keys.push_back(whoKey(r));
  }
  for (int r = 0; r < size_; ++r) {
    keys.push_back(goneKey(r));
  }
  return keys;
}

// A rank's "who" entry, "<host> <pid>", split at its space. Plain string work: the first GPU run
// crashed inside libstdc++'s stream extraction here (an extension built by a newer g++ than the
// libstdc++ the process loads), and nothing else in the backend uses iostreams.
GroupHealth::Who GroupHealth::parseWho(const std::string& entry) {
  const auto space = entry.find(' ');
  if (space == std::string::npos) {
    return {entry, ""};
  }
  return {entry.substr(0, space), entry.substr(space + 1)};
}

std::string GroupHealth::who(int rank, const std::string& entry) const {
  const std::string pid = parseWho(entry).pid;
  return "rank " + std::to_string(rank) + " (host " + nodeOfRank_[rank] + (pid.empty() ? "" : ", pid " + pid) + ")";
}

std::string GroupHealth::byNode(const std::vector<int>& ranks) const {
  std::vector<std::string> nodes;  // in order of first appearance
  std::vector<std::string> lists;
  for (int r : ranks) {
    const auto at = std::find(nodes.begin(), nodes.end(), nodeOfRank_[r]) - nodes.begin();
    if (at == static_cast<std::ptrdiff_t>(nodes.size())) {
      nodes.push_back(nodeOfRank_[r]);
      lists.emplace_back();
    }
    lists[at] += (lists[at].empty() ? "" : ",") + std::to_string(r);
  }
  std::string text;
  for (size_t i = 0; i < nodes.size(); ++i) {
    text += (text.empty() ? "" : "; ") + std::string(lists[i].find(',') == std::string::npos ? "rank " : "ranks ") +
            lists[i] + " (host " + nodes[i] + ")";
  }
  return text;
}

// One read of the store: the abort, then every rank's who and gone values.
std::string GroupHealth::peerAbort(const WorkChainerMN& waiter) {
  std::vector<std::string> keys{kAbort};
  if (waiter.isCollective()) {
    const auto whoAndGone = whoAndGoneKeys();
    keys.insert(keys.end(), whoAndGone.begin(), whoAndGone.end());
  }
  const auto values = read(std::move(keys));
  if (!values || !(*values)[0].empty() || !waiter.isCollective()) {
    return values ? (*values)[0] : "";
  }
  return leftBefore(std::vector<std::string>(values->begin() + 1, values->end()), waiter);
}

std::string GroupHealth::leftBefore(const std::vector<std::string>& whoAndGone, const WorkChainerMN& waiter) const {
  for (int r = 0; r < size_; ++r) {
    const std::string& gone = whoAndGone[size_ + r];
    const auto space = gone.rfind(' ');
    if (r == rank_ || gone.empty() || space == std::string::npos) {
      continue;
    }
    const uint64_t taken = std::strtoull(gone.c_str() + space + 1, nullptr, 10);
    if (taken < waiter.getSequencenumber()) {
      return who(r, whoAndGone[r]) + " exited the group after its collective " + std::to_string(taken) +
             " (it destroyed the group, or its process ended), so it will never take part in " + waiter.opName() +
             " seq " + std::to_string(waiter.getSequencenumber());
    }
  }
  return "";
}

void GroupHealth::abort(const std::string& reason) {
  courier_.run([store = store_, reason] { store->compareSet(kAbort, {}, bytes(reason)); });  // the first reason stays
}

void GroupHealth::waiting(const WorkChainerMN& work) {
  courier_.run(
      [store = store_, key = waitingKey(rank_),
       value = work.opName() + " seq " + std::to_string(work.getSequencenumber())] { store->set(key, bytes(value)); });
}

void GroupHealth::leaving() {
  const std::string value = "exited after collective " + std::to_string(collectivesIssued_());
  courier_.run([store = store_, key = goneKey(rank_), value] { store->set(key, bytes(value)); });
}

std::string GroupHealth::deadAmong(const std::vector<std::string>& whoAndGone) const {
  std::string exited, dead;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      continue;
    }
    const std::string& entry = whoAndGone[r];
    const Who where = parseWho(entry);
    char* end = nullptr;
    const int64_t pid = std::strtoll(where.pid.c_str(), &end, 10);
    const bool known = !where.pid.empty() && *end == '\0' && pid > 0;
    if (!whoAndGone[size_ + r].empty()) {
      exited += (exited.empty() ? "" : ", ") + who(r, entry);
    } else if (known && where.host == host_ && !processAlive(pid)) {
      // Only this host's processes can be checked; a rank elsewhere is named by its node's ranks.
      dead += (dead.empty() ? "" : ", ") + who(r, entry);
    }
  }
  std::string text = exited.empty() ? "" : exited + " exited";
  if (!dead.empty()) {
    text += (text.empty() ? "" : "; ") + dead + " died";
  }
  return text;
}

std::string GroupHealth::deadRanks() {
  const auto values = read(whoAndGoneKeys());
  return values ? deadAmong(*values) : "";
}

std::string GroupHealth::whoIsWhere(const WorkChainerMN& work) {
  const std::string here = work.opName() + " seq " + std::to_string(work.getSequencenumber());
  std::vector<std::string> keys = whoAndGoneKeys();
  for (int r = 0; r < size_; ++r) {
    keys.push_back(waitingKey(r));
  }
  const auto values = read(std::move(keys));
  if (!values) {
    // Cut off from the store's host: most likely from the other nodes too. Their ranks are the ones
    // this rank cannot have heard from; its own node's are reached without the network.
    std::vector<int> away;
    for (int r = 0; r < size_; ++r) {
      if (nodeOfRank_[r] != nodeOfRank_[rank_]) {
        away.push_back(r);
      }
    }
    return "the group's store did not answer rank " + std::to_string(rank_) + " (host " + nodeOfRank_[rank_] +
           ") within " + std::to_string(kStorePatience.count()) + " s, so the network may be down between the nodes" +
           (away.empty() ? "" : ": " + byNode(away) + " unreachable or did not take part");
  }
  std::string waited, elsewhere;
  for (int r = 0; r < size_; ++r) {
    const std::string at = r == rank_ ? here : (*values)[2 * size_ + r];
    if (at == here) {
      waited += (waited.empty() ? "" : ",") + std::to_string(r);
    } else {
      elsewhere +=
          "; " + who(r, (*values)[r]) +
          (at.empty() ? " never waited in an op for a second (or could not reach the store)" : " last waited in " + at);
    }
  }
  std::string report = "ranks " + waited + " waited in " + here + elsewhere;
  const std::string dead = deadAmong(*values);  // reads the who and gone values, the first 2 x size
  return dead.empty() ? report : report + "; " + dead;
}

}  // namespace chainermn
