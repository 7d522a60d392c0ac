#include "backend/agreement.h"

#include "backend/validate.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <algorithm>
#include <functional>
#include <iterator>

namespace chainermn {

namespace {

void copyName(char* to, size_t capacity, const char* from) {
  std::strncpy(to, from == nullptr ? "" : from, capacity - 1);
  to[capacity - 1] = '\0';
}

// 64-bit FNV-1a, folded one value at a time: the same on every rank and every build.
uint64_t mix(uint64_t hash, int64_t value) {
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= static_cast<uint64_t>(value >> (8 * byte)) & 0xff;
    hash *= 1099511628211ull;
  }
  return hash;
}

std::string rankList(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? "," : "") + std::to_string(ranks[i]);
  }
  return text;
}

// "ranks 0,2 have 10 elements; rank 1 has 20 elements": the ranks grouped by what each holds
// (shown[rank]), groups in order of their first rank.
std::string grouped(const std::vector<std::string>& shown) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(shown.size()); ++r) {
    auto found = std::find_if(groups.begin(), groups.end(), [&](const auto& group) { return group.first == shown[r]; });
    if (found == groups.end()) {
      groups.push_back({shown[r], {r}});
    } else {
      found->second.push_back(r);
    }
  }
  std::string text;
  for (size_t i = 0; i < groups.size(); ++i) {
    const bool one = groups[i].second.size() == 1;
    text += (i ? "; " : "") + rankList(groups[i].second) + (one ? " has " : " have ") + groups[i].first;
  }
  return text;
}

std::string byValue(const std::vector<Fingerprint>& all,
                    const std::function<std::string(const Fingerprint&)>& describe) {
  std::vector<std::string> shown;
  for (const auto& print : all) {
    shown.push_back(describe(print));
  }
  return grouped(shown);
}

template <typename Field>
bool differs(const std::vector<Fingerprint>& all, Field field) {
  for (const auto& print : all) {
    if (field(print) != field(all.front())) {
      return true;
    }
  }
  return false;
}

const char* reduceOpName(int32_t op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return op >= 0 && op < static_cast<int32_t>(std::size(names)) ? names[op] : "none";
}

// The first setting whose value differs between the ranks (or that some rank lacks), as
// "the block differs: ranks 0,2 have block=64; ranks 1,3 have block=192"; empty if none does.
std::string differingSetting(const std::vector<NamedSettings>& all) {
  std::vector<std::string> names;  // every rank's settings' names, in the order they first appear
  for (const auto& settings : all) {
    for (const auto& field : settings.fields) {
      if (std::find(names.begin(), names.end(), field.first) == names.end()) {
        names.push_back(field.first);
      }
    }
  }
  for (const auto& name : names) {
    std::vector<std::string> shown;  // per rank: name=value, or "no name"
    for (const auto& settings : all) {
      auto found = std::find_if(settings.fields.begin(), settings.fields.end(),
                                [&](const auto& field) { return field.first == name; });
      shown.push_back(found == settings.fields.end() ? "no " + name : name + "=" + found->second);
    }
    if (std::any_of(shown.begin(), shown.end(), [&](const std::string& one) { return one != shown.front(); })) {
      return "the " + name + " differs: " + grouped(shown);
    }
  }
  return "";
}

std::string dtypeOf(const Fingerprint& print) {
  return print.dtype < 0 ? "no dtype" : dtypeName(static_cast<at::ScalarType>(print.dtype));
}

}  // namespace

Agreement withRoot(Agreement agreement, const char* name, int64_t root) {
  agreement.rootName = name;
  agreement.root = root;
  return agreement;
}

Agreement withReduce(Agreement agreement, const c10d::ReduceOp& op) {
  agreement.reduce = static_cast<int>(op.op_);
  return agreement;
}

Fingerprint makeFingerprint(uint64_t sequence, const char* op, const Agreement& agreement) {
  Fingerprint print;
  print.sequence = sequence;
  copyName(print.op, sizeof(print.op), op);
  print.reduce = agreement.reduce;
  print.dtype = agreement.dtype == at::ScalarType::Undefined ? -1 : static_cast<int32_t>(agreement.dtype);
  print.root = agreement.rootName != nullptr ? agreement.root : -1;
  copyName(print.rootName, sizeof(print.rootName), agreement.rootName);
  print.count = agreement.count;
  print.tensors = agreement.tensors;
  print.layout = agreement.layout;
  print.settings = agreement.settings ? agreement.settings->digest : 0;
  return print;
}

