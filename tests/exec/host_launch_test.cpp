// The launcher of host_exec (exec/host_launch.hpp), as tests/exec/cpu_launch_test.cpp tests
// cpu_exec's: every thread of every block of an independent body once with its indices, grids
// larger than one block, a team body with a team of one (its barriers, shuffles, ballots and
// shared memory), the same results as cpu_exec where the body is integer, refused launches and a
// kernel fault named with its kernel.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/scan.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <moefold/kernels/simt/warp.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../kernels/simt/seam_kernels.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;
using moefold::test::index_kernel;
namespace simt = moefold::kernels::simt;

namespace {

TEST_CASE("host_exec: an independent body runs every thread of every block once") {
  for (int blocks : {1, 2, 5}) {
    std::vector<int> out(static_cast<std::size_t>(blocks) * 64 * 6, -1);
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = blocks}, index_kernel{out.data()}));
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < 64; ++t) {
        const int* o = out.data() + (b * 64 + t) * 6;
        CHECK(o[0] == t);
        CHECK(o[1] == b);
        CHECK(o[2] == blocks);
        CHECK(o[3] == t % 32);
        CHECK(o[4] == t / 32);
        CHECK(o[5] == 64);
      }
  }
  // An empty grid runs nothing.
  std::vector<int> out(64 * 6, -1);
  REQUIRE(launch(host_exec{}, launch_grid{.blocks = 0}, index_kernel{out.data()}));
  CHECK(out[0] == -1);
}

// A team body: what its context says (team size, indices), a shuffle of each kind, a ballot, a
// warp sum, a block scan through shared memory, and a value handed between threads across sync().
// Written over any team: every thread of a block writes one record per thread of the team.
struct team_probe_kernel {
  static constexpr int block_threads = 64;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "team_probe";
  static constexpr std::size_t smem_bytes =
      sizeof(int) * (block_threads + block_threads / 32 + 1);  // enough for any team
  int* out;  // [blocks, block_threads, 10]: one record per thread of the team
  template <class Ctx>
  void operator()(Ctx& c) const {
    int* handed = c.template shared<int>();          // [team]
    int* scratch = handed + Ctx::block_threads;      // block scan's
    const int v = c.block() * 100 + c.thread() + 1;  // the thread's own value
    handed[c.thread()] = v;
    c.sync();
    const int from_next = handed[(c.thread() + 1) % Ctx::block_threads];
    int total = 0;
    const int before = simt::block_exclusive_scan(c, v, scratch, total);
    int* o = out + (c.block() * block_threads + c.thread()) * 10;
    o[0] = Ctx::block_threads;
    o[1] = Ctx::warp_threads;
    o[2] = c.shfl_xor(v, 1);
    o[3] = c.shfl_idx(v, 0);
    o[4] = static_cast<int>(c.ballot(c.thread() % 2 == 0));
    o[5] = simt::warp_sum(c, v);
    o[6] = before;
    o[7] = total;
    o[8] = from_next;
    o[9] = c.grid_blocks();
  }
};

TEST_CASE("host_exec: a team body runs with a team of one thread per block") {
  const int blocks = 3;
  std::vector<int> out(static_cast<std::size_t>(blocks) * 64 * 10, -1);
  REQUIRE(launch(host_exec{},
                 launch_grid{.blocks = blocks, .smem_bytes = team_probe_kernel::smem_bytes},
                 team_probe_kernel{out.data()}));
  for (int b = 0; b < blocks; ++b) {
    const int* o = out.data() + b * 64 * 10;  // thread 0, the team's only thread
    const int v = b * 100 + 1;
    CHECK(o[0] == 1);
    CHECK(o[1] == 1);
    CHECK(o[2] == v);  // the only lane's own value
    CHECK(o[3] == v);
    CHECK(o[4] == 1);  // bit 0: its own predicate
    CHECK(o[5] == v);  // a warp sum over one lane
    CHECK(o[6] == 0);  // the exclusive scan of the first thread
    CHECK(o[7] == v);  // the block's total
    CHECK(o[8] == v);  // handed to itself across sync()
    CHECK(o[9] == blocks);
    CHECK(out[static_cast<std::size_t>(b * 64 * 10 + 10)] == -1);  // thread 1 does not exist
  }
  // On cpu_exec the same body sees the kernel's block of 64 in warps of 32.
  std::vector<int> ref(out.size(), -1);
  REQUIRE(launch(cpu_exec{test::simt_seed()},
                 launch_grid{.blocks = blocks, .smem_bytes = team_probe_kernel::smem_bytes},
                 team_probe_kernel{ref.data()}));
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < 64; ++t) {
      const int* o = ref.data() + (b * 64 + t) * 10;
      int warp = 0, before = 0, total = 0;
      for (int u = 0; u < 64; ++u) {
        const int w = b * 100 + u + 1;
        if (u / 32 == t / 32) warp += w;
        if (u < t) before += w;
        total += w;
      }
      CHECK(o[0] == 64);
      CHECK(o[1] == 32);
      CHECK(o[2] == (b * 100 + (t ^ 1) + 1));
      CHECK(o[3] == (b * 100 + t / 32 * 32 + 1));
      CHECK(static_cast<unsigned>(o[4]) == 0x55555555u);
      CHECK(o[5] == warp);
      CHECK(o[6] == before);
      CHECK(o[7] == total);
      CHECK(o[8] == (b * 100 + (t + 1) % 64 + 1));
    }
}

