// torch_chainermn._C: the backend class for torch.distributed, its transports' factories, and the
// MPI runtime helpers the launcher needs.
#include "backend/process_group.h"
#include "backend/transport_plan.h"
#include "runtime/worker.h"
#include "comm/gloo.h"
#include "python/compression.h"
#include "python/submodules.h"
#include "strategies/strategy.h"
#include "os/terminate_report.h"
#include "topology.h"
#ifdef CHAINERMN_WITH_MPI
#include "comm/mpi.h"
#include "comm/mpi_runtime.h"
#endif

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using chainermn::ProcessGroupChainerMN;
using chainermn::Topology;

namespace {

using chainermn::GroupOptions;
using chainermn::GroupSetup;
using chainermn::Level;

bool interpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// A Python callable C++ keeps: dropping the last copy, on whatever thread, takes the GIL first. Not
// once the interpreter finalizes: a thread other than the finalizing one that asks for the GIL then is
// ended by pthread_exit, and an unwind through this deleter (noexcept) aborts the process. The
// callable is left to the process's end instead.
std::shared_ptr<py::function> heldWithGil(py::function function) {
  return std::shared_ptr<py::function>(new py::function(std::move(function)), [](py::function* f) {
    if (interpreterFinalizing()) {
      return;
    }
    py::gil_scoped_acquire gil;
    delete f;
  });
}

// The host library's transport for one level, made by a Python callable (key, rank, size) -> a
// c10d Backend (Gloo's ProcessGroup is made in Python: no Gloo headers here).
chainermn::TransportFactory glooFactory(py::function make) {
  auto held = heldWithGil(std::move(make));
  return [held](const Level& level) {
    c10::intrusive_ptr<c10d::Backend> backend;
    {
      py::gil_scoped_acquire gil;
      backend = (*held)(level.key, level.index, static_cast<int>(level.ranks.size()))
                    .cast<c10::intrusive_ptr<c10d::Backend>>();
    }
    return chainermn::gloo::createTransport(std::move(backend));
  };
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch-chainermn's C++ backend";
  chainermn::installTerminateReport();  // a terminate in one of the backend's threads names the thread
  // Registers c10d::Backend, Store and Work with pybind11 so the classes below can refer to them.
  py::module::import("torch.distributed");

  py::class_<Topology>(m, "Topology")
      .def_readonly("rank", &Topology::rank)
      .def_readonly("size", &Topology::size)
      .def_readonly("intra_rank", &Topology::intraRank)
      .def_readonly("intra_size", &Topology::intraSize)
      .def_readonly("inter_rank", &Topology::interRank)
      .def_readonly("inter_size", &Topology::interSize)
      .def_readonly("node_of_rank", &Topology::nodeOfRank)
      .def_readonly("ranks_of_node", &Topology::ranksOfNode)
      .def("__repr__", [](const Topology& t) {
        return "Topology(rank=" + std::to_string(t.rank) + ", size=" + std::to_string(t.size) +
               ", intra_rank=" + std::to_string(t.intraRank) + ", intra_size=" + std::to_string(t.intraSize) +
               ", inter_rank=" + std::to_string(t.interRank) + ", inter_size=" + std::to_string(t.interSize) + ")";
      });

  // A group's transport plan (transport_plan.h), for options on a topology: what a group would carry
  // its ops on, in words.
  m.def(
      "plan_transports",
      [](const GroupOptions& options, const Topology& topology, const std::string& hostLibrary) {
        TORCH_CHECK_VALUE(hostLibrary == "mpi" || hostLibrary == "gloo",
                          "plan_transports: host_library must be 'mpi' or 'gloo', got '", hostLibrary, "'");
        const auto plan = chainermn::planTransports(options, topology, hostLibrary == "mpi" ? "mpi" : "gloo");
        auto carrier = [](chainermn::cuda::Carrier c) {
          return c == chainermn::cuda::Carrier::Nccl ? "nccl" : "staged";
        };
        const auto& cuda = plan.cuda;
        py::dict plain;
        plain["host_library"] = plan.hostLibrary;
        plain["shared_memory"] = plan.sharedMemory;
        plain["cuda_transport"] = cuda.name;
        plain["cuda_carriers"] =
            py::make_tuple(carrier(cuda.carriers.world), carrier(cuda.carriers.intra), carrier(cuda.carriers.inter));
        plain["cuda_launch_on_caller"] = cuda.allNccl;
        plain["cuda_launch_lock"] = cuda.someNccl;
        plain["cuda_bitwise"] = cuda.bitwise;
        return plain;
      },
      py::arg("options"), py::arg("topology"), py::arg("host_library"));
  m.def("topology_from_names", &chainermn::topologyFromNames, py::arg("names"), py::arg("rank"));
  m.def("stop_workers_at_exit", &chainermn::stopWorkersAtExit, py::call_guard<py::gil_scoped_release>());
  m.def(
      "discover_topology",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& nodeName) {
        return chainermn::discoverTopology(*store, rank, size, nodeName);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("node_name"),
      py::call_guard<py::gil_scoped_release>());
  m.attr("communicator_names") = chainermn::strategyNames();

  py::class_<GroupOptions>(m, "GroupOptions", "torch_chainermn.Options as the C++ backend holds it")
      .def(py::init<>())
      .def_readwrite("communicator", &GroupOptions::communicator)
      .def_readwrite("allreduce_grad_dtype", &GroupOptions::allreduceGradDtype)
      .def_readwrite("transport", &GroupOptions::transport)
      .def_readwrite("shared_memory", &GroupOptions::sharedMemory)
      .def_readwrite("cuda_transport", &GroupOptions::cudaTransport)
      .def_property(
          "checks", [](const GroupOptions& options) { return chainermn::checkLevelName(options.checks); },
          [](GroupOptions& options, const std::string& name) { options.checks = chainermn::checkLevelNamed(name); });

  py::class_<GroupSetup>(m, "GroupSetup", "who a group is, and the host library its ranks agreed on")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string name, Topology topology) {
             return GroupSetup{store, rank, size, timeout, std::move(name), std::move(topology), nullptr};
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("name"), py::arg("topology"))
      .def_readwrite("shm_chunk_bytes", &GroupSetup::shmChunkBytes, "the shared-memory collectives' chunk in bytes")
      .def_readwrite("global_ranks", &GroupSetup::globalRanks, "the group's members by global rank (flight recorder)")
      .def(
          "set_stragglers",
          [](GroupSetup& setup, int window, double marginMs, bool warn) {
            setup.stragglers = chainermn::StragglerSettings{window, marginMs, warn};
          },
          py::arg("window"), py::arg("margin_ms"), py::arg("warn"),
          "the stragglers' summary: its window in collectives, the mean lateness that names a rank, whether "
          "rank 0 logs a line when one is named")
      .def(
          "use_gloo",
          [](GroupSetup& setup, py::function make) {
            setup.makeHost = glooFactory(std::move(make));
            setup.hostLibrary = "gloo";
          },
          py::arg("make_gloo"), "between ranks, Gloo groups made by make_gloo(key, rank, size)")
#ifdef CHAINERMN_WITH_MPI
      .def(
          "use_mpi",
          [](GroupSetup& setup, std::vector<int64_t> worldRanks) {
            setup.makeHost = [worldRanks](const Level& level) {
              return chainermn::mpi::createTransport(worldRanks, level);
            };
            setup.hostLibrary = "mpi";
          },
          py::arg("world_ranks"), "between ranks, MPI over these MPI_COMM_WORLD ranks (group rank r is world_ranks[r])")
#endif
      ;

