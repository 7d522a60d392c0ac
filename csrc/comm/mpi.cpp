#include "comm/mpi.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace chainermn::mpi {
namespace {

bool gInitializedHere = false;
std::atomic<bool> gAbandoned{false};
// Blocking calls in progress on any thread. One that never returns (a peer never joined, and the
// watchdog failed the op) makes MPI_Finalize unsafe: it would wait for that call forever.
std::atomic<int> gCallsInProgress{0};

struct CallInProgress {
  CallInProgress() {
    gCallsInProgress.fetch_add(1);
  }
  ~CallInProgress() {
    gCallsInProgress.fetch_sub(1);
  }
};
int gThreadLevel = MPI_THREAD_SINGLE;

std::string errorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

// Turns an MPI error code into an exception that names the call.
void check(int code, const char* call) {
  if (code != MPI_SUCCESS) {
    C10_THROW_ERROR(DistBackendError, std::string("MPI ") + call + " failed: " + errorString(code));
  }
}

int checkedCount(int64_t count, const char* op) {
  TORCH_CHECK(
      count <= INT_MAX,
      "chainermn ",
      op,
      ": ",
      count,
      " elements exceed MPI's int count limit (",
      INT_MAX,
      ")");
  return static_cast<int>(count);
}

// ---- float16 / bfloat16: MPI has no such types, so they travel as 2-byte types with our own ops.

MPI_Datatype gHalfType = MPI_DATATYPE_NULL;
MPI_Datatype gBFloat16Type = MPI_DATATYPE_NULL;

template <typename T, typename Combine>
void combineInto(void* in, void* inout, int* len, Combine combine) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = static_cast<T>(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename T>
struct HalfOps {
  static void sum(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return a + b; });
  }
  static void product(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return a * b; });
  }
  static void min(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return std::min(a, b); });
  }
  static void max(void* in, void* inout, int* len, MPI_Datatype*) {
    combineInto<T>(in, inout, len, [](float a, float b) { return std::max(a, b); });
  }
};

// [dtype 0 = Half, 1 = BFloat16][Sum, Product, Min, Max]
MPI_Op gHalfOps[2][4];

void createHalfTypesAndOps() {
  check(MPI_Type_contiguous(2, MPI_BYTE, &gHalfType), "Type_contiguous");
  check(MPI_Type_commit(&gHalfType), "Type_commit");
  check(MPI_Type_contiguous(2, MPI_BYTE, &gBFloat16Type), "Type_contiguous");
  check(MPI_Type_commit(&gBFloat16Type), "Type_commit");
  MPI_User_function* half[4] = {
      HalfOps<c10::Half>::sum, HalfOps<c10::Half>::product, HalfOps<c10::Half>::min, HalfOps<c10::Half>::max};
  MPI_User_function* bf16[4] = {
      HalfOps<c10::BFloat16>::sum,
      HalfOps<c10::BFloat16>::product,
      HalfOps<c10::BFloat16>::min,
      HalfOps<c10::BFloat16>::max};
  for (int i = 0; i < 4; ++i) {
    check(MPI_Op_create(half[i], /*commute=*/1, &gHalfOps[0][i]), "Op_create");
    check(MPI_Op_create(bf16[i], /*commute=*/1, &gHalfOps[1][i]), "Op_create");
  }
}

// Types without an MPI counterpart (complex, float8, ...) only move, never reduce: carry them as
// contiguous runs of bytes of their element size.
MPI_Datatype opaqueType(size_t elementSize) {
  static std::mutex mutex;
  static std::unordered_map<size_t, MPI_Datatype> types;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = types.find(elementSize);
  if (it != types.end()) {
    return it->second;
  }
  MPI_Datatype type;
  check(MPI_Type_contiguous(static_cast<int>(elementSize), MPI_BYTE, &type), "Type_contiguous");
  check(MPI_Type_commit(&type), "Type_commit");
  types.emplace(elementSize, type);
  return type;
}

MPI_Datatype mpiType(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Half:
      return gHalfType;
    case c10::ScalarType::BFloat16:
      return gBFloat16Type;
    case c10::ScalarType::Char:
      return MPI_INT8_T;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool:
      return MPI_UINT8_T;
    case c10::ScalarType::Short:
      return MPI_INT16_T;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    default:
      return opaqueType(c10::elementSize(dtype));
  }
}

