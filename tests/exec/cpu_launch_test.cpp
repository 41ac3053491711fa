// The SIMT seam on the CPU executor: indices, barriers, shuffles, ballots, shared memory (poisoned
// at block start), 16-byte accesses, integer atomics, block order by seed, two blocks at once,
// and the faults a GPU would hang or compute garbage on (divergent barriers) as errors.
//
// The seam kernels written over their team (tests/kernels/simt/seam_kernels.hpp: the scan, the
// histogram) and the independent 16-byte copy also run on host_exec, where a team body gets a
// team of one: what that must give is checked next to cpu_exec's result. The others test what
// only cpu_exec has (32-lane warps, poisoned shared memory, block order, two blocks at once,
// divergence faults) and stay cpu_exec-only; host_exec's launcher itself is
// tests/exec/host_launch_test.cpp's.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <moefold/kernels/simt/warp.hpp>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "../kernels/simt/seam_kernels.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;
using namespace moefold::test;
namespace simt = moefold::kernels::simt;

namespace {

TEST_CASE("cpu_exec: every thread of every block runs once with its indices") {
  for (int blocks : {1, 2, 5}) {
    // (host_exec's loop over the same indices: host_launch_test.cpp.)
    std::vector<int> out(static_cast<std::size_t>(blocks) * 64 * 6, -1);
    REQUIRE(launch(cpu_exec{7}, launch_grid{.blocks = blocks}, index_kernel{out.data()}));
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < 64; ++t) {
        const int* o = out.data() + (b * 64 + t) * 6;
        CHECK(o[0] == t);
        CHECK(o[1] == b);
        CHECK(o[2] == blocks);
        CHECK(o[3] == t % 32);
        CHECK(o[4] == t / 32);
        CHECK(o[5] == 64);  // the kernel's block in warps of 32
      }
  }
}

// cpu_exec only: shuffle_kernel is written for 32-lane warps (seam_kernels.hpp).
TEST_CASE("cpu_exec: shuffles and ballots give exactly the CUDA results") {
  const int blocks = 3;
  std::vector<unsigned> out(static_cast<std::size_t>(blocks) * 64 * 7, 0xdeadbeefu);
  REQUIRE(launch(cpu_exec{1}, launch_grid{.blocks = blocks}, shuffle_kernel{out.data()}));
  unsigned every_third = 0;
  for (int l = 0; l < 32; l += 3) every_third |= 1u << l;
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < 64; ++t) {
      const int w = t / 32, lane = t % 32;
      auto val = [&](int l) { return static_cast<unsigned>(b * 1000 + (w * 32 + l) * 3 + 1); };
      const unsigned* o = out.data() + (b * 64 + t) * 7;
      for (int i = 0; i < 5; ++i) CHECK(o[i] == val(lane ^ (1 << i)));
      CHECK(o[5] == val((lane * 7 + 3) % 32));
      CHECK(o[6] == (w == 1 ? 0xffffffffu : every_third));
    }
}

// scan_kernel on host_exec, a team of one: thread 0 of each block alone writes, its exclusive sum
// T{} (+0), its total and warp sum its own value, bit for bit; every other element keeps `fill`.
template <int Threads, class T>
void check_team_of_one_scan(const std::vector<T>& in, int blocks, T fill) {
  using K = scan_kernel<Threads, T>;
  std::vector<T> ex(in.size(), fill), tot(in.size(), fill), ws(in.size(), fill);
  REQUIRE(launch(host_exec{},
                 launch_grid{.blocks = blocks,
                             .smem_bytes = sizeof(T) * simt::block_scan_scratch<host_team_ctx>},
                 K{in.data(), ex.data(), tot.data(), ws.data()}));
  const auto bits = [](T v) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    return std::vector<unsigned char>(b, b + sizeof(T));
  };
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < Threads; ++t) {
      const auto i = static_cast<std::size_t>(b * Threads + t);
      CAPTURE(i);
      CHECK(bits(ex[i]) == bits(t == 0 ? T{} : fill));
      CHECK(bits(tot[i]) == bits(t == 0 ? in[i] : fill));
      CHECK(bits(ws[i]) == bits(t == 0 ? in[i] : fill));
    }
}

