// testing.merged_arrival and testing.stragglers_named (tests/test_stragglers.py): the stragglers'
// arithmetic (backend/stragglers.h) on times a test chooses, without ranks.
#include "testing/bindings.h"

#include "backend/stragglers.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace chainermn {
namespace {

// Every rank's time (None: not measured), merged set by set as the levels do (each set's ranks
// merged, then the sets'): (last, shortest, next shortest, unmeasured).
std::tuple<int, int64_t, int64_t, bool> mergedArrival(const std::vector<std::optional<uint32_t>>& micros,
                                                      const std::vector<std::vector<int>>& sets) {
  Arrival merged;
  for (const auto& set : sets) {
    Arrival ofSet;
    for (const int rank : set) {
      ofSet = Arrival::merge(ofSet, Arrival::of(rank, micros.at(rank).value_or(Arrival::kNone)));
    }
    merged = Arrival::merge(merged, ofSet);
  }
  const auto shown = [](uint32_t value) { return value == Arrival::kNone ? int64_t{-1} : int64_t{value}; };
  return {merged.last, shown(merged.shortest), shown(merged.nextShortest), merged.unmeasured != 0};
}

// The rank named after each of `arrivals` ((last rank, lateness in microseconds) per collective).
std::vector<int> stragglersNamed(int size, int window, double marginMs,
                                 const std::vector<std::pair<int, uint32_t>>& arrivals) {
  Stragglers stragglers(/*rank=*/1, std::vector<std::string>(size, "node"), "test",
                        StragglerSettings{window, marginMs, false});
  std::vector<int> named;
  for (const auto& [last, lateness] : arrivals) {
    Arrival arrival;
    arrival.last = last;
    arrival.shortest = 1000;
    arrival.nextShortest = 1000 + lateness;
    stragglers.observe(arrival);
    named.push_back(stragglers.summary().named);
  }
  return named;
}

}  // namespace

void bindStragglersTesting(py::module_& testing) {
  testing.def("merged_arrival", &mergedArrival, py::arg("micros"), py::arg("sets"),
              "(last, shortest, next shortest, unmeasured) of every rank's time merged set by set");
  testing.def("stragglers_named", &stragglersNamed, py::arg("size"), py::arg("window"), py::arg("margin_ms"),
              py::arg("arrivals"), "the rank named (-1: none) after each (last rank, lateness in us)");
}

}  // namespace chainermn
