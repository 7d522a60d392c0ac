// torch_chainermn._C.testing: in-process harnesses for the C++ layers (ranks as threads), used by
// the fast unit tests.
#pragma once

#include <pybind11/pybind11.h>

namespace chainermn {

void bindTesting(pybind11::module_& testing);
// testing.DeviceQueue (testing_worker.cpp): the watchdog's device path with a scripted device.
void bindWorkerTesting(pybind11::module_& testing);
// testing.caller_op_outcome (testing_caller.cpp): an op run on its caller's thread, ended by the group's break.
void bindCallerTesting(pybind11::module_& testing);
// testing.merged_arrival, testing.stragglers_named (testing_stragglers.cpp): the stragglers' arithmetic.
void bindStragglersTesting(pybind11::module_& testing);
// testing.FlightRecorderRing (bindings_flight_recorder.cpp): a flight recorder of a chosen size.
void bindFlightRecorderTesting(pybind11::module_& testing);

}  // namespace chainermn
