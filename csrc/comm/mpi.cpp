#include "comm/mpi.h"

#include "comm/mpi_runtime.h"
#include "comm/mpi_types.h"
#include "phase.h"

#include <c10/util/Exception.h>
#include <mpi.h>

#include <climits>
#include <string>

namespace chainermn::mpi {
namespace {

int checkedCount(int64_t count, const char* op) {
  TORCH_CHECK(count <= INT_MAX, "chainermn ", op, ": ", count, " elements exceed MPI's int count limit (", INT_MAX,
              ")");
  return static_cast<int>(count);
}

// ---- requests

class MpiRequest : public Request {
 public:
  ~MpiRequest() override {
    // A request dropped before it completed (it timed out, or the group was shut down) may still be
    // written to by MPI; finalising MPI under it could block the exit.
    if (!done_) {
      noteAbandonedRequest();
    }
  }

  MPI_Request* handle() {
    return &request_;
  }

  bool test() override {
    if (!done_) {
      int flag = 0;
      MPI_Status status;
      check(MPI_Test(&request_, &flag, &status), "Test");
      if (flag) {
        done_ = true;
        source_ = status.MPI_SOURCE;
      }
    }
    return done_;
  }

  int source() const override {
    return source_;
  }

 private:
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
  int source_ = -1;
};

// ---- the adapter

class MpiTransport : public Transport {
 public:
  explicit MpiTransport(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "Comm_size");
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
  }

