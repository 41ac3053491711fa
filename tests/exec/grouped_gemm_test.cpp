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

using namespace moefold;
namespace k = moefold::kernels;

// The protocol, checked at compile time: simt_gemm on every context, host_gemm on host_exec only.
static_assert(grouped_gemm_backend<simt_gemm<float, float, float>, host_exec>);
static_assert(grouped_gemm_backend<simt_gemm<bfloat16, bfloat16, float>, cpu_exec>);
static_assert(grouped_gemm_backend<host_gemm<double, double, double>, host_exec>);
static_assert(!grouped_gemm_backend<host_gemm<float, float, float>, cpu_exec>);
static_assert(std::is_aggregate_v<grouped_gemm_args<float, float, float>>);

namespace {

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class TA_, class TB_, class TC_>
struct types {
  using TA = TA_;
  using TB = TB_;
  using TC = TC_;
};

// One grouped GEMM on the host: operands as flat vectors, the addressing of
// kernels/grouped_gemm.hpp relative to each vector's start; row ranges from counts.
template <class TA, class TB, class TC>
struct problem {
  std::string label;
  k::gemm_grouping grouping = k::gemm_grouping::rows_are_m;
  int m = 0, n = 0, k = 0;
  std::vector<long long> offsets;  // [groups + 1]
  std::vector<TA> a;
  std::vector<TB> b;
  std::vector<TC> c0;  // C before the runs
  k::gemm_operand<const TA> ao{};
  k::gemm_operand<const TB> bo{};
  k::gemm_operand<TC> co{};  // data: offsets from the vectors' starts (as pointers from null)
  bool accumulate = false;

  [[nodiscard]] int groups() const { return static_cast<int>(offsets.size()) - 1; }
  [[nodiscard]] bool by_m() const { return grouping == k::gemm_grouping::rows_are_m; }

  // The arguments over buffers at pa, pb, pc (in some context's memory), host row ranges.
  [[nodiscard]] grouped_gemm_args<TA, TB, TC> args(const TA* pa, const TB* pb, TC* pc) const {
    return {.grouping = grouping,
            .groups = groups(),
            .m = m,
            .n = n,
            .k = k,
            .host_offsets = offsets,
            .a = {pa, ao.s0, ao.s1, ao.group_stride},
            .b = {pb, bo.s0, bo.s1, bo.group_stride},
            .c = {pc, co.s0, co.s1, co.group_stride},
            .accumulate = accumulate};
  }
};

std::vector<long long> offsets_of(const std::vector<long long>& counts) {
  std::vector<long long> off(counts.size() + 1, 0);
  for (std::size_t g = 0; g < counts.size(); ++g) off[g + 1] = off[g] + counts[g];
  return off;
}

template <class T>
std::vector<T> random_vec(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(rng));
  return v;
}
template <class T>
std::vector<T> nan_vec(std::size_t n) {
  return std::vector<T>(n, T(std::numeric_limits<float>::quiet_NaN()));
}

