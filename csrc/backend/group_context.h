// GroupContext: what the operations of one group share on the worker thread, and the cross-rank
// agreement every collective runs first (group_context.cpp).
#pragma once

#include "backend/agreement.h"
#include "backend/device_context.h"
#include "backend/checked_transfers.h"
#include "backend/options.h"
#include "backend/stragglers.h"
#include "counters.h"
#include "strategies/strategy.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

namespace chainermn {

// What the operations of one group share on the worker thread. Operations hold it by shared_ptr, so
// it outlives the ProcessGroup if a transport call is still running when the group goes away.
struct GroupContext {
  std::unique_ptr<Strategy> strategy;   // how all_reduce runs, on every device
  std::unique_ptr<DeviceContext> cpu;   // built with the group
  std::unique_ptr<DeviceContext> cuda;  // built by the first CUDA op (see device_context.h)
  CudaTransportsBuilder buildCuda;

  c10::intrusive_ptr<c10d::Store> store;  // refusals' reasons (agreement.h)
  int rank = 0;
  CheckLevel checks = CheckLevel::Info;
  bool checkThroughLevels = false;              // several nodes of equal size: agreeThroughLevels (agreement.h)
  FingerprintExchange fingerprints;             // worker thread only
  std::unique_ptr<CarriedFingerprint> carried;  // the fingerprint a folded check hands the transport
  uint64_t collectivesRun = 0;                  // worker thread only: the number of the collective running now
  MessageOrder messages;                        // worker thread only: point-to-point numbering (checked_transfers.h)
  std::unique_ptr<Stragglers> stragglers;       // who arrived last at recent collectives (stragglers.h)
  Counters counters;                            // what the ops moved and their phases' time (counters.h)

  // Worker thread, before a collective's body: numbers it and, unless checks are off, compares its
  // fingerprint with every rank's; throws the same ValueError on every rank when they differ. The
  // fingerprints carry every rank's time in its previous collective to `stragglers`.
  // `refusal` is this rank's reason for refusing the call (empty: not refused).
  void agree(const char* op, const Agreement& agreement, const std::string& refusal = "");

  // agree() folded into the op's first exchange, where the CPU world transport can carry it (the
  // shared-memory segment of a one-node group; checks on; no all-to-all splits): numbers the op,
  // hands its fingerprint to the transport, and returns true. The body's first call there then
  // compares every rank's and throws agree()'s ValueError on every rank when they differ. After the
  // body, the world transport's settleCheck(); if the body throws, its carryCheck(nullptr).
  // Returns false, doing nothing, where the check must run alone: call agree().
  bool carryAgreement(const char* op, const Agreement& agreement);

 private:
  // This rank's fingerprint of collective `sequence`, with its time in the previous one.
  Fingerprint fingerprintOf(uint64_t sequence, const char* op, const Agreement& agreement);
};

}  // namespace chainermn
