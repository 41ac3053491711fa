// The library backends of the grouped-GEMM seam (cublas_dense, cublas_strided, cutlass_sm90) on
// the CPU: their descriptions (cuBLAS's column-major calls, CUTLASS's argument arrays) executed by
// host_blas, which asserts the libraries' rules. host_blas sums as simt_gemm does, so a backend's
// result equals simt_gemm's bit for bit exactly when its description addresses the right elements
// (and against fp64 within the bound of grouped_gemm_test.cpp). On fresh random inputs (seed
// printed): the shapes of the library with odd strides, empty groups, uniform groups (pad mode),
// bf16 layer shapes with 16-byte aligned odd leading dimensions; row ranges on the host and on the
// context. The argument arrays bit for bit against a host builder written here; every refusal
// named; the fallback taken and its reason.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <moefold/comm/thread_world.hpp>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/cublas_dense.hpp>
#include <moefold/exec/cublas_strided.hpp>
#include <moefold/exec/cutlass_sm90.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/fallback_gemm.hpp>
#include <moefold/exec/gemm_policy.hpp>
#include <moefold/exec/host_blas.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/exec/simt_gemm.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/experts/shared_expert.hpp>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/simt_test_sizes.hpp"
#include "gemm_problems.hpp"

using namespace moefold;
using namespace gemm_test;
namespace k = moefold::kernels;

// Each backend runs where its description has an executor: the host contexts through host_blas.
static_assert(grouped_gemm_backend<cublas_dense<float, float, float>, host_exec>);
static_assert(grouped_gemm_backend<cublas_dense<bfloat16, bfloat16, float>, cpu_exec>);
static_assert(grouped_gemm_backend<cublas_strided<double, double, double>, cpu_exec>);
static_assert(grouped_gemm_backend<cutlass_sm90<bfloat16, bfloat16, bfloat16>, cpu_exec>);
static_assert(grouped_gemm_backend<cutlass_sm90<bfloat16, bfloat16, float>, host_exec>);
static_assert(grouped_gemm_backend<
              fallback_gemm<cutlass_sm90<float, float, float>, simt_gemm<float, float, float>>,
              cpu_exec>);

