// The grouped-GEMM tests' problems (tests/exec/grouped_gemm_test.cpp, library_gemm_test.cpp):
// one grouped GEMM on the host with operands as flat vectors in the shapes the library uses, its
// fp64 reference with an error bound per output, and a backend run on a fresh context.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/grouped_gemm.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/exec/simt_gemm.hpp>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace gemm_test {

using namespace moefold;
namespace k = moefold::kernels;

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

inline std::vector<long long> offsets_of(const std::vector<long long>& counts) {
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
// `counts_of`, when given, replaces each problem's rows per group (pad mode's uniform groups).
template <class TA, class TB, class TC>
std::vector<problem<TA, TB, TC>> make_problems(
    std::mt19937_64& rng,
    const std::function<std::vector<long long>(std::vector<long long>)>& counts_of = {}) {
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
    p.offsets = offsets_of(counts_of ? counts_of(counts) : counts);
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
    p.offsets = offsets_of(counts_of ? counts_of(counts) : counts);
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
  // The unit roundoff of TC: C's one rounding (bf16 outputs too).
  const double eps_c = std::is_same_v<TC, double>     ? 0x1p-53
                       : std::is_same_v<TC, bfloat16> ? 0x1p-8
                                                      : 0x1p-24;
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
        // A TC narrower than the accumulator (bf16) rounds C after every run, each rounding
        // within eps_c of a value of at most |C0| + times sum |a b|.
        const double rounding_c = std::is_same_v<TC, bfloat16>
                                      ? eps_c * times * (std::abs(old) + times * mag)
                                      : eps_c * std::abs(ref[at]);
        bound[at] =
            2 * (eps * static_cast<double>(K + 2) * (times * mag + std::abs(old)) + rounding_c) +
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

}  // namespace gemm_test
