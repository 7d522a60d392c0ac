// torch_chainermn._C.flight_recorder: the process's flight recorder (runtime/flight_recorder.h), read
// by torch_chainermn.flight_recorder.
#include "python/submodules.h"
#include "runtime/flight_recorder.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace chainermn {
namespace {

void bindFlightRecorder(py::module_& module) {
  module.def(
      "dump",
      [](bool includeCollectives, bool includeStackTraces, bool onlyActive) {
        std::string trace;
        {
          py::gil_scoped_release released;
          trace = FlightRecorder::get().dump(includeCollectives, includeStackTraces, onlyActive);
        }
        return py::bytes(trace);
      },
      py::arg("include_collectives") = true, py::arg("include_stack_traces") = true, py::arg("only_active") = false,
      "torch's pickled dump of the recorder: version, pg_config, pg_status, entries");
  module.def(
      "write", [](const std::string& why) { return FlightRecorder::get().write(why); }, py::arg("why"),
      py::call_guard<py::gil_scoped_release>(),
      "writes the dump through torch's DebugInfoWriter; False when the recorder is off");
  module.def(
      "enabled", [] { return FlightRecorder::get().enabled(); }, "whether ops are recorded (TORCH_FR_BUFFER_SIZE > 0)");
}

const bool registered = registerSubmodule("flight_recorder", "the backend's flight recorder", bindFlightRecorder);

}  // namespace
}  // namespace chainermn