namespace {

template <class T>
bool same_vec(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Backend G's C on both host contexts equals simt_gemm's on cpu_exec bit for bit, and fp64's.
template <class G, class TA, class TB, class TC>
void check_backend(const problem<TA, TB, TC>& p, offsets_mode mode, std::mt19937_64& rng,
                   check_stats& st) {
  const int runs = 2;
  const auto want = run_backend<simt_gemm<TA, TB, TC>, cpu_exec>(p, mode, runs, rng());
  {
    const std::string who = std::string(G::name) + " on cpu_exec";
    INFO(who);
    const auto got = run_backend<G, cpu_exec>(p, mode, runs, rng());
    CHECK(same_vec(got, want));
    check_against_reference(p, got, runs, st);
  }
  {
    const std::string who = std::string(G::name) + " on host_exec";
    INFO(who);
    CHECK(same_vec(run_backend<G, host_exec>(p, mode, runs, 0), want));
  }
}

// The layer's expert GEMMs in bf16 with 16-byte aligned, odd leading dimensions (H + 8, F1 + 8):
// fc1 x W1^T and fc2 h W2^T (A K-major, B K-major), the data gradients dy W2 and da W1 (A K-major,
// B N-major), into bf16; the weight gradients (A M-major, B N-major) added into fp32.
struct layer_dims {
  int H = 24, F = 40;
};
problem<bfloat16, bfloat16, bfloat16> forward_problem(const char* label,
                                                      const std::vector<long long>& counts,
                                                      bool b_n_major, layer_dims d,
                                                      std::mt19937_64& rng) {
  problem<bfloat16, bfloat16, bfloat16> p;
  p.label = label;
  p.grouping = k::gemm_grouping::rows_are_m;
  p.n = d.F;
  p.k = d.H;
  p.offsets = offsets_of(counts);
  const long long R = p.offsets.back(), G = p.groups(), lda = d.H + 8, ldc = d.F + 8;
  p.a = random_vec<bfloat16>(static_cast<std::size_t>(R * lda + 8), rng);
  p.ao = {nullptr, lda, 1, 0};
  const long long wg = static_cast<long long>(d.F) * d.H + 16;  // experts 16 elements apart
  p.b = random_vec<bfloat16>(static_cast<std::size_t>(G * wg), rng);
  // K-major: W [F, H] as B (k = h, n = f); N-major: W [H, F] as B (k = h, n = f).
  p.bo = b_n_major ? k::gemm_operand<const bfloat16>{nullptr, d.F, 1, wg}
                   : k::gemm_operand<const bfloat16>{nullptr, 1, d.H, wg};
  p.co = {nullptr, ldc, 1, 0};
  p.c0 = nan_vec<bfloat16>(static_cast<std::size_t>(R * ldc + 8));
  return p;
}
problem<bfloat16, bfloat16, float> wgrad_problem(const char* label,
                                                 const std::vector<long long>& counts, layer_dims d,
                                                 std::mt19937_64& rng) {
  problem<bfloat16, bfloat16, float> p;
  p.label = label;
  p.grouping = k::gemm_grouping::rows_are_k;
  p.m = d.F;
  p.n = d.H;
  p.offsets = offsets_of(counts);
  const long long R = p.offsets.back(), G = p.groups(), lda = d.F + 8, ldb = d.H + 8;
  p.a = random_vec<bfloat16>(static_cast<std::size_t>(R * lda + 8), rng);  // da [R, F]: A = da^T
  p.ao = {nullptr, 1, lda, 0};
  p.b = random_vec<bfloat16>(static_cast<std::size_t>(R * ldb + 8), rng);  // x [R, H]
  p.bo = {nullptr, ldb, 1, 0};
  const long long cg = static_cast<long long>(d.F) * d.H + 4;  // fp32: 16 bytes apart
  p.co = {nullptr, d.H, 1, cg};
  p.accumulate = true;
  p.c0 = random_vec<float>(static_cast<std::size_t>(G * cg), rng);
  return p;
}

const std::vector<std::vector<long long>> layer_counts = {
    {0, 1, 7, 0, 33, 0},  // empty groups first, inside and last
    {0, 0, 0},            // all empty
    {40},                 // one group
    {64, 1, 1, 2, 0, 3},  // skewed
};

}  // namespace

TEST_CASE_TEMPLATE("cublas_dense: the seam's problems through cuBLAS's calls, bit for bit", Ty,
                   types<float, float, float>, types<bfloat16, bfloat16, float>,
                   types<double, double, double>) {
  using TA = typename Ty::TA;
  using TB = typename Ty::TB;
  using TC = typename Ty::TC;
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  check_stats st;
  for (const auto& p : make_problems<TA, TB, TC>(rng)) {
    CAPTURE(p.label);
    check_backend<cublas_dense<TA, TB, TC>>(p, {}, rng, st);
  }
  CHECK(st.outputs > 0);
}

TEST_CASE_TEMPLATE("cublas_strided: pad mode's uniform groups as one strided batch, bit for bit",
                   Ty, types<float, float, float>, types<bfloat16, bfloat16, float>,
                   types<bfloat16, bfloat16, bfloat16>) {
  using TA = typename Ty::TA;
  using TB = typename Ty::TB;
  using TC = typename Ty::TC;
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  check_stats st;
  for (const long long R : {0LL, 1LL, 13LL}) {
    CAPTURE(R);
    // make_problems' shapes with every group at R rows.
    const auto uniform = [R](std::vector<long long> counts) {
      return std::vector<long long>(counts.size(), R);
    };
    for (const auto& q : make_problems<TA, TB, TC>(rng, uniform)) {
      CAPTURE(q.label);
      check_backend<cublas_strided<TA, TB, TC>>(q, {}, rng, st);
    }
  }
  CHECK(st.outputs > 0);
}

TEST_CASE("cutlass_sm90: the layer's bf16 GEMMs through CUTLASS's argument arrays, bit for bit") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  check_stats st;
  const layer_dims d{};
  for (const auto& counts : layer_counts) {
    for (const offsets_mode mode :
         {offsets_mode{false, 0}, offsets_mode{true, 0}, offsets_mode{true, 50}}) {
      CAPTURE(mode.on_context);
      for (const bool n_major : {false, true}) {
        const auto p =
            forward_problem(n_major ? "data gradient" : "forward", counts, n_major, d, rng);
        CAPTURE(p.label);
        check_backend<cutlass_sm90<bfloat16, bfloat16, bfloat16>>(p, mode, rng, st);
      }
      const auto w = wgrad_problem("weight gradient", counts, d, rng);
      CAPTURE(w.label);
      check_backend<cutlass_sm90<bfloat16, bfloat16, float>>(w, mode, rng, st);
    }
  }
  CHECK(st.outputs > 0);
}