// The shapes of the library, on fresh inputs.
template <class TA, class TB, class TC>
std::vector<problem<TA, TB, TC>> make_problems(std::mt19937_64& rng) {
  using P = problem<TA, TB, TC>;
  std::vector<P> ps;
  auto fill_c = [&](P& p, std::size_t size) {  // NaN where C is overwritten: never read
    p.c0 = p.accumulate ? random_vec<TC>(size, rng) : nan_vec<TC>(size);
  };
  // rows_are_m: C [R, N] (ldc = N + 2) from A [R, K] and B_g [K, N].
  auto by_m = [&](const char* label, std::vector<long long> counts, int K, int N, bool a_transposed,
                  bool b_transposed, bool accumulate) {
    P p;
    p.label = label;
    p.grouping = k::gemm_grouping::rows_are_m;
    p.n = N;
    p.k = K;
    p.offsets = offsets_of(counts);
    const long long R = p.offsets.back(), G = p.groups();
    if (a_transposed) {  // A^T stored [K, R + 1]: s0 = 1, s1 = R + 1
      p.a = random_vec<TA>(static_cast<std::size_t>(K * (R + 1) + 1), rng);
      p.ao = {nullptr, 1, R + 1, 0};
    } else {  // A [R, K + 3]
      p.a = random_vec<TA>(static_cast<std::size_t>(R * (K + 3) + 1), rng);
      p.ao = {nullptr, K + 3, 1, 0};
    }
    const long long wg = static_cast<long long>(N) * K + 5;  // padded between experts
    p.b = random_vec<TB>(static_cast<std::size_t>(G * wg), rng);
    // Transposed: fc1's weights W_g [N, K] as B (k, n); plain: W_g [K, N].
    p.bo = b_transposed ? k::gemm_operand<const TB>{nullptr, 1, K, wg}
                        : k::gemm_operand<const TB>{nullptr, N, 1, wg};
    p.co = {nullptr, N + 2, 1, 0};
    p.accumulate = accumulate;
    fill_c(p, static_cast<std::size_t>(R * (N + 2) + 1));
    ps.push_back(std::move(p));
  };
  // rows_are_k: C_g [M, N] (ldc = N + 1, groups M (N + 1) + 2 apart) from A = X^T, X [R, M + 1],
  // and B [R, N + 3].
  auto by_k = [&](const char* label, std::vector<long long> counts, int M, int N, bool accumulate) {
    P p;
    p.label = label;
    p.grouping = k::gemm_grouping::rows_are_k;
    p.m = M;
    p.n = N;
    p.offsets = offsets_of(counts);
    const long long R = p.offsets.back(), G = p.groups();
    p.a = random_vec<TA>(static_cast<std::size_t>(R * (M + 1) + 1), rng);
    p.ao = {nullptr, 1, M + 1, 0};
    p.b = random_vec<TB>(static_cast<std::size_t>(R * (N + 3) + 1), rng);
    p.bo = {nullptr, N + 3, 1, 0};
    const long long cg = static_cast<long long>(M) * (N + 1) + 2;
    p.co = {nullptr, N + 1, 1, cg};
    p.accumulate = accumulate;
    fill_c(p, static_cast<std::size_t>(G * cg));
    ps.push_back(std::move(p));
  };
  by_m("forward, transposed weights", {0, 5, 0, 37, 1, 0}, 19, 35, false, true, false);
  by_m("data gradient, transposed A", {0, 5, 0, 37, 1, 0}, 19, 35, true, false, true);
  by_m("one group", {29}, 33, 8, false, false, true);
  by_m("k = 0", {3, 0, 2}, 0, 5, false, false, false);
  by_k("weight gradient", {0, 3, 40, 0, 17, 0}, 21, 13, true);
  by_k("weight gradient, empty groups zeroed", {0, 3, 40, 0, 17, 0}, 21, 13, false);
  by_k("weight gradient, one group", {50}, 9, 34, true);
  return ps;
}

// The fp64 reference of C after `runs` runs, and a bound of the error of each output.
template <class TA, class TB, class TC>
void reference(const problem<TA, TB, TC>& p, int runs, std::vector<double>& ref,
               std::vector<double>& bound, std::vector<char>& named) {
  using acc_t = typename k::grouped_gemm_kernel<TA, TB, TC>::acc_t;
  const double eps = std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24;
  const double eps_c = std::is_same_v<TC, double> ? 0x1p-53 : 0x1p-24;
  ref.assign(p.c0.size(), 0.0);
  bound.assign(p.c0.size(), 0.0);
  named.assign(p.c0.size(), 0);
  for (int g = 0; g < p.groups(); ++g) {
    const long long first = p.offsets[g], rows = p.offsets[g + 1] - first;
    const long long M = p.by_m() ? rows : p.m, K = p.by_m() ? p.k : rows;
    const long long a0 = p.by_m() ? first * p.ao.s0 : first * p.ao.s1;
    const long long b0 = p.by_m() ? g * p.bo.group_stride : first * p.bo.s0;
    const long long c0 = p.by_m() ? first * p.co.s0 : g * p.co.group_stride;
    for (long long i = 0; i < M; ++i)
      for (long long j = 0; j < p.n; ++j) {
        double sum = 0, mag = 0;
        for (long long q = 0; q < K; ++q) {
          const double x =
              detail::widen(p.a[static_cast<std::size_t>(a0 + i * p.ao.s0 + q * p.ao.s1)]);
          const double y =
              detail::widen(p.b[static_cast<std::size_t>(b0 + q * p.bo.s0 + j * p.bo.s1)]);
          sum += x * y;
          mag += std::abs(x * y);
        }
        const auto at = static_cast<std::size_t>(c0 + i * p.co.s0 + j * p.co.s1);
        const double old = p.accumulate ? static_cast<double>(detail::widen(p.c0[at])) : 0.0;
        const int times = p.accumulate ? runs : 1;
        ref[at] = old + times * sum;
        // K + 2 roundings of sum |a b| per run in the accumulator, the add to C, the rounding
        // to TC: doubled for slack.
        bound[at] = 2 * (eps * static_cast<double>(K + 2) * (times * mag + std::abs(old)) +
                         eps_c * std::abs(ref[at])) +
                    1e-300;
        named[at] = 1;
      }
  }
}

