#include "runtime/store_courier.h"

#include "os/thread_name.h"

#include <condition_variable>
#include <mutex>
#include <thread>

namespace chainermn {

// What the caller and the courier's thread share; the thread holds it too, so a courier destroyed
// while a call overran leaves the thread something valid to finish with.
struct StoreCourier::Shared {
  std::mutex mutex;
  std::condition_variable changed;
  std::function<void()> call;  // the call waiting for the thread, if any
  std::shared_ptr<bool> ok;    // where it says how it returned (its caller's, which may wake late)
  uint64_t posted = 0;         // calls handed over
  uint64_t finished = 0;       // calls returned
  bool overran = false;        // the call out now made its caller give up
  bool stopping = false;
  bool started = false;
};

StoreCourier::StoreCourier(std::chrono::milliseconds patience)
    : shared_(std::make_shared<Shared>()), patience_(patience) {}

StoreCourier::~StoreCourier() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->stopping = true;
  shared_->changed.notify_all();
}

bool StoreCourier::stuck() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->overran;
}

bool StoreCourier::run(std::function<void()> call) {
  const auto deadline = std::chrono::steady_clock::now() + patience_;
  std::unique_lock<std::mutex> lock(shared_->mutex);
  // Another thread's call is out (the watchdog's and the worker's failure paths meet here): wait for
  // it within this call's patience, unless it already overran (the store does not answer).
  while (shared_->finished != shared_->posted) {
    if (shared_->overran || (shared_->changed.wait_until(lock, deadline) == std::cv_status::timeout &&
                             shared_->finished != shared_->posted)) {
      return false;
    }
  }
  if (!shared_->started) {
    // Started on first use: only failure paths and long waits need it, and groups can be many.
    shared_->started = true;
    std::thread([shared = shared_] {
      nameThisThread("cmn-store");
      serve(shared);
    }).detach();
  }
  auto ok = std::make_shared<bool>(false);
  shared_->call = std::move(call);
  shared_->ok = ok;
  const uint64_t mine = ++shared_->posted;
  shared_->changed.notify_all();
  // >=, not ==: another caller may post and finish its call before this one wakes.
  if (!shared_->changed.wait_until(lock, deadline, [&] { return shared_->finished >= mine; })) {
    shared_->overran = true;
    return false;
  }
  return *ok;
}

void StoreCourier::serve(const std::shared_ptr<Shared>& shared) {
  std::unique_lock<std::mutex> lock(shared->mutex);
  while (true) {
    shared->changed.wait(lock, [&] { return shared->stopping || shared->call; });
    if (!shared->call) {
      return;  // stopping, nothing left
    }
    auto call = std::move(shared->call);
    auto callOk = std::move(shared->ok);
    shared->call = nullptr;
    lock.unlock();
    bool ok = true;
    try {
      call();
    } catch (...) {
      ok = false;  // the store refused or lost its connection: the caller says what is known without it
    }
    call = nullptr;  // what it owns goes before the next call is taken
    lock.lock();
    *callOk = ok;
    shared->overran = false;
    ++shared->finished;
    shared->changed.notify_all();
  }
}

}  // namespace chainermn
