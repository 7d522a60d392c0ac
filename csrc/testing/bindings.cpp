// torch_chainermn._C.testing: the in-process harness (csrc/testing/) for Python tests. Ranks are
// threads; every call below releases the GIL while they run, and a rank's Python function takes it
// only while it runs Python code.
#include "testing/bindings.h"
#include "python/compression.h"
#include "python/submodules.h"
#include "os/thread_name.h"

#include "backend/device_context.h"
#include "runtime/store_courier.h"
#include "comm/waiter_pool.h"
#include "buffers/scratch.h"
#include "kernels/quantize.h"
#include "os/linger.h"
#include "os/spin.h"
#include "strategies/compressed.h"
#include "strategies/strategy.h"
#include "testing/runner.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

namespace py = pybind11;

namespace chainermn {
namespace {

using testing::RankGroup;
using testing::RunOptions;

ReduceKind reduceKind(const std::string& name) {
  static const std::map<std::string, ReduceKind> kinds{{"sum", ReduceKind::Sum},     {"product", ReduceKind::Product},
                                                       {"min", ReduceKind::Min},     {"max", ReduceKind::Max},
                                                       {"band", ReduceKind::BitAnd}, {"bor", ReduceKind::BitOr},
                                                       {"bxor", ReduceKind::BitXor}};
  const auto found = kinds.find(name);
  TORCH_CHECK_VALUE(found != kinds.end(), "unknown reduction '", name, "' (sum, product, min, max, band, bor, bxor)");
  return found->second;
}

RunOptions runOptions(bool sharedMemory, double timeoutSeconds, size_t shmChunkBytes = shm::kDefaultChunkBytes) {
  return RunOptions{sharedMemory, std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000)),
                    shmChunkBytes};
}

// A tensor's memory as a transport sees it; an absent tensor (a non-root's recv) is no memory.
void* data(const std::optional<at::Tensor>& tensor) {
  if (!tensor) {
    return nullptr;
  }
  TORCH_CHECK_VALUE(tensor->device().is_cpu() && tensor->is_contiguous(), "expected a contiguous CPU tensor");
  return tensor->data_ptr();
}

// A Request that keeps its tensor alive, and can be waited for (bounded: test() throws at the timeout).
struct PyRequest {
  at::Tensor tensor;  // outlives the request, which may still touch it when dropped
  RequestPtr request;
  bool done = false;

  bool test() {
    done = done || request->test();
    return done;
  }
  void wait() {
    while (!test()) {
      std::this_thread::yield();
    }
  }
};

// A receive of any size (Transport::recvAnySize): wait() returns the message, a tensor of the
// sender's count and dtype.
struct PyAnySize {
  std::shared_ptr<at::Tensor> received;
  RequestPtr request;

  at::Tensor wait() {
    while (!request->test()) {
      std::this_thread::yield();
    }
    return *received;
  }
};

// One reduction for the strategy to run: the op, and the input of every rank.
using Case = std::pair<std::string, std::vector<at::Tensor>>;

// The cases in order on one set of ranks, each with its strategy and Scratch reused from case to case
// as in a process group. Returns every case's result on every rank; the inputs are not modified.
std::vector<std::vector<at::Tensor>> allreduceCases(const std::string& strategy,
                                                    const std::vector<std::string>& nodeNames,
                                                    const std::vector<Case>& cases, bool sharedMemory, double timeout,
                                                    size_t shmChunkBytes) {
  std::vector<ReduceKind> kinds;
  std::vector<std::vector<at::Tensor>> outputs;
  for (const auto& [op, inputs] : cases) {
    TORCH_CHECK_VALUE(inputs.size() == nodeNames.size(), "one input per rank: ", nodeNames.size(), " expected");
    kinds.push_back(reduceKind(op));
    outputs.emplace_back();
    for (const auto& input : inputs) {
      TORCH_CHECK_VALUE(input.device().is_cpu(), "the harness reduces CPU tensors");
      outputs.back().push_back(input.clone(at::MemoryFormat::Contiguous));
    }
  }
  py::gil_scoped_release release;
  testing::runRanks(nodeNames, runOptions(sharedMemory, timeout, shmChunkBytes), [&](RankGroup& group) {
    auto algorithm = makeStrategy(strategy, group.topology);
    Scratch scratch(at::kCPU);
    for (size_t c = 0; c < cases.size(); ++c) {
      at::Tensor& tensor = outputs[c][group.topology.rank];
      algorithm->allreduce(group.transports, scratch,
                           FlatBuffer{tensor.data_ptr(), tensor.numel(), tensor.scalar_type()}, kinds[c]);
    }
  });
  return outputs;
}