  ~MpiTransport() override {
    if (quiescent()) {
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  const char* library() const override {
    return "mpi";
  }

  void allreduce(void* buf, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi", moved::allreduce(size(), count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    check(MPI_Allreduce(MPI_IN_PLACE, buf, checkedCount(count, "all_reduce"), mpiType(dtype), mpiOp(op, dtype), comm_),
          "Allreduce");
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi",
                    moved::fromRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    check(MPI_Bcast(buf, checkedCount(count, "broadcast"), mpiType(dtype), root, comm_), "Bcast");
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi",
                    moved::toRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    const void* source = (rank_ == root && send == recv) ? MPI_IN_PLACE : send;
    check(MPI_Reduce(source, recv, checkedCount(count, "reduce"), mpiType(dtype), mpiOp(op, dtype), root, comm_),
          "Reduce");
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi", moved::allgather(size(), count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    const int n = checkedCount(count, "all_gather");
    check(MPI_Allgather(send, n, mpiType(dtype), recv, n, mpiType(dtype), comm_), "Allgather");
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi",
                    moved::toRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    const int n = checkedCount(count, "gather");
    check(MPI_Gather(send, n, mpiType(dtype), recv, n, mpiType(dtype), root, comm_), "Gather");
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi",
                    moved::fromRoot(size(), rank() == root, count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    const int n = checkedCount(count, "scatter");
    check(MPI_Scatter(send, n, mpiType(dtype), recv, n, mpiType(dtype), root, comm_), "Scatter");
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi", moved::reduceScatter(size(), count * c10::elementSize(dtype)));
    CallInProgress inProgress;
    check(MPI_Reduce_scatter_block(send, recv, checkedCount(count, "reduce_scatter"), mpiType(dtype), mpiOp(op, dtype),
                                   comm_),
          "Reduce_scatter_block");
  }

  void alltoallv(const void* send, const std::vector<int64_t>& sendCounts, void* recv,
                 const std::vector<int64_t>& recvCounts, c10::ScalarType dtype) override {
    PhaseSpan phase(
        levelPhase(withinNode()), "mpi",
        moved::allToAll(bytesOf(sendCounts, dtype), bytesOf(recvCounts, dtype),
                        sendCounts[rank()] * c10::elementSize(dtype), recvCounts[rank()] * c10::elementSize(dtype)));
    CallInProgress inProgress;
    // Only the worker thread calls a transport, so these count arrays can be reused.
    toDisplacements(sendCounts, sendCounts_, sendDispls_);
    toDisplacements(recvCounts, recvCounts_, recvDispls_);
    check(MPI_Alltoallv(send, sendCounts_.data(), sendDispls_.data(), mpiType(dtype), recv, recvCounts_.data(),
                        recvDispls_.data(), mpiType(dtype), comm_),
          "Alltoallv");
  }

  RequestPtr send(const void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    auto request = std::make_unique<MpiRequest>();
    check(MPI_Isend(buf, checkedCount(count, "send"), mpiType(dtype), peer, tag, comm_, request->handle()), "Isend");
    return request;
  }

  RequestPtr recv(void* buf, int64_t count, c10::ScalarType dtype, int peer, int tag) override {
    auto request = std::make_unique<MpiRequest>();
    const int source = peer == kAnySource ? MPI_ANY_SOURCE : peer;
    check(MPI_Irecv(buf, checkedCount(count, "recv"), mpiType(dtype), source, tag, comm_, request->handle()), "Irecv");
    return request;
  }

  void barrier() override {
    PhaseSpan phase(levelPhase(withinNode()), "mpi", Moved{});
    CallInProgress inProgress;
    check(MPI_Barrier(comm_), "Barrier");
  }

 private:
  static void toDisplacements(const std::vector<int64_t>& counts, std::vector<int>& out, std::vector<int>& displs) {
    out.resize(counts.size());
    displs.resize(counts.size());
    int64_t offset = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      out[i] = checkedCount(counts[i], "all_to_all");
      displs[i] = checkedCount(offset, "all_to_all");
      offset += counts[i];
    }
  }

  MPI_Comm comm_;
  std::vector<int> sendCounts_, sendDispls_, recvCounts_, recvDispls_;
  int rank_ = 0;
  int size_ = 0;
};

// The tag of a level's MPI_Comm_create_group: the same on every rank of the level (it depends on
// the level's key and members only), and different, but for a rare hash collision, for every other
// level. The standard asks only that concurrent creations within one process differ, and creations
// here are sequential; but creations do overlap across processes: the nodes create their disjoint
// intra levels at the same time, and a rank that is done with its node starts the inter level while
// its inter peer still creates its own node's. Distinct tags keep each creation's messages apart
// even in an MPI that matched them by tag alone. FNV-1a, not std::hash: the same in every build.
int creationTag(const Level& level, const std::vector<int>& members) {
  uint32_t hash = 2166136261u;
  auto mix = [&hash](uint32_t byte) { hash = (hash ^ byte) * 16777619u; };
  for (const char c : level.key) {
    mix(static_cast<unsigned char>(c));
  }
  for (const int rank : members) {
    for (int shift = 0; shift < 32; shift += 8) {
      mix((static_cast<uint32_t>(rank) >> shift) & 0xff);
    }
  }
  return static_cast<int>(hash % 32768);  // MPI guarantees tags up to at least 32767
}

}  // namespace

TransportPtr createTransport(const std::vector<int64_t>& worldRanks, const Level& level) {
  initialize();
  TORCH_CHECK(threadMultiple(), "chainermn: the MPI transport needs MPI_THREAD_MULTIPLE");
  createTypes();
  std::vector<int> members;
  members.reserve(level.ranks.size());
  for (const int rank : level.ranks) {
    TORCH_CHECK(rank >= 0 && rank < static_cast<int>(worldRanks.size()), "chainermn: level ", level.key,
                " names group rank ", rank, " of a group of ", worldRanks.size());
    members.push_back(static_cast<int>(worldRanks[rank]));
  }
  MPI_Group world;
  check(MPI_Comm_group(MPI_COMM_WORLD, &world), "Comm_group");
  MPI_Group group;
  const int included = MPI_Group_incl(world, static_cast<int>(members.size()), members.data(), &group);
  MPI_Group_free(&world);
  check(included, "Group_incl");
  MPI_Comm comm;
  // Collective over the level's members only, as torch creates a backend on a group's members only.
  const int created = MPI_Comm_create_group(MPI_COMM_WORLD, group, creationTag(level, members), &comm);
  MPI_Group_free(&group);
  check(created, "Comm_create_group");
  auto transport = std::make_shared<MpiTransport>(comm);
  TORCH_CHECK(transport->rank() == level.index, "chainermn: rank ", transport->rank(),
              " in the MPI communicator of level ", level.key, ", position ", level.index, " in the level");
  return transport;
}

}  // namespace chainermn::mpi