TEST_CASE("cutlass_sm90: the argument arrays bit for bit against a host builder") {
  const auto seed = test::simt_seed();
  std::mt19937_64 rng(seed);
  const layer_dims d{};
  cpu_exec x{rng()};
  auto check_arrays = [&](const auto& p) {
    using TA = std::decay_t<decltype(p.a[0])>;
    using TB = std::decay_t<decltype(p.b[0])>;
    using TC = std::decay_t<decltype(p.c0[0])>;
    const auto a = upload(x, p.a);
    const auto b = upload(x, p.b);
    auto c = upload(x, p.c0);
    const auto offsets = upload(x, p.offsets);
    auto args = p.args(a.view().data(), b.view().data(), c.view().data());
    args.host_offsets = {};
    args.offsets = offsets.view().data();
    args.row_bound = p.offsets.back();
    using G = cutlass_sm90<TA, TB, TC>;
    REQUIRE(G::can_implement(args));
    auto ws = exec_buffer<std::byte, cpu_exec>::make(x, 1, G::workspace_bytes(args));
    REQUIRE(ws);
    G g;
    REQUIRE(
        g.initialize(x, args, std::span<std::byte>(ws->view().data(), G::workspace_bytes(args))));
    const auto& arr = g.arrays();
    const int L = p.groups();
    REQUIRE(arr.groups == L);
    const auto get = [&](const auto* ptr, int n) {
      using V = std::remove_cv_t<std::remove_pointer_t<decltype(ptr)>>;
      std::vector<V> h(static_cast<std::size_t>(n));
      REQUIRE(x.copy(row_view<const V, cpu_device_space>(ptr, 1, n), row_view<V>(h.data(), 1, n)));
      return h;
    };
    const auto shapes = get(arr.shapes, 3 * L);
    const auto pa = get(arr.a, L);
    const auto pb = get(arr.b, L);
    const auto pc = get(arr.c, L);
    const auto lda = get(arr.lda, L), ldb = get(arr.ldb, L), ldc = get(arr.ldc, L);
    // The host builder: CUTLASS's shapes and first elements from the row ranges.
    for (int e = 0; e < L; ++e) {
      CAPTURE(e);
      const long long first = p.offsets[e], rows = p.offsets[e + 1] - first;
      const bool empty = rows == 0;
      const int M = p.by_m() ? static_cast<int>(rows) : p.m;
      const int K = p.by_m() ? p.k : static_cast<int>(rows);
      CHECK(shapes[3 * e] == (empty ? 0 : M));
      CHECK(shapes[3 * e + 1] == (empty ? 0 : p.n));
      CHECK(shapes[3 * e + 2] == (empty ? 0 : K));
      const TA* a0 = args.a.data;
      const TB* b0 = args.b.data;
      TC* c0 = args.c.data;
      if (!empty) {
        a0 += p.by_m() ? first * p.ao.s0 : first * p.ao.s1;
        b0 += p.by_m() ? e * p.bo.group_stride : first * p.bo.s0;
        c0 += p.by_m() ? first * p.co.s0 : e * p.co.group_stride;
      }
      CHECK(pa[e] == a0);
      CHECK(pb[e] == b0);
      CHECK(pc[e] == c0);
      CHECK(lda[e] == (arr.a_major == k::gemm_major::k ? p.ao.s0 : p.ao.s1));
      CHECK(ldb[e] == (arr.b_major == k::gemm_major::k ? p.bo.s1 : p.bo.s0));
      CHECK(ldc[e] == p.co.s0);
    }
    return arr;
  };
  for (const auto& counts : layer_counts) {
    CAPTURE(counts.size());
    const auto f = check_arrays(forward_problem("forward", counts, false, d, rng));
    CHECK(f.a_major == k::gemm_major::k);
    CHECK(f.b_major == k::gemm_major::k);
    CHECK_FALSE(f.accumulate);
    const auto g = check_arrays(forward_problem("data gradient", counts, true, d, rng));
    CHECK(g.a_major == k::gemm_major::k);
    CHECK(g.b_major == k::gemm_major::mn);
    const auto w = check_arrays(wgrad_problem("weight gradient", counts, d, rng));
    CHECK(w.a_major == k::gemm_major::mn);
    CHECK(w.b_major == k::gemm_major::mn);
    CHECK(w.accumulate);
  }
}

