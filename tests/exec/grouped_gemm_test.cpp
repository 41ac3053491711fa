// The grouped-GEMM operation (exec/grouped_gemm.hpp) and its two backends: simt_gemm on host_exec
// and cpu_exec, host_gemm on host_exec. Each against an fp64 reference computed here, on fresh
// random inputs (seed printed), in the shapes the library uses: the forward through transposed
// per-expert weights, the data gradient with a transposed A, the weight gradient grouped over K
// (C per group), one group; padded leading dimensions and group strides, whose padding must stay
// untouched; empty groups first, inside and last; every run made twice (accumulate: C0 + 2 A B;
// without: A B, whatever C held, NaN in these tests). fp32, bf16 inputs into fp32, fp64. Row
// ranges on the host and on the context (with an exact and a loose row bound); simt_gemm bit for
// bit against a direct launch of the kernel; every rule of can_implement refused with its message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/grouped_gemm.hpp>
#include <moefold/exec/grouped_gemm_launch.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/exec/host_gemm.hpp>
#include <moefold/exec/simt_gemm.hpp>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/simt_test_sizes.hpp"
#include "gemm_problems.hpp"

using namespace moefold;
namespace k = moefold::kernels;

// The protocol, checked at compile time: simt_gemm on every context, host_gemm on host_exec only.
static_assert(grouped_gemm_backend<simt_gemm<float, float, float>, host_exec>);
static_assert(grouped_gemm_backend<simt_gemm<bfloat16, bfloat16, float>, cpu_exec>);
static_assert(grouped_gemm_backend<host_gemm<double, double, double>, host_exec>);
static_assert(!grouped_gemm_backend<host_gemm<float, float, float>, cpu_exec>);
static_assert(std::is_aggregate_v<grouped_gemm_args<float, float, float>>);

using namespace gemm_test;

TEST_CASE_TEMPLATE("grouped GEMM: every backend against fp64, host and context row ranges", Ty,
                   types<float, float, float>, types<bfloat16, bfloat16, float>,
                   types<double, double, double>) {
  using TA = typename Ty::TA;
  using TB = typename Ty::TB;
  using TC = typename Ty::TC;
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  check_stats st;
  const int runs = 2;
  for (const auto& p : make_problems<TA, TB, TC>(rng)) {
    CAPTURE(p.label);
    for (const offsets_mode mode :
         {offsets_mode{false, 0}, offsets_mode{true, 0}, offsets_mode{true, 50}}) {
      CAPTURE(mode.on_context);
      CAPTURE(mode.slack);
      {
        INFO("simt_gemm on host_exec");
        check_against_reference(p, run_backend<simt_gemm<TA, TB, TC>, host_exec>(p, mode, runs, 0),
                                runs, st);
      }
      {
        INFO("simt_gemm on cpu_exec");
        check_against_reference(
            p, run_backend<simt_gemm<TA, TB, TC>, cpu_exec>(p, mode, runs, rng()), runs, st);
      }
      {
        INFO("host_gemm on host_exec");
        check_against_reference(p, run_backend<host_gemm<TA, TB, TC>, host_exec>(p, mode, runs, 0),
                                runs, st);
      }
    }
  }
  MESSAGE(st.outputs << " outputs; worst error " << st.worst << " of its bound");
  CHECK(st.outputs > 0);
}

