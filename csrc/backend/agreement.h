// Cross-rank agreement before a collective moves data.
//
// Every collective carries a Fingerprint: what the op is and what every rank must pass the same
// (dtype, element counts, root, reduce op, tensor count) plus the group's collective number. The
// ranks exchange their fingerprints before the op's body moves data (in an exchange of their own, or
// carried in the op's first exchange where the transport can: CarriedFingerprint); if any field
// differs, every rank raises the same ValueError naming the op, the field and the ranks, and no rank
// touches its output. Because the collective number travels too, an op can never be paired with a
// different op of another rank: the group cannot silently fall out of step.
//
// A rank that refuses a call (a ValueError on its calling thread) still takes part in the exchange
// with a `refused` fingerprint, so its peers fail that op at once, naming it and its reason, and
// the group stays in step.
#pragma once

#include "backend/stragglers.h"
#include "comm/transport.h"
#include "kernels/code.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace chainermn {

// What a collective's caller must pass the same on every rank. Fields left at their defaults are
// not compared.
struct Agreement {
  bool collective = true;          // false for point to point (not exchanged)
  const char* rootName = nullptr;  // "src", "dst": root is compared when set
  int64_t root = -1;
  int reduce = -1;  // c10d::ReduceOp::RedOpType
  at::ScalarType dtype = at::ScalarType::Undefined;
  int64_t count = -1;    // elements every rank passes (per rank, as the op defines it)
  int64_t tensors = -1;  // number of tensors
  uint64_t layout = 0;   // the tensors' element counts (and shapes, with DETAIL), hashed
  // all-to-all: elements this rank sends to and expects from each rank, checked pairwise
  // (checkSplits) since they legitimately differ from rank to rank.
  std::vector<int64_t> sendCounts, recvCounts;
  // An op's settings beyond these (a compressed mean's code and what it reads: kernels/code.h's
  // NamedSettings), any number of them: the ranks compare their digest, and only when the digests
  // differ exchange the settings themselves (through the store) to name the one that differs.
  std::shared_ptr<const NamedSettings> settings;
};

// The bytes every rank sends: plain data, the same layout on every rank.
struct Fingerprint {
  uint64_t sequence = 0;  // the group's collective number, counted where the ops run
  char op[32] = {};       // "all_reduce", NUL-terminated
  int32_t reduce = -1;
  int32_t dtype = -1;
  int64_t root = -1;
  int64_t count = -1;
  int64_t tensors = -1;
  uint64_t layout = 0;
  char rootName[8] = {};
  int32_t refused = 0;  // this rank refused the call; its reason is in the store (refusalKey)
  int32_t pad = 0;
  uint64_t settings = 0;  // Agreement::settings' digest (0: none)
  uint8_t reserved[16] = {};
  // Not compared (they differ from rank to rank): carried for the stragglers' summary
  // (backend/stragglers.h), at no message of their own.
  uint32_t tookMicros = Arrival::kNone;  // how long this rank's previous collective took
  int32_t rank = -1;                     // this rank in the group
};
static_assert(sizeof(Fingerprint) == 128, "the exchanged fingerprint has a fixed size");
// The bytes of a fingerprint every rank must send the same: all but the fields after `tookMicros`.
constexpr size_t kComparedBytes = offsetof(Fingerprint, tookMicros);
static_assert(kComparedBytes + 8 == sizeof(Fingerprint), "the fields not compared are last");
static_assert(sizeof(Fingerprint) <= kExchangeBytes, "a carried check fits a shared-memory cell's head");

// The root and the reduce op, for the collectives that have them.
Agreement withRoot(Agreement agreement, const char* name, int64_t root);
Agreement withReduce(Agreement agreement, const c10d::ReduceOp& op);

Fingerprint makeFingerprint(uint64_t sequence, const char* op, const Agreement& agreement);

// Hash of the tensors' element counts, with `shapes` of their sizes too, and of the strides of any
// tensor that is not contiguous.
uint64_t layoutOf(const std::vector<at::Tensor>& tensors, bool shapes);