namespace {

template <class G>
void refused(const typename G::args_type& a, errc code, const std::string& words) {
  const status st = G::can_implement(a);
  REQUIRE_FALSE(st);
  CHECK(st.error().code == code);
  CHECK_MESSAGE(st.error().message.rfind(std::string(G::name) + ": ", 0) == 0, st.error().message);
  CHECK_MESSAGE(st.error().message.find(words) != std::string::npos, st.error().message);
  G g;
  host_exec x;
  std::vector<std::byte> ws(1 << 16);
  CHECK_FALSE(g.initialize(x, a, ws));
  CHECK_FALSE(g.run(x));
}

}  // namespace

TEST_CASE("library backends: can_implement refuses each rule, naming it") {
  std::mt19937_64 rng(test::simt_seed());
  const layer_dims d{};
  const auto fwd = forward_problem("forward", {3, 0, 5}, false, d, rng);
  auto fa = fwd.args(fwd.a.data(), fwd.b.data(), const_cast<bfloat16*>(fwd.c0.data()));
  using C16 = cutlass_sm90<bfloat16, bfloat16, bfloat16>;
  using C32 = cutlass_sm90<bfloat16, bfloat16, float>;
  REQUIRE(C16::can_implement(fa));
  REQUIRE(cublas_dense<bfloat16, bfloat16, bfloat16>::can_implement(fa));
  auto with = [](auto a, auto change) {
    change(a);
    return a;
  };
  using A16 = grouped_gemm_args<bfloat16, bfloat16, bfloat16>;
  SUBCASE("cutlass_sm90") {
    refused<cutlass_sm90<float, float, float>>({.groups = 3, .host_offsets = fwd.offsets},
                                               errc::not_supported,
                                               "takes bf16 A and B into bf16 or fp32 C");
    refused<C16>(with(fa, [](A16& a) { a.a.s0 = 30; }), errc::not_supported,
                 "A's leading dimension (30 elements) must be a multiple of 16 bytes");
    refused<C16>(with(fa, [](A16& a) { a.c.s0 = 44; }), errc::not_supported,
                 "C's leading dimension (44 elements)");
    refused<C16>(with(fa, [](A16& a) { a.k = 20; }), errc::not_supported,
                 "A's contiguous extent (20 elements) must be a multiple of 16 bytes");
    refused<C16>(with(fa, [](A16& a) { ++a.a.data; }), errc::not_supported,
                 "A's address must be 16-byte aligned");
    refused<C16>(with(fa, [](A16& a) { a.b.group_stride += 1; }), errc::not_supported,
                 "B's group stride must be a multiple of 16 bytes");
    refused<C16>(with(fa, [](A16& a) { a.accumulate = true; }), errc::not_supported,
                 "no kernel instantiated for A K-major, B K-major, C bfloat16 with accumulate");
    refused<C16>(with(fa,
                      [](A16& a) {
                        a.a = {a.a.data, 2, 2, 0};
                      }),
                 errc::not_supported, "each operand needs a unit stride");
    refused<C16>(with(fa,
                      [](A16& a) {
                        a.a = {a.a.data, 1, 32, 0};
                      }),
                 errc::not_supported, "no kernel instantiated for A MN-major");
    const auto w = wgrad_problem("weight gradient", {3, 0, 5}, d, rng);
    auto wa = w.args(w.a.data(), w.b.data(), const_cast<float*>(w.c0.data()));
    REQUIRE(C32::can_implement(wa));
    using A32 = grouped_gemm_args<bfloat16, bfloat16, float>;
    refused<C32>(with(wa, [](A32& a) { a.accumulate = false; }), errc::not_supported,
                 "no kernel instantiated");
    refused<C32>(with(wa, [](A32& a) { a.c.group_stride += 2; }), errc::not_supported,
                 "C's group stride must be a multiple of 16 bytes");
  }
  SUBCASE("cublas_dense and cublas_strided") {
    using D = cublas_dense<bfloat16, bfloat16, bfloat16>;
    using S = cublas_strided<bfloat16, bfloat16, bfloat16>;
    refused<cublas_dense<float, bfloat16, float>>(
        {.groups = 3, .host_offsets = fwd.offsets}, errc::not_supported,
        "cuBLAS takes A and B of one type and C of that type (or fp32 for 16-bit inputs); got "
        "float32 x bfloat16 -> float32");
    const long long on_device[4] = {0, 3, 3, 8};
    refused<D>(with(fa,
                    [&](A16& a) {
                      a.host_offsets = {};
                      a.offsets = on_device;
                      a.row_bound = 8;
                    }),
               errc::not_supported, "needs the row ranges on the host");
    refused<D>(with(fa,
                    [](A16& a) {
                      a.a = {a.a.data, 2, 2, 0};
                    }),
               errc::not_supported, "A (m, k) needs a unit stride");
    refused<D>(with(fa,
                    [](A16& a) {
                      a.c = {a.c.data, 1, 48, 0};
                    }),
               errc::not_supported, "C must be row-major");
    refused<S>(fa, errc::not_supported,
               "every group must hold the same rows (pad mode): host_offsets[2] = 3, not 2 x 3");
  }
}

