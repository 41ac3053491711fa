// The portable SIMT grouped GEMM (kernels/grouped_gemm.hpp) on the CPU executor, on fresh random
// inputs (seed printed), in the three shapes the reference expert uses: the forward through a
// transposed weight (x W^T), the data gradient through a plain one (dy W), and the weight
// gradient grouped over K with accumulation (W += dy^T x). Each output against a host loop of
// std::fma over k in ascending order (the kernel's defined order: bit for bit) and against fp64
// within K roundings of sum |a b|; strides wider than the rows, whose padding must stay
// untouched; expert row counts 0, 1 and across tiles; fp32 and bf16. Every launch also runs on
// host_exec (a team of one: one thread owns the whole 32 x 32 tile) on the same inputs, into its
// own copy of C: the same bits as cpu_exec's, padding included (each output adds its k in order).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/grouped_gemm.hpp>
#include <random>
#include <vector>

#include "../support/simt_test_sizes.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                     sizeof(T) * a.size()) == 0;
}

struct gemm_stats {
  long outputs = 0, differ = 0;
  double worst = 0;  // |C - C64| over its bound
};

// One launch against the host: C (ldc wide rows, poisoned) from operands given as accessors;
// the same launch on host_exec into a copy of C gives cpu_exec's bits.
template <class T>
void check_gemm(const k::grouped_gemm_kernel<T, T, T>& kernel, std::vector<T>& c,
                const std::vector<long long>& offsets, std::mt19937_64& rng, gemm_stats& st) {
  const std::vector<T> before = c;
  const launch_grid grid{.blocks = 3, .smem_bytes = k::grouped_gemm_kernel<T, T, T>::smem_bytes};
  REQUIRE(launch(cpu_exec{rng()}, grid, kernel));
  std::vector<T> host = before;
  auto on_host = kernel;
  on_host.c.data = host.data() + (kernel.c.data - c.data());
  REQUIRE(launch(host_exec{}, grid, on_host));
  CHECK_MESSAGE(same_bits(host, c), "host_exec against cpu_exec");
  std::vector<char> written(c.size(), 0);
  const bool by_m = kernel.grouping == k::gemm_grouping::rows_are_m;
  for (int g = 0; g < kernel.groups; ++g) {
    const long long first = offsets[g], rows = offsets[g + 1] - offsets[g];
    const long long M = by_m ? rows : kernel.m, K = by_m ? kernel.k : rows;
    const T* pa = by_m ? kernel.a.data + first * kernel.a.s0 : kernel.a.data + first * kernel.a.s1;
    const T* pb =
        by_m ? kernel.b.data + g * kernel.b.group_stride : kernel.b.data + first * kernel.b.s0;
    const long long c0 = by_m ? first * kernel.c.s0 : g * kernel.c.group_stride;
    for (long long i = 0; i < M; ++i)
      for (long long j = 0; j < kernel.n; ++j) {
        float acc = 0.0f;
        double exact = 0, mag = 0;
        for (long long q = 0; q < K; ++q) {
          const float x = detail::widen(pa[i * kernel.a.s0 + q * kernel.a.s1]);
          const float y = detail::widen(pb[q * kernel.b.s0 + j * kernel.b.s1]);
          acc = std::fma(x, y, acc);
          exact += static_cast<double>(x) * y;
          mag += std::abs(static_cast<double>(x) * y);
        }
        const auto at = static_cast<std::size_t>(c0 + i * kernel.c.s0 + j * kernel.c.s1);
        const float old = detail::widen(before[at]);
        const T want = detail::narrow<T>(kernel.accumulate ? old + acc : acc);
        written[at] = 1;
        ++st.outputs;
        if (!same_bits(c[at], want)) ++st.differ;
        // A GEMM at all: within K roundings of sum |a b| of fp64 (plus the old value and the
        // output's own rounding to T).
        const double ref = (kernel.accumulate ? old : 0.0) + exact;
        const double half_ulp_t = sizeof(T) == 4 ? 0x1p-24 : 0x1p-8;
        // fp32: K + 1 roundings of sum |a b| (and of the old value); then rounding to T, within
        // half an ulp of that fp32 value.
        const double b32 = 0x1p-24 * (static_cast<double>(K) + 1) * (mag + std::abs(old));
        const double bound = b32 + half_ulp_t * (std::abs(ref) + b32) + 1e-30;
        const double err = std::abs(static_cast<double>(detail::widen(c[at])) - ref);
        st.worst = std::max(st.worst, err / bound);
        CHECK(err <= bound);
      }
  }
  long touched = 0;  // elements the kernel must not write: padding columns, rows of no expert
  for (std::size_t i = 0; i < c.size(); ++i)
    if (!written[i] && !same_bits(c[i], before[i])) ++touched;
  CHECK(touched == 0);
}