uint64_t layoutOf(const std::vector<at::Tensor>& tensors, bool shapes) {
  uint64_t hash = 14695981039346656037ull;
  for (const auto& tensor : tensors) {
    hash = mix(hash, tensor.numel());
    if (shapes) {
      hash = mix(hash, tensor.dim());
      for (int64_t extent : tensor.sizes()) {
        hash = mix(hash, extent);
      }
    }
    if (tensor.layout() == at::kStrided && !tensor.is_contiguous()) {
      // A dense layout other than the contiguous one (channels_last): elementwise ops reduce memory
      // in storage order, so every rank must lay its tensor out alike.
      for (int64_t stride : tensor.strides()) {
        hash = mix(hash, stride);
      }
    }
  }
  return hash;
}

const std::vector<Fingerprint>& FingerprintExchange::exchange(Transport& transport, const Fingerprint& mine,
                                                              std::vector<Fingerprint>& into) {
  into.resize(transport.size());
  transport.exchange(&mine, into.data(), sizeof(Fingerprint));
  return into;
}

const std::vector<Fingerprint>& FingerprintExchange::all(Transport& world, const Fingerprint& mine) {
  return exchange(world, mine, world_);
}

namespace {
bool allSame(const std::vector<Fingerprint>& prints) {
  return std::all_of(prints.begin(), prints.end(), [&](const Fingerprint& print) {
    return std::memcmp(&print, &prints.front(), kComparedBytes) == 0;
  });
}
}  // namespace

bool FingerprintExchange::agreeThroughLevels(const TransportSet& transports, const Fingerprint& mine) {
  // Both exchanges on every rank, whatever the first shows: the peers of the second wait for it.
  const bool nodeSame = allSame(exchange(*transports.intra, mine, node_));
  const bool acrossSame = allSame(exchange(*transports.inter, mine, across_));
  // The times ride along: this node's ranks together saw every rank's (intra rank i's peers across
  // nodes are every node's rank i).
  const Verdict verdict{nodeSame && acrossSame, Arrival::merge(arrivalOf(node_), arrivalOf(across_))};
  verdicts_.resize(transports.intra->size());
  transports.intra->exchange(&verdict, verdicts_.data(), sizeof(Verdict));
  arrival_ = Arrival{};
  bool agreed = true;
  for (const Verdict& seen : verdicts_) {
    agreed = agreed && seen.sawNoDifference == 1;
    arrival_ = Arrival::merge(arrival_, seen.arrival);
  }
  return agreed;
}

Arrival arrivalOf(const std::vector<Fingerprint>& prints) {
  Arrival arrival;
  for (const Fingerprint& print : prints) {
    arrival = Arrival::merge(arrival, Arrival::of(print.rank, print.tookMicros));
  }
  return arrival;
}

