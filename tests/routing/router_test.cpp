// The top-k router's forward on the host: the router-math invariants of docs/dispatch-semantics.md
// section 11 (item 11), the tie rule, group limits, float vs double, and every kind of bad input.
// The values themselves are checked against Megatron-Core's own code in megatron_reference_test.
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/routing/input_jitter.hpp>
#include <moefold/routing/router.hpp>
#include <moefold/routing/topk_router.hpp>
#include "../support/host_gating.hpp"
#include "../support/host_topk_router.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "util.hpp"

using namespace moefold;
using moefold::test::all_variants;
using moefold::test::random_vector;

namespace {

constexpr int E = 8, N = 24;

// Independent score of one expert for selection: what the options say, computed directly.
template <class T>
std::vector<T> selection_scores(const topk_router_options& o, const T* row,
                                const std::vector<float>& bias) {
  std::vector<T> s(E);
  if (o.score == score_function::softmax) {
    if (!o.pre_softmax) return std::vector<T>(row, row + E);
    T m = *std::max_element(row, row + E), z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(row[e] - m);
    for (int e = 0; e < E; ++e) s[e] = std::exp(row[e] - m) / z;
    return s;
  }
  for (int e = 0; e < E; ++e) {
    const T x = row[e];
    s[e] = o.score == score_function::sigmoid ? T(1) / (T(1) + std::exp(-x))
                                              : std::sqrt(std::log1p(std::exp(x)));
    if (o.expert_bias) s[e] += static_cast<T>(bias[e]);
  }
  return s;
}

}  // namespace

TEST_CASE_TEMPLATE("every variant: selection is the top-k of its scores, within the kept groups", T,
                   float, double) {
  const auto logits = random_vector<T>(N * E, 11);
  const auto bias = random_vector<float>(E, 12, -0.3, 0.3);
  for (const auto& v : all_variants(E)) {
    CAPTURE(v.name);
    const auto router = host_topk_router<T>::make(v.opt).value();
    topk_routing<T> r;
    REQUIRE(router.route(
        logits, r, v.opt.expert_bias ? std::span<const float>(bias) : std::span<const float>{}));
    const int k = v.opt.topk;
    CHECK(r.num_tokens == N);
    for (int t = 0; t < N; ++t) {
      const auto s = selection_scores<T>(v.opt, logits.data() + t * E, bias);
      std::set<int> chosen;
      for (int i = 0; i < k; ++i) chosen.insert(r.expert(t, i));
      CHECK(static_cast<int>(chosen.size()) == k);
      // Sorted by selection score, descending.
      for (int i = 1; i < k; ++i) CHECK(s[r.expert(t, i - 1)] >= s[r.expert(t, i)]);
      if (v.opt.num_groups == 0) {
        // Every non-chosen expert scores at most the weakest chosen one.
        for (int e = 0; e < E; ++e)
          if (!chosen.count(e)) CHECK(s[e] <= s[r.expert(t, k - 1)]);
      } else {
        const int per = E / v.opt.num_groups;
        std::set<int> groups;
        for (int e : chosen) groups.insert(e / per);
        CHECK(static_cast<int>(groups.size()) <= v.opt.group_topk);
        // Group scores: sum of the top-(k/g) scores per group; the kept groups are the best.
        std::vector<T> gs(v.opt.num_groups);
        for (int g = 0; g < v.opt.num_groups; ++g) {
          std::vector<T> m(s.begin() + g * per, s.begin() + (g + 1) * per);
          std::sort(m.rbegin(), m.rend());
          for (int i = 0; i < k / v.opt.group_topk; ++i) gs[g] += m[i];
        }
        std::vector<T> sorted = gs;
        std::sort(sorted.rbegin(), sorted.rend());
        for (int g : groups) CHECK(gs[g] >= sorted[v.opt.group_topk - 1]);
        // Inside the allowed groups the choice is a plain top-k.
        std::set<int> allowed;
        for (int g = 0; g < v.opt.num_groups; ++g)
          if (gs[g] >= sorted[v.opt.group_topk - 1]) allowed.insert(g);
        for (int e = 0; e < E; ++e)
          if (!chosen.count(e) && allowed.count(e / per) && groups.count(e / per))
            CHECK(s[e] <= s[r.expert(t, k - 1)]);
      }
    }
  }
}

