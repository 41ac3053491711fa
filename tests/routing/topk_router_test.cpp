// topk_router (routing/topk_router.hpp) on cpu_exec (the SIMT GEMM) and host_exec (the host
// GEMM, a thread per token) against fp64 references on fresh random inputs (seed printed): the
// logits against x W^T in fp64 within the GEMM's bound; the routing against
// host_topk_router<double> over the same logits (indices equal, probabilities within the router
// kernel's bound, near-ties excluded); dlogits against host_topk_router<double>::backward within
// its condition; dx and the accumulated weight gradient against fp64 over the same dlogits. fp32
// and bf16 tokens, x with a row stride wider than H, the warp team (E <= 256) and the block team
// (E 512). In fp64 (R = double, CPU contexts only) the router's gradients through the production
// kernels against central finite differences of a loss of its probabilities. Bad shapes and
// options beyond the kernels are refused. The TSan build (MOEFOLD_SIMT_REDUCED) runs the cpu_exec
// half only: host_exec has one thread, nothing to race.
#include <doctest/doctest.h>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/routing/topk_router.hpp>
#include "../support/host_topk_router.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/simt_test_sizes.hpp"
#include "../support/ulp.hpp"

using namespace moefold;

namespace {

constexpr double eps32 = 0x1p-24;  // half an fp32 ulp at 1: the unit roundoff

// Views of host vectors in a context's space (cpu_exec's device memory is host memory).
template <class S, class T>
row_view<T, S> dev(std::vector<T>& v, int rows, int width, long long stride = -1) {
  return row_view<T, S>(v.data(), rows, width, stride < 0 ? width : stride);
}
template <class S, class T>
row_view<const T, S> cdev(const std::vector<T>& v, int rows, int width, long long stride = -1) {
  return row_view<const T, S>(v.data(), rows, width, stride < 0 ? width : stride);
}

// A router's workspace in its context's memory.
template <class Router, class Exec>
exec_buffer<std::byte, Exec> router_workspace(Exec& x) {
  auto ws = exec_buffer<std::byte, Exec>::make(
      x, 1, static_cast<std::int64_t>(std::max<std::size_t>(Router::workspace_bytes(), 1)));
  REQUIRE(ws);
  return std::move(*ws);
}
template <class T, class Exec>
std::span<std::byte> bytes_of(const exec_buffer<T, Exec>& b) {
  return {reinterpret_cast<std::byte*>(b.view().data()),
          static_cast<std::size_t>(b.view().width())};
}

using test::ulp_distance;

// The selection values of a token (scores plus bias) have two within 1e-6 of the largest
// magnitude among the k + 1 best: the two routers may order them differently.
bool near_tie(const topk_router_options& o, const std::vector<double>& row,
              const std::vector<float>& bias) {
  std::vector<double> sel;
  double mx = 0;
  for (std::size_t e = 0; e < row.size(); ++e) {
    double v = row[e];
    if (o.score == score_function::sigmoid) v = 1 / (1 + std::exp(-v));
    if (o.expert_bias) v += bias[e];
    sel.push_back(v);
    mx = std::max(mx, std::abs(v));
  }
  std::sort(sel.begin(), sel.end(), std::greater<>());
  // A softmax before top-k selects on float probabilities, where a logit gap d is a relative gap
  // d, which their rounding (exp, the division, x - max: a few ulp) hides below about 1e-6
  // whatever the logits' scale: small logits (H = 1) are judged against 1e-6 absolute.
  const double scale = o.pre_softmax ? std::max(mx, 1.0) : std::max(mx, 1e-30);
  for (int i = 0; i + 1 < std::min<int>(o.topk + 1, static_cast<int>(sel.size())); ++i)
    if (sel[static_cast<std::size_t>(i)] - sel[static_cast<std::size_t>(i) + 1] <= 1e-6 * scale)
      return true;
  return false;
}

struct variant {
  const char* name;
  topk_router_options o;
  bool backward;  // softmax variants: the backward's condition below is the formula's own
};

// Tokens whose routing was compared, and those left out as near-ties.
struct tally {
  int compared = 0, ties = 0;
};

template <class T, class Exec>
void check_router(Exec& x_exec, const variant& v, int N, int H, std::mt19937_64& rng,
                  tally& count) {
  using dspace = typename Exec::memory_space;
  const topk_router_options& o = v.o;
  const int E = o.num_experts, K = o.topk;
  const long long xs = H + 3;  // x's row stride: wider than H
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<T> x(static_cast<std::size_t>(N * xs)), w(static_cast<std::size_t>(E * H));
  for (auto& e : x) e = static_cast<T>(static_cast<float>(nd(rng)));
  for (auto& e : w) e = static_cast<T>(static_cast<float>(0.5 * nd(rng)));
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (auto& b : bias) b = static_cast<float>(0.1 * nd(rng));
  using G = main_grad_t<T>;
  std::vector<G> grad(w.size()), grad0;
  for (auto& g : grad) g = static_cast<G>(nd(rng));
  grad0 = grad;
  using router_t = topk_router<T, Exec>;
  auto r = router_t::make(o, H);
  REQUIRE_MESSAGE(r, r.error().message);
  const auto ws = router_workspace<router_t>(x_exec);
  std::vector<float> logits(static_cast<std::size_t>(N * E), -7.f),
      probs(static_cast<std::size_t>(N * K), -7.f);
  std::vector<int> idx(static_cast<std::size_t>(N * K), -7);
  const topk_router_forward<T, float, dspace> f{
      .x = cdev<dspace>(x, N, H, xs),
      .weight = cdev<dspace>(w, E, H),
      .expert_bias = o.expert_bias ? cdev<dspace>(bias, 1, E) : row_view<const float, dspace>{},
      .logits = dev<dspace>(logits, N, E),
      .indices = dev<dspace>(idx, N, K),
      .probs = dev<dspace>(probs, N, K)};
  REQUIRE(r->forward(x_exec, f, bytes_of(ws)));
  const auto xv = [&](int n, int h) {
    return static_cast<double>(moefold::detail::widen(x[static_cast<std::size_t>(n * xs + h)]));
  };
  const auto wv = [&](int e, int h) {
    return static_cast<double>(moefold::detail::widen(w[static_cast<std::size_t>(e * H + h)]));
  };
  // Logits: one fp32 fma chain over H: within (H + 1) roundings of sum |x w|.
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < E; ++e) {
      double ref = 0, mag = 0;
      for (int h = 0; h < H; ++h) {
        ref += xv(n, h) * wv(e, h);
        mag += std::abs(xv(n, h) * wv(e, h));
      }
      const double got = logits[static_cast<std::size_t>(n * E + e)];
      if (std::abs(got - ref) > (H + 1) * eps32 * mag) {
        CAPTURE(n);
        CAPTURE(e);
        CHECK(got == doctest::Approx(ref));
      }
    }
  // Routing: host_topk_router<double> over the same logits.
  auto ref_router = host_topk_router<double>::make(o);
  REQUIRE(ref_router);
  const std::vector<double> l64(logits.begin(), logits.end());
  topk_routing<double> ref;
  REQUIRE(ref_router->route(
      l64, ref, o.expert_bias ? std::span<const float>(bias) : std::span<const float>{}));
  std::vector<bool> tie(static_cast<std::size_t>(N));
  for (int n = 0; n < N; ++n) {
    const std::vector<double> row(l64.begin() + n * E, l64.begin() + (n + 1) * E);
    tie[static_cast<std::size_t>(n)] = near_tie(o, row, bias);
    if (tie[static_cast<std::size_t>(n)]) {
      ++count.ties;
      continue;
    }
    ++count.compared;
    // The scores' largest |x - max| (softmax before top-k: over E; after: over the k chosen).
    double spread = 0;
    const double m = *std::max_element(row.begin(), row.end());
    for (int i = 0; i < K; ++i)
      spread = std::max(
          spread,
          m - row[static_cast<std::size_t>(ref.indices[static_cast<std::size_t>(n * K + i)])]);
    if (o.pre_softmax) spread = m - *std::min_element(row.begin(), row.end());
    for (int i = 0; i < K; ++i) {
      const auto at = static_cast<std::size_t>(n * K + i);
      CAPTURE(n);
      CAPTURE(i);
      CHECK(idx[at] == ref.indices[at]);
      // The router kernel's bound against fp64 (tests/kernels/router_kernel_test.cpp): what
      // rounding x - max costs exp (|x - max| ulp), 2 + log2(E) / 2 ulp for a softmax, 4 ulp
      // for the elementwise scores, plus the renormalisation's sum and division over k.
      // On host_exec a team of one adds a softmax's E terms in expert order instead of the tree:
      // up to host_ulps(E) = 2 + 2 ceil(sqrt E) more (kernels/router.hpp, the kernel tests).
      const int team_of_one = std::is_same_v<Exec, host_exec> && o.pre_softmax
                                  ? 2 + 2 * static_cast<int>(std::ceil(std::sqrt(E)))
                                  : 0;
      const int bound = static_cast<int>(std::ceil(spread)) + 4 +
                        static_cast<int>(std::ceil(std::log2(static_cast<double>(E)) / 2)) +
                        static_cast<int>(std::ceil(std::log2(static_cast<double>(K)))) + 1 +
                        team_of_one;
      CHECK(ulp_distance(probs[at], static_cast<float>(ref.probs[at])) <= bound);
    }
  }
  if (!v.backward) return;
  // dlogits: the router kernel's backward against host_topk_router<double>'s, each element within 8
  // fp32 epsilons of the element, the row's largest gradient and the formula's condition:
  // s_e (|ds_e| + sum |s ds|) with a softmax before top-k, p_i (|g_i| + sum |p g|) after
  // (g = dprobs times the scaling factor); the kernel test's bound (with the fp32 host term
  // below).
  std::vector<float> dprobs(static_cast<std::size_t>(N * K)), dlogits(l64.size(), -7.f);
  for (auto& d : dprobs) d = static_cast<float>(nd(rng));
  REQUIRE(r->backward(x_exec, {.logits = cdev<dspace>(logits, N, E),
                               .indices = cdev<dspace>(idx, N, K),
                               .dprobs = cdev<dspace>(dprobs, N, K),
                               .dlogits = dev<dspace>(dlogits, N, E)}));
  const std::vector<double> dp64(dprobs.begin(), dprobs.end());
  std::vector<double> dl64(l64.size());
  REQUIRE(ref_router->backward(l64, ref, dp64, dl64));
  // The host router in fp32 over the same logits: where the formula itself is ill-conditioned in
  // fp32 (s (1 - s) for s near 1) the bound allows four times its error, as the kernel test does.
  auto f32_router = host_topk_router<float>::make(o);
  REQUIRE(f32_router);
  topk_routing<float> r32;
  REQUIRE(f32_router->route(
      logits, r32, o.expert_bias ? std::span<const float>(bias) : std::span<const float>{}));
  std::vector<float> dl32(l64.size());
  REQUIRE(f32_router->backward(logits, r32, dprobs, dl32));
  const double scale = o.scaling_factor.value_or(1.0);
  for (int n = 0; n < N; ++n) {
    if (tie[static_cast<std::size_t>(n)]) continue;
    std::vector<double> s(static_cast<std::size_t>(E), 0.0), ds(s.size(), 0.0);
    const double* row = l64.data() + n * E;
    if (o.pre_softmax) {
      const double m = *std::max_element(row, row + E);
      double z = 0;
      for (int e = 0; e < E; ++e) z += std::exp(row[e] - m);
      for (int e = 0; e < E; ++e) s[static_cast<std::size_t>(e)] = std::exp(row[e] - m) / z;
      for (int i = 0; i < K; ++i) {
        const auto at = static_cast<std::size_t>(n * K + i);
        ds[static_cast<std::size_t>(ref.indices[at])] = scale * dp64[at];
      }
    } else {
      for (int i = 0; i < K; ++i) {
        const auto at = static_cast<std::size_t>(n * K + i);
        const auto e = static_cast<std::size_t>(ref.indices[at]);
        s[e] = ref.probs[at] / scale;
        ds[e] = scale * dp64[at];
      }
    }
    double sum = 0, row_max = 0;
    for (int e = 0; e < E; ++e) {
      sum += std::abs(s[static_cast<std::size_t>(e)] * ds[static_cast<std::size_t>(e)]);
      row_max = std::max(row_max, std::abs(dl64[static_cast<std::size_t>(n * E + e)]));
    }
    for (int e = 0; e < E; ++e) {
      const auto at = static_cast<std::size_t>(n * E + e);
      const double cond =
          s[static_cast<std::size_t>(e)] * (std::abs(ds[static_cast<std::size_t>(e)]) + sum);
      CAPTURE(n);
      CAPTURE(e);
      CHECK(std::abs(dlogits[at] - dl64[at]) <=
            8 * 0x1p-23 * (std::abs(dl64[at]) + row_max + cond) +
                4 * std::abs(static_cast<double>(dl32[at]) - dl64[at]) + 1e-30);
    }
  }
  // dx = dlogits W and dW += dlogits^T x over the kernel's own dlogits, every token.
  std::vector<float> dx(static_cast<std::size_t>(N * xs), -7.f);
  REQUIRE(r->backward_gating(
      x_exec,
      gating_backward_args<T, float, G, dspace>{.x = cdev<dspace>(x, N, H, xs),
                                                .weight = cdev<dspace>(w, E, H),
                                                .dlogits = cdev<dspace>(dlogits, N, E),
                                                .dx = dev<dspace>(dx, N, H, xs),
                                                .weight_grad = dev<dspace>(grad, E, H)},
      bytes_of(ws)));
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      double ref_dx = 0, mag = 0;
      for (int e = 0; e < E; ++e) {
        const double t =
            static_cast<double>(dlogits[static_cast<std::size_t>(n * E + e)]) * wv(e, h);
        ref_dx += t;
        mag += std::abs(t);
      }
      CAPTURE(n);
      CAPTURE(h);
      CHECK(std::abs(dx[static_cast<std::size_t>(n * xs + h)] - ref_dx) <= (E + 1) * eps32 * mag);
    }
  for (int n = 0; n < N; ++n)  // the padding between rows is not written
    for (long long c = H; c < xs; ++c) CHECK(dx[static_cast<std::size_t>(n * xs + c)] == -7.f);
  for (int e = 0; e < E; ++e)
    for (int h = 0; h < H; ++h) {
      const auto at = static_cast<std::size_t>(e * H + h);
      double sum = 0, mag = 0;
      for (int n = 0; n < N; ++n) {
        const double t =
            static_cast<double>(dlogits[static_cast<std::size_t>(n * E + e)]) * xv(n, h);
        sum += t;
        mag += std::abs(t);
      }
      const double want = static_cast<double>(grad0[at]) + sum;
      CAPTURE(e);
      CAPTURE(h);
      CHECK(std::abs(static_cast<double>(grad[at]) - want) <=
            (N + 2) * eps32 * (mag + std::abs(static_cast<double>(grad0[at]))));
    }
}

