// The fused router kernel (kernels/router.hpp) on the CPU executor against the host router
// (routing/topk_router.hpp) on fresh random logits (seed printed): every variant the host has.
// The selected experts are equal wherever the selection is not a near-tie (two candidates within
// 1e-6 max|value|, which exp's last bits may order either way); the probabilities agree to a few
// ulp (the kernel's exp is moefold's, the host's the C library's; the worst is printed). The
// CPU executor and the GPU give the same bits (simt-gpu checks the math functions bitwise).
// Every launch also runs on host_exec (the same body with a team of one thread per token)
// against cpu_exec's result: the same bits where no sum over E is involved (the selection, a
// softmax after top-k, the elementwise scores, groups, bias, scaling, and their backward); with
// a softmax before top-k (whose sum over E a team of one adds in expert order) the same experts
// except near-ties and probabilities and gradients within host_ulps(E) (below). Over integer
// logits (exact ties everywhere) host_exec chooses cpu_exec's experts: the lower index first.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>
#include <random>
#include <string>
#include <vector>
#include "../support/host_topk_router.hpp"

#include "../support/simt_test_sizes.hpp"
#include "../support/ulp.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

using test::ulp_distance;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// How far host_exec's result may be from cpu_exec's where a sum over E is involved, in ulp
// (kernels/router.hpp): a team of one adds the E terms in expert order, cpu_exec (and the GPU) in
// the team's tree. Each order rounds up to E - 1 times, errors of at most half an ulp of the sum;
// over random logits they add like a random walk: about sqrt(E) ulp apart at worst (measured
// over 60,000 tokens of normal logits: 5, 13, 21 ulp at E = 8, 64, 256; 31 at 1,024 over 5,000).
// Twice that, plus 2 for the roundings after the sum (the division by it, or a product), rounded
// up: 8, 18, 34, 66 ulp at those E.
int host_ulps(int E) {
  return 2 + 2 * static_cast<int>(std::ceil(std::sqrt(static_cast<double>(E))));
}
// The worst case of the same, for inputs whose roundings need not be independent (many equal
// terms, as integer logits give, round alike: 35 ulp at E = 256, 63 at 1,024 measured): either
// order of a sum of E non-negative terms is within (E - 1) half-ulps (relative) of the exact
// sum, so the two within 2 (E - 1) ulp; plus 2 for the roundings after it.
int host_ulps_worst(int E) { return 2 * E; }

struct variant {
  const char* name;
  topk_router_options o;
};