MPI_Op mpiOp(ReduceKind op, c10::ScalarType dtype) {
  const bool half = dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16;
  if (half) {
    const int which = dtype == c10::ScalarType::Half ? 0 : 1;
    switch (op) {
      case ReduceKind::Sum:
        return gHalfOps[which][0];
      case ReduceKind::Product:
        return gHalfOps[which][1];
      case ReduceKind::Min:
        return gHalfOps[which][2];
      case ReduceKind::Max:
        return gHalfOps[which][3];
      default:
        TORCH_CHECK(false, "chainermn: ", reduceKindName(op), " is not defined for ", dtype);
    }
  }
  switch (op) {
    case ReduceKind::Sum:
      return MPI_SUM;
    case ReduceKind::Product:
      return MPI_PROD;
    case ReduceKind::Min:
      return MPI_MIN;
    case ReduceKind::Max:
      return MPI_MAX;
    case ReduceKind::BitAnd:
      return MPI_BAND;
    case ReduceKind::BitOr:
      return MPI_BOR;
    case ReduceKind::BitXor:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
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
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !gAbandoned.load() && gCallsInProgress.load() == 0) {
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
    CallInProgress inProgress;
    check(
        MPI_Allreduce(MPI_IN_PLACE, buf, checkedCount(count, "all_reduce"), mpiType(dtype), mpiOp(op, dtype), comm_),
        "Allreduce");
  }

  void broadcast(void* buf, int64_t count, c10::ScalarType dtype, int root) override {
    CallInProgress inProgress;
    check(MPI_Bcast(buf, checkedCount(count, "broadcast"), mpiType(dtype), root, comm_), "Bcast");
  }

  void reduce(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op, int root)
      override {
    CallInProgress inProgress;
    const void* source = (rank_ == root && send == recv) ? MPI_IN_PLACE : send;
    check(
        MPI_Reduce(source, recv, checkedCount(count, "reduce"), mpiType(dtype), mpiOp(op, dtype), root, comm_),
        "Reduce");
  }

  void allgather(const void* send, void* recv, int64_t count, c10::ScalarType dtype) override {
    CallInProgress inProgress;
    const int n = checkedCount(count, "all_gather");
    check(MPI_Allgather(send, n, mpiType(dtype), recv, n, mpiType(dtype), comm_), "Allgather");
  }

  void gather(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    CallInProgress inProgress;
    const int n = checkedCount(count, "gather");
    check(MPI_Gather(send, n, mpiType(dtype), recv, n, mpiType(dtype), root, comm_), "Gather");
  }

  void scatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, int root) override {
    CallInProgress inProgress;
    const int n = checkedCount(count, "scatter");
    check(MPI_Scatter(send, n, mpiType(dtype), recv, n, mpiType(dtype), root, comm_), "Scatter");
  }

  void reduceScatter(const void* send, void* recv, int64_t count, c10::ScalarType dtype, ReduceKind op) override {
    CallInProgress inProgress;
    check(
        MPI_Reduce_scatter_block(
            send, recv, checkedCount(count, "reduce_scatter"), mpiType(dtype), mpiOp(op, dtype), comm_),
        "Reduce_scatter_block");
  }

  void alltoallv(
      const void* send,
      const std::vector<int64_t>& sendCounts,
      void* recv,
      const std::vector<int64_t>& recvCounts,
      c10::ScalarType dtype) override {
    CallInProgress inProgress;
    // Only the worker thread calls a transport, so these count arrays can be reused.
    toDisplacements(sendCounts, sendCounts_, sendDispls_);
    toDisplacements(recvCounts, recvCounts_, recvDispls_);
    check(
        MPI_Alltoallv(
            send,
            sendCounts_.data(),
            sendDispls_.data(),
            mpiType(dtype),
            recv,
            recvCounts_.data(),
            recvDispls_.data(),
            mpiType(dtype),
            comm_),
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

} // namespace

bool launchedByMpiexec() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"}) {
    if (std::getenv(name) != nullptr) {
      return true;
    }
  }
  return false;
}

void initialize() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    check(MPI_Initialized(&initialized), "Initialized");
    if (initialized) {
      check(MPI_Query_thread(&gThreadLevel), "Query_thread");
    } else {
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &gThreadLevel), "Init_thread");
      gInitializedHere = true;
    }
    createHalfTypesAndOps();
  });
}

bool threadMultiple() {
  return gThreadLevel >= MPI_THREAD_MULTIPLE;
}

int worldRank() {
  int rank = 0;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "Comm_rank");
  return rank;
}

int worldSize() {
  int size = 0;
  check(MPI_Comm_size(MPI_COMM_WORLD, &size), "Comm_size");
  return size;
}

std::string broadcastString(const std::string& text, int root) {
  int length = static_cast<int>(text.size());
  check(MPI_Bcast(&length, 1, MPI_INT, root, MPI_COMM_WORLD), "Bcast");
  std::string result = text;
  result.resize(length);
  check(MPI_Bcast(result.data(), length, MPI_CHAR, root, MPI_COMM_WORLD), "Bcast");
  return result;
}

void finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (gInitializedHere && !finalized && !gAbandoned.load() && gCallsInProgress.load() == 0) {
    MPI_Finalize();
  }
}

void abortJob(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  std::_Exit(code);
}

void noteAbandonedRequest() {
  gAbandoned.store(true);
}

TransportSet createTransports(const std::vector<int64_t>& worldRanks, const Topology& topology) {
  initialize();
  TORCH_CHECK(threadMultiple(), "chainermn: the MPI transport needs MPI_THREAD_MULTIPLE");
  MPI_Group world;
  check(MPI_Comm_group(MPI_COMM_WORLD, &world), "Comm_group");
  std::vector<int> ranks(worldRanks.begin(), worldRanks.end());
  MPI_Group group;
  check(MPI_Group_incl(world, static_cast<int>(ranks.size()), ranks.data(), &group), "Group_incl");
  MPI_Comm groupComm;
  // Collective over the group's members only, as torch creates a backend on members only.
  check(MPI_Comm_create_group(MPI_COMM_WORLD, group, /*tag=*/0, &groupComm), "Comm_create_group");
  MPI_Group_free(&group);
  MPI_Group_free(&world);

  TransportSet transports;
  transports.world = std::make_shared<MpiTransport>(groupComm);
  // Every rank takes the same branches: they depend on the whole group's topology only.
  const bool oneRankPerNode = topology.interSize == topology.size;
  auto split = [&](int color) {
    MPI_Comm part;
    check(MPI_Comm_split(groupComm, color, topology.rank, &part), "Comm_split");
    return std::make_shared<MpiTransport>(part);
  };
  transports.intra = topology.interSize == 1 ? transports.world : split(topology.interRank);
  transports.inter = oneRankPerNode ? transports.world : split(topology.intraRank);
  return transports;
}

} // namespace chainermn::mpi
