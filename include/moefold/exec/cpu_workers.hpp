//! @file cpu_workers.hpp
//! @brief The CPU executor's threads, kept for reuse: `cpu_workers::run(n, task)` runs task(i) for
//! every i in [0, n), each on its own OS thread, and returns when all have returned. A launch of
//! the CPU executor needs one thread per running block (its threads are fibers), or with
//! MOEFOLD_CPU_EXEC_THREADS=1 2 x block_threads threads at once (every CUDA thread its own
//! thread, exec/cpu_launch.hpp); creating them anew for each launch cost more than the launch
//! itself (under ThreadSanitizer 0.85 s per 512 threads on 2 cores), so the workers of one run
//! wait on their own condition variable for the next.
//!
//! Each calling host thread has its own set (`local_workers()`, a thread_local), destroyed (its
//! threads joined) when that host thread ends: ranks of a thread world launching at once never
//! share or wait for each other's workers. Nothing in it affects a result: every task of a run is
//! on a distinct thread, as with fresh threads, and ThreadSanitizer sees a happens-before edge from
//! the run's start to each task and from each task to the run's end (the mutexes below), so the
//! races it reports are those inside one launch.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moefold {
inline namespace v0_1 {
namespace detail {

class cpu_workers {
 public:
  cpu_workers() = default;
  cpu_workers(const cpu_workers&) = delete;
  cpu_workers& operator=(const cpu_workers&) = delete;
  ~cpu_workers() {
    for (auto& w : workers_) {
      {
        std::lock_guard<std::mutex> lk(w->m);
        w->stop = true;
      }
      w->cv.notify_one();
    }
    for (auto& w : workers_) w->th.join();
  }

  //! Runs fn(ctx, i) for i in [0, n), each on its own thread; returns when every call returned.
  //! One run at a time (the set belongs to one host thread).
  void run(int n, void (*fn)(void*, int), void* ctx) {
    if (n <= 0) return;
    while (static_cast<int>(workers_.size()) < n) {
      auto w = std::make_unique<worker>();
      worker* raw = w.get();
      raw->th = std::thread([this, raw] { loop(*raw); });
      workers_.push_back(std::move(w));
    }
    {
      std::lock_guard<std::mutex> lk(done_m_);
      pending_ = n;
    }
    for (int i = 0; i < n; ++i) {
      worker& w = *workers_[static_cast<std::size_t>(i)];
      {
        std::lock_guard<std::mutex> lk(w.m);
        w.fn = fn;
        w.ctx = ctx;
        w.index = i;
        w.has_task = true;
      }
      w.cv.notify_one();
    }
    std::unique_lock<std::mutex> lk(done_m_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
  }

  //! How many threads the set holds (the most one run asked for).
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size(); }

 private:
  struct worker {
    std::thread th;
    std::mutex m;
    std::condition_variable cv;
    bool has_task = false, stop = false;
    void (*fn)(void*, int) = nullptr;
    void* ctx = nullptr;
    int index = 0;
  };

  void loop(worker& w) {
    for (;;) {
      void (*fn)(void*, int) = nullptr;
      void* ctx = nullptr;
      int index = 0;
      {
        std::unique_lock<std::mutex> lk(w.m);
        w.cv.wait(lk, [&] { return w.has_task || w.stop; });
        if (w.stop) return;
        fn = w.fn;
        ctx = w.ctx;
        index = w.index;
      }
      fn(ctx, index);
      {
        std::lock_guard<std::mutex> lk(w.m);
        w.has_task = false;
      }
      std::lock_guard<std::mutex> lk(done_m_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::unique_ptr<worker>> workers_;
  std::mutex done_m_;
  std::condition_variable done_cv_;
  int pending_ = 0;
};

//! The calling host thread's workers.
[[nodiscard]] inline cpu_workers& local_workers() {
  thread_local cpu_workers w;
  return w;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