template <class T, class Exec>
exec_buffer<T, Exec> upload(Exec& x, const std::vector<T>& h) {
  auto b = exec_buffer<T, Exec>::make(x, 1, static_cast<std::int64_t>(h.size()));
  REQUIRE(b);
  const int n = static_cast<int>(h.size());
  REQUIRE(x.copy(row_view<const T>(h.data(), 1, n), b->view()));
  return std::move(*b);
}
template <class T, class Exec>
std::vector<T> download(Exec& x, const exec_buffer<T, Exec>& b, std::size_t n) {
  std::vector<T> h(n);
  REQUIRE(x.copy(b.cview(), row_view<T>(h.data(), 1, static_cast<int>(n))));
  return h;
}

// Where the row ranges come from: the host, or the context with a row bound of rows + slack.
struct offsets_mode {
  bool on_context = false;
  long long slack = 0;
};

// C after `runs` runs of backend G on a fresh context Exec, operands copied in and out.
template <class G, class Exec, class TA, class TB, class TC>
std::vector<TC> run_backend(const problem<TA, TB, TC>& p, offsets_mode mode, int runs,
                            std::uint64_t seed) {
  Exec x{};
  if constexpr (std::is_same_v<Exec, cpu_exec>) x = cpu_exec{seed};
  const auto a = upload(x, p.a);
  const auto b = upload(x, p.b);
  auto c = upload(x, p.c0);
  const auto offsets = upload(x, p.offsets);
  auto args = p.args(a.view().data(), b.view().data(), c.view().data());
  if (mode.on_context) {
    args.host_offsets = {};
    args.offsets = offsets.view().data();
    args.row_bound = p.offsets.back() + mode.slack;
  }
  REQUIRE(G::can_implement(args));
  const std::size_t bytes = G::workspace_bytes(args);
  if (mode.on_context && std::is_same_v<G, simt_gemm<TA, TB, TC>>) CHECK(bytes == 0);
  auto ws = exec_buffer<std::byte, Exec>::make(x, 1, static_cast<std::int64_t>(bytes));
  REQUIRE(ws);
  G gemm;
  REQUIRE(gemm.initialize(x, args, std::span<std::byte>(ws->view().data(), bytes)));
  for (int r = 0; r < runs; ++r) REQUIRE(gemm.run(x));
  return download(x, c, p.c0.size());
}

struct check_stats {
  long outputs = 0;
  double worst = 0;  // |C - ref| over its bound
};

template <class TA, class TB, class TC>
void check_against_reference(const problem<TA, TB, TC>& p, const std::vector<TC>& got, int runs,
                             check_stats& st) {
  std::vector<double> ref, bound;
  std::vector<char> named;
  reference(p, runs, ref, bound, named);
  long bad = 0, touched = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!named[i]) {  // padding: never written
      if (!same_bits(got[i], p.c0[i])) ++touched;
      continue;
    }
    const double err = std::abs(static_cast<double>(detail::widen(got[i])) - ref[i]);
    ++st.outputs;
    if (!(err <= bound[i])) {  // NaN fails too
      if (bad++ < 3)
        MESSAGE("output " << i << ": " << static_cast<double>(detail::widen(got[i])) << " against "
                          << ref[i] << " (bound " << bound[i] << ")");
    } else {
      st.worst = std::max(st.worst, err / bound[i]);
    }
  }
  CHECK(bad == 0);
  CHECK(touched == 0);
}

}  // namespace

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
