#include "comm/mpi_runtime.h"

#include <c10/util/Exception.h>
#include <mpi.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace chainermn::mpi {
namespace {

bool gInitializedHere = false;
int gThreadLevel = MPI_THREAD_SINGLE;
std::atomic<bool> gAbandoned{false};
std::atomic<int> gCallsInProgress{0};

std::string errorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

}  // namespace

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) {
    C10_THROW_ERROR(DistBackendError, std::string("MPI ") + call + " failed: " + errorString(code));
  }
}

CallInProgress::CallInProgress() {
  gCallsInProgress.fetch_add(1);
}

CallInProgress::~CallInProgress() {
  gCallsInProgress.fetch_sub(1);
}

bool quiescent() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return !finalized && !gAbandoned.load() && gCallsInProgress.load() == 0;
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
  if (gInitializedHere && quiescent()) {
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

}  // namespace chainermn::mpi
