// The router's kernels in fp64 (R = double: kernels/router.hpp, router_block.hpp,
// router_aux_loss.hpp, router_z_loss.hpp) on cpu_exec and host_exec, against the host router and
// losses in fp64 (routing/topk_router.hpp, aux_loss.hpp) on fresh random logits (seed printed),
// and the double math they run on (kernels/simt/math.hpp) against the C library in long double.
// fp64 runs on CPU contexts only: it is what makes the finite-difference gradient checks of the
// router exercise the production kernels.
//
// Bounds: a sum over E terms rounds E - 1 times and each exp, log or division once or twice, so
// the kernels and the host (other exp, other order of the sums on a GPU-shaped team) agree within
// (2 E + 8) ulp of fp64 relative to the values' scale; the selected experts agree except at a
// near-tie (two candidates within 1e-12 of the largest value).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_aux_loss.hpp>
#include <moefold/kernels/router_block.hpp>
#include <moefold/kernels/router_z_loss.hpp>
#include <random>
#include <vector>
#include "../support/host_aux_loss.hpp"
#include "../support/host_topk_router.hpp"

#include "../support/simt_test_sizes.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

constexpr double ulp = 0x1p-52;

// |a - b| within (2 E + 8) ulp of scale.
bool close(double a, double b, int E, double scale) {
  return std::abs(a - b) <= (2.0 * E + 8.0) * ulp * std::max(scale, 1e-300);
}

template <class K>
void run_on(bool host, const K& kernel, int blocks, std::mt19937_64& rng) {
  std::size_t smem = 0;
  if constexpr (requires { K::smem_bytes; }) smem = K::smem_bytes;
  const launch_grid g{.blocks = blocks, .smem_bytes = smem};
  if (host)
    REQUIRE(launch(host_exec{}, g, kernel));
  else
    REQUIRE(launch(cpu_exec{rng()}, g, kernel));
}

// The host's selection values (score + bias, logit, or softmax) of one token hold a near-tie
// among its top k + 1.
bool near_tie(const topk_router_options& o, const double* row, const std::vector<float>& bias) {
  std::vector<double> v(row, row + o.num_experts);
  for (int e = 0; e < o.num_experts; ++e) {
    double& x = v[static_cast<std::size_t>(e)];
    if (o.score == score_function::sigmoid) x = 1 / (1 + std::exp(-x));
    if (o.score == score_function::sqrt_softplus) x = std::sqrt(std::log1p(std::exp(x)));
    if (o.expert_bias) x += bias[static_cast<std::size_t>(e)];
  }
  if (o.num_groups > 0) return true;  // group scores: compared through the probabilities only
  std::sort(v.begin(), v.end(), std::greater<>());
  for (int i = 0; i + 1 < std::min(o.topk + 1, o.num_experts); ++i)
    if (v[static_cast<std::size_t>(i)] - v[static_cast<std::size_t>(i) + 1] <=
        1e-12 * std::max(std::abs(v.front()), 1.0))
      return true;
  return false;
}

std::vector<topk_router_options> variants(int E) {
  std::vector<topk_router_options> v;
  for (int kk : {1, 2, 8}) {
    if (kk > E) continue;
    v.push_back({.num_experts = E, .topk = kk, .pre_softmax = true});
    if (kk > 1) v.push_back({.num_experts = E, .topk = kk});
    v.push_back({.num_experts = E, .topk = kk, .score = score_function::sigmoid});
    v.push_back({.num_experts = E,
                 .topk = kk,
                 .score = score_function::sigmoid,
                 .scaling_factor = 2.5,
                 .expert_bias = true});
    v.push_back({.num_experts = E, .topk = kk, .score = score_function::sqrt_softplus});
    if (E >= 64 && kk == 8)
      v.push_back({.num_experts = E,
                   .topk = kk,
                   .score = score_function::sigmoid,
                   .num_groups = 8,
                   .group_topk = 4,
                   .expert_bias = true});
  }
  return v;
}