TEST_CASE_TEMPLATE(
    "grouped GEMM: empty groups of rows_are_k give 0, or C unchanged with accumulate", Ty,
    types<float, float, float>, types<bfloat16, bfloat16, float>) {
  using TA = typename Ty::TA;
  using TB = typename Ty::TB;
  using TC = typename Ty::TC;
  std::mt19937_64 rng(test::simt_seed());
  const int M = 6, N = 7;
  const std::vector<long long> offsets = offsets_of({0, 4, 0, 0, 3, 0});  // first, inner, last
  const long long R = offsets.back();
  const auto a = random_vec<TA>(static_cast<std::size_t>(R * M), rng);  // X [R, M]: A = X^T
  const auto b = random_vec<TB>(static_cast<std::size_t>(R * N), rng);
  const std::size_t csize = static_cast<std::size_t>(offsets.size() - 1) * M * N;
  for (const bool accumulate : {false, true}) {
    CAPTURE(accumulate);
    // Without accumulate, C starts as garbage (NaN) and must come out as 0 where a group is
    // empty; with it, C's values stay (bit for bit: x + 0 is x for every finite x but -0).
    const std::vector<TC> c0 = accumulate ? random_vec<TC>(csize, rng) : nan_vec<TC>(csize);
    auto check = [&](const std::vector<TC>& c, const char* who) {
      INFO(who);
      for (int g = 0; g < static_cast<int>(offsets.size()) - 1; ++g) {
        const bool empty = offsets[g + 1] == offsets[g];
        for (int e = 0; e < M * N; ++e) {
          const auto at = static_cast<std::size_t>(g * M * N + e);
          if (empty && accumulate)
            CHECK(same_bits(c[at], c0[at]));
          else if (empty)
            CHECK(same_bits(c[at], TC(0.0f)));
          else
            CHECK(std::isfinite(static_cast<double>(detail::widen(c[at]))));
        }
      }
    };
    const grouped_gemm_args<TA, TB, TC> base{.grouping = k::gemm_grouping::rows_are_k,
                                             .groups = static_cast<int>(offsets.size()) - 1,
                                             .m = M,
                                             .n = N,
                                             .host_offsets = offsets,
                                             .a = {nullptr, 1, M, 0},
                                             .b = {nullptr, N, 1, 0},
                                             .c = {nullptr, N, 1, M * N},
                                             .accumulate = accumulate};
    {  // host_exec, both backends: host memory as it is
      std::vector<TC> c_simt = c0, c_host = c0;
      auto args = base;
      args.a.data = a.data();
      args.b.data = b.data();
      host_exec x;
      args.c.data = c_simt.data();
      std::vector<std::byte> ws(simt_gemm<TA, TB, TC>::workspace_bytes(args));
      simt_gemm<TA, TB, TC> sg;
      REQUIRE(sg.initialize(x, args, ws));
      REQUIRE(sg.run(x));
      check(c_simt, "simt_gemm on host_exec");
      args.c.data = c_host.data();
      ws.resize(host_gemm<TA, TB, TC>::workspace_bytes(args));
      host_gemm<TA, TB, TC> hg;
      REQUIRE(hg.initialize(x, args, ws));
      REQUIRE(hg.run(x));
      check(c_host, "host_gemm on host_exec");
    }
    {  // cpu_exec: the poisoned context memory, offsets on the context
      cpu_exec x{rng()};
      const auto da = upload(x, a);
      const auto db = upload(x, b);
      auto dc = upload(x, c0);
      const auto doff = upload(x, offsets);
      auto args = base;
      args.a.data = da.view().data();
      args.b.data = db.view().data();
      args.c.data = dc.view().data();
      args.host_offsets = {};
      args.offsets = doff.view().data();
      args.row_bound = R;
      simt_gemm<TA, TB, TC> sg;
      REQUIRE(simt_gemm<TA, TB, TC>::workspace_bytes(args) == 0);
      REQUIRE(sg.initialize(x, args, {}));
      REQUIRE(sg.run(x));
      check(download(x, dc, csize), "simt_gemm on cpu_exec");
    }
  }
}

TEST_CASE_TEMPLATE("simt_gemm: the bits of a direct launch of the kernel", Ty,
                   types<float, float, float>, types<bfloat16, bfloat16, float>,
                   types<double, double, double>) {
  using TA = typename Ty::TA;
  using TB = typename Ty::TB;
  using TC = typename Ty::TC;
  const auto seed = test::simt_seed();
  std::mt19937_64 rng(seed);
  for (const auto& p : make_problems<TA, TB, TC>(rng)) {
    CAPTURE(p.label);
    const auto via_simt = run_backend<simt_gemm<TA, TB, TC>, cpu_exec>(p, {}, 1, seed);
    // The kernel launched directly on the same inputs, on both CPU contexts.
    auto direct = [&](auto& x) {
      const auto a = upload(x, p.a);
      const auto b = upload(x, p.b);
      auto c = upload(x, p.c0);
      const auto offsets = upload(x, p.offsets);
      const auto args = p.args(a.view().data(), b.view().data(), c.view().data());
      const k::grouped_gemm_kernel<TA, TB, TC> kernel{.grouping = args.grouping,
                                                      .offsets = offsets.view().data(),
                                                      .groups = args.groups,
                                                      .m = args.m,
                                                      .n = args.n,
                                                      .k = args.k,
                                                      .a = args.a,
                                                      .b = args.b,
                                                      .c = args.c,
                                                      .accumulate = args.accumulate};
      REQUIRE(launch_grouped_gemm(x, kernel, std::span<const long long>(p.offsets)));
      return download(x, c, p.c0.size());
    };
    cpu_exec on_cpu{rng()};
    host_exec on_host;
    const auto want = direct(on_cpu);
    CHECK(std::memcmp(via_simt.data(), want.data(), want.size() * sizeof(TC)) == 0);
    CHECK(std::memcmp(direct(on_host).data(), want.data(), want.size() * sizeof(TC)) == 0);
    const auto on_host_simt = run_backend<simt_gemm<TA, TB, TC>, host_exec>(p, {}, 1, 0);
    CHECK(std::memcmp(on_host_simt.data(), want.data(), want.size() * sizeof(TC)) == 0);
    // Row ranges on the context (a loose bound): the same bits.
    const auto from_context =
        run_backend<simt_gemm<TA, TB, TC>, cpu_exec>(p, {true, 100}, 1, rng());
    CHECK(std::memcmp(from_context.data(), want.data(), want.size() * sizeof(TC)) == 0);
  }
}

