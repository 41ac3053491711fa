// The GPU check's `gemm` step (scripts/gpu-check.sh): each library backend of the grouped-GEMM
// seam on cuda_exec (cutlass_sm90 on CUTLASS's Hopper kernels, cublas_dense, cublas_strided)
// against simt_gemm on the same device and against an fp64 host reference, on fresh random inputs
// (seed printed): groups of 0, 1, 7, 129, 1,024 and 4,096 rows, all groups empty, odd 16-byte
// aligned leading dimensions, beta = 1 run twice (C0 + 2 A B into fp32), the layer's three
// layouts (forward, data gradient, weight gradient). Cases named "small:" are what the check runs
// under compute-sanitizer memcheck and initcheck. Without a device: exit 77 (skipped), which the
// check counts as a failure where a GPU is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <moefold/exec/cublas_dense.hpp>
#include <moefold/exec/cublas_strided.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/exec/cutlass_sm90.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/simt_gemm.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using namespace moefold;
namespace k = moefold::kernels;

namespace {

std::uint64_t seed() {
  static const auto s =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return s;
}

// One grouped GEMM of the layer's shapes on the host: rows per group, the layout, the operands.
struct shape {
  std::string name;
  bool wgrad = false;       // rows_are_k into fp32 with accumulate (else rows_are_m into bf16)
  bool b_n_major = false;   // rows_are_m: the data gradient's B (else the forward's, K-major)
  int m = 0, n = 0, k = 0;  // the fixed sizes
  int pad = 8;              // elements added to each leading dimension (16-byte aligned)
  std::vector<long long> counts;
};

template <class TC>
struct operands {
  std::vector<long long> off;
  std::vector<bfloat16> a, b;
  std::vector<TC> c0;
  grouped_gemm_args<bfloat16, bfloat16, TC> args;  // pointers relative to null, filled per run
};

template <class TC>
operands<TC> make(const shape& s, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  operands<TC> o;
  o.off.assign(s.counts.size() + 1, 0);
  for (std::size_t g = 0; g < s.counts.size(); ++g) o.off[g + 1] = o.off[g] + s.counts[g];
  const long long R = o.off.back(), L = static_cast<long long>(s.counts.size());
  auto fill = [&](auto& v, long long n) {
    using V = typename std::decay_t<decltype(v)>::value_type;
    v.resize(static_cast<std::size_t>(n));
    for (auto& x : v) x = V(d(rng));
  };
  auto& a = o.args;
  a.groups = static_cast<int>(L);
  if (!s.wgrad) {
    const long long lda = s.k + s.pad, ldc = s.n + s.pad, wg = static_cast<long long>(s.n) * s.k;
    a.grouping = k::gemm_grouping::rows_are_m;
    a.n = s.n;
    a.k = s.k;
    fill(o.a, R * lda + 8);
    fill(o.b, L * wg + 8);
    a.a = {nullptr, lda, 1, 0};
    a.b = s.b_n_major ? k::gemm_operand<const bfloat16>{nullptr, s.n, 1, wg}
                      : k::gemm_operand<const bfloat16>{nullptr, 1, s.k, wg};
    a.c = {nullptr, ldc, 1, 0};
    o.c0.assign(static_cast<std::size_t>(R * ldc + 8), TC(std::nanf("")));
  } else {
    const long long lda = s.m + s.pad, ldb = s.n + s.pad, cg = static_cast<long long>(s.m) * s.n;
    a.grouping = k::gemm_grouping::rows_are_k;
    a.m = s.m;
    a.n = s.n;
    a.accumulate = true;
    fill(o.a, R * lda + 8);
    fill(o.b, R * ldb + 8);
    a.a = {nullptr, 1, lda, 0};
    a.b = {nullptr, ldb, 1, 0};
    a.c = {nullptr, s.n, 1, cg};
    fill(o.c0, L * cg + 8);
  }
  return o;
}

// C after `runs` runs of backend G on a cuda_exec, row ranges on the host or on the device.
template <class G, class TC>
std::vector<TC> run(cuda_exec& x, const operands<TC>& o, bool device_offsets, int runs) {
  auto up = [&](const auto& v) {
    using V = typename std::decay_t<decltype(v)>::value_type;
    auto b = exec_buffer<V, cuda_exec>::make(x, 1, static_cast<std::int64_t>(v.size())).value();
    REQUIRE(x.copy(row_view<const V>(v.data(), 1, static_cast<int>(v.size())), b.view()));
    return b;
  };
  const auto a = up(o.a);
  const auto b = up(o.b);
  const auto off = up(o.off);
  auto c = up(o.c0);
  auto args = o.args;
  args.a.data = a.view().data();
  args.b.data = b.view().data();
  args.c.data = c.view().data();
  if (device_offsets) {
    args.offsets = off.view().data();
    args.row_bound = o.off.back();
  } else {
    args.host_offsets = o.off;
  }
  const status can = G::can_implement(args);
  REQUIRE_MESSAGE(can, (can ? std::string() : can.error().message));
  const std::size_t bytes = G::workspace_bytes(args);
  auto ws = exec_buffer<std::byte, cuda_exec>::make(x, 1, static_cast<std::int64_t>(bytes)).value();
  G g;
  const status init = g.initialize(x, args, std::span<std::byte>(ws.view().data(), bytes));
  REQUIRE_MESSAGE(init, (init ? std::string() : init.error().message));
  for (int r = 0; r < runs; ++r) {
    const status st = g.run(x);
    REQUIRE_MESSAGE(st, (st ? std::string() : st.error().message));
  }
  std::vector<TC> h(o.c0.size());
  REQUIRE(x.copy(c.cview(), row_view<TC>(h.data(), 1, static_cast<int>(h.size()))));
  REQUIRE(x.device_status());
  return h;
}

// The fp64 reference of C after `runs` runs at every output, NaN elsewhere (never written).
template <class TC>
std::vector<double> reference(const operands<TC>& o, int runs) {
  const auto& a = o.args;
  const bool by_m = a.grouping == k::gemm_grouping::rows_are_m;
  std::vector<double> ref(o.c0.size(), std::nan(""));
  const auto wide = [](bfloat16 v) { return static_cast<double>(static_cast<float>(v)); };
  for (int g = 0; g < a.groups; ++g) {
    const long long first = o.off[g], rows = o.off[g + 1] - first;
    const long long M = by_m ? rows : a.m, K = by_m ? a.k : rows;
    for (long long i = 0; i < M; ++i)
      for (long long j = 0; j < a.n; ++j) {
        double s = 0;
        for (long long q = 0; q < K; ++q) {
          const long long ia =
              by_m ? (first + i) * a.a.s0 + q * a.a.s1 : i * a.a.s0 + (first + q) * a.a.s1;
          const long long ib = by_m ? g * a.b.group_stride + q * a.b.s0 + j * a.b.s1
                                    : (first + q) * a.b.s0 + j * a.b.s1;
          s += wide(o.a[static_cast<std::size_t>(ia)]) * wide(o.b[static_cast<std::size_t>(ib)]);
        }
        const long long ic =
            by_m ? (first + i) * a.c.s0 + j : g * a.c.group_stride + i * a.c.s0 + j;
        const auto at = static_cast<std::size_t>(ic);
        ref[at] =
            (a.accumulate ? static_cast<double>(static_cast<float>(o.c0[at])) : 0.0) + runs * s;
      }
  }
  return ref;
}

// ||got - ref|| / ||ref|| over the outputs; every other element must be as it was.
template <class TC>
double normwise_error(const operands<TC>& o, const std::vector<double>& ref,
                      const std::vector<TC>& got) {
  double err = 0, norm = 0;
  long touched = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(ref[i])) {
      touched += std::memcmp(&got[i], &o.c0[i], sizeof(TC)) != 0 ? 1 : 0;
      continue;
    }
    const double v = static_cast<double>(static_cast<float>(got[i]));
    err += (v - ref[i]) * (v - ref[i]);  // NaN (an output never written) fails below
    norm += ref[i] * ref[i];
  }
  CHECK_MESSAGE(touched == 0, touched << " elements outside the outputs were written");
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

