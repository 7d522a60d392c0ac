#include "comm/waiter_pool.h"

#include "os/thread_name.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace chainermn {

struct WaiterPool::Shared {
  std::mutex mutex;
  std::condition_variable wakeUp;
  std::deque<std::function<void()>> jobs;  // queued, each promised to a thread that is idle now
  int idle = 0;                            // threads waiting for a job
  int started = 0;
  bool stopping = false;
};

namespace {

void serve(const std::shared_ptr<WaiterPool::Shared>& shared) {
  std::unique_lock<std::mutex> lock(shared->mutex);
  while (true) {
    ++shared->idle;
    shared->wakeUp.wait(lock, [&] { return shared->stopping || !shared->jobs.empty(); });
    --shared->idle;
    if (shared->jobs.empty()) {
      return;  // stopping, nothing left to run
    }
    std::function<void()> job = std::move(shared->jobs.front());
    shared->jobs.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // what the job holds is released before this thread waits again
    lock.lock();
  }
}

}  // namespace

WaiterPool::WaiterPool() : shared_(std::make_shared<Shared>()) {}

WaiterPool::~WaiterPool() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->stopping = true;
  shared_->wakeUp.notify_all();
}

void WaiterPool::run(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  // Idle threads not yet promised a queued job: one of them takes this job, else a new thread does.
  const bool idleFree = shared_->idle > static_cast<int>(shared_->jobs.size());
  shared_->jobs.push_back(std::move(job));
  if (idleFree) {
    shared_->wakeUp.notify_one();
    return;
  }
  ++shared_->started;
  // Detached: it holds the shared state, and ends on its own once the pool is stopping.
  std::thread([shared = shared_] {
    nameThisThread("cmn-gloo-wait");
    serve(shared);
  }).detach();
}

int WaiterPool::threadsStarted() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->started;
}

int WaiterPool::threadsIdle() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->idle;
}

}  // namespace chainermn