template <class T>
std::vector<T> random_vec(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(rng));
  return v;
}

template <class T>
void run_shapes(std::mt19937_64& rng, gemm_stats& st) {
  // Expert row counts: empty, one row, across a 32-row tile, a partial tile.
  const std::vector<std::vector<long long>> groupings =
      test::simt_reduced ? std::vector<std::vector<long long>>{{0, 1, 35}}
                         : std::vector<std::vector<long long>>{{0, 7}, {0, 0, 1, 34, 41}};
  const std::vector<std::pair<int, int>> kn =  // (K, N): K across 16-steps, N across tiles
      test::simt_reduced ? std::vector<std::pair<int, int>>{{17, 9}}
                         : std::vector<std::pair<int, int>>{{1, 1}, {16, 33}, {40, 8}};
  for (const auto& offsets : groupings)
    for (auto [K, N] : kn) {
      const int G = static_cast<int>(offsets.size()) - 1;
      const long long R = offsets.back();
      CAPTURE(G);
      CAPTURE(R);
      CAPTURE(K);
      CAPTURE(N);
      const long long lda = K + 3, ldc = N + 2;  // wider rows: padding stays untouched
      // Forward: C [R, N] = A [R, K] W_g^T, W [G, N, K] (fc1's layout); data gradient:
      // C = A W_g, W [G, K, N].
      const auto a = random_vec<T>(static_cast<std::size_t>(R * lda + 1), rng);
      const auto w = random_vec<T>(static_cast<std::size_t>(G) * N * K + 1, rng);
      std::vector<T> c(static_cast<std::size_t>(R * ldc + 1));
      const long long wsize = static_cast<long long>(N) * K;
      for (const k::gemm_operand<const T> b :
           {k::gemm_operand<const T>{w.data(), 1, K, wsize}, {w.data(), N, 1, wsize}}) {
        std::fill(c.begin(), c.end(), T(-3.0f));
        check_gemm<T>({.grouping = k::gemm_grouping::rows_are_m,
                       .offsets = offsets.data(),
                       .groups = G,
                       .m = 0,
                       .n = N,
                       .k = K,
                       .a = {a.data(), lda, 1, 0},
                       .b = b,
                       .c = {c.data(), ldc, 1, 0},
                       .accumulate = false},
                      c, offsets, rng, st);
      }
      // Weight gradient: C_g [K, N] += A^T B over the group's rows, A [R, K] (lda), B [R, N]
      // (ldc), C [G, K, N] holding earlier gradients.
      const auto bmat = random_vec<T>(static_cast<std::size_t>(R * ldc + 1), rng);
      auto grad = random_vec<T>(static_cast<std::size_t>(G) * K * N + 1, rng);
      check_gemm<T>({.grouping = k::gemm_grouping::rows_are_k,
                     .offsets = offsets.data(),
                     .groups = G,
                     .m = K,
                     .n = N,
                     .k = 0,
                     .a = {a.data(), 1, lda, 0},
                     .b = {bmat.data(), ldc, 1, 0},
                     .c = {grad.data(), N, 1, static_cast<long long>(K) * N},
                     .accumulate = true},
                    grad, offsets, rng, st);
    }
}

}  // namespace

TEST_CASE("grouped GEMM kernel: forward, data and weight gradient shapes against the host") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  gemm_stats f32, b16;
  run_shapes<float>(rng, f32);
  run_shapes<bfloat16>(rng, b16);
  MESSAGE("fp32: " << f32.outputs << " outputs, " << f32.differ
                   << " differ from the fma chain; worst " << f32.worst
                   << " of the fp64 bound. bf16: " << b16.outputs << " outputs, " << b16.differ
                   << " differ; worst " << b16.worst);
  CHECK(f32.outputs > 0);
  CHECK(f32.differ == 0);
  CHECK(b16.differ == 0);
}

TEST_CASE("widen_offsets kernel: the experts' row ranges widened, on cpu_exec and host_exec") {
  std::mt19937_64 rng(test::simt_seed());
  for (int count : {1, 9, 257, 1000}) {
    CAPTURE(count);
    std::vector<int> from(static_cast<std::size_t>(count));
    int run = 0;
    for (auto& v : from) v = run += static_cast<int>(rng() % 100);
    std::vector<long long> cpu(from.size() + 1, -7), host(cpu);
    const k::widen_offsets_kernel on_cpu{.from = from.data(), .count = count, .to = cpu.data()};
    const k::widen_offsets_kernel on_host{.from = from.data(), .count = count, .to = host.data()};
    REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = 3}, on_cpu));
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = 3}, on_host));
    for (int i = 0; i < count; ++i)
      CHECK(cpu[static_cast<std::size_t>(i)] == from[static_cast<std::size_t>(i)]);
    CHECK(cpu.back() == -7);  // nothing past count
    CHECK(host == cpu);
  }
}