const std::vector<variant>& variants() {
  static const std::vector<variant> v = {
      {"softmax after top-k, E 8 k 2", {.num_experts = 8, .topk = 2}, true},
      {"softmax before top-k, E 64 k 8, scaled",
       {.num_experts = 64, .topk = 8, .pre_softmax = true, .scaling_factor = 2.5},
       true},
      {"sigmoid with expert bias, E 256 k 8",
       {.num_experts = 256, .topk = 8, .score = score_function::sigmoid, .expert_bias = true},
       false},
      {"softmax before top-k, E 512 k 4 (block team)",
       {.num_experts = 512, .topk = 4, .pre_softmax = true},
       true},
  };
  return v;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "topk_router on cpu_exec and host_exec: logits, routing and gradients against "
    "fp64",
    T, float, bfloat16) {
  const std::uint64_t seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 41);
  // Two GEMM row tiles at N 33, several k steps at H 40; H 1 makes every token's logits one
  // column of W times a scalar (bf16 weights then tie often: those tokens are left out).
  tally count;
  cpu_exec cpu(rng());
  [[maybe_unused]] host_exec host;
  for (const variant& v : variants())
    for (int N : {1, 33})
      for (int H : {1, 40}) {
        const std::string name = v.name;
        CAPTURE(name);
        CAPTURE(N);
        CAPTURE(H);
        check_router<T>(cpu, v, N, H, rng, count);
#ifndef MOEFOLD_SIMT_REDUCED  // the TSan build: host_exec runs on one thread, nothing to race
        check_router<T>(host, v, N, H, rng, count);
#endif
      }
  MESSAGE("tokens compared " << count.compared << ", near-ties left out " << count.ties);
  CHECK(count.compared >= 3 * count.ties);
}