// The compressed mean of inputs[r] on rank r (threads), `steps` times with the same inputs, each rank
// keeping its residuals as a process group's caller would. Returns [step][rank] results, and the
// residuals every rank ends with.
py::tuple compressedMeanSteps(const std::vector<std::string>& nodeNames, const std::vector<at::Tensor>& inputs,
                              int steps, const PyCompressionSpec& handle, bool sharedMemory) {
  const CompressionSpec& spec = handle.spec();
  TORCH_CHECK_VALUE(inputs.size() == nodeNames.size(), "one input per rank: ", nodeNames.size(), " expected");
  const size_t size = inputs.size();
  std::vector<std::vector<at::Tensor>> results(steps, std::vector<at::Tensor>(size));
  std::vector<at::Tensor> first(size), second(size);
  {
    py::gil_scoped_release release;
    testing::runRanks(nodeNames, runOptions(sharedMemory, 30.0), [&](RankGroup& group) {
      const int rank = group.topology.rank;
      const ResidualShape shape = residualShape(group.topology, spec, inputs[rank].numel());
      first[rank] = at::zeros({shape.first}, at::kFloat);
      second[rank] = at::zeros({shape.second}, at::kFloat);
      Scratch scratch(at::kCPU);
      for (int step = 0; step < steps; ++step) {
        at::Tensor tensor = inputs[rank].clone(at::MemoryFormat::Contiguous);
        compressedMean(group.transports, scratch, group.topology, flatParts({tensor}), spec,
                       shape.first ? first[rank].data_ptr<float>() : nullptr,
                       shape.second ? second[rank].data_ptr<float>() : nullptr);
        results[step][rank] = tensor;
      }
    });
  }
  return py::make_tuple(results, first, second);
}

py::list run(const std::vector<std::string>& nodeNames, const py::function& perRank, bool sharedMemory,
             double timeout) {
  std::vector<py::object> results(nodeNames.size());
  {
    py::gil_scoped_release release;
    testing::runRanks(nodeNames, runOptions(sharedMemory, timeout), [&](RankGroup& group) {
      py::gil_scoped_acquire gil;
      results[group.topology.rank] = perRank(RankGroup(group));  // a copy: Python may keep it
    });
  }
  py::list out;
  for (auto& result : results) {
    out.append(result);
  }
  return out;
}