// The host's selection values of one token (scores + bias, or logits, or softmax), and whether
// its top k + 1 (and, grouped, its group scores) hold a near-tie.
bool near_tie(const topk_router_options& o, const float* row, const std::vector<float>& bias) {
  const int E = o.num_experts;
  std::vector<double> sel(static_cast<std::size_t>(E));
  double mx = 0;
  for (int e = 0; e < E; ++e) {
    const double x = row[e];
    double v = x;
    if (o.score == score_function::sigmoid) v = 1 / (1 + std::exp(-x));
    if (o.score == score_function::sqrt_softplus) v = std::sqrt(std::log1p(std::exp(x)));
    if (o.expert_bias) v += bias[static_cast<std::size_t>(e)];
    sel[static_cast<std::size_t>(e)] = v;
    mx = std::max(mx, std::abs(v));
  }
  const double tol = 1e-6 * std::max(mx, 1e-30);
  auto close_in_top = [&](std::vector<double> v, int n) {
    std::sort(v.begin(), v.end(), std::greater<>());
    for (int i = 0; i + 1 < std::min<int>(n + 1, static_cast<int>(v.size())); ++i)
      if (v[static_cast<std::size_t>(i)] - v[static_cast<std::size_t>(i) + 1] <= tol) return true;
    return false;
  };
  if (o.num_groups > 0) {
    const int per = E / o.num_groups, take = o.topk / o.group_topk;
    std::vector<double> gs;
    for (int g = 0; g < o.num_groups; ++g) {
      std::vector<double> part(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      if (close_in_top(part, take)) return true;
      std::sort(part.begin(), part.end(), std::greater<>());
      double s = 0;
      for (int i = 0; i < take; ++i) s += part[static_cast<std::size_t>(i)];
      gs.push_back(s);
    }
    if (close_in_top(gs, o.group_topk)) return true;
  }
  return close_in_top(sel, o.topk);
}

// Every variant the host router has, over the given E and k 1/2/8.
std::vector<variant> all_variants(std::initializer_list<int> experts = {1, 8, 64, 256}) {
  std::vector<variant> v;
  for (int E : experts)
    for (int kk : {1, 2, 8}) {
      if (kk > E) continue;
      v.push_back({"softmax, pre", {.num_experts = E, .topk = kk, .pre_softmax = true}});
      if (kk > 1) v.push_back({"softmax, post", {.num_experts = E, .topk = kk}});
      v.push_back({"sigmoid", {.num_experts = E, .topk = kk, .score = score_function::sigmoid}});
      v.push_back({"sigmoid + bias, scaled",
                   {.num_experts = E,
                    .topk = kk,
                    .score = score_function::sigmoid,
                    .scaling_factor = 2.5,
                    .expert_bias = true}});
      v.push_back({"sqrt_softplus",
                   {.num_experts = E, .topk = kk, .score = score_function::sqrt_softplus}});
      if (E >= 64 && kk == 8)
        v.push_back({"group-limited sigmoid + bias (8 groups, 4 kept)",
                     {.num_experts = E,
                      .topk = kk,
                      .score = score_function::sigmoid,
                      .num_groups = 8,
                      .group_topk = 4,
                      .expert_bias = true}});
    }
  return v;
}

// Random logits [N, E] (normal, sigma 2) and, with an expert bias, a bias [E] a tenth of that.
struct router_inputs {
  std::vector<float> logits, bias;
};
router_inputs random_inputs(const topk_router_options& o, int N, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 2.0f);
  router_inputs in;
  in.logits.resize(static_cast<std::size_t>(N) * o.num_experts);
  for (auto& x : in.logits) x = d(rng);
  if (o.expert_bias)
    for (int e = 0; e < o.num_experts; ++e) in.bias.push_back(0.1f * d(rng));
  return in;
}