template <int Threads>
void check_int_scan(std::uint64_t seed, int blocks) {
  const int n = blocks * Threads;
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::vector<long long> in(static_cast<std::size_t>(n));
  for (auto& v : in) v = static_cast<long long>(rng() % 2000001) - 1000000;
  std::vector<long long> ex(in.size(), -7), tot(in.size(), -7), ws(in.size(), -7);
  using K = scan_kernel<Threads, long long>;
  REQUIRE(launch(
      cpu_exec{seed},
      launch_grid{.blocks = blocks,
                  .smem_bytes = sizeof(long long) * simt::block_scan_scratch<cpu_ctx<Threads>>},
      K{in.data(), ex.data(), tot.data(), ws.data()}));
  check_team_of_one_scan<Threads>(in, blocks, -7LL);
  for (int b = 0; b < blocks; ++b) {
    long long run = 0, all = 0;
    for (int t = 0; t < Threads; ++t) all += in[static_cast<std::size_t>(b * Threads + t)];
    for (int t = 0; t < Threads; ++t) {
      const auto i = static_cast<std::size_t>(b * Threads + t);
      CHECK(ex[i] == run);
      CHECK(tot[i] == all);
      long long w = 0;
      for (int l = 0; l < 32; ++l) w += in[static_cast<std::size_t>(b * Threads + t / 32 * 32 + l)];
      CHECK(ws[i] == w);
      run += in[i];
    }
  }
}

TEST_CASE("cpu_exec: warp sums and block scans of integers are exact (host_exec: a team of one)") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  check_int_scan<32>(seed, 3);
  check_int_scan<256>(seed + 1, 3);
  check_int_scan<1024>(seed + 2, test::simt_reduced ? 1 : 2);
}

TEST_CASE("cpu_exec: a float block scan is the same bits for every seed") {
  const int blocks = 4, n = blocks * 256;
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> in(static_cast<std::size_t>(n));
  for (auto& v : in) v = d(rng);
  using K = scan_kernel<256, float>;
  auto run = [&](std::uint64_t seed) {
    std::vector<float> ex(in.size()), tot(in.size()), ws(in.size());
    REQUIRE(
        launch(cpu_exec{seed},
               launch_grid{.blocks = blocks,
                           .smem_bytes = sizeof(float) * simt::block_scan_scratch<cpu_ctx<256>>},
               K{in.data(), ex.data(), tot.data(), ws.data()}));
    return std::vector<std::vector<float>>{ex, tot, ws};
  };
  const auto a = run(1), b = run(2);
  check_team_of_one_scan<256>(in, blocks, -7.0f);
  for (std::size_t k = 0; k < a.size(); ++k)
    CHECK(std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)) == 0);
  // Every lane of a warp holds the same sum, bit for bit; the sum is within rounding of fp64.
  for (int w = 0; w < n / 32; ++w) {
    double ref = 0;
    for (int l = 0; l < 32; ++l) ref += in[static_cast<std::size_t>(w * 32 + l)];
    for (int l = 0; l < 32; ++l) {
      CHECK(std::memcmp(&a[2][static_cast<std::size_t>(w * 32 + l)],
                        &a[2][static_cast<std::size_t>(w * 32)], sizeof(float)) == 0);
    }
    CHECK(std::abs(a[2][static_cast<std::size_t>(w * 32)] - ref) <= 1e-5 * 32);
  }
}

TEST_CASE("cpu_exec: an atomic histogram is exact and the same for every seed (and on host_exec)") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937 rng(static_cast<unsigned>(seed));
  for (int bins : {1, 8, 64, 256}) {
    const int n = test::simt_reduced ? 64 : 513;
    std::vector<int> ids(static_cast<std::size_t>(n));
    for (auto& v : ids) v = static_cast<int>(rng() % static_cast<unsigned>(bins));
    std::vector<int> ref(static_cast<std::size_t>(bins), 0);
    for (int v : ids) ++ref[static_cast<std::size_t>(v)];
    for (std::uint64_t s : {seed, seed + 1}) {
      std::vector<int> counts(static_cast<std::size_t>(bins), 0);
      REQUIRE(launch(
          cpu_exec{s},
          launch_grid{.blocks = 3, .smem_bytes = sizeof(int) * static_cast<std::size_t>(bins)},
          histogram_kernel{ids.data(), n, bins, counts.data()}));
      CHECK(counts == ref);
    }
    // A team of one per block: each block counts its grid-strided share alone.
    std::vector<int> counts(static_cast<std::size_t>(bins), 0);
    REQUIRE(
        launch(host_exec{},
               launch_grid{.blocks = 3, .smem_bytes = sizeof(int) * static_cast<std::size_t>(bins)},
               histogram_kernel{ids.data(), n, bins, counts.data()}));
    CHECK(counts == ref);
  }
}

// Shared memory as the block finds it (cpu_exec's poison: host_exec has none), and 16-byte
// accesses.
struct poison_kernel {
  static constexpr int block_threads = 32;
  unsigned* seen;  // (blocks * 32): what each thread read before anyone wrote
  template <class Ctx>
  void operator()(Ctx& c) const {
    unsigned* s = c.template shared<unsigned>();
    seen[c.block() * 32 + c.thread()] = s[c.thread()];
    c.sync();
    s[c.thread()] = 0;  // the next block on this executor must not see this
  }
};