TEST_CASE_TEMPLATE("router math: probabilities per variant (invariant 11)", T, float, double) {
  const auto logits = random_vector<T>(N * E, 21);
  const auto bias = random_vector<float>(E, 22, -0.5, 0.5);
  const T tol = std::is_same_v<T, float> ? T(2e-6) : T(1e-14);
  for (const auto& v : all_variants(E)) {
    CAPTURE(v.name);
    const auto router = host_topk_router<T>::make(v.opt).value();
    topk_routing<T> r;
    REQUIRE(router.route(
        logits, r, v.opt.expert_bias ? std::span<const float>(bias) : std::span<const float>{}));
    const int k = v.opt.topk;
    const T scale = v.opt.scaling_factor ? T(*v.opt.scaling_factor) : T(1);
    for (int t = 0; t < N; ++t) {
      const T* row = logits.data() + t * E;
      T sum = 0;
      for (int i = 0; i < k; ++i) sum += r.prob(t, i);
      if (v.opt.score == score_function::softmax && !v.opt.pre_softmax) {
        CHECK(sum == doctest::Approx(scale).epsilon(tol));  // post-softmax: sums to 1 (x scale)
      } else if (v.opt.score == score_function::softmax) {
        // Pre-softmax: the entries of the softmax over all experts, not renormalised.
        T m = *std::max_element(row, row + E), z = 0;
        for (int e = 0; e < E; ++e) z += std::exp(row[e] - m);
        for (int i = 0; i < k; ++i)
          CHECK(r.prob(t, i) ==
                doctest::Approx(std::exp(row[r.expert(t, i)] - m) / z).epsilon(tol));
      } else {
        // Sigmoid / sqrt-softplus: the unbiased scores of the chosen experts, renormalised when
        // k > 1 (the expert bias changed only the choice).
        std::vector<T> s(k);
        T ssum = 0;
        for (int i = 0; i < k; ++i) {
          const T x = row[r.expert(t, i)];
          s[i] = v.opt.score == score_function::sigmoid ? T(1) / (T(1) + std::exp(-x))
                                                        : std::sqrt(std::log1p(std::exp(x)));
          ssum += s[i];
        }
        for (int i = 0; i < k; ++i)
          CHECK(r.prob(t, i) == doctest::Approx((k > 1 ? s[i] / ssum : s[i]) * scale).epsilon(tol));
        if (k > 1) CHECK(sum == doctest::Approx(scale).epsilon(tol));
      }
    }
    // Dense views agree with the record.
    const auto dp = r.dense_probs();
    const auto dm = r.dense_map();
    for (int t = 0; t < N; ++t) {
      int routed = 0;
      for (int e = 0; e < E; ++e) routed += dm[t * E + e];
      CHECK(routed == k);
      for (int i = 0; i < k; ++i) CHECK(dp[t * E + r.expert(t, i)] == r.prob(t, i));
    }
  }
}

TEST_CASE("the expert bias changes the indices, never the probability values") {
  const auto logits = random_vector<double>(N * E, 31);
  const topk_router_options o{
      .num_experts = E, .topk = 2, .score = score_function::sigmoid, .expert_bias = true};
  const auto router = host_topk_router<double>::make(o).value();
  std::vector<float> zero(E, 0.f), bias(E, 0.f);
  bias[5] = 10.f;  // forces expert 5 into every selection
  topk_routing<double> a, b;
  REQUIRE(router.route(logits, a, zero));
  REQUIRE(router.route(logits, b, bias));
  const auto plain = host_topk_router<double>::make(
                         {.num_experts = E, .topk = 2, .score = score_function::sigmoid})
                         .value();
  topk_routing<double> c;
  REQUIRE(plain.route(logits, c));
  CHECK(a.indices == c.indices);
  CHECK(a.probs == c.probs);
  int changed = 0;
  for (int t = 0; t < N; ++t) {
    CHECK(b.expert(t, 0) == 5);
    const double s5 = 1 / (1 + std::exp(-logits[t * E + 5]));
    const double so = 1 / (1 + std::exp(-logits[t * E + b.expert(t, 1)]));
    CHECK(b.prob(t, 0) == doctest::Approx(s5 / (s5 + so)).epsilon(1e-14));
    changed += b.expert(t, 0) != a.expert(t, 0) || b.expert(t, 1) != a.expert(t, 1);
  }
  CHECK(changed > 0);
}

TEST_CASE("exact ties go to the lower expert index, in plain and group-limited selection") {
  // All logits equal: every score ties.
  std::vector<double> flat(3 * E, 0.5);
  for (const auto& v : all_variants(E)) {
    CAPTURE(v.name);
    const auto router = host_topk_router<double>::make(v.opt).value();
    topk_routing<double> r;
    std::vector<float> bias(E, 0.f);
    REQUIRE(router.route(
        flat, r, v.opt.expert_bias ? std::span<const float>(bias) : std::span<const float>{}));
    for (int t = 0; t < 3; ++t)
      for (int i = 0; i < v.opt.topk; ++i) CHECK(r.expert(t, i) == i);
  }
  // A tie between experts 6 and 2 for the second place: 2 wins.
  std::vector<double> row = {0, 0, 1, 0, 0, 0, 1, 3};
  const auto router = host_topk_router<double>::make({.num_experts = E, .topk = 2}).value();
  topk_routing<double> r;
  REQUIRE(router.route(row, r));
  CHECK(r.expert(0, 0) == 7);
  CHECK(r.expert(0, 1) == 2);
}