namespace {

// The fp64 router's gradients through the production kernels against central differences: the
// loss L = sum c . probs (c fixed, random) of the routing of x W^T; dL/dx and dL/dW from
// backward() (dprobs = c) and backward_gating(), against (L(v + h) - L(v - h)) / 2h at random
// coordinates of x and W (h = 1e-6; a coordinate whose step changes the selection is skipped).
template <class Exec>
void check_fp64_gradients(Exec& exec, const topk_router_options& o, std::mt19937_64& rng,
                          int& checked) {
  using S = typename Exec::memory_space;
  using router_t = topk_router<double, Exec, double>;
  const int N = 5, H = 6, E = o.num_experts, K = o.topk;
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(N * H)), w(static_cast<std::size_t>(E * H)),
      c(static_cast<std::size_t>(N * K));
  for (auto& e : x) e = nd(rng);
  for (auto& e : w) e = 0.5 * nd(rng);
  for (auto& e : c) e = nd(rng);
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (auto& b : bias) b = static_cast<float>(0.1 * nd(rng));
  auto r = router_t::make(o, H);
  REQUIRE_MESSAGE(r, r.error().message);
  const auto ws = router_workspace<router_t>(exec);
  std::vector<double> logits(static_cast<std::size_t>(N * E)), probs(c.size());
  std::vector<int> idx(c.size());
  const auto loss = [&](std::vector<int>& chosen) {
    REQUIRE(
        r->forward(exec,
                   {.x = cdev<S>(x, N, H),
                    .weight = cdev<S>(w, E, H),
                    .expert_bias = o.expert_bias ? cdev<S>(bias, 1, E) : row_view<const float, S>{},
                    .logits = dev<S>(logits, N, E),
                    .indices = dev<S>(chosen, N, K),
                    .probs = dev<S>(probs, N, K)},
                   bytes_of(ws)));
    double l = 0;
    for (std::size_t i = 0; i < c.size(); ++i) l += c[i] * probs[i];
    return l;
  };
  (void)loss(idx);
  std::vector<double> dlogits(logits.size()), dx(x.size()), dw(w.size(), 0.0);
  REQUIRE(r->backward(exec, {.logits = cdev<S>(logits, N, E),
                             .indices = cdev<S>(idx, N, K),
                             .dprobs = cdev<S>(c, N, K),
                             .dlogits = dev<S>(dlogits, N, E)}));
  REQUIRE(r->backward_gating(
      exec,
      gating_backward_args<double, double, double, S>{.x = cdev<S>(x, N, H),
                                                      .weight = cdev<S>(w, E, H),
                                                      .dlogits = cdev<S>(dlogits, N, E),
                                                      .dx = dev<S>(dx, N, H),
                                                      .weight_grad = dev<S>(dw, E, H)},
      bytes_of(ws)));
  const double h = 1e-6;
  const auto central = [&](std::vector<double>& v, std::size_t at, double analytic) {
    const double keep = v[at];
    std::vector<int> up(idx.size()), down(idx.size());
    v[at] = keep + h;
    const double lu = loss(up);
    v[at] = keep - h;
    const double ld = loss(down);
    v[at] = keep;
    if (up != idx || down != idx) return;  // the step crosses a selection boundary
    const double fd = (lu - ld) / (2 * h);
    CHECK(std::abs(fd - analytic) <= 1e-6 * (1 + std::abs(analytic)));
    ++checked;
  };
  std::uniform_int_distribution<std::size_t> px(0, x.size() - 1), pw(0, w.size() - 1);
  for (int i = 0; i < 6; ++i) {
    const std::size_t a = px(rng), b = pw(rng);
    central(x, a, dx[a]);
    central(w, b, dw[b]);
  }
}

}  // namespace

