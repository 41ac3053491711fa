// The CPU executor's reusable threads: every task of a run on a thread of its own, each index
// once, the run returning only after all of them; the same threads for the next run; another
// host thread its own set.
#include <doctest/doctest.h>
#include <moefold/exec/cpu_workers.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

using moefold::detail::cpu_workers;

namespace {

struct record {
  std::mutex m;
  std::vector<int> hits;                 // [n]: how often each index ran
  std::vector<std::thread::id> threads;  // [n]: which thread ran it
  std::atomic<int> inside{0}, most_inside{0};
};

void task(void* p, int i) {
  auto& r = *static_cast<record*>(p);
  const int now = ++r.inside;
  int seen = r.most_inside.load();
  while (now > seen && !r.most_inside.compare_exchange_weak(seen, now)) {
  }
  // Wait (bounded) until every task of the run is inside: they must all run at once, as the
  // threads of a block do, which a pool of fewer threads could not.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (r.inside.load() < static_cast<int>(r.hits.size()) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  {
    std::lock_guard<std::mutex> lk(r.m);
    ++r.hits[static_cast<std::size_t>(i)];
    r.threads[static_cast<std::size_t>(i)] = std::this_thread::get_id();
  }
}

std::set<std::thread::id> run_once(cpu_workers& w, int n, record& r) {
  r.hits.assign(static_cast<std::size_t>(n), 0);
  r.threads.assign(static_cast<std::size_t>(n), std::thread::id{});
  r.inside = 0;
  r.most_inside = 0;
  w.run(n, task, &r);
  // Returned: every task has finished (no lock needed to read what they wrote).
  CHECK(std::all_of(r.hits.begin(), r.hits.end(), [](int h) { return h == 1; }));
  CHECK(r.most_inside.load() == n);
  const std::set<std::thread::id> ids(r.threads.begin(), r.threads.end());
  CHECK(ids.size() == static_cast<std::size_t>(n));  // each on a thread of its own
  CHECK(ids.count(std::this_thread::get_id()) == 0);
  return ids;
}

}  // namespace

TEST_CASE("cpu_workers: each index once, each on its own thread, all at once, threads reused") {
  cpu_workers w;
  record r;
  const auto first = run_once(w, 24, r);
  CHECK(w.size() == 24);
  const auto second = run_once(w, 24, r);
  CHECK(first == second);  // the same threads again
  const auto fewer = run_once(w, 5, r);
  CHECK(w.size() == 24);
  CHECK(std::includes(first.begin(), first.end(), fewer.begin(), fewer.end()));
  run_once(w, 40, r);  // grows
  CHECK(w.size() == 40);
  w.run(0, task, &r);  // nothing to do
}

TEST_CASE("cpu_workers: each host thread has its own set") {
  const cpu_workers* mine = &moefold::detail::local_workers();
  const cpu_workers* other = nullptr;
  std::thread([&] { other = &moefold::detail::local_workers(); }).join();
  CHECK(mine != other);
  CHECK(mine == &moefold::detail::local_workers());
}
