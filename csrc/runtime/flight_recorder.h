// The flight recorder: the last N ops of every chainermn group in this process, each with its state
// (scheduled, started, completed), dumped in the format of torch's own FlightRecorder so that torch's
// analyzer reads it (python -m torch_chainermn.fr_trace, docs/observability.md).
//
// torch's recorder is not reachable from an extension (libtorch's instance and its methods are hidden
// symbols, and its template needs nlohmann/json, which torch's wheel does not ship): this is the
// backend's own, with torch's settings (TORCH_FR_BUFFER_SIZE, legacy TORCH_NCCL_TRACE_BUFFER_SIZE,
// default 2000, 0 = off) and torch's keys (flight_recorder_dump.cpp).
//
// One ring per process, as torch's: its record ids order the ops of all groups, which is what the
// analyzer aligns the ranks' dumps by. Each slot's storage is reused (its vectors keep their capacity),
// so recording allocates nothing once every slot has been written. An op is recorded by the thread
// that posts it and marked started and ended by the thread that runs it: each slot has a lock of its
// own, held for a few stores, so the two threads share the slot's cache lines only, not a mutex of
// the process besides (a 4 KiB all_reduce took 0.25-0.4 us longer with one). The ids are taken from
// an atomic counter. Off (buffer 0), the backend's cost is one branch per op.
#pragma once

#include "os/tick_clock.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace chainermn {

// A group as a dump names it (pg_config, pg_status). Registered once per group, kept for the process's
// life (a dump names groups already destroyed, as torch's does).
struct TracedGroup {
  size_t id = 0;  // pg_id: the order in which this process's chainermn groups were created
  // torch's name and description of the group (ProcessGroup.group_name, group_desc), known only once
  // torch has set them on the backend, after its creation: read at the group's first recorded op.
  std::string name;  // written once, under the recorder's mutex, before `named` is set
  std::string desc;
  std::atomic<bool> named{false};
  std::vector<int64_t> globalRanks;  // the group's members, by global rank
  // pg_status: the last collective (its sequence number) posted, started, completed; -1 for none.
  std::atomic<int64_t> lastEnqueued{-1};
  std::atomic<int64_t> lastStarted{-1};
  std::atomic<int64_t> lastCompleted{-1};
  std::atomic<uint64_t> ops{0};  // op_id: every op posted on the group
};

// What the funnel knows of an op when it posts it.
struct PostedOp {
  c10d::OpType type;
  const char* name;  // the backend's name of it ("all_gather_into_tensor"): a literal, kept by the ring
  bool collective;
  uint64_t collectiveSeq;  // the group's collectives posted so far, this one included if collective
  uint64_t p2pSeq;         // likewise for sends and receives
  int rank;                // in the group
  int peer;                // a send's destination, a receive's source (group ranks); -1 otherwise
  std::chrono::milliseconds timeout;
  const std::vector<at::Tensor>& inputs;
  const std::vector<at::Tensor>& outputs;
};

class FlightRecorder {
 public:
  using Id = uint64_t;
  static constexpr Id kNotRecorded = ~Id(0);

  // The process's recorder, sized from torch's settings the first time it is asked for.
  static FlightRecorder& get();
  // A recorder of its own (tests): `capacity` ops, 0 = off.
  explicit FlightRecorder(size_t capacity);

  bool enabled() const {
    return !slots_.empty();
  }

  // A new group, its members by global rank, this process's place among them being `groupRank`.
  // `fallbackName` names it in dumps if torch never names it (a backend made outside a ProcessGroup).
  TracedGroup* addGroup(std::vector<int64_t> globalRanks, int groupRank, std::string fallbackName);

  // The op enters the ring as "scheduled"; its id, for the calls below. `groupName`/`groupDesc`: torch's,
  // read the first time only.
  Id record(TracedGroup& group, const std::string& groupName, const std::string& groupDesc, const PostedOp& op);
  // A thread began running it ("started"); later calls for the same op change nothing.
  void started(Id id);
  // It completed, or failed (it stays "started" or "scheduled", retired, as torch shows an op that
  // timed out). Ids whose slot was reused since are ignored.
  void ended(Id id, bool completed);

  // torch's dump (FlightRecorder::dump): the pickled dict of version, pg_config, pg_status and entries.
  std::string dump(bool includeCollectives, bool includeStackTraces, bool onlyActive);
  // Writes dump() through torch's DebugInfoWriter (TORCH_FR_DUMP_TEMP_FILE + rank), as
  // ProcessGroupNCCL does on a timeout; false when the recorder is off. Never throws.
  bool write(const std::string& why);
  // write(), on a failure (a timeout, a dead peer, a mismatch), unless TORCH_NCCL_DUMP_ON_TIMEOUT=0.
  void writeOnFailure(const std::string& why);

  // An op as recorded: what a ring slot holds, its storage reused by the op recorded over it.
  struct Entry {
    Id id = kNotRecorded;
    TracedGroup* group = nullptr;
    uint64_t collectiveSeq = 0;
    uint64_t p2pSeq = 0;
    uint64_t opId = 0;
    bool collective = false;
    bool isP2P = false;
    bool retired = false;
    // Its profiling name, put together at the dump: "chainermn:" + op ("all_reduce"), and for a send
    // or a receive the ranks ("chainermn:send 0->1", "chainermn:recv 1<-0").
    const char* op = "";
    const char* direction = nullptr;  // "->" for a send, "<-" for a receive; null for the rest
    int rank = 0;
    int peer = -1;
    // When it was posted, started, completed, in ticks of os/tick_clock.h (0: not yet); the dump
    // turns them into the wall clock's nanoseconds, as torch's are.
    tick_clock::Ticks created = 0;
    tick_clock::Ticks started = 0;
    tick_clock::Ticks completed = 0;
    int64_t timeoutMs = 0;
    std::thread::id thread;
    char threadName[16] = {};
    // Every tensor's dims, flattened; how many dims each input and output has; their dtypes.
    std::vector<int64_t> sizes;
    std::vector<int64_t> inputDims;
    std::vector<int64_t> outputDims;
    std::vector<c10::ScalarType> inputDtypes;
    std::vector<c10::ScalarType> outputDtypes;
  };

 private:
  struct Slot {
    std::atomic<bool> busy{false};  // the slot's lock: a thread writing or copying its entry
    Entry entry;
  };
  // The slot `id` was recorded in, locked, while it still holds that op (null once it was reused).
  class Locked {
   public:
    Locked(FlightRecorder& recorder, Id id);
    ~Locked();
    Entry* operator->() const {
      return entry_;
    }
    Entry& operator*() const {
      return *entry_;
    }
    explicit operator bool() const {
      return entry_ != nullptr;
    }

   private:
    Slot* slot_ = nullptr;
    Entry* entry_ = nullptr;
  };
  static void lock(Slot& slot);
  static void unlock(Slot& slot);

  std::mutex mutex_;  // the groups (and a group's first naming); the dump's view of them
  std::vector<Slot> slots_;
  std::atomic<Id> next_{0};
  std::vector<std::unique_ptr<TracedGroup>> groups_;
  std::atomic<int64_t> globalRank_{0};  // this process's, from its first group: the dump file's suffix
};

}  // namespace chainermn