void bindTransport(py::module_& testing) {
  using T = Transport;
  using Tensor = at::Tensor;
  using Maybe = std::optional<at::Tensor>;
  const auto noGil = py::call_guard<py::gil_scoped_release>();
  py::class_<PyRequest>(testing, "Request")
      .def("test", &PyRequest::test, noGil)
      .def("wait", &PyRequest::wait, noGil)
      .def_property_readonly("source", [](const PyRequest& r) { return r.request->source(); });
  py::class_<PyAnySize>(testing, "AnySize").def("wait", &PyAnySize::wait, noGil);
  py::class_<T, std::shared_ptr<T>>(testing, "Transport")
      .def_property_readonly("rank", &T::rank)
      .def_property_readonly("size", &T::size)
      .def_property_readonly("library", &T::library)
      .def(
          "allreduce",
          [](T& t, Tensor& x, const std::string& op) {
            t.allreduce(data(x), x.numel(), x.scalar_type(), reduceKind(op));
          },
          py::arg("tensor"), py::arg("op") = "sum", noGil)
      .def(
          "broadcast", [](T& t, Tensor& x, int root) { t.broadcast(data(x), x.numel(), x.scalar_type(), root); },
          py::arg("tensor"), py::arg("root"), noGil)
      .def(
          "reduce",
          [](T& t, Tensor& send, Maybe recv, const std::string& op, int root) {
            t.reduce(data(send), data(recv), send.numel(), send.scalar_type(), reduceKind(op), root);
          },
          py::arg("send"), py::arg("recv"), py::arg("op"), py::arg("root"), noGil)
      .def(
          "allgather",
          [](T& t, Tensor& send, Tensor& recv) {
            t.allgather(data(send), data(recv), send.numel(), send.scalar_type());
          },
          noGil)
      .def(
          "gather",
          [](T& t, Tensor& send, Maybe recv, int root) {
            t.gather(data(send), data(recv), send.numel(), send.scalar_type(), root);
          },
          noGil)
      .def(
          "scatter",
          [](T& t, Maybe send, Tensor& recv, int root) {
            t.scatter(data(send), data(recv), recv.numel(), recv.scalar_type(), root);
          },
          noGil)
      .def(
          "reduce_scatter",
          [](T& t, Tensor& send, Tensor& recv, const std::string& op) {
            t.reduceScatter(data(send), data(recv), recv.numel(), recv.scalar_type(), reduceKind(op));
          },
          py::arg("send"), py::arg("recv"), py::arg("op") = "sum", noGil)
      .def(
          "alltoallv",
          [](T& t, Tensor& send, const std::vector<int64_t>& sendCounts, Tensor& recv,
             const std::vector<int64_t>& recvCounts) {
            t.alltoallv(data(send), sendCounts, data(recv), recvCounts, send.scalar_type());
          },
          noGil)
      .def(
          "send",
          [](T& t, Tensor& x, int peer, int tag) {
            return PyRequest{x, t.send(data(x), x.numel(), x.scalar_type(), peer, tag)};
          },
          py::arg("tensor"), py::arg("peer"), py::arg("tag") = 0, noGil)
      .def(
          "recv",
          [](T& t, Tensor& x, int peer, int tag) {
            return PyRequest{x, t.recv(data(x), x.numel(), x.scalar_type(), peer, tag)};
          },
          py::arg("tensor"), py::arg("peer") = kAnySource, py::arg("tag") = 0, noGil)
      .def(
          "recv_any_size",
          [](T& t, int peer, int tag) {
            auto received = std::make_shared<at::Tensor>();
            auto request = t.recvAnySize(peer, tag, [received](int64_t count, c10::ScalarType dtype) {
              *received = at::empty({count}, at::TensorOptions().dtype(dtype));
              return received->data_ptr();
            });
            return PyAnySize{received, std::move(request)};
          },
          py::arg("peer"), py::arg("tag") = 0, noGil)
      .def("barrier", &T::barrier, noGil);
  py::class_<RankGroup>(testing, "Rank")
      .def_property_readonly("rank", [](const RankGroup& g) { return g.topology.rank; })
      .def_readonly("topology", &RankGroup::topology)
      .def_property_readonly("world", [](const RankGroup& g) { return g.transports.world; })
      .def_property_readonly("intra", [](const RankGroup& g) { return g.transports.intra; })
      .def_property_readonly("inter", [](const RankGroup& g) { return g.transports.inter; });
}