template <class TC>
void check_all(const shape& s, bool cutlass_only = false) {
  CAPTURE(s.name);
  std::mt19937_64 rng(seed() + s.counts.size());
  const auto o = make<TC>(s, rng);
  auto x = cuda_exec::make(nullptr).value();
  const int runs = o.args.accumulate ? 2 : 1;
  const auto ref = reference(o, runs);
  const double tol = std::is_same_v<TC, float> ? 1e-5 : 1e-2;
  const auto simt = run<simt_gemm<bfloat16, bfloat16, TC>>(x, o, true, runs);
  const double e_simt = normwise_error(o, ref, simt);
  CHECK(e_simt <= tol);
#if defined(MOEFOLD_CUTLASS_SM90)
  for (const bool dev : {true, false}) {
    CAPTURE(dev);
    const auto got = run<cutlass_sm90<bfloat16, bfloat16, TC>>(x, o, dev, runs);
    const double e = normwise_error(o, ref, got);
    MESSAGE(s.name, ": cutlass_sm90 ", e, " (simt_gemm ", e_simt, ")");
    CHECK(e <= tol);
    // No split-K or stream-K: a second run gives the same bits.
    const auto again = run<cutlass_sm90<bfloat16, bfloat16, TC>>(x, o, dev, runs);
    CHECK(std::memcmp(got.data(), again.data(), got.size() * sizeof(TC)) == 0);
  }
#else
  FAIL("built without CUTLASS (meson option cutlass): cutlass_sm90 cannot run here");
#endif
  if (cutlass_only) return;
  const auto dense = run<cublas_dense<bfloat16, bfloat16, TC>>(x, o, false, runs);
  const double e_dense = normwise_error(o, ref, dense);
  MESSAGE(s.name, ": cublas_dense ", e_dense);
  CHECK(e_dense <= tol);
  bool uniform = true;
  for (long long n : s.counts) uniform = uniform && n == s.counts.front();
  if (uniform) {
    const auto strided = run<cublas_strided<bfloat16, bfloat16, TC>>(x, o, false, runs);
    const double e = normwise_error(o, ref, strided);
    MESSAGE(s.name, ": cublas_strided ", e);
    CHECK(e <= tol);
  }
}

