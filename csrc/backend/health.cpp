#include "backend/health.h"

#include "process.h"

#include <unistd.h>

#include <sstream>

namespace chainermn {

namespace {

const std::string kPrefix = "chainermn/health/";
const std::string kAbort = kPrefix + "abort";

std::string whoKey(int rank) {
  return kPrefix + "who/" + std::to_string(rank);
}
std::string waitingKey(int rank) {
  return kPrefix + "waiting/" + std::to_string(rank);
}

std::vector<uint8_t> bytes(const std::string& text) {
  return {text.begin(), text.end()};
}

} // namespace

GroupHealth::GroupHealth(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size), host_(hostName()) {
  store_->set(whoKey(rank_), bytes(host_ + " " + std::to_string(getpid())));
}

std::string GroupHealth::read(const std::string& key) {
  try {
    if (!store_->check({key})) {
      return "";
    }
    const auto value = store_->get(key);
    return {value.begin(), value.end()};
  } catch (const std::exception&) {
    return "";  // the store's host may be the rank that died: say what is known without it
  }
}

std::string GroupHealth::who(int rank) {
  std::istringstream entry(read(whoKey(rank)));
  std::string host, pid;
  entry >> host >> pid;
  return "rank " + std::to_string(rank) + (host.empty() ? "" : " (host " + host + ", pid " + pid + ")");
}

std::string GroupHealth::peerAbort() {
  return read(kAbort);
}

void GroupHealth::abort(const std::string& reason) {
  try {
    store_->compareSet(kAbort, {}, bytes(reason));  // the first reason stays
  } catch (const std::exception&) {
  }
}

void GroupHealth::waiting(const WorkChainerMN& work) {
  try {
    store_->set(waitingKey(rank_), bytes(work.opName() + " seq " + std::to_string(work.getSequencenumber())));
  } catch (const std::exception&) {
  }
}

std::string GroupHealth::deadRanks() {
  std::string dead;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      continue;
    }
    std::istringstream entry(read(whoKey(r)));
    std::string host;
    int64_t pid = 0;
    // Only this host's processes can be checked; a rank elsewhere is named by its node's ranks.
    if (entry >> host >> pid && host == host_ && !processAlive(pid)) {
      dead += (dead.empty() ? "" : ", ") + who(r);
    }
  }
  return dead.empty() ? "" : dead + " died";
}

std::string GroupHealth::whoIsWhere(const WorkChainerMN& work) {
  const std::string here = work.opName() + " seq " + std::to_string(work.getSequencenumber());
  std::string waited, elsewhere;
  for (int r = 0; r < size_; ++r) {
    const std::string at = r == rank_ ? here : read(waitingKey(r));
    if (at == here) {
      waited += (waited.empty() ? "" : ",") + std::to_string(r);
    } else {
      elsewhere += "; " + who(r) + (at.empty() ? " never waited in an op for a second" : " last waited in " + at);
    }
  }
  std::string report = "ranks " + waited + " waited in " + here + elsewhere;
  const std::string dead = deadRanks();
  return dead.empty() ? report : report + "; " + dead;
}

} // namespace chainermn
