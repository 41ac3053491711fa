// simt_router (routing/simt_router.hpp) on the CPU executor against fp64 references on fresh
// random inputs (seed printed): the logits against x W^T in fp64 within the GEMM's bound; the
// routing against topk_router<double> over the same logits (indices equal, probabilities within
// the router kernel's bound, near-ties excluded); dlogits against topk_router<double>::backward
// within its condition; dx and the accumulated weight gradient against fp64 over the same
// dlogits. fp32 and bf16 tokens, x with a row stride wider than H, the warp team (E <= 256) and
// the block team (E 512). Bad shapes and options beyond the kernels are refused.
#include <doctest/doctest.h>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/routing/simt_router.hpp>
#include <moefold/routing/topk_router.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../support/simt_test_sizes.hpp"
#include "../support/ulp.hpp"

using namespace moefold;

namespace {

constexpr double eps32 = 0x1p-24;  // half an fp32 ulp at 1: the unit roundoff

using dspace = cpu_device_space;
template <class T>
row_view<T, dspace> dev(std::vector<T>& v, int rows, int width, long long stride = -1) {
  return row_view<T, dspace>(v.data(), rows, width, stride < 0 ? width : stride);
}
template <class T>
row_view<const T, dspace> cdev(const std::vector<T>& v, int rows, int width,
                               long long stride = -1) {
  return row_view<const T, dspace>(v.data(), rows, width, stride < 0 ? width : stride);
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

template <class T>
void check_router(const variant& v, int N, int H, std::mt19937_64& rng, tally& count) {
  const topk_router_options& o = v.o;
  const int E = o.num_experts, K = o.topk;
  const long long xs = H + 3;  // x's row stride: wider than H
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<T> x(static_cast<std::size_t>(N * xs)), w(static_cast<std::size_t>(E * H));
  for (auto& e : x) e = static_cast<T>(static_cast<float>(nd(rng)));
  for (auto& e : w) e = static_cast<T>(static_cast<float>(0.5 * nd(rng)));
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (auto& b : bias) b = static_cast<float>(0.1 * nd(rng));
  using G = accumulator_t<T>;
  std::vector<G> grad(w.size()), grad0;
  for (auto& g : grad) g = static_cast<G>(nd(rng));
  grad0 = grad;
  cpu_exec x_exec(rng());
  auto r = simt_router<T, cpu_exec>::make(x_exec, o, H, cdev(w, E, H), dev(grad, E, H));
  REQUIRE_MESSAGE(r, r.error().message);
  std::vector<float> logits(static_cast<std::size_t>(N * E), -7.f),
      probs(static_cast<std::size_t>(N * K), -7.f);
  std::vector<int> idx(static_cast<std::size_t>(N * K), -7);
  const simt_router_forward<T, dspace> f{
      .x = cdev(x, N, H, xs),
      .expert_bias = o.expert_bias ? cdev(bias, 1, E) : row_view<const float, dspace>{},
      .logits = dev(logits, N, E),
      .indices = dev(idx, N, K),
      .probs = dev(probs, N, K)};
  REQUIRE(r->forward(f));
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
  // Routing: topk_router<double> over the same logits.
  auto ref_router = topk_router<double>::make(o);
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
      const int bound = static_cast<int>(std::ceil(spread)) + 4 +
                        static_cast<int>(std::ceil(std::log2(static_cast<double>(E)) / 2)) +
                        static_cast<int>(std::ceil(std::log2(static_cast<double>(K)))) + 1;
      CHECK(ulp_distance(probs[at], static_cast<float>(ref.probs[at])) <= bound);
    }
  }
  if (!v.backward) return;
  // dlogits: the router kernel's backward against topk_router<double>'s, each element within 8
  // fp32 epsilons of the element, the row's largest gradient and the formula's condition:
  // s_e (|ds_e| + sum |s ds|) with a softmax before top-k, p_i (|g_i| + sum |p g|) after
  // (g = dprobs times the scaling factor); the kernel test's bound (with the fp32 host term
  // below).
  std::vector<float> dprobs(static_cast<std::size_t>(N * K)), dlogits(l64.size(), -7.f);
  for (auto& d : dprobs) d = static_cast<float>(nd(rng));
  REQUIRE(r->backward_logits({.logits = cdev(logits, N, E),
                              .indices = cdev(idx, N, K),
                              .dprobs = cdev(dprobs, N, K),
                              .dlogits = dev(dlogits, N, E)}));
  const std::vector<double> dp64(dprobs.begin(), dprobs.end());
  std::vector<double> dl64(l64.size());
  REQUIRE(ref_router->backward(l64, ref, dp64, dl64));
  // The host router in fp32 over the same logits: where the formula itself is ill-conditioned in
  // fp32 (s (1 - s) for s near 1) the bound allows four times its error, as the kernel test does.
  auto f32_router = topk_router<float>::make(o);
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
      {.x = cdev(x, N, H, xs), .dlogits = cdev(dlogits, N, E), .dx = dev(dx, N, H, xs)}));
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