// WaiterPool (comm/waiter_pool.h): every round's jobs meet (each needs a thread of its own), and the
// threads of one round serve the next once they are idle again.
int waiterPoolRounds(int inFlight, int rounds, double timeout) {
  WaiterPool pool;
  const auto limit = std::chrono::duration<double>(timeout);
  for (int round = 0; round < rounds; ++round) {
    struct Meeting {
      std::mutex mutex;
      std::condition_variable changed;
      int arrived = 0, finished = 0;
      bool allMet = true;
    };
    auto meeting = std::make_shared<Meeting>();
    for (int i = 0; i < inFlight; ++i) {
      pool.run([meeting, inFlight, limit] {
        std::unique_lock<std::mutex> lock(meeting->mutex);
        ++meeting->arrived;
        meeting->changed.notify_all();
        if (!meeting->changed.wait_for(lock, limit, [&] { return meeting->arrived >= inFlight; })) {
          meeting->allMet = false;
        }
        ++meeting->finished;
        meeting->changed.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(meeting->mutex);
    TORCH_CHECK(
        meeting->changed.wait_for(lock, limit * 2, [&] { return meeting->finished == inFlight; }) && meeting->allMet,
        "waiter_pool: the ", inFlight, " jobs of round ", round, " did not all run at once");
    lock.unlock();
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (pool.threadsIdle() < pool.threadsStarted() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return pool.threadsStarted();
}

}  // namespace

// _C.testing exists in the builds that link this file: the test build (tools/build_sources.py).
static const bool registered =
    registerSubmodule("testing", "in-process harnesses for the C++ layers (tests only)", bindTesting);

void bindTesting(py::module_& testing) {
  testing.attr("any_source") = kAnySource;
  testing.def("allreduce_cases", &allreduceCases,
              "Strategy allreduce of each case (op, [input of rank r]) in order on one set of ranks (threads); "
              "returns [case][rank] results",
              py::arg("strategy"), py::arg("node_names"), py::arg("cases"), py::arg("shared_memory") = false,
              py::arg("timeout") = 30.0, py::arg("shm_chunk_bytes") = shm::kDefaultChunkBytes);
  testing.def(
      "allreduce",
      [](const std::string& strategy, const std::vector<std::string>& nodeNames, const std::vector<at::Tensor>& inputs,
         const std::string& op, bool sharedMemory, double timeout) {
        return allreduceCases(strategy, nodeNames, {Case{op, inputs}}, sharedMemory, timeout, shm::kDefaultChunkBytes)
            .front();
      },
      "Strategy allreduce of inputs[r] on rank r (ranks as threads); returns every rank's result", py::arg("strategy"),
      py::arg("node_names"), py::arg("inputs"), py::arg("op") = "sum", py::arg("shared_memory") = false,
      py::arg("timeout") = 30.0);
  testing.def(
      "algorithm",
      [](const std::string& strategy, const std::vector<std::string>& nodeNames) {
        return std::string(makeStrategy(strategy, topologyFromNames(nodeNames, 0))->name());
      },
      "The algorithm the named strategy runs on these nodes", py::arg("strategy"), py::arg("node_names"));
  testing.def("compressed_mean_steps", &compressedMeanSteps,
              "Gradient compression's mean of inputs[r] on rank r (threads), `steps` times; returns "
              "([step][rank] results, first residuals, second residuals)",
              py::arg("node_names"), py::arg("inputs"), py::arg("steps"), py::arg("spec"),
              py::arg("shared_memory") = false);
  testing.def(
      "quantize",
      [](const std::string& kind, std::optional<at::Tensor> add, at::Tensor& residual, int64_t chunk,
         double threshold) {
        const Code which = codeNamed(kind, "quantize");
        TORCH_CHECK_VALUE(which->needsResidual, "quantize: a code that needs a residual (2bit, 1bit)");
        TORCH_CHECK_VALUE(residual.scalar_type() == at::kFloat && residual.is_contiguous(),
                          "residual: contiguous float32");
        TORCH_CHECK_VALUE(chunk >= residual.numel(), "chunk must hold the residual's values");
        TORCH_CHECK_VALUE(!add || (add->scalar_type() == at::kFloat && add->numel() == residual.numel() &&
                                   add->device() == residual.device()),
                          "add: float32 with the residual's values and device");
        const CodeSettings settings{static_cast<float>(threshold)};
        at::Tensor block = at::empty({wireRowBytes(which, chunk, settings) / 4}, residual.options().dtype(at::kInt));
        const at::Tensor values = add ? add->contiguous() : at::Tensor();  // kept alive through the call
        moverFor(residual.device())
            ->encode(which, settings, add ? values.data_ptr<float>() : nullptr, residual.data_ptr<float>(),
                     block.data_ptr<int32_t>(), 1, block.numel() * 4, residual.numel());
        return block;
      },
      "One block of codes for residual (+ add), updating residual in place (kernels/quantize.h)", py::arg("kind"),
      py::arg("add"), py::arg("residual"), py::arg("chunk"), py::arg("threshold") = 0.5);
  testing.def(
      "dequantize",
      [](const std::string& kind, const at::Tensor& block, at::Tensor& out, int64_t count, double threshold,
         bool accumulate) {
        TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= count,
                          "out: contiguous float32 of at least count values");
        const Code which = codeNamed(kind, "dequantize");
        TORCH_CHECK_VALUE(which->needsResidual, "dequantize: a code that needs a residual (2bit, 1bit)");
        const CodeSettings settings{static_cast<float>(threshold)};
        TORCH_CHECK_VALUE(block.scalar_type() == at::kInt && block.is_contiguous() &&
                              block.numel() * 4 >= wireRowBytes(which, count, settings) &&
                              block.device() == out.device(),
                          "block: contiguous int32 words enough for count values, on out's device");
        moverFor(out.device())
            ->decode(which, settings, block.data_ptr<int32_t>(), 1, block.numel() * 4, out.data_ptr<float>(), count,
                     /*sum=*/true, accumulate);
      },
      "out (+)= the values a block of codes carries (kernels/quantize.h)", py::arg("kind"), py::arg("block"),
      py::arg("out"), py::arg("count"), py::arg("threshold") = 0.5, py::arg("accumulate") = false);
  testing.def("waiter_pool", &waiterPoolRounds,
              "`rounds` rounds of `in_flight` WaiterPool jobs that each wait until all of the round run at once; "
              "returns the threads started (raises if a round's jobs did not all run at once)",
              py::arg("in_flight"), py::arg("rounds"), py::arg("timeout") = 10.0,
              py::call_guard<py::gil_scoped_release>());
  testing.def(
      "linger_decisions",
      [](const std::vector<double>& gapsUs, int64_t lingerUs) {
        LingerPolicy policy{std::chrono::microseconds(lingerUs)};
        std::vector<bool> spun;
        for (double gap : gapsUs) {
          spun.push_back(policy.linger().count() > 0);
          policy.ended(std::chrono::duration_cast<LingerPolicy::Clock::duration>(
              std::chrono::duration<double, std::micro>(gap)));
        }
        return spun;
      },
      "Whether a thread under LingerPolicy (linger.h) spins before each of these idle gaps (microseconds)",
      py::arg("gaps_us"), py::arg("linger_us") = 50);
  testing.def(
      "yield_verdicts",
      [] {
        // Whether Spin::yieldedTooLong calls a yield contention: 0.5 ms, then 5 ms with no other
        // thread of the process working; 5 ms over another thread's work, under way or ended within
        // the gap; 5 ms while only this thread itself works (an op's own wait).
        using Clock = Spin::Clock;
        const auto gap = std::chrono::milliseconds(5);
        const auto quiet = [&] { std::this_thread::sleep_for(gap + std::chrono::milliseconds(1)); };
        std::vector<bool> verdicts;
        quiet();
        verdicts.push_back(Spin::yieldedTooLong(Clock::now() - std::chrono::microseconds(500), Clock::now()));
        verdicts.push_back(Spin::yieldedTooLong(Clock::now() - gap, Clock::now()));
        {
          std::promise<void> started, release;
          std::thread other([&] {
            OwnWork working;
            started.set_value();
            release.get_future().wait();
          });
          started.get_future().wait();
          verdicts.push_back(Spin::yieldedTooLong(Clock::now() - gap, Clock::now()));
          release.set_value();
          other.join();
        }
        verdicts.push_back(Spin::yieldedTooLong(Clock::now() - gap, Clock::now()));
        quiet();
        {
          OwnWork working;
          verdicts.push_back(Spin::yieldedTooLong(Clock::now() - gap, Clock::now()));
        }
        return verdicts;
      },
      "Spin::yieldedTooLong's verdicts on five yields (spin.h); see the test",
      py::call_guard<py::gil_scoped_release>());
  testing.def(
      "store_courier",
      [](int64_t patienceMs) {
        // A quick call; one that hangs (a store cut off) until released; one while it hangs; one
        // after; one that throws; one while another thread's slow call is out. Each outcome with the
        // milliseconds the caller waited.
        StoreCourier courier{std::chrono::milliseconds(patienceMs)};
        auto gate = std::make_shared<std::promise<void>>();
        std::shared_future<void> open = gate->get_future().share();
        std::vector<std::pair<bool, double>> seen;
        auto timed = [&](std::function<void()> call) {
          const auto start = std::chrono::steady_clock::now();
          const bool ok = courier.run(std::move(call));
          seen.emplace_back(
              ok, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
        };
        timed([] {});
        timed([open] { open.wait(); });
        timed([] {});
        gate->set_value();
        while (courier.stuck()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        timed([] {});
        timed([] { throw std::runtime_error("the store refused"); });
        // Two threads at once (the watchdog's and the worker's failure paths): the second waits its turn.
        std::thread other(
            [&courier] { courier.run([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }); });
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        timed([] {});
        other.join();
        return seen;
      },
      "StoreCourier (runtime/store_courier.h) through a hanging call: [(returned ok, ms waited)]",
      py::arg("patience_ms"), py::call_guard<py::gil_scoped_release>());
  testing.def(
      "terminate_on_thread",
      [](const std::string& name) {
        std::thread([name] {
          nameThisThread(name.c_str());
          std::terminate();
        }).join();
      },
      "Ends the process with std::terminate on a new thread called `name` (terminate_report.h's test)", py::arg("name"),
      py::call_guard<py::gil_scoped_release>());
  bindTransport(testing);
  bindWorkerTesting(testing);
  bindCallerTesting(testing);
  bindStragglersTesting(testing);
  bindFlightRecorderTesting(testing);
  testing.def("run", &run, "per_rank(Rank) on one thread per rank; returns its results, or raises the first error",
              py::arg("node_names"), py::arg("per_rank"), py::arg("shared_memory") = false, py::arg("timeout") = 30.0);
}

}  // namespace chainermn