TEST_CASE("float and double routers agree to float rounding") {
  const auto ld = random_vector<double>(N * E, 41);
  std::vector<float> lf(ld.begin(), ld.end());
  std::vector<double> lfd(lf.begin(), lf.end());  // the same inputs in both precisions
  const auto bias = random_vector<float>(E, 42, -0.2, 0.2);
  for (const auto& v : all_variants(E)) {
    CAPTURE(v.name);
    topk_routing<float> rf;
    topk_routing<double> rd;
    const auto b = v.opt.expert_bias ? std::span<const float>(bias) : std::span<const float>{};
    REQUIRE(host_topk_router<float>::make(v.opt).value().route(lf, rf, b));
    REQUIRE(host_topk_router<double>::make(v.opt).value().route(lfd, rd, b));
    CHECK(rf.indices == rd.indices);
    for (std::size_t i = 0; i < rf.probs.size(); ++i)
      CHECK(rf.probs[i] == doctest::Approx(rd.probs[i]).epsilon(1e-6));
  }
}

TEST_CASE("no tokens: an empty routing, not an error") {
  const auto router = host_topk_router<float>::make({.num_experts = E, .topk = 2}).value();
  topk_routing<float> r;
  REQUIRE(router.route(std::span<const float>{}, r));
  CHECK(r.num_tokens == 0);
  CHECK(r.indices.empty());
}

TEST_CASE("bad options are rejected with the rule that was broken") {
  auto code = [](topk_router_options o) { return host_topk_router<float>::make(o).error().code; };
  CHECK(code({.num_experts = 0, .topk = 1}) == errc::invalid_size);
  CHECK(code({.num_experts = 8, .topk = 9}) == errc::invalid_argument);  // k > E
  CHECK(code({.num_experts = 8, .topk = 0}) == errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 1}) == errc::invalid_argument);  // k=1 post-softmax
  CHECK(
      code({.num_experts = 8, .topk = 2, .score = score_function::sigmoid, .pre_softmax = true}) ==
      errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 2, .expert_bias = true}) == errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 2, .num_groups = 3, .group_topk = 1}) ==
        errc::invalid_argument);  // groups do not divide the experts
  CHECK(code({.num_experts = 8, .topk = 2, .num_groups = 4, .group_topk = 5}) ==
        errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 2, .num_groups = 4, .group_topk = 0}) ==
        errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 2, .num_groups = 4, .group_topk = 3}) ==
        errc::invalid_argument);  // k < group_topk
  CHECK(code({.num_experts = 8, .topk = 5, .num_groups = 4, .group_topk = 2}) ==
        errc::invalid_argument);  // 2 groups of 2 cannot supply 5 experts
  CHECK(code({.num_experts = 8, .topk = 2, .scaling_factor = 0.0}) == errc::invalid_argument);
  CHECK(code({.num_experts = 8, .topk = 2, .scaling_factor = NAN}) == errc::invalid_argument);
  const auto e = host_topk_router<float>::make({.num_experts = 8, .topk = 9}).error();
  CHECK(e.message.find("topk") != std::string::npos);
  CHECK(e.message.find("9") != std::string::npos);
}

TEST_CASE_TEMPLATE("bad inputs: non-finite logits, wrong shapes, a missing or extra bias", T, float,
                   double) {
  const auto router = host_topk_router<T>::make({.num_experts = E, .topk = 2}).value();
  topk_routing<T> r;
  auto logits = random_vector<T>(4 * E, 51);
  CHECK(router.route(std::span<const T>(logits.data(), 4 * E - 1), r).error().code ==
        errc::shape_mismatch);
  logits[13] = std::numeric_limits<T>::quiet_NaN();
  auto s = router.route(logits, r);
  CHECK(s.error().code == errc::non_finite_input);
  CHECK(s.error().message.find("13") != std::string::npos);
  logits[13] = std::numeric_limits<T>::infinity();
  CHECK(router.route(logits, r).error().code == errc::non_finite_input);
  logits[13] = 0;
  std::vector<float> bias(E, 0.f);
  CHECK(router.route(logits, r, bias).error().code == errc::invalid_argument);
  const auto biased =
      host_topk_router<T>::make(
          {.num_experts = E, .topk = 2, .score = score_function::sigmoid, .expert_bias = true})
          .value();
  CHECK(biased.route(logits, r).error().code == errc::shape_mismatch);
  bias[3] = std::numeric_limits<float>::infinity();
  CHECK(biased.route(logits, r, bias).error().code == errc::non_finite_input);
  // Backward with a routing of another shape.
  bias[3] = 0;
  REQUIRE(biased.route(logits, r, bias));
  std::vector<T> dprobs(3 * 2), dlogits(4 * E);
  CHECK(biased.backward(logits, r, dprobs, dlogits).error().code == errc::shape_mismatch);
}

