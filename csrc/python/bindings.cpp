// torch_chainermn._C: the backend class for torch.distributed, its transports' factories, and the
// MPI runtime helpers the launcher needs.
#include "backend/process_group.h"
#include "backend/worker.h"
#include "comm/gloo.h"
#include "python/testing.h"
#include "strategies/strategy.h"
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

using chainermn::TransportSet;
using chainermn::GroupOptions;

GroupOptions groupOptions(
    std::string communicator,
    std::string allreduceGradDtype,
    bool sharedMemory,
    std::string cudaTransport) {
  return GroupOptions{std::move(communicator), std::move(allreduceGradDtype), sharedMemory, std::move(cudaTransport)};
}

c10::intrusive_ptr<ProcessGroupChainerMN> withGloo(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    std::string groupName,
    Topology topology,
    c10::intrusive_ptr<c10d::Backend> world,
    c10::intrusive_ptr<c10d::Backend> intra,
    c10::intrusive_ptr<c10d::Backend> inter,
    std::string communicator,
    std::string allreduceGradDtype,
    bool sharedMemory,
    std::string cudaTransport) {
  // One Gloo group serves every level it spans (the world is also the intra level on one node).
  TransportSet transports;
  transports.world = chainermn::gloo::createTransport(world);
  transports.intra = intra == world ? transports.world : chainermn::gloo::createTransport(intra);
  transports.inter = inter == world ? transports.world : chainermn::gloo::createTransport(inter);
  return c10::make_intrusive<ProcessGroupChainerMN>(
      store, rank, size, timeout, std::move(groupName), std::move(topology), std::move(transports),
      groupOptions(std::move(communicator), std::move(allreduceGradDtype), sharedMemory, std::move(cudaTransport)));
}

#ifdef CHAINERMN_WITH_MPI
c10::intrusive_ptr<ProcessGroupChainerMN> withMpi(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    std::string groupName,
    Topology topology,
    const std::vector<int64_t>& worldRanks,
    std::string communicator,
    std::string allreduceGradDtype,
    bool sharedMemory,
    std::string cudaTransport) {
  auto transports = chainermn::makeTransportSet(topology, [&](const chainermn::Level& level) {
    return chainermn::mpi::createTransport(worldRanks, level);
  });
  return c10::make_intrusive<ProcessGroupChainerMN>(
      store, rank, size, timeout, std::move(groupName), std::move(topology), std::move(transports),
      groupOptions(std::move(communicator), std::move(allreduceGradDtype), sharedMemory, std::move(cudaTransport)));
}
#endif

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch-chainermn's C++ backend";
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

  m.def("topology_from_names", &chainermn::topologyFromNames, py::arg("names"), py::arg("rank"));
  m.def("local_node_name", &chainermn::localNodeName, py::arg("global_rank"));
  m.def("stop_workers_at_exit", &chainermn::stopWorkersAtExit, py::call_guard<py::gil_scoped_release>());
  m.def(
      "discover_topology",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int globalRank) {
        return chainermn::discoverTopology(*store, rank, size, globalRank);
      },
      py::arg("store"),
      py::arg("rank"),
      py::arg("size"),
      py::arg("global_rank"),
      py::call_guard<py::gil_scoped_release>());
  m.attr("communicator_names") = chainermn::strategyNames();

  py::class_<ProcessGroupChainerMN, c10d::Backend, c10::intrusive_ptr<ProcessGroupChainerMN>>(
      m, "ProcessGroupChainerMN")
      .def_static(
          "with_gloo",
          &withGloo,
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("group_name"),
          py::arg("topology"),
          py::arg("world"),
          py::arg("intra"),
          py::arg("inter"),
          py::arg("communicator"),
          py::arg("allreduce_grad_dtype"),
          py::arg("shared_memory"),
          py::arg("cuda_transport") = "nccl",
          py::call_guard<py::gil_scoped_release>())
#ifdef CHAINERMN_WITH_MPI
      .def_static(
          "with_mpi",
          &withMpi,
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"),
          py::arg("group_name"),
          py::arg("topology"),
          py::arg("world_ranks"),
          py::arg("communicator"),
          py::arg("allreduce_grad_dtype"),
          py::arg("shared_memory"),
          py::arg("cuda_transport") = "nccl",
          py::call_guard<py::gil_scoped_release>())
#endif
      .def("topology", &ProcessGroupChainerMN::topology, py::return_value_policy::copy)
      .def_property_readonly("transport", &ProcessGroupChainerMN::transport)
      .def_property_readonly("communicator", [](const ProcessGroupChainerMN& pg) { return pg.options().communicator; })
      .def_property_readonly(
          "allreduce_grad_dtype", [](const ProcessGroupChainerMN& pg) { return pg.options().allreduceGradDtype; })
      .def_property_readonly("algorithm", &ProcessGroupChainerMN::algorithm)
      .def_property_readonly("shared_memory", &ProcessGroupChainerMN::sharedMemory)
      .def_property_readonly("cuda_transport", &ProcessGroupChainerMN::cudaTransport)
      .def(
          "mean_coalesced",
          [](ProcessGroupChainerMN& pg, std::vector<at::Tensor> tensors, std::optional<at::ScalarType> wireDtype) {
            return pg.meanCoalesced(tensors, wireDtype);
          },
          py::arg("tensors"),
          py::arg("wire_dtype") = std::nullopt,
          py::call_guard<py::gil_scoped_release>())
      .def("scratch_bytes", &ProcessGroupChainerMN::scratchBytes);

  auto testing = m.def_submodule("testing", "in-process harnesses for the C++ layers (tests only)");
  chainermn::bindTesting(testing);

  m.attr("cuda_built") = chainermn::cudaBuilt();
  m.attr("cuda_transports") = chainermn::cudaTransports();
  m.def("nccl_version", &chainermn::ncclVersion);

#ifdef CHAINERMN_WITH_MPI
  m.attr("mpi_built") = true;
  m.def("mpi_launched", &chainermn::mpi::launchedByMpiexec);
  m.def("mpi_initialize", &chainermn::mpi::initialize, py::call_guard<py::gil_scoped_release>());
  m.def("mpi_thread_multiple", &chainermn::mpi::threadMultiple);
  m.def("mpi_world_rank", &chainermn::mpi::worldRank);
  m.def("mpi_world_size", &chainermn::mpi::worldSize);
  m.def(
      "mpi_broadcast_string",
      &chainermn::mpi::broadcastString,
      py::arg("text"),
      py::arg("root") = 0,
      py::call_guard<py::gil_scoped_release>());
  m.def("mpi_finalize", &chainermn::mpi::finalize, py::call_guard<py::gil_scoped_release>());
  m.def("mpi_abort", &chainermn::mpi::abortJob, py::arg("code") = 1, py::call_guard<py::gil_scoped_release>());
#else
  m.attr("mpi_built") = false;
#endif
}