TEST_CASE_TEMPLATE("simt_router on cpu_exec: logits, routing and gradients against fp64", T, float,
                   bfloat16) {
  const std::uint64_t seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 41);
  // Two GEMM row tiles at N 33, several k steps at H 40; H 1 makes every token's logits one
  // column of W times a scalar (bf16 weights then tie often: those tokens are left out).
  tally count;
  for (const variant& v : variants())
    for (int N : {1, 33})
      for (int H : {1, 40}) {
        const std::string name = v.name;
        CAPTURE(name);
        CAPTURE(N);
        CAPTURE(H);
        check_router<T>(v, N, H, rng, count);
      }
  MESSAGE("tokens compared " << count.compared << ", near-ties left out " << count.ties);
  CHECK(count.compared >= 3 * count.ties);
}

TEST_CASE("simt_router refuses what its kernels cannot take and views of the wrong shape") {
  cpu_exec x;
  std::vector<float> w(8 * 4), g(8 * 4);
  const topk_router_options o{.num_experts = 8, .topk = 2};
  auto too_many = simt_router<float, cpu_exec>::make(
      x, {.num_experts = 2048, .topk = 2, .pre_softmax = true}, 4, cdev(w, 8, 4), dev(g, 8, 4));
  REQUIRE_FALSE(too_many);
  CHECK(too_many.error().message.find("E <= 1024") != std::string::npos);
  auto bad_weight = simt_router<float, cpu_exec>::make(x, o, 5, cdev(w, 8, 4), dev(g, 8, 4));
  REQUIRE_FALSE(bad_weight);
  CHECK(bad_weight.error().message.find("[E, H] = [8, 5]") != std::string::npos);
  auto invalid = simt_router<float, cpu_exec>::make(x, {.num_experts = 8, .topk = 9}, 4,
                                                    cdev(w, 8, 4), dev(g, 8, 4));
  CHECK_FALSE(invalid);  // validate()'s rule
  auto r = simt_router<float, cpu_exec>::make(x, o, 4, cdev(w, 8, 4), dev(g, 8, 4));
  REQUIRE(r);
  std::vector<float> xs(3 * 4), logits(3 * 8), probs(3 * 2), bias(8);
  std::vector<int> idx(3 * 2);
  const auto narrow = r->forward({.x = cdev(xs, 3, 4),
                                  .logits = dev(logits, 3, 7),
                                  .indices = dev(idx, 3, 2),
                                  .probs = dev(probs, 3, 2)});
  REQUIRE_FALSE(narrow);
  CHECK(narrow.error().message.find("logits must be contiguous [3, 8]") != std::string::npos);
  const auto unasked_bias = r->forward({.x = cdev(xs, 3, 4),
                                        .expert_bias = cdev(bias, 1, 8),
                                        .logits = dev(logits, 3, 8),
                                        .indices = dev(idx, 3, 2),
                                        .probs = dev(probs, 3, 2)});
  REQUIRE_FALSE(unasked_bias);
  CHECK(unasked_bias.error().message.find("expert_bias must be empty") != std::string::npos);
}
