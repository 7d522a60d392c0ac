// torch_chainermn._C.testing.caller_op_outcome: a collective run on its caller's thread
// (Worker::runIfIdle, as backend/funnel.cpp runs a small one over shared memory) whose peer never
// arrives. The caller is the thread waiting in the segment's barrier, so no watchdog can free it by
// failing the Work: the group's break must abort the transport (AbortableComms). Ranks are threads
// of this process (testing/runner.h).
#include "testing/bindings.h"

#include "runtime/worker.h"
#include "testing/runner.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <map>
#include <thread>

namespace py = pybind11;

namespace chainermn {
namespace {

// The group's transports as the watchdog sees them: here, the one the caller waits in.
class AbortsTransport : public AbortableComms {
 public:
  explicit AbortsTransport(TransportPtr transport) : transport_(std::move(transport)) {}
  std::string asyncError() override {
    return "";
  }
  void abort() override {
    transport_->abort();
  }

 private:
  TransportPtr transport_;
};

// Rank 0 runs a barrier on its caller's thread; rank 1 never enters it. `how`: "timeout" (the op's
// deadline passes), "abort" (another thread aborts the group, as ProcessGroup.abort() does),
// "worker-busy" (an op is queued first: runIfIdle must refuse, and the barrier runs on the worker,
// behind it). The transport's own wait is bounded by 60 s. Returns what ended the wait inside the
// transport and what the Work's wait() raised.
std::map<std::string, std::string> callerOpOutcome(const std::string& how) {
  TORCH_CHECK_VALUE(how == "timeout" || how == "abort" || how == "worker-busy", "caller_op_outcome: how is ", how);
  testing::RunOptions options;
  options.sharedMemory = true;
  options.timeout = std::chrono::seconds(60);
  std::atomic<bool> done{false};
  std::map<std::string, std::string> outcome;
  testing::runRanks({"node", "node"}, options, [&](testing::RankGroup& group) {
    if (group.topology.rank == 1) {
      while (!done.load()) {  // bounded: rank 0's waits end by its deadline, the abort or the transport's
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return;
    }
    // Rank 1 leaves once rank 0 is through, whichever way (a failed check throws).
    struct Release {
      std::atomic<bool>& done;
      ~Release() {
        done.store(true);
      }
    } release{done};
    TransportPtr world = group.transports.world;
    auto worker = std::make_unique<Worker>("caller-op", nullptr, std::make_shared<AbortsTransport>(world));
    const auto timeout = std::chrono::milliseconds(how == "timeout" ? 300 : 30000);
    auto makeWork = [&](uint64_t sequence) {
      return c10::make_intrusive<WorkChainerMN>(c10d::OpType::BARRIER,
                                                WorkChainerMN::Label{"barrier", "shm", 0, 2, timeout, true}, sequence,
                                                std::vector<at::Tensor>{}, Clock::now() + timeout);
    };
    std::string waitEnded = "returned";
    std::atomic<bool> entered{false};
    std::atomic<bool> left{false};
    Worker::Body barrier = [&] {
      entered.store(true);
      try {
        world->barrier();
      } catch (const std::exception& error) {
        waitEnded = error.what();
        left.store(true);
        throw;
      }
      left.store(true);
      return Pending();
    };
    // Until `flag` is set: bounded, as every wait of the harness.
    auto await = [](const std::atomic<bool>& flag) {
      const auto giveUp = Clock::now() + std::chrono::seconds(30);
      while (!flag.load() && Clock::now() < giveUp) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    };
    if (how == "worker-busy") {
      // The worker holds an op (for 0.2 s); the barrier must queue behind it, then fail with the group.
      auto first = makeWork(1);
      worker->enqueue(first, [] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return Pending();
      });
      auto second = makeWork(2);
      outcome["ran_on_caller"] = worker->runIfIdle(second, barrier) ? "yes" : "no";
      if (outcome["ran_on_caller"] == "no") {
        worker->enqueue(second, std::move(barrier));
      }
      await(entered);  // the worker runs the barrier
      worker->abortGroup("the test aborted the group");
      try {
        second->wait();
        outcome["wait"] = "completed";
      } catch (const std::exception& error) {
        outcome["wait"] = error.what();
      }
    } else {
      std::thread aborter;
      if (how == "abort") {
        aborter = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          worker->abortGroup("the test aborted the group");
        });
      }
      auto work = makeWork(1);
      outcome["ran_on_caller"] = worker->runIfIdle(work, barrier) ? "yes" : "no";
      if (aborter.joinable()) {
        aborter.join();
      }
      try {
        work->wait();
        outcome["wait"] = "completed";
      } catch (const std::exception& error) {
        outcome["wait"] = error.what();
      }
    }
    await(left);  // with "worker-busy", the worker's wait: the abort frees it too
    outcome["transport"] = left.load() ? waitEnded : "still waiting";
    worker.reset();
  });
  return outcome;
}

}  // namespace

void bindCallerTesting(py::module_& testing) {
  testing.def("caller_op_outcome", &callerOpOutcome, py::call_guard<py::gil_scoped_release>(),
              "A barrier run on its caller's thread over shared memory whose peer never comes, ended by "
              "`how` ('timeout', 'abort', or 'worker-busy': queued behind the worker's op instead); returns "
              "what ended the transport's wait and what wait() raised",
              py::arg("how"));
}

}  // namespace chainermn