// A team body over a grid-strided range with barriers between phases: each tile of 64 elements
// reversed through shared memory. Any grid, any team: the same output.
struct reverse_tiles_kernel {
  static constexpr int block_threads = 64;
  static constexpr bool cooperative = true;
  static constexpr const char* name = "reverse_tiles";
  static constexpr int tile = 64;
  const int* in;
  int* out;
  long long n;  // a multiple of tile
  template <class Ctx>
  void operator()(Ctx& c) const {
    int* sh = c.template shared<int>();  // [tile]
    for (long long t = c.block(); t * tile < n; t += c.grid_blocks()) {
      for (int i = c.thread(); i < tile; i += Ctx::block_threads) sh[i] = in[t * tile + i];
      c.sync();
      for (int i = c.thread(); i < tile; i += Ctx::block_threads)
        out[t * tile + i] = sh[tile - 1 - i];
      c.sync();  // sh is rewritten by the next tile only after every thread has read it
    }
  }
};

TEST_CASE("host_exec: a team body with barriers over grids of 1 to many blocks equals cpu_exec") {
  const long long n = 64 * 37;
  std::vector<int> in(static_cast<std::size_t>(n));
  std::iota(in.begin(), in.end(), 5);
  std::vector<int> want(in.size());
  for (long long i = 0; i < n; ++i)
    want[static_cast<std::size_t>(i)] = in[static_cast<std::size_t>(i / 64 * 64 + 63 - i % 64)];
  for (int blocks : {1, 2, 7, 37, 64}) {
    CAPTURE(blocks);
    const launch_grid g{.blocks = blocks, .smem_bytes = sizeof(int) * 64};
    std::vector<int> host(in.size(), -1), cpu(in.size(), -1);
    REQUIRE(launch(host_exec{}, g, reverse_tiles_kernel{in.data(), host.data(), n}));
    REQUIRE(launch(cpu_exec{test::simt_seed()}, g, reverse_tiles_kernel{in.data(), cpu.data(), n}));
    CHECK(host == want);
    CHECK(cpu == want);
  }
}

// Reverses the first shared_bytes / 4 elements through shared memory.
struct big_smem_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;
  const int* in;
  int* out;
  long long n;
  template <class Ctx>
  void operator()(Ctx& c) const {
    int* sh = c.template shared<int>();
    const long long cap = static_cast<long long>(c.shared_bytes() / sizeof(int));
    for (long long i = c.thread(); i < n && i < cap; i += Ctx::block_threads) sh[i] = in[i];
    c.sync();
    for (long long i = c.thread(); i < n && i < cap; i += Ctx::block_threads)
      out[i] = sh[cap - 1 - i];
  }
};

TEST_CASE("host_exec: shared memory larger than the launcher's stack buffer") {
  // 64 KiB of shared memory: the launch's heap buffer.
  const long long n = 16 * 1024;
  std::vector<int> in(static_cast<std::size_t>(n)), out(in.size(), -1);
  std::iota(in.begin(), in.end(), 0);
  const launch_grid g{.blocks = 1, .smem_bytes = sizeof(int) * static_cast<std::size_t>(n)};
  REQUIRE(launch(host_exec{}, g, big_smem_kernel{in.data(), out.data(), n}));
  for (long long i = 0; i < n; ++i) CHECK(out[static_cast<std::size_t>(i)] == n - 1 - i);
}