// Kernel K (router_topk_kernel or router_topk_block_kernel) against the host router over
// `variants` and `tokens`: experts equal except near-ties, elementwise scores' probabilities
// within 4 ulp of the host's, a softmax before top-k within 2 + log2(E) / 2 ulp of fp64 beyond
// the rounding of x - max, and one after top-k within 2 + log2(k) / 2 ulp of fp64 beyond the
// rounding of each x_j - max.
template <class K>
void check_forward(const std::vector<variant>& variants, const std::vector<int>& tokens,
                   std::mt19937_64& rng) {
  int worst_ulp = 0, worst_pre = 0, worst_post = 0;
  long compared = 0, ties = 0;
  int worst_host = 0;                    // host_exec against cpu_exec, softmax before top-k, in ulp
  double worst_host_share = 0;           // the same over host_ulps(E)
  long host_bitwise = 0, host_ties = 0;  // tokens host_exec gave cpu_exec's bits; near-ties
  for (const auto& v : variants)
    for (int N : tokens) {
      const auto& o = v.o;
      const std::string name = v.name;
      CAPTURE(name);
      CAPTURE(o.num_experts);
      CAPTURE(o.topk);
      CAPTURE(N);
      auto router = host_topk_router<float>::make(o);
      REQUIRE(router);
      const int E = o.num_experts, kk = o.topk;
      auto [logits, bias] = random_inputs(o, N, rng);
      topk_routing<float> ref;
      REQUIRE(router->route(logits, ref, bias));
      std::vector<int> idx(static_cast<std::size_t>(N) * kk, -7);
      std::vector<float> probs(idx.size(), -7.0f);
      const K kernel{.logits = logits.data(),
                     .num_tokens = N,
                     .num_experts = E,
                     .topk = kk,
                     .score = o.score,
                     .pre_softmax = o.pre_softmax,
                     .num_groups = o.num_groups,
                     .group_topk = o.group_topk,
                     .expert_bias = o.expert_bias ? bias.data() : nullptr,
                     .scale = o.scaling_factor.has_value(),
                     .scaling_factor = static_cast<float>(o.scaling_factor.value_or(1.0)),
                     .indices = idx.data(),
                     .probs = probs.data()};
      std::size_t smem = 0;
      if constexpr (requires { K::smem_bytes; }) smem = K::smem_bytes;
      REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = std::min(N, 4), .smem_bytes = smem},
                     kernel));
      for (int t = 0; t < N; ++t) {
        if (near_tie(o, logits.data() + static_cast<std::size_t>(t) * E, bias)) {
          ++ties;
          continue;
        }
        ++compared;
        for (int i = 0; i < kk; ++i) {
          const auto at = static_cast<std::size_t>(t) * kk + i;
          CHECK(idx[at] == ref.indices[at]);
          if (o.pre_softmax) {
            // Against fp64: the host's float sum of E exponentials in expert order is itself
            // off by up to sqrt(E) ulp or so, which would hide the kernel's own error. Within
            // 2 ulp plus what rounding x - max to float can cost exp (a relative error of
            // |x - max| 2^-24: up to |x - max| ulp), which any fp32 softmax pays.
            const float* row = logits.data() + static_cast<std::size_t>(t) * E;
            const double m = *std::max_element(row, row + E);
            double z = 0;
            for (int e = 0; e < E; ++e) z += std::exp(static_cast<double>(row[e]) - m);
            const double x = row[idx[at]];
            const double p64 = std::exp(x - m) / z;
            const int excess = ulp_distance(probs[at], static_cast<float>(p64)) -
                               static_cast<int>(std::ceil(std::abs(x - m)));
            worst_pre = std::max(worst_pre, excess);
            // Beyond that: exp (1.05 ulp), the division and the reference's rounding (0.5 each),
            // and the sum of E terms, rounded once per level of its tree (log2 E levels, whose
            // errors add like a random walk): 2 + log2(E) / 2 ulp.
            CHECK(excess <= 2 + static_cast<int>(std::ceil(std::log2(static_cast<double>(E)) / 2)));
          } else if (o.score == score_function::softmax) {
            // A softmax after top-k, over the k selected logits, against fp64 too: the host's
            // float sum of k exponentials is off by up to k / 2 ulp itself (with k = 8 the two
            // were once 5 ulp apart). Within 2 + log2(k) / 2 ulp, as above, beyond what rounding
            // each x_j - max to float costs: |x_i - max| ulp in the numerator, the sum's share
            // sum_j p_j |x_j - max| in the denominator.
            const float* row = logits.data() + static_cast<std::size_t>(t) * E;
            const auto sel = [&](int j) {
              return static_cast<double>(row[idx[static_cast<std::size_t>(t) * kk + j]]);
            };
            double m = sel(0);
            for (int j = 1; j < kk; ++j) m = std::max(m, sel(j));
            double z = 0;
            for (int j = 0; j < kk; ++j) z += std::exp(sel(j) - m);
            double shares = 0;
            for (int j = 0; j < kk; ++j) shares += std::exp(sel(j) - m) / z * std::abs(sel(j) - m);
            const double x = sel(i);
            const double p64 = std::exp(x - m) / z;
            const int excess = ulp_distance(probs[at], static_cast<float>(p64)) -
                               static_cast<int>(std::ceil(std::abs(x - m))) -
                               static_cast<int>(std::ceil(shares));
            worst_post = std::max(worst_post, excess);
            CHECK(excess <=
                  2 + static_cast<int>(std::ceil(std::log2(static_cast<double>(kk)) / 2)));
          } else {
            // Elementwise scores: moefold's exp/log against the C library's, composed (sqrt of
            // log1p of exp) within 4 ulp.
            const int u = ulp_distance(probs[at], ref.probs[at]);
            worst_ulp = std::max(worst_ulp, u);
            CHECK(u <= 4);
          }
        }
      }

      // The same body on host_exec, a team of one per token (two blocks when there are two
      // tokens: the body's grid stride), against cpu_exec: its bits without a softmax before
      // top-k; with one, the same experts except near-ties, probabilities within host_ulps(E).
      std::vector<int> hidx(idx.size(), -7);
      std::vector<float> hprobs(idx.size(), -7.0f);
      K on_host = kernel;
      on_host.indices = hidx.data();
      on_host.probs = hprobs.data();
      REQUIRE(
          launch(host_exec{}, launch_grid{.blocks = std::min(N, 2), .smem_bytes = smem}, on_host));
      for (int t = 0; t < N; ++t) {
        const auto at = static_cast<std::size_t>(t) * kk;
        const bool same_experts = std::equal(hidx.begin() + static_cast<long>(at),
                                             hidx.begin() + static_cast<long>(at) + kk,
                                             idx.begin() + static_cast<long>(at));
        if (!o.pre_softmax) {
          CHECK_MESSAGE(same_experts, "host_exec token " << t);
          long differ = 0;
          for (int i = 0; i < kk; ++i) differ += same_bits(hprobs[at + i], probs[at + i]) ? 0 : 1;
          CHECK_MESSAGE(differ == 0, "host_exec token " << t);
          ++host_bitwise;
          continue;
        }
        if (!same_experts) {
          CHECK_MESSAGE(near_tie(o, logits.data() + static_cast<std::size_t>(t) * E, bias),
                        "host_exec token " << t << ": other experts than cpu_exec's, no near-tie");
          ++host_ties;
          continue;
        }
        for (int i = 0; i < kk; ++i) {
          const int u = ulp_distance(hprobs[at + i], probs[at + i]);
          worst_host = std::max(worst_host, u);
          worst_host_share = std::max(worst_host_share, static_cast<double>(u) / host_ulps(E));
          CHECK_MESSAGE(u <= host_ulps(E), "host_exec token " << t << " selection " << i << ": "
                                                              << hprobs[at + i] << " vs "
                                                              << probs[at + i]);
        }
      }
    }
  MESSAGE(compared << " tokens compared, " << ties << " near-ties skipped; probabilities within "
                   << worst_ulp << " ulp of the host router; a softmax before top-k within "
                   << worst_pre << " ulp of fp64 beyond |x - max|, after top-k within "
                   << worst_post << " beyond its rounding terms");
  MESSAGE("host_exec: " << host_bitwise << " tokens cpu_exec's bits; a softmax before top-k within "
                        << worst_host << " ulp of cpu_exec, at worst " << worst_host_share
                        << " of host_ulps(E) (" << host_ties << " near-ties with other experts)");
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("router kernel: every variant against the host router") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  // Tokens 1, 7, 33: every warp of a block, two blocks, a partial last step. (513 tokens take
  // 6.5 minutes on the CPU executor, whose shuffles are barriers of 32 OS threads.)
  // Under TSan (the reduced matrix) E 8 and 64 only, 7 tokens: the router has no shared memory,
  // so what TSan can find is in the warp operations, which every E exercises alike.
  if (test::simt_reduced)
    check_forward<k::router_topk_kernel>(all_variants({8, 64}), {7}, rng);
  else
    check_forward<k::router_topk_kernel>(all_variants(), {1, 7, 33}, rng);
}