namespace {

// can_implement and initialize of backend G refuse each broken rule with its kind and words.
template <class G>
void check_refusals() {
  using args_t = typename G::args_type;
  const std::string prefix = std::string(G::name) + ": ";
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  const std::vector<long long> offsets{0, 2, 2, 5};
  const args_t good{.grouping = k::gemm_grouping::rows_are_m,
                    .groups = 3,
                    .n = 4,
                    .k = 3,
                    .host_offsets = offsets,
                    .a = {a.data(), 3, 1, 0},
                    .b = {b.data(), 4, 1, 12},
                    .c = {c.data(), 4, 1, 0}};
  REQUIRE(G::can_implement(good));
  auto refused = [&](const args_t& bad, errc code, const std::string& words) {
    const status st = G::can_implement(bad);
    REQUIRE_FALSE(st);
    CHECK(st.error().code == code);
    CHECK_MESSAGE(st.error().message.rfind(prefix, 0) == 0, st.error().message);
    CHECK_MESSAGE(st.error().message.find(words) != std::string::npos, st.error().message);
    // initialize refuses the same, and run afterwards is refused too.
    G gemm;
    host_exec x;
    std::vector<std::byte> ws(4096);
    const status init = gemm.initialize(x, bad, ws);
    REQUIRE_FALSE(init);
    CHECK(init.error().message == st.error().message);
    CHECK_FALSE(gemm.run(x));
  };
  auto with = [&](auto change) {
    args_t v = good;
    change(v);
    return v;
  };
  const std::vector<long long> short_offsets{0, 2, 5}, late_start{1, 2, 2, 5},
      decreasing{0, 3, 2, 5};
  refused(with([](args_t& v) { v.groups = 0; }), errc::invalid_size, "groups must be >= 1 (got 0)");
  refused(with([](args_t& v) { v.n = -1; }), errc::invalid_size, "n must be >= 0 (got -1)");
  refused(with([](args_t& v) { v.k = -2; }), errc::invalid_size, "k must be >= 0");
  refused(with([](args_t& v) {
            v.grouping = k::gemm_grouping::rows_are_k;
            v.m = -3;
          }),
          errc::invalid_size, "m must be >= 0");
  refused(with([](args_t& v) { v.grouping = static_cast<k::gemm_grouping>(7); }),
          errc::invalid_argument, "grouping must be rows_are_m or rows_are_k");
  refused(with([&](args_t& v) { v.offsets = offsets.data(); }), errc::invalid_argument,
          "exactly one of host_offsets and offsets (got both)");
  refused(with([](args_t& v) { v.host_offsets = {}; }), errc::invalid_argument,
          "exactly one of host_offsets and offsets (got neither)");
  refused(with([&](args_t& v) { v.host_offsets = short_offsets; }), errc::shape_mismatch,
          "host_offsets must hold groups + 1 = 4 entries (got 3)");
  refused(with([&](args_t& v) { v.host_offsets = late_start; }), errc::invalid_argument,
          "host_offsets must start at 0 (got 1)");
  refused(with([&](args_t& v) { v.host_offsets = decreasing; }), errc::invalid_argument,
          "host_offsets must be non-decreasing (host_offsets[2] = 2 < host_offsets[1] = 3)");
  refused(with([&](args_t& v) {
            v.host_offsets = {};
            v.offsets = offsets.data();
            v.row_bound = -1;
          }),
          errc::invalid_size, "row_bound must be >= 0 (got -1)");
  refused(with([](args_t& v) { v.a.data = nullptr; }), errc::invalid_argument, "a.data is null");
  refused(with([](args_t& v) { v.b.data = nullptr; }), errc::invalid_argument, "b.data is null");
  refused(with([](args_t& v) { v.c.data = nullptr; }), errc::invalid_argument, "c.data is null");
  // Null operands are fine where nothing reads them: no rows, k = 0 (C still written), n = 0.
  const std::vector<long long> no_rows{0, 0, 0, 0};
  CHECK(G::can_implement(with([&](args_t& v) {
    v.host_offsets = no_rows;
    v.a.data = nullptr;
    v.b.data = nullptr;
    v.c.data = nullptr;
  })));
  CHECK(G::can_implement(with([](args_t& v) {
    v.k = 0;
    v.a.data = nullptr;
    v.b.data = nullptr;
  })));
  CHECK(G::can_implement(with([](args_t& v) {
    v.n = 0;
    v.a.data = v.b.data = nullptr;
    v.c.data = nullptr;
  })));
  // A workspace smaller than asked for.
  host_exec x;
  G gemm;
  std::vector<std::byte> ws(G::workspace_bytes(good));
  REQUIRE(!ws.empty());
  const status small = gemm.initialize(x, good, std::span<std::byte>(ws).first(ws.size() - 1));
  REQUIRE_FALSE(small);
  CHECK(small.error().code == errc::workspace_too_small);
  CHECK(small.error().message.rfind(prefix, 0) == 0);
  // run() before initialize.
  const status early = G{}.run(x);
  REQUIRE_FALSE(early);
  CHECK(early.error().message.find("before a successful initialize()") != std::string::npos);
}

}  // namespace