TEST_CASE("host_blas: each library rule broken in a description is an error naming it") {
  std::vector<float> a(256, 1.0f), b(256, 1.0f), c(256, 0.0f);
  const blas_gemm_call<float, float, float> good{.m = 4,
                                                 .n = 3,
                                                 .k = 5,
                                                 .a = a.data(),
                                                 .lda = 4,
                                                 .b = b.data(),
                                                 .ldb = 5,
                                                 .c = c.data(),
                                                 .ldc = 4};
  REQUIRE(host_blas::gemm(good));
  for (float v : std::span(c).first(12)) CHECK(v == 5.0f);
  const auto bad = [](auto call, const std::string& words) {
    const status st = host_blas::gemm(call);
    REQUIRE_FALSE(st);
    CHECK_MESSAGE(st.error().message.find(words) != std::string::npos, st.error().message);
  };
  auto g = good;
  g.lda = 3;
  bad(g, "host_blas: cuBLAS: lda = 3 < max(1, rows of A) = 4");
  g = good;
  g.transb = blas_op::t;
  g.ldb = 2;
  bad(g, "ldb = 2 < max(1, rows of B) = 3");
  g = good;
  g.ldc = 2;
  bad(g, "ldc = 2 < max(1, m) = 4");
  g = good;
  g.k = -1;
  bad(g, "m, n, k and batch must be >= 0");
  g = good;
  g.c = nullptr;
  bad(g, "C must be present");

  // CUTLASS's arrays: one group, then each rule broken.
  alignas(16) bfloat16 A[64], B[64], D[64];
  int shapes[3] = {2, 8, 8};
  const bfloat16* pa[1] = {A};
  const bfloat16* pb[1] = {B};
  bfloat16* pd[1] = {D};
  long long lda[1] = {8}, ldb[1] = {8}, ldc[1] = {8};
  const k::grouped_gemm_arrays<bfloat16, bfloat16, bfloat16> arr{
      .groups = 1, .shapes = shapes, .a = pa, .b = pb, .c = pd, .lda = lda, .ldb = ldb, .ldc = ldc};
  for (auto& v : A) v = bfloat16(1.0f);
  for (auto& v : B) v = bfloat16(2.0f);
  REQUIRE(host_blas::grouped(arr));
  CHECK(static_cast<float>(D[0]) == 16.0f);
  const auto bad_arrays = [&](const std::string& words) {
    const status st = host_blas::grouped(arr);
    REQUIRE_FALSE(st);
    CHECK_MESSAGE(st.error().message.find(words) != std::string::npos, st.error().message);
  };
  shapes[2] = 0;
  bad_arrays("host_blas: CUTLASS grouped GEMM, group 0: K = 0 with M N > 0");
  shapes[2] = 8;
  lda[0] = 4;
  bad_arrays("A's leading dimension (4 elements) must be a multiple of 16 bytes");
  lda[0] = 8;
  pb[0] = B + 1;
  bad_arrays("B's address must be 16-byte aligned");
  pb[0] = B;
  shapes[1] = 4;
  bad_arrays("C's contiguous extent (4 elements) must be a multiple of 16 bytes");
  shapes[1] = 16;
  bad_arrays("C's leading dimension (8) must be >= its contiguous extent (16)");
  shapes[1] = 8;
  shapes[0] = -1;
  bad_arrays("M, N and K must be >= 0");
}