// Forward and backward of the router over Team in fp64 against the host router, on both CPU
// contexts.
template <class Team>
void check_router(int E, int N, std::mt19937_64& rng) {
  using fwd = k::basic_router_topk_kernel<Team, double>;
  using bwd = k::basic_router_backward_kernel<Team, double>;
  std::normal_distribution<double> d(0.0, 2.0);
  long compared = 0;
  for (const auto& o : variants(E))
    for (bool host : {false, true}) {
      CAPTURE(E);
      CAPTURE(o.topk);
      CAPTURE(static_cast<int>(o.score));
      CAPTURE(o.pre_softmax);
      CAPTURE(host);
      const int kk = o.topk;
      std::vector<double> logits(static_cast<std::size_t>(N) * E);
      for (auto& x : logits) x = d(rng);
      std::vector<float> bias;
      if (o.expert_bias)
        for (int e = 0; e < E; ++e) bias.push_back(static_cast<float>(0.1 * d(rng)));
      auto router = host_topk_router<double>::make(o);
      REQUIRE(router);
      topk_routing<double> ref;
      REQUIRE(router->route(logits, ref, bias));
      std::vector<int> idx(static_cast<std::size_t>(N) * kk, -7);
      std::vector<double> probs(idx.size(), -7.0);
      const fwd f{.logits = logits.data(),
                  .num_tokens = N,
                  .num_experts = E,
                  .topk = kk,
                  .score = o.score,
                  .pre_softmax = o.pre_softmax,
                  .num_groups = o.num_groups,
                  .group_topk = o.group_topk,
                  .expert_bias = o.expert_bias ? bias.data() : nullptr,
                  .scale = o.scaling_factor.has_value(),
                  .scaling_factor = o.scaling_factor.value_or(1.0),
                  .indices = idx.data(),
                  .probs = probs.data()};
      run_on(host, f, std::min(N, 3), rng);
      // The backward from the host's routing (so that near-ties cannot change what is compared).
      std::vector<double> dprobs(idx.size());
      for (auto& g : dprobs) g = d(rng);
      std::vector<double> dl(logits.size(), -7.0), dl_ref(logits.size());
      REQUIRE(router->backward(logits, ref, dprobs, dl_ref));
      const bwd b{.logits = logits.data(),
                  .indices = ref.indices.data(),
                  .dprobs = dprobs.data(),
                  .num_tokens = N,
                  .num_experts = E,
                  .topk = kk,
                  .score = o.score,
                  .pre_softmax = o.pre_softmax,
                  .scale = o.scaling_factor.has_value(),
                  .scaling_factor = o.scaling_factor.value_or(1.0),
                  .dlogits = dl.data()};
      run_on(host, b, std::min(N, 3), rng);
      const double gscale = 4.0 * o.scaling_factor.value_or(1.0);
      for (int t = 0; t < N; ++t) {
        const auto row = static_cast<std::size_t>(t);
        const bool tie = near_tie(o, logits.data() + row * E, bias);
        for (int i = 0; i < kk; ++i) {
          const auto at = row * kk + i;
          if (!tie) CHECK(idx[at] == ref.indices[at]);
          if (!tie || o.num_groups > 0)
            CHECK(close(probs[at], ref.probs[at], E, o.scaling_factor.value_or(1.0)));
        }
        for (int e = 0; e < E; ++e) CHECK(close(dl[row * E + e], dl_ref[row * E + e], E, gscale));
        compared += tie ? 0 : 1;
      }
    }
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("simt double log, log1p, sigmoid and sqrt against the C library in long double") {
  std::mt19937_64 rng(test::simt_seed());
  MESSAGE("seed " << test::simt_seed());
  std::uniform_real_distribution<double> expo(-1000.0, 1000.0), unit(1.0, 2.0), lin(-40.0, 40.0);
  const auto ulps = [](double got, long double want) {
    const long double w = std::abs(want);
    const long double u = std::ldexp(1.0L, std::ilogb(static_cast<double>(w)) - 52);
    return static_cast<double>(std::abs(static_cast<long double>(got) - want) / u);
  };
  double worst_log = 0, worst_log1p = 0, worst_sig = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = unit(rng) * std::exp2(std::round(expo(rng)));
    if (x != 1.0)
      worst_log = std::max(worst_log, ulps(k::simt::log(x), std::log(static_cast<long double>(x))));
    const double y = lin(rng);
    const double ey = std::exp(y);
    worst_log1p =
        std::max(worst_log1p, ulps(k::simt::log1p(ey), std::log1p(static_cast<long double>(ey))));
    worst_sig = std::max(worst_sig, ulps(k::simt::sigmoid(y),
                                         1.0L / (1.0L + std::exp(-static_cast<long double>(y)))));
    CHECK(k::simt::sqrt(x) == std::sqrt(x));
  }
  MESSAGE("worst ulp: log " << worst_log << ", log1p " << worst_log1p << ", sigmoid " << worst_sig);
  CHECK(worst_log <= 2.0);
  CHECK(worst_log1p <= 4.0);  // the log's 2, the quotient's and the product's roundings
  CHECK(worst_sig <= 4.0);
  CHECK(k::simt::log(0.0) == -HUGE_VAL);
  CHECK(std::isnan(k::simt::log(-1.0)));
  CHECK(k::simt::log(HUGE_VAL) == HUGE_VAL);
  CHECK(k::simt::log(0x1p-1074) == doctest::Approx(std::log(0x1p-1074)).epsilon(1e-15));
  CHECK(k::simt::neg_inf<double>() == -HUGE_VAL);
}

TEST_CASE("router kernels in fp64 on cpu_exec and host_exec: every variant against the host") {
  std::mt19937_64 rng(test::simt_seed());
  MESSAGE("seed " << test::simt_seed());
  const int N = test::simt_reduced ? 8 : 24;
  for (int E : {8, 64, 256}) check_router<k::detail_router::warp_per_token>(E, N, rng);
  check_router<k::detail_router::block_per_token>(512, test::simt_reduced ? 4 : 8, rng);
}

