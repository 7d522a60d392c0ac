// What every rank checks before a collective runs (GroupContext::agree, group_context.h): the
// fingerprints of the op, through the levels where that is cheaper, and the splits of an all_to_all.
#include "backend/group_context.h"

#include "phase.h"

#include <c10/util/Exception.h>

namespace chainermn {

namespace {
void checkSplitsIfAny(Transport& world, const char* op, uint64_t sequence, const Agreement& agreement) {
  if (!agreement.sendCounts.empty() && world.size() > 1) {
    checkSplits(world, op, sequence, agreement);
  }
}
} // namespace

bool GroupContext::carryAgreement(const char* op, const Agreement& agreement) {
  Transport& world = *cpu->transports.world;
  if (checks == CheckLevel::Off || checkThroughLevels || !agreement.sendCounts.empty() || world.size() < 2) {
    return false;
  }
  if (!carried) {
    carried = std::make_unique<CarriedFingerprint>(
        world.size(),
        [this](uint64_t sequence, int r) {
          const auto reason = store->get(refusalKey(sequence, r));
          return std::string(reason.begin(), reason.end());
        },
        *stragglers);
  }
  if (!world.carryCheck(carried.get())) {
    return false;
  }
  carried->set(fingerprintOf(++collectivesRun, op, agreement));  // numbered as agree() numbers it
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
    const std::string problem = disagreement(all, [&](int r) {
      const auto reason = store->get(refusalKey(sequence, r));
      return std::string(reason.begin(), reason.end());
    });
    TORCH_CHECK_VALUE(problem.empty(), "chainermn: ", problem);
    stragglers->observe(arrivalOf(all));
  }
  checkSplitsIfAny(world, op, sequence, agreement);
}

} // namespace chainermn
