// torch_chainermn._C.testing.DeviceQueue: a group's Worker fed ops that end on a "device" the test
// drives, so the watchdog's device path (worker.h: a CUDA collective's Work completes when queued;
// the watchdog watches its end, polls the transports' asynchronous errors, aborts them on a timeout
// or an error) runs in CI, where there is no GPU. The device here is a counter the test advances and
// an error string it sets: what a CUDA event and ncclCommGetAsyncError report on a GPU.
#include "testing/bindings.h"

#include "runtime/worker.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

namespace py = pybind11;

namespace chainermn {
namespace {

// What the watchdog asks of a group's device transports, scripted by the test.
class ScriptedDevice : public AbortableComms {
 public:
  std::string asyncError() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  void abort() override {
    aborts_.fetch_add(1);
  }
  void setError(const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
  }
  int aborts() const {
    return aborts_.load();
  }

 private:
  std::mutex mutex_;
  std::string error_;
  std::atomic<int> aborts_{0};
};

// What the test's device has done, and what the watchdog has seen of it: the events a test waits for
// before it says that something has not happened yet (no sleep stands in for them).
struct DeviceCounters {
  std::atomic<int> finished{0};         // ops the device has run (finish())
  std::atomic<int> endPolls{0};         // times the watchdog asked whether an op's end is reached
  std::atomic<int> endsSeen{0};         // ... and was told yes
  std::atomic<int> verdictsAwaited{0};  // cross-rank checks the worker has begun to wait for
  std::atomic<int> verdictsTaken{0};    // cross-rank verdicts the worker has taken (check())
};

// The end of the op numbered `index` (from 0): reached once the test has finished that many ops.
class ScriptedEnd : public Request {
 public:
  ScriptedEnd(std::shared_ptr<DeviceCounters> counters, int index) : counters_(std::move(counters)), index_(index) {}
  bool test() override {
    const bool reached = counters_->finished.load() > index_;
    counters_->endPolls.fetch_add(1);
    if (reached) {
      counters_->endsSeen.fetch_add(1);
    }
    return reached;
  }

 private:
  std::shared_ptr<DeviceCounters> counters_;
  int index_;
};

// The cross-rank verdict on a launched op, given by the test (check()): "" agrees, else the ValueError
// a disagreement raises.
class Verdict {
 public:
  void give(const std::string& mismatch) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mismatch_ = mismatch;
      given_ = true;
    }
    cv_.notify_all();
  }
  // On the worker: waits for the test's verdict (at most 30 s) and throws a disagreement.
  void await(std::atomic<int>& awaited, std::atomic<int>& taken) {
    awaited.fetch_add(1);
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(cv_.wait_for(lock, std::chrono::seconds(30), [this] { return given_; }), "no verdict given");
    taken.fetch_add(1);
    TORCH_CHECK_VALUE(mismatch_.empty(), mismatch_);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool given_ = false;
  std::string mismatch_;
};

class DeviceQueue {
 public:
  explicit DeviceQueue(double timeoutSeconds)
      : timeout_(static_cast<int64_t>(timeoutSeconds * 1000)),
        device_(std::make_shared<ScriptedDevice>()),
        worker_(std::make_unique<Worker>("device-queue", nullptr, device_)) {}

  // Posts an all_reduce whose kernels "run" until finish() passes it.
  c10::intrusive_ptr<c10d::Work> post() {
    const int index = posted_++;
    auto work = makeWork(index, "nccl");
    worker_->enqueue(work, [counters = counters_, index] {
      Pending queued(std::make_unique<ScriptedEnd>(counters, index));
      queued.onDevice = true;
      return queued;
    });
    return work;
  }