TEST_CASE("router losses in fp64 on cpu_exec and host_exec: aux scores, loss, gradients, z-loss") {
  std::mt19937_64 rng(test::simt_seed());
  MESSAGE("seed " << test::simt_seed());
  std::normal_distribution<double> d(0.0, 2.0);
  const int N = test::simt_reduced ? 8 : 32;
  for (int E : {8, 64})
    for (auto f : {score_function::softmax, score_function::sigmoid, score_function::sqrt_softplus})
      for (bool host : {false, true}) {
        CAPTURE(E);
        CAPTURE(static_cast<int>(f));
        CAPTURE(host);
        const int kk = 2;
        using team = k::detail_router::warp_per_token;
        std::vector<double> logits(static_cast<std::size_t>(N) * E);
        for (auto& x : logits) x = d(rng);
        std::vector<std::uint8_t> padding(static_cast<std::size_t>(N), 0);
        padding[3] = 1;
        // Scores and map.
        std::vector<double> scores(logits.size(), -7.0);
        std::vector<std::uint8_t> map(logits.size(), 7);
        run_on(host,
               k::basic_aux_scores_kernel<team, double>{.logits = logits.data(),
                                                        .padding = padding.data(),
                                                        .num_tokens = N,
                                                        .num_experts = E,
                                                        .topk = kk,
                                                        .score = f,
                                                        .scores = scores.data(),
                                                        .map = map.data()},
               2, rng);
        aux_scores<double> ref;
        REQUIRE(compute_aux_scores<double>(f, kk, E, logits, padding, ref));
        for (std::size_t i = 0; i < scores.size(); ++i)
          CHECK(close(scores[i], ref.scores[i], E, 1.0));
        // The loss from the kernel's column sums and counts.
        std::vector<double> sums(static_cast<std::size_t>(E)), counts(static_cast<std::size_t>(E));
        run_on(host,
               k::aux_column_sums_kernel<double>{.scores = scores.data(),
                                                 .map = map.data(),
                                                 .rows = N,
                                                 .columns = E,
                                                 .sums = sums.data(),
                                                 .counts = counts.data()},
               1, rng);
        double loss = -7;
        std::vector<double> dscores(static_cast<std::size_t>(E));
        const double coeff = 0.01;
        run_on(host,
               k::switch_loss_kernel<double>{.column_sums = sums.data(),
                                             .counts = counts.data(),
                                             .columns = E,
                                             .total_tokens = N - 1.0,
                                             .per_token = kk,
                                             .topk = kk,
                                             .num_experts = E,
                                             .coeff = coeff,
                                             .divide_by = 1.0,
                                             .running = nullptr,
                                             .used = nullptr,
                                             .loss = &loss,
                                             .dscores = dscores.data()},
               1, rng);
        aux_loss_term<double> term;
        term.counts = column_counts(ref.map, static_cast<std::size_t>(E));
        switch_load_balancing_into<double>(ref.scores, static_cast<std::size_t>(E), N - 1.0, kk, E,
                                           coeff, 1.0, term);
        CHECK(close(loss, term.loss, N * E, std::abs(term.loss)));
        // The aux gradient chained into the logits, then the z-loss's added on top.
        std::vector<double> dl(logits.size(), 0.5), dl_ref(logits.size(), 0.5);
        const double seed = 0.75;
        run_on(host,
               k::basic_aux_loss_backward_kernel<team, double>{.logits = logits.data(),
                                                               .padding = padding.data(),
                                                               .num_tokens = N,
                                                               .num_experts = E,
                                                               .score = f,
                                                               .dscores = dscores.data(),
                                                               .columns = E,
                                                               .seed = seed,
                                                               .dlogits = dl.data()},
               2, rng);
        REQUIRE(add_aux_loss_gradient<double>(f, logits, E, padding, term, seed, dl_ref));
        std::vector<double> lse(static_cast<std::size_t>(N));
        run_on(host,
               k::basic_logsumexp_kernel<team, double>{.logits = logits.data(),
                                                       .padding = padding.data(),
                                                       .num_tokens = N,
                                                       .num_experts = E,
                                                       .lse = lse.data()},
               2, rng);
        double z = -7;
        int valid = -7;
        const double zc = 0.001;
        run_on(host,
               k::z_loss_total_kernel<double>{.lse = lse.data(),
                                              .padding = padding.data(),
                                              .num_tokens = N,
                                              .coeff = zc,
                                              .loss = &z,
                                              .valid = &valid},
               1, rng);
        CHECK(valid == N - 1);
        auto z_ref = z_loss<double>(logits, E, zc, padding);
        REQUIRE(z_ref);
        CHECK(close(z, *z_ref, N + E, *z_ref));
        run_on(host,
               k::basic_z_loss_backward_kernel<team, double>{.logits = logits.data(),
                                                             .padding = padding.data(),
                                                             .lse = lse.data(),
                                                             .valid = &valid,
                                                             .num_tokens = N,
                                                             .num_experts = E,
                                                             .coeff = zc,
                                                             .seed = seed,
                                                             .dlogits = dl.data()},
               2, rng);
        REQUIRE(add_z_loss_gradient<double>(logits, E, zc, padding, seed, dl_ref));
        for (std::size_t i = 0; i < dl.size(); ++i) CHECK(close(dl[i], dl_ref[i], E, 1.0));
      }
}
