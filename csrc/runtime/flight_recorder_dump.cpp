// The flight recorder's dump, in torch's format (FlightRecorder::dump in torch's
// FlightRecorderDetail.hpp): a pickled dict of
//   version          "2.10", the format version torch 2.12 to 2.14 write and their analyzer reads
//   pg_config        {group name: {"name", "desc", "ranks": "[0, 1, 2]"}}
//   pg_status        {pg_id: {"last_enqueued_collective", "last_started_collective", "last_completed_collective"}}
//   comm_lib_version "chainermn"
//   entries          one dict per op, oldest first, with torch's keys
// and its writing through torch's DebugInfoWriter, where torch writes nccl's and gloo's.
#include "runtime/flight_recorder.h"

#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>  // DebugInfoWriter; TraceUtils' new_dict, pickle_str
#include <torch/csrc/distributed/c10d/Utils.hpp>           // getCvarBool

#include <c10/util/Logging.h>

#include <iostream>
#include <sstream>

namespace chainermn {

namespace {

// torch's FlightRecorder.hpp version_val: the same in torch 2.12, 2.13 and 2.14.
constexpr const char* kFormatVersion = "2.10";

// A group as the dump names it, copied under the recorder's lock.
struct GroupView {
  std::string name;
  std::string desc;
};

c10::List<c10::IValue> sizesOf(const std::vector<int64_t>& dims, const int64_t*& next) {
  auto sizes = c10d::new_list();
  for (int64_t count : dims) {
    auto shape = c10d::new_list();
    for (int64_t d = 0; d < count; ++d) {
      shape.push_back(*next++);
    }
    sizes.push_back(shape);
  }
  return sizes;
}

std::vector<std::string> dtypeNames(const std::vector<c10::ScalarType>& dtypes) {
  std::vector<std::string> names;
  names.reserve(dtypes.size());
  for (auto dtype : dtypes) {
    names.emplace_back(c10::toString(dtype));
  }
  return names;
}

c10::Dict<c10::IValue, c10::IValue> entryOf(const FlightRecorder::Entry& slot, const GroupView& group,
                                            bool includeStackTraces) {
  auto entry = c10d::new_dict();
  if (includeStackTraces) {
    entry.insert("frames", c10d::new_list());  // no stack is captured (docs/observability.md)
  }
  entry.insert("record_id", static_cast<int64_t>(slot.id));
  entry.insert("pg_id", static_cast<int64_t>(slot.group->id));
  entry.insert("process_group", std::make_tuple(group.name, group.desc));
  entry.insert("thread_name", std::string(slot.threadName));
  std::ostringstream thread;
  thread << slot.thread;
  entry.insert("thread_id", thread.str());
  entry.insert("collective_seq_id", static_cast<int64_t>(slot.collectiveSeq));
  entry.insert("p2p_seq_id", static_cast<int64_t>(slot.p2pSeq));
  entry.insert("op_id", static_cast<int64_t>(slot.opId));
  std::string name = std::string("chainermn:") + slot.op;
  if (slot.direction != nullptr) {
    name += " " + std::to_string(slot.rank) + slot.direction + std::to_string(slot.peer);
  }
  entry.insert("profiling_name", name);
  entry.insert("time_created_ns", tick_clock::unixNanos(slot.created));
  if (slot.completed != 0) {
    entry.insert("duration_ms", static_cast<double>(tick_clock::nanosBetween(slot.started, slot.completed)) / 1e6);
  }
  const int64_t* next = slot.sizes.data();
  entry.insert("input_sizes", sizesOf(slot.inputDims, next));
  entry.insert("input_dtypes", dtypeNames(slot.inputDtypes));
  entry.insert("output_sizes", sizesOf(slot.outputDims, next));
  entry.insert("output_dtypes", dtypeNames(slot.outputDtypes));
  entry.insert("state", slot.completed != 0 ? "completed" : slot.started != 0 ? "started" : "scheduled");
  const auto wall = [](tick_clock::Ticks ticks) {
    return ticks != 0 ? c10::IValue(tick_clock::unixNanos(ticks)) : c10::IValue();
  };
  entry.insert("time_discovered_started_ns", wall(slot.started));
  entry.insert("time_discovered_completed_ns", wall(slot.completed));
  entry.insert("retired", slot.retired);
  entry.insert("timeout_ms", slot.timeoutMs);
  entry.insert("is_p2p", slot.isP2P);
  return entry;
}

std::string ranksText(const std::vector<int64_t>& ranks) {
  std::string text = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return text + "]";
}

}  // namespace

std::string FlightRecorder::dump(bool includeCollectives, bool includeStackTraces, bool onlyActive) {
  auto result = c10d::new_dict();
  auto pgConfig = c10d::new_dict();
  auto pgStatus = c10d::new_dict();
  std::vector<Entry> slots;
  std::vector<GroupView> groups;
  {
    // Copied under the lock, as torch's dump_entries does; the dicts are built after.
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& group : groups_) {
      groups.push_back({group->name, group->named ? group->desc : "undefined"});
      auto config = c10d::new_dict();
      config.insert("name", group->name);
      config.insert("desc", groups.back().desc);
      config.insert("ranks", ranksText(group->globalRanks));
      pgConfig.insert(group->name, config);
      auto status = c10d::new_dict();
      status.insert("last_enqueued_collective", group->lastEnqueued.load());
      status.insert("last_started_collective", group->lastStarted.load());
      status.insert("last_completed_collective", group->lastCompleted.load());
      pgStatus.insert(std::to_string(group->id), status);
    }
    if (includeCollectives && !slots_.empty()) {
      // Each entry copied under its slot's lock; one recorded meanwhile over an older one is taken
      // as it is, one whose recording has not begun is left out.
      const Id next = next_.load();
      const Id first = next > slots_.size() ? next - slots_.size() : 0;
      slots.reserve(next - first);
      for (Id id = first; id < next; ++id) {
        Locked slot(*this, id);
        if (slot && !(onlyActive && slot->completed != 0)) {
          slots.push_back(*slot);
        }
      }
    }
  }
  result.insert("version", kFormatVersion);
  result.insert("pg_config", pgConfig);
  result.insert("comm_lib_version", "chainermn");
  result.insert("pg_status", pgStatus);
  if (includeCollectives) {
    auto entries = c10d::new_list();
    for (const auto& slot : slots) {
      entries.push_back(entryOf(slot, groups.at(slot.group->id), includeStackTraces));
    }
    result.insert("entries", entries);
  }
  return c10d::pickle_str(result);
}

bool FlightRecorder::write(const std::string& why) {
  if (!enabled()) {
    return false;
  }
  try {
    const int64_t rank = globalRank_.load();
    const std::string trace = dump(/*includeCollectives=*/true, /*includeStackTraces=*/false, /*onlyActive=*/false);
    auto& writer = c10d::DebugInfoWriter::getWriter(static_cast<int>(rank));
    writer.write(trace);
    LOG(WARNING) << "chainermn: flight recorder dump written to " << writer.getWriterTarget() << " (" << why << ")";
    return true;
  } catch (const std::exception& error) {
    LOG(ERROR) << "chainermn: writing the flight recorder's dump failed: " << error.what();
    return false;
  }
}

void FlightRecorder::writeOnFailure(const std::string& why) {
  // torch's switch for nccl's dump on a timeout; on by default, as there.
  static const bool onFailure = c10d::getCvarBool({"TORCH_NCCL_DUMP_ON_TIMEOUT"}, true);
  if (onFailure) {
    write(why);
  }
}

}  // namespace chainermn