  // An all_reduce launched on the caller's thread, as over NCCL: queued at once (its Work completes
  // when queued), watched by the watchdog, and, when `checked`, completed only once its cross-rank
  // check, run on the worker beside it, has the test's verdict (check()).
  c10::intrusive_ptr<c10d::Work> launch(bool checked) {
    const int index = posted_++;
    auto work = makeWork(index, "nccl");
    work->completeQueued();
    worker_->watchOnDevice(work, std::make_unique<ScriptedEnd>(counters_, index), checked);
    if (checked) {
      auto verdict = std::make_shared<Verdict>();
      verdicts_[index] = verdict;
      worker_->enqueueCheck(makeWork(index, "gloo"), work, [verdict, counters = counters_] {
        verdict->await(counters->verdictsAwaited, counters->verdictsTaken);
      });
    }
    return work;
  }

  // The ranks' verdict on launched op `index`: "" when they agree, else the disagreement.
  void check(int index, const std::string& mismatch) {
    verdicts_.at(index)->give(mismatch);
  }

  void drain() {
    worker_->drain();
  }

  // The device has run the first `count` ops.
  void finish(int count) {
    counters_->finished.store(count);
  }
  void setError(const std::string& error) {
    device_->setError(error);
  }
  int aborts() const {
    return device_->aborts();
  }
  const DeviceCounters& counters() const {
    return *counters_;
  }

 private:
  c10::intrusive_ptr<WorkChainerMN> makeWork(int index, const char* transport) const {
    return c10::make_intrusive<WorkChainerMN>(
        c10d::OpType::ALLREDUCE, WorkChainerMN::Label{"all_reduce", transport, 0, 1, timeout_, true},
        static_cast<uint64_t>(index + 1), std::vector<at::Tensor>{}, Clock::now() + timeout_);
  }

  const std::chrono::milliseconds timeout_;
  std::shared_ptr<ScriptedDevice> device_;
  std::shared_ptr<DeviceCounters> counters_ = std::make_shared<DeviceCounters>();
  std::unique_ptr<Worker> worker_;
  int posted_ = 0;
  std::map<int, std::shared_ptr<Verdict>> verdicts_;
};

}  // namespace

void bindWorkerTesting(py::module_& testing) {
  const auto noGil = py::call_guard<py::gil_scoped_release>();
  py::class_<DeviceQueue>(testing, "DeviceQueue",
                          "A Worker whose ops end on a scripted device (the watchdog's CUDA path)")
      .def(py::init<double>(), py::arg("timeout") = 30.0)
      .def("post", &DeviceQueue::post, noGil, "An all_reduce queued on the device; returns its Work")
      .def("launch", &DeviceQueue::launch, noGil,
           "An all_reduce launched on the caller's thread (as over NCCL); checked: its cross-rank check "
           "waits for check()",
           py::arg("checked") = true)
      .def("check", &DeviceQueue::check, noGil, "The ranks' verdict on launched op `index`", py::arg("index"),
           py::arg("mismatch") = "")
      .def("drain", &DeviceQueue::drain, noGil, "Waits for everything posted, the device's work included")
      .def("finish", &DeviceQueue::finish, "The device has run the first `count` ops", py::arg("count"))
      .def("set_error", &DeviceQueue::setError, "What the transports report as an asynchronous error", py::arg("error"))
      .def_property_readonly("aborts", &DeviceQueue::aborts, "How often the watchdog aborted the transports")
      .def_property_readonly(
          "end_polls", [](const DeviceQueue& q) { return q.counters().endPolls.load(); },
          "How often the watchdog asked the device whether an op's end is reached")
      .def_property_readonly(
          "ends_seen", [](const DeviceQueue& q) { return q.counters().endsSeen.load(); },
          "How often it was told an end is reached")
      .def_property_readonly(
          "verdicts_awaited", [](const DeviceQueue& q) { return q.counters().verdictsAwaited.load(); },
          "Cross-rank checks the worker has begun to wait for")
      .def_property_readonly(
          "verdicts_taken", [](const DeviceQueue& q) { return q.counters().verdictsTaken.load(); },
          "Cross-rank verdicts the worker has taken");
}

}  // namespace chainermn