TEST_CASE("router block kernel: E 512 and 1024, every variant, against the host router") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 1);
  // A block per token: tokens 1 and 5 (a block's second token); under TSan E 512, 2 tokens.
  if (test::simt_reduced)
    check_forward<k::router_topk_block_kernel>(all_variants({512}), {2}, rng);
  else
    check_forward<k::router_topk_block_kernel>(all_variants({512, 1024}), {1, 5}, rng);
}

namespace {

// Backward kernel K (router_backward_kernel or router_backward_block_kernel) against the host
// backward in fp64 over the same selection, every element within a bound from its own
// condition.
template <class K>
void check_backward(const std::vector<variant>& variants, const std::vector<int>& tokens,
                    std::mt19937_64& rng) {
  double worst = 0;  // |kernel - fp64| over the bound, worst case
  long compared = 0;
  double worst_host = 0;  // |host_exec - cpu_exec| over its bound (a softmax before top-k)
  long host_bitwise = 0;  // gradients host_exec gave cpu_exec's bits of
  for (const auto& v : variants)
    for (int N : tokens) {
      const auto& o = v.o;
      const std::string name = v.name;
      CAPTURE(name);
      CAPTURE(o.num_experts);
      CAPTURE(o.topk);
      CAPTURE(N);
      auto router = host_topk_router<float>::make(o);
      auto router64 = host_topk_router<double>::make(o);
      REQUIRE(router);
      REQUIRE(router64);
      const int E = o.num_experts, kk = o.topk;
      auto [logits, bias] = random_inputs(o, N, rng);  // the bias selects; it has no gradient
      std::normal_distribution<float> d(0.0f, 2.0f);
      topk_routing<float> r;
      REQUIRE(router->route(logits, r, bias));
      std::vector<float> dprobs(r.probs.size());
      for (auto& x : dprobs) x = d(rng);
      // The fp64 reference: the host backward in double over the same selection.
      topk_routing<double> r64{.num_tokens = N,
                               .num_experts = E,
                               .topk = kk,
                               .indices = r.indices,
                               .probs = {r.probs.begin(), r.probs.end()}};
      std::vector<double> logits64(logits.begin(), logits.end()),
          dprobs64(dprobs.begin(), dprobs.end()), ref(logits.size());
      REQUIRE(router64->backward(logits64, r64, dprobs64, ref));
      std::vector<float> host(logits.size());  // the host's fp32 backward (the same formulas)
      REQUIRE(router->backward(logits, r, dprobs, host));
      std::vector<float> got(logits.size(), -7.0f);
      const K kernel{.logits = logits.data(),
                     .indices = r.indices.data(),
                     .dprobs = dprobs.data(),
                     .num_tokens = N,
                     .num_experts = E,
                     .topk = kk,
                     .score = o.score,
                     .pre_softmax = o.pre_softmax,
                     .scale = o.scaling_factor.has_value(),
                     .scaling_factor = static_cast<float>(o.scaling_factor.value_or(1.0)),
                     .dlogits = got.data()};
      REQUIRE(launch(cpu_exec{rng()},
                     launch_grid{.blocks = std::min(N, 4), .smem_bytes = K::smem_bytes}, kernel));
      // The same body on host_exec (a team of one per token; two blocks when there are two
      // tokens): cpu_exec's bits without a softmax before top-k; with one, below.
      std::vector<float> hgot(logits.size(), -7.0f);
      K on_host = kernel;
      on_host.dlogits = hgot.data();
      REQUIRE(launch(host_exec{},
                     launch_grid{.blocks = std::min(N, 2), .smem_bytes = K::smem_bytes}, on_host));
      for (int t = 0; t < N; ++t) {
        double row_max = 0;
        for (int e = 0; e < E; ++e)
          row_max = std::max(row_max, std::abs(ref[static_cast<std::size_t>(t) * E + e]));
        // A softmax before top-k: dlogit_e = s_e (ds_e - <s, ds>), whose fp32 error scales with
        // s_e (|ds_e| + sum |s ds|) (s in fp64 here), not with the result.
        std::vector<double> cond(static_cast<std::size_t>(E), 0.0);
        if (o.pre_softmax) {
          const double* lrow = logits64.data() + static_cast<std::size_t>(t) * E;
          const double m = *std::max_element(lrow, lrow + E);
          std::vector<double> sm(static_cast<std::size_t>(E)), ds(static_cast<std::size_t>(E));
          double z = 0, dot_abs = 0;
          for (int e = 0; e < E; ++e) z += sm[static_cast<std::size_t>(e)] = std::exp(lrow[e] - m);
          for (int i = 0; i < kk; ++i)
            ds[static_cast<std::size_t>(r.indices[static_cast<std::size_t>(t) * kk + i])] +=
                dprobs64[static_cast<std::size_t>(t) * kk + i];
          for (int e = 0; e < E; ++e) {
            sm[static_cast<std::size_t>(e)] /= z;
            dot_abs += std::abs(sm[static_cast<std::size_t>(e)] * ds[static_cast<std::size_t>(e)]);
          }
          for (int e = 0; e < E; ++e)
            cond[static_cast<std::size_t>(e)] =
                sm[static_cast<std::size_t>(e)] *
                (std::abs(ds[static_cast<std::size_t>(e)]) + dot_abs);
        } else {
          // The k selected: a softmax after top-k, p_i (|g_i| + sum |p g|); a renormalised
          // score, (|g_i| / D + sum |g s| / D^2) |score'(x_i)|; k = 1, |g score'|.
          const double sc = o.scaling_factor.value_or(1.0);
          std::vector<double> x(static_cast<std::size_t>(kk)), g(x), sk(x), dsk(x);
          double zmax = -1e300;
          for (int i = 0; i < kk; ++i) {
            const auto at = static_cast<std::size_t>(t) * kk + i;
            x[i] = logits64[static_cast<std::size_t>(t) * E + r.indices[at]];
            g[i] = dprobs64[at] * sc;
            zmax = std::max(zmax, x[i]);
            if (o.score == score_function::sigmoid) {
              sk[i] = 1 / (1 + std::exp(-x[i]));
              dsk[i] = sk[i] * (1 - sk[i]);
            } else if (o.score == score_function::sqrt_softplus) {
              const double sp = x[i] > 20 ? x[i] : std::log1p(std::exp(x[i]));
              sk[i] = std::sqrt(sp);
              dsk[i] = (x[i] > 20 ? 1.0 : 1 / (1 + std::exp(-x[i]))) / (2 * sk[i]);
            }
          }
          double z = 0, pg = 0, gs = 0, d = 0;
          if (o.score == score_function::softmax) {
            for (int i = 0; i < kk; ++i) z += sk[i] = std::exp(x[i] - zmax);
            for (int i = 0; i < kk; ++i) pg += std::abs((sk[i] /= z) * g[i]);
          } else {
            for (int i = 0; i < kk; ++i) d += sk[i], gs += std::abs(g[i] * sk[i]);
          }
          for (int i = 0; i < kk; ++i) {
            double c = 0;
            if (o.score == score_function::softmax)
              c = sk[i] * (std::abs(g[i]) + pg);
            else if (kk > 1)
              c = (std::abs(g[i]) / d + gs / (d * d)) * std::abs(dsk[i]);
            else
              c = std::abs(g[i] * dsk[i]);
            cond[static_cast<std::size_t>(r.indices[static_cast<std::size_t>(t) * kk + i])] = c;
          }
        }
        for (int e = 0; e < E; ++e) {
          const auto at = static_cast<std::size_t>(t) * E + e;
          // fp32 arithmetic with moefold's exp against fp64: a few float epsilons of the
          // element, the row's largest gradient and the element's condition above, or, where
          // the formula itself is ill-conditioned in fp32 (s (1 - s) for s near 1), no more
          // than four times the host's own fp32 error.
          const double bound =
              8 * 1.2e-7 * (std::abs(ref[at]) + row_max + cond[static_cast<std::size_t>(e)]) +
              4 * std::abs(static_cast<double>(host[at]) - ref[at]) + 1e-30;
          const double err = std::abs(static_cast<double>(got[at]) - ref[at]);
          worst = std::max(worst, err / bound);
          CHECK_MESSAGE(err <= bound,
                        "token " << t << " expert " << e << ": " << got[at] << " vs " << ref[at]);
          ++compared;
          if (!o.pre_softmax) {
            CHECK_MESSAGE(same_bits(hgot[at], got[at]), "host_exec token " << t << " expert " << e
                                                                           << ": " << hgot[at]
                                                                           << " vs " << got[at]);
            ++host_bitwise;
            continue;
          }
          // s_e (ds_e - <s, ds>) from a softmax (and so s_e) within host_ulps(E) relative and a
          // dot product over E added in another order: host_ulps(E) of the element, plus twice
          // that of its condition s_e (|ds_e| + sum |s ds|) (one for s_e, one for the dot).
          const double hbound =
              host_ulps(E) * 0x1p-23 *
                  (std::abs(static_cast<double>(got[at])) +
                   2 * o.scaling_factor.value_or(1.0) * cond[static_cast<std::size_t>(e)]) +
              1e-30;
          const double herr = std::abs(static_cast<double>(hgot[at]) - got[at]);
          worst_host = std::max(worst_host, herr / hbound);
          CHECK_MESSAGE(herr <= hbound, "host_exec token " << t << " expert " << e << ": "
                                                           << hgot[at] << " vs " << got[at]);
        }
      }
    }
  MESSAGE(compared << " gradients compared; worst error " << worst << " of the bound");
  MESSAGE("host_exec: " << host_bitwise << " gradients cpu_exec's bits; with a softmax before "
                        << "top-k the worst " << worst_host << " of its bound");
  CHECK(compared > 0);
}

}  // namespace