TEST_CASE("fallback_gemm: the primary where it accepts the arguments, else the fallback") {
  std::mt19937_64 rng(test::simt_seed());
  const layer_dims d{};
  const auto p = forward_problem("forward", {3, 0, 5}, false, d, rng);
  using F = fallback_gemm<cutlass_sm90<bfloat16, bfloat16, bfloat16>,
                          simt_gemm<bfloat16, bfloat16, bfloat16>>;
  const auto want = run_backend<simt_gemm<bfloat16, bfloat16, bfloat16>, cpu_exec>(p, {}, 1, 1);
  CHECK(same_vec(run_backend<F, cpu_exec>(p, {}, 1, 2), want));
  cpu_exec x{3};
  const auto a = upload(x, p.a);
  const auto b = upload(x, p.b);
  auto c = upload(x, p.c0);
  auto args = p.args(a.view().data(), b.view().data(), c.view().data());
  auto ws = exec_buffer<std::byte, cpu_exec>::make(x, 1, F::workspace_bytes(args));
  REQUIRE(ws);
  const std::span<std::byte> w(ws->view().data(), F::workspace_bytes(args));
  F f;
  REQUIRE(f.initialize(x, args, w));
  CHECK_FALSE(f.used_fallback());
  CHECK_FALSE(f.fallback_reason().has_value());
  // A leading dimension TMA cannot take: simt_gemm runs, and the reason is the refusal.
  args.a.s0 = d.H + 1;
  REQUIRE(F::can_implement(args));
  REQUIRE(f.initialize(x, args, w));
  CHECK(f.used_fallback());
  REQUIRE(f.fallback_reason().has_value());
  CHECK(f.fallback_reason()->message.find("A's leading dimension (25 elements)") !=
        std::string::npos);
  REQUIRE(f.run(x));
}

namespace {

// cpu_exec reporting a GPU other than Hopper (compute capability 10.0): where cutlass_sm90 must
// decline at initialize and the GEMM fall back.
struct sm100_cpu_exec : cpu_exec {
  using cpu_exec::cpu_exec;
  static constexpr const char* name = "sm100_cpu_exec";
  [[nodiscard]] int compute_capability() const noexcept { return 100; }
};

}  // namespace

TEST_CASE("cutlass_sm90 declines a GPU other than sm_90, and the GEMM falls back") {
  std::mt19937_64 rng(test::simt_seed());
  const auto p = forward_problem("forward", {3, 0, 5}, false, layer_dims{}, rng);
  using G = cutlass_sm90<bfloat16, bfloat16, bfloat16>;
  using F = fallback_gemm<G, cublas_dense<bfloat16, bfloat16, bfloat16>>;
  sm100_cpu_exec x{5};
  const auto a = upload(x, p.a);
  const auto b = upload(x, p.b);
  auto c = upload(x, p.c0);
  const auto args = p.args(a.view().data(), b.view().data(), c.view().data());
  REQUIRE(G::can_implement(args));  // the arguments are fine: the device is not
  std::vector<std::byte> ws(F::workspace_bytes(args));
  G g;
  const status st = g.initialize(x, args, ws);
  REQUIRE_FALSE(st);
  CHECK(st.error().message ==
        "cutlass_sm90: the kernels need compute capability 9.0 (wgmma, TMA); this device has 10.0");
  F f;
  REQUIRE(f.initialize(x, args, ws));
  CHECK(f.used_fallback());
  CHECK(std::string(f.ran_on()) == "cublas_dense");
  CHECK(f.fallback_chain() == st.error().message);
  REQUIRE(f.run(x));
  CHECK(same_vec(download(x, c, p.c0.size()),
                 run_backend<simt_gemm<bfloat16, bfloat16, bfloat16>, cpu_exec>(p, {}, 1, 6)));
}