TEST_CASE("a user type models the router concept") {
  // Round-robin routing (the deterministic test router of the reference, 2.1): expert (t*k+i)%E.
  struct round_robin {
    using value_type = float;
    int E = 4, k = 2;
    int num_experts() const { return E; }
    int topk() const { return k; }
    status route(host_exec&, const router_route_args<float, host_space>& f) const {
      for (int t = 0; t < f.logits.rows(); ++t)
        for (int i = 0; i < k; ++i) {
          f.indices.data()[t * k + i] = (t * k + i) % E;
          f.probs.data()[t * k + i] = 1.f / k;
        }
      return {};
    }
    status backward(host_exec&, const router_backward_args<float, host_space>& b) const {
      std::fill(b.dlogits.data(), b.dlogits.data() + b.dlogits.rows() * E, 0.f);
      return {};
    }
  };
  static_assert(routing::router<round_robin, host_exec>);
  static_assert(!routing::router<round_robin, cpu_exec>);  // its views are host memory
  static_assert(routing::router<topk_router<float, host_exec>, host_exec>);
  static_assert(routing::router<topk_router<double, cpu_exec, double>, cpu_exec>);
}

TEST_CASE("gating: logits = x W^T + b in the router dtype") {
  const gating_shape g{.num_tokens = 5, .hidden = 7, .num_experts = 3};
  const auto x = random_vector<float>(35, 61);
  const auto w = random_vector<float>(21, 62);
  const auto b = random_vector<float>(3, 63);
  std::vector<double> logits(15);
  REQUIRE(gating_forward<double, float, float>(g, x, w, b, logits));
  for (int n = 0; n < 5; ++n)
    for (int e = 0; e < 3; ++e) {
      double ref = b[e];
      for (int h = 0; h < 7; ++h) ref += double(x[n * 7 + h]) * double(w[e * 7 + h]);
      CHECK(logits[n * 3 + e] == doctest::Approx(ref).epsilon(1e-15));
    }
  std::vector<double> bad(14);
  CHECK(gating_forward<double, float, float>(g, x, w, b, bad).error().code == errc::shape_mismatch);
  CHECK(gating_forward<double, float, float>({.num_tokens = 5, .hidden = 0, .num_experts = 3}, x, w,
                                             b, logits)
            .error()
            .code == errc::invalid_size);
}

TEST_CASE("input jitter: U(1-eps, 1+eps), reproducible from the seed, independent per element") {
  const auto x = random_vector<double>(4096, 71, 0.5, 2.0);
  std::vector<double> a(x.size()), b(x.size()), c(x.size());
  REQUIRE(apply_input_jitter<double>(x, 0.01, 7, 0, a));
  REQUIRE(apply_input_jitter<double>(x, 0.01, 7, 0, b));
  REQUIRE(apply_input_jitter<double>(x, 0.01, 8, 0, c));
  CHECK(a == b);
  CHECK(a != c);
  double mean = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double f = a[i] / x[i];
    CHECK(f >= 0.99 - 1e-15);
    CHECK(f < 1.01 + 1e-15);
    mean += f;
  }
  mean /= static_cast<double>(x.size());
  // Mean of 4096 uniforms on [0.99, 1.01]: standard error 0.02/sqrt(12*4096) = 9e-5.
  CHECK(std::abs(mean - 1.0) < 5e-4);
  // Offsets address the same stream: element i of offset 100 is element 100+i of offset 0.
  std::vector<double> d(10);
  REQUIRE(apply_input_jitter<double>(std::span<const double>(x.data() + 100, 10), 0.01, 7, 100, d));
  for (int i = 0; i < 10; ++i) CHECK(d[i] == a[100 + i]);
  CHECK(apply_input_jitter<double>(x, 0.0, 7, 0, a).error().code == errc::invalid_argument);
  CHECK(apply_input_jitter<double>(x, 1.5, 7, 0, a).error().code == errc::invalid_argument);
}