TEST_CASE("cpu_exec: shared memory is poisoned at every block start; 16-byte copies") {
  std::vector<unsigned> seen(6 * 32, 0);
  REQUIRE(launch(cpu_exec{3}, launch_grid{.blocks = 6, .smem_bytes = 32 * sizeof(unsigned)},
                 poison_kernel{seen.data()}));
  for (unsigned v : seen) CHECK(v == 0xffffffffu);

  alignas(16) unsigned char src[16 * 37], dst[16 * 37];
  for (int i = 0; i < 16 * 37; ++i) src[i] = static_cast<unsigned char>(i * 13 + 5);
  std::memset(dst, 0xAB, sizeof dst);
  REQUIRE(launch(cpu_exec{4}, launch_grid{.blocks = 2}, copy16_kernel{src, dst, 37}));
  CHECK(std::memcmp(src, dst, sizeof src) == 0);
  std::memset(dst, 0xAB, sizeof dst);  // host_exec: the same copy, 32 threads of a block in a loop
  REQUIRE(launch(host_exec{}, launch_grid{.blocks = 2}, copy16_kernel{src, dst, 37}));
  CHECK(std::memcmp(src, dst, sizeof src) == 0);
}

// Block order: each block takes a ticket; two blocks also wait for each other (they must run at
// the same time, or this would time out and report it). cpu_exec only: host_exec runs blocks in
// order, one at a time.
struct order_kernel {
  static constexpr int block_threads = 32;
  int* tickets;  // (blocks)
  int* next;
  int* pair_met;  // (blocks): 1 when another block was running at the same time
  std::atomic<int>* running;
  template <class Ctx>
  void operator()(Ctx& c) const {
    if (c.thread() == 0) {
      tickets[c.block()] = c.atomic_add(next, 1);
      running->fetch_add(1);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (running->load() < 2 && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      pair_met[c.block()] = running->load() >= 2 ? 1 : 0;
    }
  }
};

struct ticket_kernel {
  static constexpr int block_threads = 32;
  int* tickets;
  int* next;
  template <class Ctx>
  void operator()(Ctx& c) const {
    if (c.thread() == 0) tickets[c.block()] = c.atomic_add(next, 1);
  }
};

TEST_CASE("cpu_exec: blocks run two at a time, in an order drawn from the seed") {
  const int blocks = 2;  // exactly two: both run at once, so neither waits for a third
  std::atomic<int> running{0};
  std::vector<int> tickets(blocks, -1), met(blocks, 0);
  int next = 0;
  REQUIRE(launch(cpu_exec{5}, launch_grid{.blocks = blocks},
                 order_kernel{tickets.data(), &next, met.data(), &running}));
  CHECK(met == std::vector<int>{1, 1});

  // Start order over 16 blocks: a permutation, and not the same for all seeds.
  auto order_for = [](std::uint64_t seed) {
    std::vector<int> t(16, -1);
    int n = 0;
    REQUIRE(launch(cpu_exec{seed}, launch_grid{.blocks = 16}, ticket_kernel{t.data(), &n}));
    return t;
  };
  std::vector<std::vector<int>> orders;
  for (std::uint64_t s = 0; s < 4; ++s) {
    auto t = order_for(s);
    auto sorted = t;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> iota(16);
    std::iota(iota.begin(), iota.end(), 0);
    CHECK(sorted == iota);
    orders.push_back(t);
  }
  // Tickets come from two concurrent slots, so they only roughly follow the drawn order; the
  // blocks that start first still differ between seeds.
  std::vector<int> iota(16);
  std::iota(iota.begin(), iota.end(), 0);
  bool all_in_order = true, all_same = true;
  for (auto& o : orders) {
    all_in_order = all_in_order && o == iota;
    all_same = all_same && o == orders[0];
  }
  CHECK_FALSE(all_in_order);
  CHECK_FALSE(all_same);
}

// A missing barrier: each thread writes its shared slot and reads its neighbour's without sync().
// With sync() between (the correct kernel) every seed gives the neighbours' values. cpu_exec only:
// written over its own 64 threads (a barrier's test, not a team body; host_launch_test.cpp hands
// a value across sync() on a team of one).
template <bool Sync>
struct neighbour_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "neighbour_kernel";
  int* out;
  template <class Ctx>
  void operator()(Ctx& c) const {
    int* s = c.template shared<int>();
    s[c.thread()] = c.thread();
    if constexpr (Sync) c.sync();
    out[c.block() * block_threads + c.thread()] = s[(c.thread() + 1) % block_threads];
  }
};