TEST_CASE("mlp_experts tells once which GEMMs left the tensor-core backends, and why") {
  // H = 12: rows of 24 bytes, which TMA cannot take, so the expert GEMMs of tensor_core_gemms
  // fall back (to cublas_dense: the row ranges are on the host). Each fallback is told once,
  // however many calls.
  using experts_t = mlp_experts<bfloat16, cpu_exec, tensor_core_gemms<>, float, float>;
  const mlp_shape s{.hidden = 12, .ffn = 8, .num_local_experts = 2};
  cpu_exec x{9};
  const auto n = mlp_sizes(s);
  auto w1 = exec_buffer<bfloat16, cpu_exec>::make(x, 2 * 2 * 8, 12).value();
  auto w2 = exec_buffer<bfloat16, cpu_exec>::make(x, 2 * 12, 8).value();
  auto g1 = exec_buffer<float, cpu_exec>::make(x, 2 * 2 * 8, 12).value();
  auto g2 = exec_buffer<float, cpu_exec>::make(x, 2 * 12, 8).value();
  REQUIRE(n.fc1 == 2u * 2 * 8 * 12);
  for (auto* buf : {&w1, &w2}) REQUIRE(x.fill(buf->view(), bfloat16(0.25f)));
  for (auto* buf : {&g1, &g2}) REQUIRE(x.fill(buf->view(), 0.0f));
  auto e = experts_t::make(s, {w1.cview(), w2.cview()}, {g1.view(), g2.view()}).value();
  std::vector<std::string> told;
  e.set_gemm_notice([&](std::string_view m) { told.emplace_back(m); });
  const int M = 5;
  auto rows = exec_buffer<bfloat16, cpu_exec>::make(x, M, 12).value();
  auto probs = exec_buffer<float, cpu_exec>::make(x, M, 1).value();
  auto y = exec_buffer<bfloat16, cpu_exec>::make(x, M, 12).value();
  REQUIRE(x.fill(rows.view(), bfloat16(0.5f)));
  REQUIRE(x.fill(probs.view(), 1.0f));
  const std::vector<int> counts{2, 3};
  auto ws = exec_buffer<std::byte, cpu_exec>::make(x, 1, e.workspace_bytes(M)).value();
  const std::span<std::byte> w(ws.view().data(), e.workspace_bytes(M));
  const expert_batch<bfloat16, float, cpu_device_space> batch{
      .counts = counts, .x = rows.cview(), .probs = probs.cview()};
  auto saved = exec_buffer<std::byte, cpu_exec>::make(x, 1, e.saved_bytes(M)).value();
  const std::span<std::byte> sv(saved.view().data(), e.saved_bytes(M));
  for (int call = 0; call < 3; ++call) REQUIRE(e.forward(x, batch, y.view(), sv, w));
  // fc1 and fc2 forward: once each, not three times.
  REQUIRE(told.size() == 2);
  CHECK(told == e.gemm_notices_said());
  for (const auto& m : told) {
    CAPTURE(m);
    CHECK(m.rfind("moefold: mlp_experts: fc", 0) == 0);
    CHECK(m.find("runs on cublas_dense, not cutlass_sm90: cutlass_sm90: ") != std::string::npos);
    CHECK(m.find("must be a multiple of 16 bytes") != std::string::npos);
  }
}