TEST_CASE("topk_router in fp64 on host_exec and cpu_exec: gradients against finite differences") {
  const std::uint64_t seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 43);
  cpu_exec cpu(rng());
  [[maybe_unused]] host_exec host;
  int checked = 0;
  const topk_router_options cases[] = {
      {.num_experts = 8, .topk = 2},
      {.num_experts = 8, .topk = 3, .pre_softmax = true, .scaling_factor = 1.5},
      {.num_experts = 16, .topk = 4, .score = score_function::sigmoid, .expert_bias = true},
      {.num_experts = 16, .topk = 2, .score = score_function::sqrt_softplus},
      {.num_experts = 16,
       .topk = 4,
       .score = score_function::sigmoid,
       .num_groups = 4,
       .group_topk = 2,
       .expert_bias = true},
      {.num_experts = 512, .topk = 4, .pre_softmax = true},  // the block team
  };
  for (const auto& o : cases) {
    CAPTURE(o.num_experts);
    CAPTURE(o.topk);
    CAPTURE(static_cast<int>(o.score));
#ifndef MOEFOLD_SIMT_REDUCED  // the TSan build: host_exec runs on one thread, nothing to race
    check_fp64_gradients(host, o, rng, checked);
#endif
    check_fp64_gradients(cpu, o, rng, checked);
  }
  MESSAGE("coordinates checked " << checked);
  CHECK(checked >= (test::simt_reduced ? 50 : 100));  // about 72 per context
}