const std::vector<long long> sizes = {0, 1, 7, 129, 1024, 4096};

}  // namespace

TEST_CASE("gemm: the forward's layout, groups of 0 to 4,096 rows") {
  check_all<bfloat16>({.name = "forward", .n = 384, .k = 256, .counts = sizes});
}
TEST_CASE("gemm: the data gradient's layout, groups of 0 to 4,096 rows") {
  check_all<bfloat16>(
      {.name = "data gradient", .b_n_major = true, .n = 256, .k = 384, .counts = sizes});
}
TEST_CASE("gemm: the weight gradient, beta = 1 twice into fp32") {
  check_all<float>({.name = "weight gradient", .wgrad = true, .m = 384, .n = 256, .counts = sizes});
}
TEST_CASE("gemm: pad mode's uniform groups, odd aligned strides") {
  check_all<bfloat16>({.name = "pad forward",
                       .n = 136,
                       .k = 72,
                       .pad = 24,
                       .counts = std::vector<long long>(8, 128)});
  check_all<float>({.name = "pad weight gradient",
                    .wgrad = true,
                    .m = 72,
                    .n = 136,
                    .pad = 40,
                    .counts = std::vector<long long>(8, 128)});
}
TEST_CASE("small: every layout on small groups, all groups empty") {
  check_all<bfloat16>({.name = "small forward", .n = 24, .k = 16, .counts = {0, 3, 1, 9}});
  check_all<bfloat16>(
      {.name = "small data gradient", .b_n_major = true, .n = 16, .k = 24, .counts = {5, 0, 2}});
  check_all<float>(
      {.name = "small weight gradient", .wgrad = true, .m = 16, .n = 24, .counts = {4, 0, 7}});
  check_all<bfloat16>({.name = "all empty", .n = 16, .k = 16, .counts = {0, 0, 0}});
  check_all<float>(
      {.name = "all empty, weight gradient", .wgrad = true, .m = 16, .n = 8, .counts = {0, 0}});
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu-library-gemm: no CUDA device, skipped\n");
    return 77;
  }
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed()));
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