namespace {

// Every GEMM on cublas_dense's descriptions, no fallback: a refusal fails the run.
struct dense_only_gemms {
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using backend = cublas_dense<A, B, C>;
};

// What one rank of a shared expert computes: out and dx [N, H], its fc1, fc2 and gate gradients.
struct shared_run {
  std::vector<bfloat16> out, dx;
  std::vector<float> g1, g2, gg;
};

// A gated SwiGLU shared expert in bf16 (fp32 gradients), TP 2 over the thread world with
// sequence parallelism, on cpu_exec with the GEMM policy Gemms: forward and backward, N = 5 per
// rank, H 16 and F / TP 8 (rows of 32 and 16 bytes), deterministic values from `seed`.
template <class Gemms>
std::vector<shared_run> run_shared(std::uint64_t seed) {
  constexpr int tp = 2, N = 5, H = 16, F = 16, fs = F / tp;
  std::vector<shared_run> res(tp);
  const auto st = run_thread_world(tp, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    const int r = dw.rank();
    cpu_exec x(5 + static_cast<std::uint64_t>(r));
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(r));
    std::normal_distribution<float> nd(0.f, 0.5f);
    const auto rand = [&](std::size_t n) {
      std::vector<bfloat16> v(n);
      for (auto& e : v) e = bfloat16(nd(rng));
      return v;
    };
    using se_t = shared_expert<bfloat16, cpu_exec, thread_device_communicator, float, Gemms>;
    auto se = se_t::make(
        x, {.max_tokens = N, .hidden = H, .ffn = F, .tp = tp, .tp_rank = r, .gate = true});
    if (!se) return unexpected<error>(se.error());
    const auto up = [&](const std::vector<bfloat16>& v) { return upload(x, v); };
    auto w1 = up(rand(2 * fs * H)), w2 = up(rand(H * fs)), wg = up(rand(H));
    auto xs = up(rand(N * H)), dout = up(rand(N * H));
    auto out = up(std::vector<bfloat16>(N * H, bfloat16(0.f)));
    auto dx = up(std::vector<bfloat16>(N * H, bfloat16(0.f)));
    auto g1 = upload(x, std::vector<float>(2 * fs * H)), g2 = upload(x, std::vector<float>(H * fs)),
         gg = upload(x, std::vector<float>(H));
    using S = cpu_device_space;
    const auto rows = [](auto& b, int n, int w) {
      using U = std::remove_reference_t<decltype(*b.view().data())>;
      return row_view<U, S>(b.view().data(), n, w);
    };
    const auto crows = [&](auto& b, int n, int w) {
      using U = std::remove_reference_t<decltype(*b.view().data())>;
      return row_view<const U, S>(b.view().data(), n, w);
    };
    if (auto b = se->bind(typename se_t::views_type{.mlp = {crows(w1, 2 * fs, H), crows(w2, H, fs)},
                                                    .grads = {rows(g1, 2 * fs, H), rows(g2, H, fs)},
                                                    .gate = crows(wg, 1, H),
                                                    .gate_grad = rows(gg, 1, H)});
        !b)
      return b;
    auto saved = upload(x, std::vector<std::byte>(se->saved_bytes()));
    auto scratch = upload(x, std::vector<std::byte>(se->scratch_bytes()));
    const std::span<std::byte> sv(saved.view().data(), se->saved_bytes()),
        sc(scratch.view().data(), se->scratch_bytes());
    if (auto f = se->forward(x, crows(xs, N, H), dw, rows(out, N, H), sv, sc); !f) return f;
    if (auto b = se->backward(x, crows(dout, N, H), dw, rows(dx, N, H), sv, sc); !b) return b;
    shared_run& o = res[static_cast<std::size_t>(r)];
    o.out = download(x, out, N * H);
    o.dx = download(x, dx, N * H);
    o.g1 = download(x, g1, 2 * fs * H);
    o.g2 = download(x, g2, H * fs);
    o.gg = download(x, gg, H);
    return {};
  });
  for (const auto& e : st) REQUIRE_MESSAGE(e.has_value(), e.error().message);
  return res;
}

}  // namespace

TEST_CASE("the shared expert on cublas_dense's descriptions equals simt_gemm bit for bit (TP 2)") {
  // host_blas sums as simt_gemm does, so the same bits mean each of the shared expert's GEMMs
  // addressed the right elements on cuBLAS's column-major calls (bf16 in, bf16 out forward and
  // data gradients, fp32 weight gradients accumulated); the SIMT shared expert is checked
  // against fp64 in tests/experts/shared_expert_test.cpp and the layer tests.
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  const auto lib = run_shared<dense_only_gemms>(seed), simt = run_shared<simt_gemms>(seed);
  for (std::size_t r = 0; r < lib.size(); ++r) {
    CAPTURE(r);
    CHECK(same_vec(lib[r].out, simt[r].out));
    CHECK(same_vec(lib[r].dx, simt[r].dx));
    CHECK(same_vec(lib[r].g1, simt[r].g1));
    CHECK(same_vec(lib[r].g2, simt[r].g2));
    CHECK(same_vec(lib[r].gg, simt[r].gg));
    // Not trivially equal: the expert computed something.
    CHECK(std::any_of(lib[r].g1.begin(), lib[r].g1.end(), [](float v) { return v != 0.f; }));
  }
}