TEST_CASE("router backward kernel: every variant against the host router's backward") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  // Under TSan (the reduced matrix) E 8 and 64, 7 tokens.
  if (test::simt_reduced)
    check_backward<k::router_backward_kernel>(all_variants({8, 64}), {7}, rng);
  else
    check_backward<k::router_backward_kernel>(all_variants(), {1, 7, 33}, rng);
}

TEST_CASE("router block backward kernel: E 512 and 1024, every variant, against the host") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 2);
  // A block per token: tokens 1 and 5; under TSan E 512, 2 tokens.
  if (test::simt_reduced)
    check_backward<k::router_backward_block_kernel>(all_variants({512}), {2}, rng);
  else
    check_backward<k::router_backward_block_kernel>(all_variants({512, 1024}), {1, 5}, rng);
}

namespace {

// Forward kernel K on host_exec against cpu_exec over logits with exact ties (integers in
// [-3, 3], a bias of multiples of 1/8): both take the lower expert (and group) first on every
// tie, so the experts are the same for every token, ties and all; the probabilities cpu_exec's
// bits, or, with a softmax before top-k (whose equal logits stay equal probabilities on each
// context), within host_ulps_worst(E): equal terms round alike, not as a random walk.
template <class K>
void check_ties(const std::vector<variant>& variants, int N, std::mt19937_64& rng) {
  long tokens = 0;
  for (const auto& v : variants) {
    const auto& o = v.o;
    const std::string name = v.name;
    CAPTURE(name);
    CAPTURE(o.num_experts);
    CAPTURE(o.topk);
    const int E = o.num_experts, kk = o.topk;
    std::uniform_int_distribution<int> q(-3, 3);
    std::vector<float> logits(static_cast<std::size_t>(N) * E), bias;
    for (auto& x : logits) x = static_cast<float>(q(rng));
    if (o.expert_bias)
      for (int e = 0; e < E; ++e) bias.push_back(static_cast<float>(q(rng)) / 8.0f);
    std::vector<int> idx(static_cast<std::size_t>(N) * kk, -7), hidx(idx);
    std::vector<float> probs(idx.size(), -7.0f), hprobs(probs);
    const K kernel{.logits = logits.data(),
                   .num_tokens = N,
                   .num_experts = E,
                   .topk = kk,
                   .score = o.score,
                   .pre_softmax = o.pre_softmax,
                   .num_groups = o.num_groups,
                   .group_topk = o.group_topk,
                   .expert_bias = o.expert_bias ? bias.data() : nullptr,
                   .scale = o.scaling_factor.has_value(),
                   .scaling_factor = static_cast<float>(o.scaling_factor.value_or(1.0)),
                   .indices = idx.data(),
                   .probs = probs.data()};
    REQUIRE(launch(cpu_exec{rng()},
                   launch_grid{.blocks = std::min(N, 4), .smem_bytes = K::smem_bytes}, kernel));
    K on_host = kernel;
    on_host.indices = hidx.data();
    on_host.probs = hprobs.data();
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = 1, .smem_bytes = K::smem_bytes}, on_host));
    long differ = 0;
    for (std::size_t i = 0; i < idx.size(); ++i) {
      differ += hidx[i] == idx[i] ? 0 : 1;
      if (o.pre_softmax)
        CHECK(ulp_distance(hprobs[i], probs[i]) <= host_ulps_worst(E));
      else
        differ += same_bits(hprobs[i], probs[i]) ? 0 : 1;
    }
    CHECK(differ == 0);
    tokens += N;
  }
  MESSAGE(tokens << " tokens with exact ties: host_exec chose cpu_exec's experts");
}

}  // namespace

TEST_CASE("router kernels on host_exec: exact ties choose cpu_exec's experts") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 3);
  check_ties<k::router_topk_kernel>(all_variants({8, 64, 256}), 16, rng);
  check_ties<k::router_topk_block_kernel>(all_variants({512, 1024}), 4, rng);
}
