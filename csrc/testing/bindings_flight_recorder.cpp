// torch_chainermn._C.testing.FlightRecorderRing: a flight recorder of its own size (the process's is
// sized once, from the environment), fed ops by the test, so that the ring's wrap-around, its states and
// its dump are checked in process.
#include "testing/bindings.h"

#include "runtime/flight_recorder.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>

namespace py = pybind11;

namespace chainermn {
namespace {

c10d::OpType opType(const std::string& name) {
  static const std::map<std::string, c10d::OpType> types{{"all_reduce", c10d::OpType::ALLREDUCE},
                                                         {"all_gather", c10d::OpType::ALLGATHER},
                                                         {"reduce_scatter", c10d::OpType::REDUCE_SCATTER},
                                                         {"barrier", c10d::OpType::BARRIER},
                                                         {"send", c10d::OpType::SEND},
                                                         {"recv", c10d::OpType::RECV}};
  const auto found = types.find(name);
  TORCH_CHECK_VALUE(found != types.end(), "FlightRecorderRing: no op '", name, "'");
  return found->second;
}

class Ring {
 public:
  Ring(size_t capacity, std::vector<int64_t> globalRanks, int rank, const std::string& name, const std::string& desc)
      : recorder_(capacity), name_(name), desc_(desc), rank_(rank) {
    group_ = recorder_.addGroup(std::move(globalRanks), rank, name);
  }
  uint64_t record(const std::string& op, uint64_t collectiveSeq, uint64_t p2pSeq, int peer,
                  const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
    const c10d::OpType type = opType(op);
    const bool collective = type != c10d::OpType::SEND && type != c10d::OpType::RECV;
    // Named by its type (every type here has its name in the analyzer's table): the ring keeps a name's
    // pointer, and `op` is gone once this returns.
    return recorder_.record(*group_, name_, desc_,
                            PostedOp{type, "", collective, collectiveSeq, p2pSeq, rank_, peer,
                                     std::chrono::milliseconds(1000), inputs, outputs});
  }
  void started(uint64_t id) {
    recorder_.started(id);
  }
  void ended(uint64_t id, bool completed) {
    recorder_.ended(id, completed);
  }
  py::bytes dump(bool onlyActive) {
    return py::bytes(recorder_.dump(true, true, onlyActive));
  }
  // What the recorder adds to one op, in ns: `ops` all_reduces of `tensor` recorded, started and ended
  // (benchmarks/observability_cost.py --recorder-cost).
  double nanosecondsPerOp(const at::Tensor& tensor, int64_t ops) {
    const std::vector<at::Tensor> tensors{tensor};
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < ops; ++i) {
      const auto id = recorder_.record(*group_, name_, desc_,
                                       PostedOp{c10d::OpType::ALLREDUCE, "all_reduce", true, uint64_t(i), 0, rank_, -1,
                                                std::chrono::milliseconds(1000), tensors, tensors});
      recorder_.started(id);
      recorder_.ended(id, true);
    }
    const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
    return elapsed.count() / static_cast<double>(ops);
  }

 private:
  FlightRecorder recorder_;
  TracedGroup* group_;
  const std::string name_;
  const std::string desc_;
  const int rank_;
};

}  // namespace

void bindFlightRecorderTesting(py::module_& testing) {
  py::class_<Ring>(testing, "FlightRecorderRing")
      .def(py::init<size_t, std::vector<int64_t>, int, const std::string&, const std::string&>(), py::arg("capacity"),
           py::arg("global_ranks"), py::arg("rank"), py::arg("name"), py::arg("desc"))
      .def("record", &Ring::record, py::arg("op"), py::arg("collective_seq"), py::arg("p2p_seq"), py::arg("peer"),
           py::arg("inputs"), py::arg("outputs"))
      .def("started", &Ring::started)
      .def("ended", &Ring::ended, py::arg("id"), py::arg("completed"))
      .def("dump", &Ring::dump, py::arg("only_active") = false)
      .def("nanoseconds_per_op", &Ring::nanosecondsPerOp, py::arg("tensor"), py::arg("ops"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace chainermn
