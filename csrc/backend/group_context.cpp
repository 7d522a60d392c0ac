// What every rank checks before a collective runs (GroupContext::agree, group_context.h): the
// fingerprints of the op, through the levels where that is cheaper, and the splits of an all_to_all.
#include "backend/group_context.h"

#include "phase.h"

#include <c10/util/Exception.h>

namespace chainermn {

namespace {

std::string fetched(c10d::Store& store, const std::string& key) {
  const auto bytes = store.get(key);
  return std::string(bytes.begin(), bytes.end());
}

// What the ranks leave in the store for each other when they disagree: the reasons of ranks that
// refused a call, and (only when the settings' digests differ) each rank's settings, this rank's
// published before it reads any other's, so that every rank finds every other's.
PeerRecords peerRecords(c10d::Store& store, int myRank) {
  return PeerRecords{[&store](uint64_t sequence, int rank) { return fetched(store, refusalKey(sequence, rank)); },
                     [&store, myRank](uint64_t sequence, int rank, const NamedSettings* mine) {
                       if (rank == myRank) {
                         const std::string text = mine ? mine->text() : "";
                         store.set(settingsKey(sequence, rank), std::vector<uint8_t>(text.begin(), text.end()));
                         return mine ? *mine : NamedSettings{};
                       }
                       return NamedSettings::parse(fetched(store, settingsKey(sequence, rank)));
                     }};
}

void checkSplitsIfAny(Transport& world, const char* op, uint64_t sequence, const Agreement& agreement) {
  if (!agreement.sendCounts.empty() && world.size() > 1) {
    checkSplits(world, op, sequence, agreement);
  }
}
}  // namespace

bool GroupContext::carryAgreement(const char* op, const Agreement& agreement) {
  Transport& world = *cpu->transports.world;
  if (checks == CheckLevel::Off || checkThroughLevels || !agreement.sendCounts.empty() || world.size() < 2) {
    return false;
  }
  if (!carried) {
    carried = std::make_unique<CarriedFingerprint>(world.size(), peerRecords(*store, rank), *stragglers);
  }
  if (!world.carryCheck(carried.get())) {
    return false;
  }
  // numbered as agree() numbers it
  carried->set(fingerprintOf(++collectivesRun, op, agreement), agreement.settings);
  return true;
}

Fingerprint GroupContext::fingerprintOf(uint64_t sequence, const char* op, const Agreement& agreement) {
  Fingerprint print = makeFingerprint(sequence, op, agreement);
  print.tookMicros = stragglers->takeMine();
  print.rank = rank;
  return print;
}

void GroupContext::agree(const char* op, const Agreement& agreement, const std::string& refusal) {
  const uint64_t sequence = ++collectivesRun;
  Transport& world = *cpu->transports.world;
  if (checks != CheckLevel::Off) {
    PhaseSpan checking(phase::kCheck);
    Fingerprint mine = fingerprintOf(sequence, op, agreement);
    if (!refusal.empty()) {
      store->set(refusalKey(sequence, rank), std::vector<uint8_t>(refusal.begin(), refusal.end()));
      mine.refused = 1;
    }
    // Between nodes the levels are cheaper; only a disagreement (rare) needs every fingerprint to
    // say which ranks differ, and then every rank knows to ask.
    if (checkThroughLevels && fingerprints.agreeThroughLevels(cpu->transports, mine)) {
      stragglers->observe(fingerprints.arrivalThroughLevels());
      checkSplitsIfAny(world, op, sequence, agreement);
      return;
    }
    const auto& all = fingerprints.all(world, mine);
    const PeerRecords records = peerRecords(*store, rank);
    const std::string problem = disagreement(
        all, [&](int r) { return records.reasonOf(sequence, r); },
        [&](int r) { return records.settingsOf(sequence, r, agreement.settings.get()); });
    TORCH_CHECK_VALUE(problem.empty(), "chainermn: ", problem);
    stragglers->observe(arrivalOf(all));
  }
  checkSplitsIfAny(world, op, sequence, agreement);
}

}  // namespace chainermn