TEST_CASE(
    "host_exec: the device-wide scan (three team and plain launches) equals std::exclusive_scan") {
  std::mt19937 rng(static_cast<unsigned>(test::simt_seed()));
  for (long long n : {1LL, 1023LL, 1024LL, 5000LL, 70001LL}) {
    CAPTURE(n);
    std::vector<int> in(static_cast<std::size_t>(n));
    for (auto& v : in) v = static_cast<int>(rng() % 7);
    std::vector<int> want(in.size());
    std::exclusive_scan(in.begin(), in.end(), want.begin(), 0);
    const long long tiles =
        (n + kernels::scan_tiles_kernel::tile - 1) / kernels::scan_tiles_kernel::tile;
    std::vector<int> out(in.size(), -1), sums(static_cast<std::size_t>(tiles), -1), total(1, -1);
    const std::size_t smem = sizeof(int) * simt::block_scan_scratch<cpu_ctx<256>>;
    const host_exec h;
    for (int blocks : {1, 3}) {
      REQUIRE(launch(h, launch_grid{.blocks = blocks, .smem_bytes = smem},
                     kernels::scan_tiles_kernel{in.data(), out.data(), n, sums.data()}));
      REQUIRE(launch(h, launch_grid{.blocks = 1, .smem_bytes = smem},
                     kernels::scan_tile_sums_kernel{sums.data(), tiles, total.data()}));
      REQUIRE(launch(h, launch_grid{.blocks = blocks},
                     kernels::add_tile_offsets_kernel{out.data(), n, sums.data()}));
      CHECK(out == want);
      CHECK(total[0] == std::accumulate(in.begin(), in.end(), 0));
    }
  }
}

// One 16-byte load at `p + offset` per thread.
struct load16_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "load16_probe";
  const unsigned char* p;
  int offset;
  bytes16* out;
  template <class Ctx>
  void operator()(Ctx& c) const {
    out[c.thread()] = c.load16(p + (c.thread() == 5 ? offset : 0));
  }
};

TEST_CASE(
    "host_exec and cpu_exec: a misaligned 16-byte access is a kernel fault naming the kernel") {
  alignas(16) unsigned char buf[64] = {};
  std::vector<bytes16> out(32);
  REQUIRE(launch(host_exec{}, launch_grid{.blocks = 2}, load16_kernel{buf, 0, out.data()}));
  const auto h = launch(host_exec{}, launch_grid{.blocks = 2}, load16_kernel{buf, 4, out.data()});
  REQUIRE_FALSE(h);
  CHECK(h.error().code == errc::kernel_fault);
  CHECK(h.error().message ==
        "host_exec: load16_probe, block 0: thread 5: load16 of an address that is not 16-byte "
        "aligned");
  const auto c = launch(cpu_exec{1}, launch_grid{.blocks = 1}, load16_kernel{buf, 4, out.data()});
  REQUIRE_FALSE(c);
  CHECK(c.error().code == errc::kernel_fault);
  CHECK(c.error().message.find("cpu_exec: load16_probe, block 0: thread 5: load16 of an address "
                               "that is not 16-byte aligned") == 0);
}

TEST_CASE("host_exec: refused launches name the kernel and the rule") {
  std::vector<int> out(64 * 6);
  const auto neg = launch(host_exec{}, launch_grid{.blocks = -1}, index_kernel{out.data()});
  REQUIRE_FALSE(neg);
  CHECK(neg.error().code == errc::invalid_argument);
  CHECK(neg.error().message.find("index_kernel") != std::string::npos);
  CHECK(neg.error().message.find("blocks >= 0") != std::string::npos);
  const auto big = launch(host_exec{}, launch_grid{.blocks = 1, .smem_bytes = 300 * 1024},
                          team_probe_kernel{out.data()});
  REQUIRE_FALSE(big);
  CHECK(big.error().code == errc::invalid_argument);
  CHECK(big.error().message.find("team_probe") != std::string::npos);
}

}  // namespace