// The exchanges of fingerprints, into buffers sized once: they run before every collective, and
// allocate nothing after the first.
class FingerprintExchange {
 public:
  // Every rank's fingerprint, in group rank order (one small collective over `world`).
  const std::vector<Fingerprint>& all(Transport& world, const Fingerprint& mine);

  // Whether every rank's fingerprint equals this one, known the same on every rank, through the
  // levels of nodes of equal size: fingerprints within the node, then across nodes among the ranks of
  // this intra rank, then the node's verdicts. If every rank's two comparisons pass, all fingerprints
  // are equal (any two ranks are linked through the rank of the same intra rank on the other's node);
  // and if any differ, every node has a rank that saw it. Two node-local exchanges (shared memory: one
  // barrier each) and one exchange among as many ranks as there are nodes, instead of one among all.
  bool agreeThroughLevels(const TransportSet& transports, const Fingerprint& mine);
  // After agreeThroughLevels returned true: every rank's times merged (the same on every rank).
  const Arrival& arrivalThroughLevels() const {
    return arrival_;
  }

 private:
  static const std::vector<Fingerprint>& exchange(Transport& transport, const Fingerprint& mine,
                                                  std::vector<Fingerprint>& into);

  // What a node's ranks tell each other last: whether they saw a difference, and the times they saw.
  struct Verdict {
    int64_t sawNoDifference;
    Arrival arrival;
  };
  std::vector<Fingerprint> world_, node_, across_;
  std::vector<Verdict> verdicts_;
  Arrival arrival_;
};

// Every rank's times in these fingerprints, merged.
Arrival arrivalOf(const std::vector<Fingerprint>& prints);

// What a rank left in the store for its peers when the ranks disagree (group_context.cpp implements
// it over the group's store): the reason of a rank that refused collective `sequence`, and a rank's
// settings (`mine`: this rank's, published first, so that every rank can read every other's).
struct PeerRecords {
  std::function<std::string(uint64_t sequence, int rank)> reasonOf;
  std::function<NamedSettings(uint64_t sequence, int rank, const NamedSettings* mine)> settingsOf;
};

// A collective's fingerprint carried in its first exchange (Transport::carryCheck, group_context.h):
// verify() throws, on every rank, the ValueError that an exchange of its own would have.
class CarriedFingerprint : public CarriedCheck {
 public:
  // `records`: what refusing or disagreeing ranks left in the store. Once the ranks agree, their
  // times go to `stragglers`.
  CarriedFingerprint(int size, PeerRecords records, Stragglers& stragglers);

  void set(const Fingerprint& mine, std::shared_ptr<const NamedSettings> settings) {
    mine_ = mine;
    settings_ = std::move(settings);
  }
  const void* mine() const override {
    return &mine_;
  }
  size_t bytes() const override {
    return sizeof(Fingerprint);
  }
  void verify(const void* all) override;

 private:
  Fingerprint mine_;
  std::shared_ptr<const NamedSettings> settings_;
  std::vector<Fingerprint> all_;  // sized once
  PeerRecords records_;
  Stragglers& stragglers_;
};

// Empty when every rank agrees; otherwise the message every rank raises (the same on every rank).
// `reasonOf(rank)` fetches the reason of a rank that refused the call, `settingsOf(rank)` a rank's
// settings (called for every rank, in rank order, when their digests differ).
std::string disagreement(const std::vector<Fingerprint>& all, const std::function<std::string(int rank)>& reasonOf,
                         const std::function<NamedSettings(int rank)>& settingsOf);

// All-to-all: every rank's count for each peer is what that peer expects from it. One small
// all-to-all and one exchange; throws the same ValueError on every rank otherwise (a transport given
// disagreeing counts may abort the process).
void checkSplits(Transport& world, const char* op, uint64_t sequence, const Agreement& agreement);

// Where a refusing rank leaves its reason, for its peers to quote.
std::string refusalKey(uint64_t sequence, int rank);
// Where a rank leaves its settings when the ranks' digests differ.
std::string settingsKey(uint64_t sequence, int rank);

}  // namespace chainermn