TEST_CASE("cpu_exec: a missing barrier gives results that depend on the seed") {
  auto run = [](auto kernel_tag, std::uint64_t seed) {
    using K = decltype(kernel_tag);
    std::vector<int> out(2 * 64, -7);
    REQUIRE(launch(cpu_exec{seed}, launch_grid{.blocks = 2, .smem_bytes = 64 * sizeof(int)},
                   K{out.data()}));
    return out;
  };
  std::vector<int> want(2 * 64);
  for (int i = 0; i < 2 * 64; ++i) want[static_cast<std::size_t>(i)] = (i % 64 + 1) % 64;
  for (std::uint64_t seed = 0; seed < 4; ++seed) CHECK(run(neighbour_kernel<true>{}, seed) == want);
#if !MOEFOLD_CPU_EXEC_THREADS && !MOEFOLD_TSAN
  // Fibers run from barrier to barrier in an order drawn from the seed and the block: without the
  // barrier, a thread resumed before its neighbour reads the poison (-1), and which threads those
  // are differs between seeds. (With OS threads the outcome is up to the scheduler; under TSan the
  // race is reported instead, which ends the program: simt-tsan-race-probe checks that.)
  std::vector<std::vector<int>> outs;
  for (std::uint64_t seed = 0; seed < 4; ++seed)
    outs.push_back(run(neighbour_kernel<false>{}, seed));
  bool any_poison = false, all_same = true;
  for (auto& o : outs) {
    any_poison = any_poison || std::count(o.begin(), o.end(), -1) > 0;
    all_same = all_same && o == outs[0];
  }
  CHECK(any_poison);
  CHECK_FALSE(all_same);
#endif
}

// Faults: a GPU hangs or computes garbage; the CPU executor names the broken rule. (A team of one
// cannot diverge: cpu_exec only.)
struct divergent_sync_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "divergent_sync_kernel";
  template <class Ctx>
  void operator()(Ctx& c) const {
    if (c.warp() == 0) c.sync();  // warp 1 leaves without it
  }
};
struct early_lane_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "early_lane_kernel";
  int* out;
  template <class Ctx>
  void operator()(Ctx& c) const {
    if (c.lane() == 5) return;  // lane 5 leaves; the others shuffle without it
    out[c.lane()] = c.shfl_xor(c.lane(), 1);
  }
};
struct partial_warp_sync_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "partial_warp_sync_kernel";
  template <class Ctx>
  void operator()(Ctx& c) const {
    if (c.thread() != 3) c.sync();  // thread 3 leaves; its warp-mates wait at sync()
  }
};

TEST_CASE("cpu_exec: divergent barriers are errors naming the kernel, block and operations") {
  auto a = launch(cpu_exec{1}, launch_grid{.blocks = 3}, divergent_sync_kernel{});
  REQUIRE_FALSE(a);
  CHECK(a.error().code == errc::kernel_fault);
  CHECK(a.error().message.find("divergent_sync_kernel") != std::string::npos);
  CHECK(a.error().message.find("sync()") != std::string::npos);
  CHECK(a.error().message.find("the end of the kernel") != std::string::npos);

  std::vector<int> out(32, 0);
  auto b = launch(cpu_exec{1}, launch_grid{.blocks = 1}, early_lane_kernel{out.data()});
  REQUIRE_FALSE(b);
  CHECK(b.error().code == errc::kernel_fault);
  CHECK(b.error().message.find("in warp 0") != std::string::npos);
  CHECK(b.error().message.find("a shuffle") != std::string::npos);

  // Thread 3's warp barrier at exit can never fill while 31 lanes wait at sync(): every thread
  // of the block waits, which is reported instead of hanging.
  auto c = launch(cpu_exec{1}, launch_grid{.blocks = 2}, partial_warp_sync_kernel{});
  REQUIRE_FALSE(c);
  CHECK(c.error().code == errc::kernel_fault);
  CHECK(c.error().message.find("every thread waits") != std::string::npos);
  MESSAGE(c.error().message);
}

TEST_CASE("cpu_exec: a launch with a negative grid or too much shared memory is refused") {
  auto a = launch(cpu_exec{}, launch_grid{.blocks = -1}, index_kernel{nullptr});
  REQUIRE_FALSE(a);
  CHECK(a.error().code == errc::invalid_argument);
  CHECK(a.error().message.find("blocks >= 0") != std::string::npos);
  auto b = launch(cpu_exec{}, launch_grid{.blocks = 1, .smem_bytes = max_smem_bytes_per_block + 1},
                  index_kernel{nullptr});
  REQUIRE_FALSE(b);
  CHECK(b.error().message.find("Hopper") != std::string::npos);
  CHECK(launch(cpu_exec{}, launch_grid{.blocks = 0}, index_kernel{nullptr}));  // nothing to run
}

}  // namespace