  py::class_<ProcessGroupChainerMN, c10d::Backend, c10::intrusive_ptr<ProcessGroupChainerMN>>(m,
                                                                                              "ProcessGroupChainerMN")
      .def(py::init([](const GroupSetup& setup, GroupOptions options) {
             TORCH_CHECK(setup.makeHost, "chainermn: GroupSetup needs use_gloo() or use_mpi() first");
             // The GIL is released for the construction only (it waits for the peers): pybind11
             // registers the new instance after the factory returns, and doing that without the GIL
             // corrupts its instance map when threads create groups at once (torchft's Manager does).
             py::gil_scoped_release release;
             return c10::make_intrusive<ProcessGroupChainerMN>(setup, std::move(options));
           }),
           py::arg("setup"), py::arg("options"))
      .def("topology", &ProcessGroupChainerMN::topology, py::return_value_policy::copy)
      .def_property_readonly("transport", &ProcessGroupChainerMN::transport)
      // What torch's split_group deep-copies and passes back (as ProcessGroupNCCL's options).
      .def_property_readonly("options", &ProcessGroupChainerMN::getBackendOptions)
      .def_property_readonly("group_options", &ProcessGroupChainerMN::options, py::return_value_policy::copy)
      .def_property_readonly("algorithm", &ProcessGroupChainerMN::algorithm)
      .def_property_readonly("shared_memory", &ProcessGroupChainerMN::sharedMemory)
      .def_property_readonly("cuda_transport", &ProcessGroupChainerMN::cudaTransport)
      .def("recv_message", &ProcessGroupChainerMN::recvMessage, py::arg("src"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("send_message", &ProcessGroupChainerMN::sendMessage, py::arg("parts"), py::arg("offsets"), py::arg("bytes"),
           py::arg("dst"), py::arg("tag"), py::call_guard<py::gil_scoped_release>())
      .def(
          "mean_coalesced",
          [](ProcessGroupChainerMN& pg, std::vector<at::Tensor> tensors, std::optional<at::ScalarType> wireDtype) {
            return pg.meanCoalesced(tensors, wireDtype);
          },
          py::arg("tensors"), py::arg("wire_dtype") = std::nullopt, py::call_guard<py::gil_scoped_release>())
      .def(
          "compressed_mean",
          [](ProcessGroupChainerMN& pg, std::vector<at::Tensor> tensors, std::optional<at::Tensor> residual,
             std::optional<at::Tensor> secondResidual, const chainermn::PyCompressionSpec& spec) {
            return pg.compressedMean(tensors, residual.value_or(at::Tensor()), secondResidual.value_or(at::Tensor()),
                                     spec.spec());
          },
          py::arg("tensors"), py::arg("residual"), py::arg("second_residual"),
          py::arg("spec"),  // a torch_chainermn.CompressionSpec (python/compression.cpp)
          py::call_guard<py::gil_scoped_release>())
      .def(
          "compression_residuals",
          [](const ProcessGroupChainerMN& pg, int64_t count, const chainermn::PyCompressionSpec& spec) {
            const chainermn::ResidualShape shape = pg.compressionResiduals(spec.spec(), count);
            return py::make_tuple(shape.first, shape.second, shape.secondOffset, shape.secondCount);
          },
          py::arg("count"), py::arg("spec"),
          "(first, second, second_offset, second_count): the residuals this rank keeps for `count` values")
      .def("scratch_bytes", &ProcessGroupChainerMN::scratchBytes)
      .def("ops_run_on_caller", &ProcessGroupChainerMN::opsRunOnCaller,
           "how many ops ran on their caller's thread instead of the group's worker (blocking collectives over "
           "shared memory, messages written straight into the ring)")
      .def("checks_carried", &ProcessGroupChainerMN::checksCarried,
           "how many collectives' cross-rank checks rode in the op's own first exchange (a small collective "
           "over shared memory: one barrier, check included) instead of an exchange of their own")
      .def(
          "counters",
          [](ProcessGroupChainerMN& pg) {
            py::list rows;
            for (const auto& row : pg.counters().rows()) {
              rows.append(py::make_tuple(row.phase, row.what, row.calls, row.nanoseconds, row.out, row.in));
            }
            return py::make_tuple(pg.counters().ops(), rows);
          },
          "(ops, [(phase, transport or code, calls, nanoseconds, bytes out, bytes in)]): see "
          "torch_chainermn.counters()")
      .def("reset_counters", [](ProcessGroupChainerMN& pg) { pg.counters().reset(); })
      .def(
          "stragglers",
          [](ProcessGroupChainerMN& pg) {
            const auto summary = pg.stragglers().summary();
            py::list ranks;
            for (size_t r = 0; r < summary.ranks.size(); ++r) {
              const auto& rank = summary.ranks[r];
              ranks.append(py::make_tuple(summary.nodeOfRank[r], rank.last, rank.meanMs, rank.maxMs));
            }
            return py::make_tuple(summary.settings.window, summary.settings.marginMs, summary.settings.warn,
                                  summary.observed, summary.inWindow, summary.named, ranks);
          },
          "(window, margin_ms, warn, observed, in_window, named, [(node, last, mean_ms, max_ms) per rank]): see "
          "torch_chainermn.stragglers()")
      .def("reset_stragglers", [](ProcessGroupChainerMN& pg) { pg.stragglers().reset(); })
      .def("broken_reason", &ProcessGroupChainerMN::brokenReason,
           "why the group is unusable (a timeout, a dead or aborting peer, abort()), or \"\" while it is not")
      .def(
          "_set_splitter",
          [](ProcessGroupChainerMN& pg, py::function split) {
            auto held = heldWithGil(std::move(split));
            pg.setSplitter([held](const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::vector<int>& ranks,
                                  std::chrono::milliseconds timeout, const std::string& name,
                                  const GroupOptions& options) {
              py::gil_scoped_acquire gil;
              return (*held)(store, rank, ranks, timeout, name, options).cast<c10::intrusive_ptr<c10d::Backend>>();
            });
          },
          py::arg("split"),
          "split(store, rank, ranks, timeout, name, options) -> the child group's backend: what split_group calls");

  // What the group's Backend.options returns: torch's split_group deep-copies it and hands it back.
  py::class_<chainermn::BackendOptions, c10d::Backend::Options, c10::intrusive_ptr<chainermn::BackendOptions>>(
      m, "BackendOptions")
      .def_readonly("group_options", &chainermn::BackendOptions::group)
      .def("__copy__",
           [](const chainermn::BackendOptions& o) { return c10::make_intrusive<chainermn::BackendOptions>(o); })
      .def("__deepcopy__", [](const chainermn::BackendOptions& o, py::dict) {
        return c10::make_intrusive<chainermn::BackendOptions>(o);
      });

  // _C.testing in a test build: csrc/testing/bindings.cpp registers it when the build links it in.
  chainermn::bindRegisteredSubmodules(m);

  m.attr("cuda_built") = chainermn::cudaBuilt();
  m.attr("cuda_transports") = chainermn::cudaTransportNames();
  m.def("nccl_version", &chainermn::ncclVersion);

#ifdef CHAINERMN_WITH_MPI
  m.attr("mpi_built") = true;
  m.def("mpi_initialize", &chainermn::mpi::initialize, py::call_guard<py::gil_scoped_release>());
  m.def("mpi_thread_multiple", &chainermn::mpi::threadMultiple);
  m.def("mpi_world_rank", &chainermn::mpi::worldRank);
  m.def("mpi_world_size", &chainermn::mpi::worldSize);
  m.def("mpi_broadcast_string", &chainermn::mpi::broadcastString, py::arg("text"), py::arg("root") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("mpi_finalize", &chainermn::mpi::finalize, py::call_guard<py::gil_scoped_release>());
  m.def("mpi_abort", &chainermn::mpi::abortJob, py::arg("code") = 1, py::call_guard<py::gil_scoped_release>());
#else
  m.attr("mpi_built") = false;
#endif
}