std::string disagreement(const std::vector<Fingerprint>& all, const std::function<std::string(int rank)>& reasonOf,
                         const std::function<NamedSettings(int rank)>& settingsOf) {
  const Fingerprint& first = all.front();
  // Every op takes this path: agreeing fingerprints are equal byte for byte (plain data, zero-filled),
  // and then nothing is built (no string, no allocation).
  if (std::all_of(all.begin(), all.end(),
                  [&](const Fingerprint& p) { return std::memcmp(&p, &first, kComparedBytes) == 0 && !p.refused; })) {
    return "";
  }
  const std::string head = std::string(first.op) + " (collective " + std::to_string(first.sequence) + ")";
  if (differs(all, [](const Fingerprint& p) { return p.sequence; })) {
    return "the ranks are out of step: " +
           byValue(all,
                   [](const Fingerprint& p) {
                     return "issued " + std::to_string(p.sequence - 1) + " collectives before " + p.op;
                   }) +
           " (a rank skipped or added a collective)";
  }
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].refused) {
      return head + ": rank " + std::to_string(r) + " refused the call: " + reasonOf(r);
    }
  }
  if (differs(all, [](const Fingerprint& p) { return std::string(p.op); })) {
    return "the ranks called different collectives: " +
           byValue(all, [](const Fingerprint& p) { return std::string("called ") + p.op; });
  }
  if (differs(all, [](const Fingerprint& p) { return p.dtype; })) {
    return head + ": the dtypes differ: " + byValue(all, dtypeOf);
  }
  if (differs(all, [](const Fingerprint& p) { return p.tensors; })) {
    return head + ": the number of tensors differs: " + byValue(all, [](const Fingerprint& p) {
             return std::to_string(p.tensors) + " tensors";
           });
  }
  if (differs(all, [](const Fingerprint& p) { return p.count; })) {
    return head + ": the sizes differ: " + byValue(all, [](const Fingerprint& p) {
             return std::to_string(p.count) + " " + dtypeOf(p) + " elements";
           });
  }
  if (differs(all, [](const Fingerprint& p) { return p.layout; })) {
    return head + ": the tensors' sizes or memory layouts (channels_last, ...) differ (same total): " +
           byValue(all, [](const Fingerprint& p) { return "layout " + std::to_string(p.layout % 100000); });
  }
  if (differs(all, [](const Fingerprint& p) { return p.root; })) {
    return head + ": the " + first.rootName + " differs: " + byValue(all, [](const Fingerprint& p) {
             return std::string(p.rootName) + "=" + std::to_string(p.root);
           });
  }
  if (differs(all, [](const Fingerprint& p) { return p.settings; })) {
    std::vector<NamedSettings> settings;
    for (int r = 0; r < static_cast<int>(all.size()); ++r) {
      settings.push_back(settingsOf(r));
    }
    const std::string which = differingSetting(settings);
    return head + ": " + (which.empty() ? "the settings differ (their digests do)" : which);
  }
  if (differs(all, [](const Fingerprint& p) { return p.reduce; })) {
    return head + ": the reduce ops differ: " + byValue(all, [](const Fingerprint& p) {
             return std::string("op ") + reduceOpName(p.reduce);
           });
  }
  return "";
}

CarriedFingerprint::CarriedFingerprint(int size, PeerRecords records, Stragglers& stragglers)
    : all_(size), records_(std::move(records)), stragglers_(stragglers) {}

void CarriedFingerprint::verify(const void* all) {
  std::memcpy(all_.data(), all, all_.size() * sizeof(Fingerprint));
  const std::string problem = disagreement(
      all_, [this](int r) { return records_.reasonOf(mine_.sequence, r); },
      [this](int r) { return records_.settingsOf(mine_.sequence, r, settings_.get()); });
  TORCH_CHECK_VALUE(problem.empty(), "chainermn: ", problem);
  stragglers_.observe(arrivalOf(all_));
}

void checkSplits(Transport& world, const char* op, uint64_t sequence, const Agreement& agreement) {
  const int size = world.size();
  const std::vector<int64_t> ones(size, 1);
  std::vector<int64_t> sent(size);  // sent[q]: what rank q sends this rank
  world.alltoallv(agreement.sendCounts.data(), ones, sent.data(), ones, at::kLong);
  struct Mismatch {
    int64_t sender = -1;
    int64_t sends = 0;
    int64_t expected = 0;
  } mine;
  for (int q = 0; q < size; ++q) {
    if (sent[q] != agreement.recvCounts[q]) {
      mine = {q, sent[q], agreement.recvCounts[q]};
      break;
    }
  }
  std::vector<Mismatch> all(size);
  world.exchange(&mine, all.data(), sizeof(Mismatch));
  std::string problems;
  for (int r = 0; r < size; ++r) {
    if (all[r].sender >= 0) {
      problems += std::string(problems.empty() ? "" : "; ") + "rank " + std::to_string(r) + " expects " +
                  std::to_string(all[r].expected) + " elements from rank " + std::to_string(all[r].sender) +
                  ", which sends " + std::to_string(all[r].sends);
    }
  }
  TORCH_CHECK_VALUE(problems.empty(), "chainermn: ", op, " (collective ", sequence,
                    "): the split sizes do not match between ranks: ", problems);
}

std::string refusalKey(uint64_t sequence, int rank) {
  return "chainermn/refused/" + std::to_string(sequence) + "/" + std::to_string(rank);
}

std::string settingsKey(uint64_t sequence, int rank) {
  return "chainermn/settings/" + std::to_string(sequence) + "/" + std::to_string(rank);
}

}  // namespace chainermn