TEST_CASE("topk_router refuses what its kernels cannot take and views of the wrong shape") {
  cpu_exec x;
  using router_t = topk_router<float, cpu_exec>;
  using S = cpu_device_space;
  std::vector<float> w(8 * 4);
  const topk_router_options o{.num_experts = 8, .topk = 2};
  auto too_many = router_t::make({.num_experts = 2048, .topk = 2, .pre_softmax = true}, 4);
  REQUIRE_FALSE(too_many);
  CHECK(too_many.error().message.find("E <= 1024") != std::string::npos);
  CHECK_FALSE(router_t::make(o, 0));
  CHECK_FALSE(router_t::make({.num_experts = 8, .topk = 9}, 4));  // validate()'s rule
  auto r = router_t::make(o, 5);
  REQUIRE(r);
  const auto ws = router_workspace<router_t>(x);
  std::vector<float> xs(3 * 5), logits(3 * 8), probs(3 * 2), bias(8);
  std::vector<int> idx(3 * 2);
  const auto bad_weight = r->forward(x,
                                     {.x = cdev<S>(xs, 3, 5),
                                      .weight = cdev<S>(w, 8, 4),
                                      .logits = dev<S>(logits, 3, 8),
                                      .indices = dev<S>(idx, 3, 2),
                                      .probs = dev<S>(probs, 3, 2)},
                                     bytes_of(ws));
  REQUIRE_FALSE(bad_weight);
  CHECK(bad_weight.error().message.find("weight must be contiguous [8, 5]") != std::string::npos);
  std::vector<float> w5(8 * 5);
  const auto narrow = r->forward(x,
                                 {.x = cdev<S>(xs, 3, 5),
                                  .weight = cdev<S>(w5, 8, 5),
                                  .logits = dev<S>(logits, 3, 7),
                                  .indices = dev<S>(idx, 3, 2),
                                  .probs = dev<S>(probs, 3, 2)},
                                 bytes_of(ws));
  REQUIRE_FALSE(narrow);
  CHECK(narrow.error().message.find("logits must be contiguous [3, 8]") != std::string::npos);
  const auto unasked_bias = r->route(x, {.logits = cdev<S>(logits, 3, 8),
                                         .expert_bias = cdev<S>(bias, 1, 8),
                                         .indices = dev<S>(idx, 3, 2),
                                         .probs = dev<S>(probs, 3, 2)});
  REQUIRE_FALSE(unasked_bias);
  CHECK(unasked_bias.error().message.find("expert_bias must be empty") != std::string::npos);
  const auto small_ws = r->forward(x,
                                   {.x = cdev<S>(xs, 3, 5),
                                    .weight = cdev<S>(w5, 8, 5),
                                    .logits = dev<S>(logits, 3, 8),
                                    .indices = dev<S>(idx, 3, 2),
                                    .probs = dev<S>(probs, 3, 2)},
                                   {});
  if (router_t::workspace_bytes() > 0) {
    REQUIRE_FALSE(small_ws);
    CHECK(small_ws.error().code == errc::workspace_too_small);
  }
}