TEST_CASE("grouped GEMM: can_implement and initialize refuse each rule, naming it") {
  check_refusals<simt_gemm<float, float, float>>();
  check_refusals<host_gemm<float, float, float>>();
}

TEST_CASE("grouped GEMM: refusals at run time") {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  std::vector<long long> offsets{0, 2, 5};
  const grouped_gemm_args<float, float, float> args{.grouping = k::gemm_grouping::rows_are_m,
                                                    .groups = 2,
                                                    .n = 4,
                                                    .k = 3,
                                                    .offsets = offsets.data(),
                                                    .row_bound = 5,
                                                    .a = {a.data(), 3, 1, 0},
                                                    .b = {b.data(), 4, 1, 12},
                                                    .c = {c.data(), 4, 1, 0}};
  host_exec x;
  SUBCASE("simt_gemm: run on another kind of context than initialize") {
    simt_gemm<float, float, float> g;
    REQUIRE(g.initialize(x, args, {}));
    cpu_exec other;
    const status st = g.run(other);
    REQUIRE_FALSE(st);
    CHECK(st.error().message ==
          "simt_gemm: run() on cpu_exec after initialize() on another kind of context");
    CHECK(g.run(x));
  }
  SUBCASE("host_gemm: device offsets are checked where they are read") {
    host_gemm<float, float, float> g;
    std::vector<std::byte> ws(host_gemm<float, float, float>::workspace_bytes(args));
    REQUIRE(g.initialize(x, args, ws));
    REQUIRE(g.run(x));
    offsets = {0, 3, 2};
    status st = g.run(x);
    REQUIRE_FALSE(st);
    CHECK(st.error().message ==
          "host_gemm: offsets must be non-decreasing (offsets[2] = 2 < offsets[1] = 3)");
    offsets = {0, 3, 6};
    st = g.run(x);
    REQUIRE_FALSE(st);
    CHECK(st.error().message == "host_gemm: offsets end past row_bound (offsets[groups] = 6 > 5)");
    offsets = {1, 3, 5};
    st = g.run(x);
    REQUIRE_FALSE(st);
    CHECK(st.error().message == "host_gemm: offsets must start at 0 (got 1)");
  }
}

TEST_CASE("host_gemm leaves no copy of its operands or results in its workspace") {
  // A layer on caller-owned parameters must hold no copy of them: the packed blocks and the
  // accumulators are zeroed before run() returns (tests/layer/caller_params_test.cpp audits the
  // heap of a whole layer).
  const int M = 70, N = 20, K = 150;  // two row blocks, two k steps
  std::vector<double> a(static_cast<std::size_t>(M) * K, 1.5),
      b(static_cast<std::size_t>(K) * N, -2.5), c(static_cast<std::size_t>(M) * N, 0.0);
  const long long rows[2] = {0, M};
  const grouped_gemm_args<double, double, double> args{
      .grouping = kernels::gemm_grouping::rows_are_m,
      .groups = 1,
      .n = N,
      .k = K,
      .host_offsets = rows,
      .a = {a.data(), K, 1, 0},
      .b = {b.data(), N, 1, 0},
      .c = {c.data(), N, 1, 0}};
  using G = host_gemm<double, double, double>;
  REQUIRE(G::can_implement(args));
  std::vector<std::byte> ws(G::workspace_bytes(args), std::byte{0});
  host_exec x;
  G g;
  REQUIRE(g.initialize(x, args, ws));
  REQUIRE(g.run(x));
  for (double v : c) CHECK(v == 1.5 * -2.5 * K);
  CHECK(std::all_of(ws.begin(), ws.end(), [](std::byte v) { return v == std::byte{0}; }));
}
