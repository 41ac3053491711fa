// The router's losses as device values (kernels/router_aux_loss.hpp, router_z_loss.hpp,
// expert_bias.hpp) on the CPU executor against the host's (routing/aux_loss.hpp,
// group_losses.hpp, expert_bias.hpp) on fresh random logits (seed printed):
// - aux scores against the host's in fp64 within a derived bound, the top-k map equal except
//   near-ties, padding tokens zero;
// - from the kernel's own scores, the column sums, counts, and every load-balancing loss (per
//   micro-batch, per sequence, global over two micro-batches, with and without a padding mask)
//   the same bits as the host group functions on a one-rank world;
// - the aux-loss and z-loss gradients against the host's in fp64, each element within a bound
//   from its own condition; the z-loss against fp64 and its valid count exact;
// - the expert-bias counts and update the same bits as the host's.
// Every router-loss kernel also runs on host_exec (team bodies with a team of one thread per
// token) from cpu_exec's inputs, against cpu_exec's result: the column sums, counts, every loss
// and the z-loss's valid count the same bits; what adds over E (the aux scores, the aux-loss
// gradient, the logsumexp, the z-loss gradient) or over the tokens (the z-loss total) in another
// order within host_ulps (below), the top-k map the same except near-ties (over integer logits,
// exact ties everywhere, the same map).
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <moefold/comm/thread_world.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/expert_bias.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/router_aux_loss.hpp>
#include <moefold/kernels/router_z_loss.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#include "../support/host_aux_loss.hpp"
#include "../support/host_expert_bias.hpp"
#include "../support/host_group_losses.hpp"

#include "../support/simt_test_sizes.hpp"
#include "../support/ulp.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

constexpr double eps = 0x1p-24;  // half an fp32 ulp, relative

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// How far host_exec's result may be from cpu_exec's where a sum over n terms is formed in
// another order, in ulp (kernels/router.hpp): a team of one adds in expert (token) order,
// cpu_exec (and the GPU) in the team's tree. Each order rounds up to n - 1 times, errors of at
// most half an ulp of the sum; over random logits they add like a random walk: about sqrt(n) ulp
// apart at worst (measured over 60,000 tokens of normal logits: 5, 13, 21 ulp at n = 8, 64, 256;
// 31 at 1,024 over 5,000). Twice that, plus 2 for the roundings after the sum, rounded up (as
// router_kernel_test.cpp's).
int host_ulps(int n) {
  return 2 + 2 * static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
}
// The worst case of the same, for inputs whose roundings need not be independent (many equal
// terms, as integer logits give, round alike: 35 ulp at n = 256, 63 at 1,024 measured): either
// order of a sum of n non-negative terms is within (n - 1) half-ulps (relative) of the exact
// sum, so the two within 2 (n - 1) ulp; plus 2 for the roundings after it.
int host_ulps_worst(int n) { return 2 * n; }

struct loss_case {
  int N, E, k, B;  // tokens, experts, top-k, sequences (N a multiple of B)
  score_function f;
  int padding;  // 0 none, 1 some tokens, 2 every token
};

std::vector<loss_case> cases_for(std::initializer_list<int> experts, int N,
                                 std::initializer_list<int> topks = {1, 2, 8}) {
  std::vector<loss_case> c;
  for (int E : experts)
    for (int kk : topks) {
      if (kk > E) continue;
      for (auto f :
           {score_function::softmax, score_function::sigmoid, score_function::sqrt_softplus})
        c.push_back({N, E, kk, N % 3 == 0 ? 3 : 1, f, kk == 2 ? 1 : 0});
    }
  c.push_back({N, *experts.begin(), 1, 1, score_function::softmax, 2});  // every token padding
  return c;
}

struct worst_seen {
  double scores = 0, aux_grad = 0, z = 0, z_grad = 0;
  long tokens = 0, ties = 0;
  // host_exec against cpu_exec, each over its bound; tokens whose map differs (near-ties).
  double host_scores = 0, host_aux_grad = 0, host_lse = 0, host_z = 0, host_z_grad = 0;
  long host_map_ties = 0;
};

// The host's top k + 1 of a row of fp64 scores hold a near-tie (within 1e-6 max).
bool near_tie(const double* s, int E, int kk) {
  std::vector<double> v(s, s + E);
  std::sort(v.begin(), v.end(), std::greater<>());
  const double tol = 1e-6 * std::max(v.front(), 1e-30);
  for (int i = 0; i + 1 < std::min(kk + 1, E); ++i)
    if (v[static_cast<std::size_t>(i)] - v[static_cast<std::size_t>(i) + 1] <= tol) return true;
  return false;
}

template <class K>
void run(const K& kernel, std::mt19937_64& rng, int blocks) {
  std::size_t smem = 0;
  if constexpr (requires { K::smem_bytes; }) smem = K::smem_bytes;
  REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = blocks, .smem_bytes = smem}, kernel));
}
// The same kernel on host_exec (a team body: a team of one thread per block).
template <class K>
void run_host(const K& kernel, int blocks) {
  std::size_t smem = 0;
  if constexpr (requires { K::smem_bytes; }) smem = K::smem_bytes;
  REQUIRE(launch(host_exec{}, launch_grid{.blocks = blocks, .smem_bytes = smem}, kernel));
}

// The loss and gradient kernel at one load-balancing loss, against the host group function.
struct switch_result {
  float loss;
  std::vector<float> dscores;
  std::vector<double> used;
};
switch_result run_switch(const std::vector<float>& sums, const std::vector<double>& counts,
                         double total, double per_token, int kk, int E, double coeff,
                         double divide_by, std::vector<double>* running, std::mt19937_64& rng) {
  const int cols = static_cast<int>(sums.size());
  switch_result r{-7.0f, std::vector<float>(sums.size(), -7.0f), std::vector<double>(sums.size())};
  std::vector<double> host_running;  // the running counts as they were, for host_exec
  if (running) host_running = *running;
  const k::switch_loss_kernel<> kernel{.column_sums = sums.data(),
                                       .counts = counts.data(),
                                       .columns = cols,
                                       .total_tokens = total,
                                       .per_token = per_token,
                                       .topk = kk,
                                       .num_experts = E,
                                       .coeff = coeff,
                                       .divide_by = divide_by,
                                       .running = running ? running->data() : nullptr,
                                       .used = r.used.data(),
                                       .loss = &r.loss,
                                       .dscores = r.dscores.data()};
  run(kernel, rng, 1);
  // The same on host_exec (independent threads, one of which does it all): the same bits.
  switch_result h{-7.0f, std::vector<float>(sums.size(), -7.0f), std::vector<double>(sums.size())};
  auto on_host = kernel;
  on_host.running = running ? host_running.data() : nullptr;
  on_host.used = h.used.data();
  on_host.loss = &h.loss;
  on_host.dscores = h.dscores.data();
  run_host(on_host, 1);
  CHECK(same_bits(h.loss, r.loss));
  long differ = 0;
  for (int c = 0; c < cols; ++c)
    differ += same_bits(h.dscores[c], r.dscores[c]) && h.used[c] == r.used[c] ? 0 : 1;
  if (running)  // the counts and the micro-batch count after them
    for (int c = 0; c <= cols; ++c) differ += host_running[c] == (*running)[c] ? 0 : 1;
  CHECK(differ == 0);
  return r;
}

void check_same(const switch_result& got, const aux_loss_term<float>& want) {
  CHECK(same_bits(got.loss, want.loss));
  REQUIRE(got.dscores.size() == want.dscores.size());
  long differ = 0;
  for (std::size_t c = 0; c < got.dscores.size(); ++c) {
    differ += same_bits(got.dscores[c], want.dscores[c]) ? 0 : 1;
    CHECK(got.used[c] == want.counts[c]);
  }
  CHECK(differ == 0);
}

template <class Aux, class AuxBw, class Lse, class ZBw>
void check_losses(const std::vector<loss_case>& cases, std::mt19937_64& rng, worst_seen& w) {
  for (const auto& lc : cases) {
    const int N = lc.N, E = lc.E, kk = lc.k, B = lc.B;
    CAPTURE(N);
    CAPTURE(E);
    CAPTURE(kk);
    CAPTURE(static_cast<int>(lc.f));
    CAPTURE(lc.padding);
    const auto NE = static_cast<std::size_t>(N) * E;
    std::normal_distribution<float> d(0.0f, 2.0f);
    std::vector<float> logits(NE);
    for (auto& x : logits) x = d(rng);
    std::vector<std::uint8_t> padding;
    if (lc.padding == 1)
      for (int t = 0; t < N; ++t) padding.push_back(t % 4 == 1 ? 1 : 0);
    if (lc.padding == 2) padding.assign(static_cast<std::size_t>(N), 1);
    const std::uint8_t* pad = padding.empty() ? nullptr : padding.data();
    const auto score = lc.f;
    const int blocks = std::min(N, 3);

    // Aux scores and map against fp64.
    std::vector<float> scores(NE, -7.0f);
    std::vector<std::uint8_t> map(NE, 7);
    const Aux aux{.logits = logits.data(),
                  .padding = pad,
                  .num_tokens = N,
                  .num_experts = E,
                  .topk = kk,
                  .score = score,
                  .scores = scores.data(),
                  .map = map.data()};
    run(aux, rng, blocks);
    // The same on host_exec (one block: every token in turn), compared below.
    std::vector<float> host_scores(NE, -7.0f);
    std::vector<std::uint8_t> host_map(NE, 7);
    auto aux_on_host = aux;
    aux_on_host.scores = host_scores.data();
    aux_on_host.map = host_map.data();
    run_host(aux_on_host, 1);
    const std::vector<double> logits64(logits.begin(), logits.end());
    aux_scores<double> a64;
    REQUIRE(compute_aux_scores<double>(lc.f, kk, E, logits64, padding, a64));
    for (int t = 0; t < N; ++t) {
      const auto row = static_cast<std::size_t>(t) * E;
      const bool tie = (pad == nullptr || !pad[t]) && near_tie(a64.scores.data() + row, E, kk);
      w.ties += tie ? 1 : 0;
      w.tokens += tie ? 0 : 1;
      const double m = *std::max_element(logits64.begin() + static_cast<long>(row),
                                         logits64.begin() + static_cast<long>(row) + E);
      // host_exec: a padding token's zeros; else scores within host_ulps(E) of cpu_exec's (the
      // sum over E in expert order) and the same map except near-ties.
      const bool host_map_same = std::equal(host_map.begin() + static_cast<long>(row),
                                            host_map.begin() + static_cast<long>(row) + E,
                                            map.begin() + static_cast<long>(row));
      if (!host_map_same) {
        ++w.host_map_ties;
        CHECK_MESSAGE(tie, "host_exec token " << t << ": another top-k map, no near-tie");
      }
      for (int e = 0; e < E; ++e) {
        const auto at = row + static_cast<std::size_t>(e);
        const int hu = test::ulp_distance(host_scores[at], scores[at]);
        const int hbound = pad != nullptr && pad[t] ? 0 : host_ulps(E);
        w.host_scores = std::max(w.host_scores, static_cast<double>(hu) / host_ulps(E));
        CHECK_MESSAGE(hu <= hbound, "host_exec score token " << t << " expert " << e << ": "
                                                             << host_scores[at] << " vs "
                                                             << scores[at]);
      }
      for (int e = 0; e < E; ++e) {
        const auto at = row + static_cast<std::size_t>(e);
        if (!tie) CHECK(map[at] == a64.map[at]);
        // moefold's exp (about 1 ulp), the sum of E terms in the team's tree (log2 E levels),
        // the division; a softmax also pays |x - max| ulp for rounding x - max to float.
        double allowed = 8 + std::log2(static_cast<double>(E));
        if (lc.f == score_function::softmax) allowed += std::abs(logits64[at] - m) * 2;
        const double err = std::abs(scores[at] - a64.scores[at]) / (eps * a64.scores[at] + 1e-300);
        if (a64.scores[at] == 0) {
          CHECK(scores[at] == 0.0f);
          continue;
        }
        w.scores = std::max(w.scores, err / allowed);
        CHECK(err <= allowed);
      }
    }

    // Column sums and counts from the kernel's scores: the host's row-order sums, bit for bit.
    aux_scores<float> a{.num_tokens = N,
                        .num_experts = E,
                        .topk = kk,
                        .valid_tokens = 0,
                        .has_padding_mask = pad != nullptr,
                        .scores = scores,
                        .map = map};
    for (int t = 0; t < N; ++t) a.valid_tokens += (pad && pad[t]) ? 0 : 1;
    auto sums_of = [&](int cols) {
      std::vector<float> sums(static_cast<std::size_t>(cols), -7.0f);
      std::vector<double> counts(static_cast<std::size_t>(cols), -7.0);
      const k::aux_column_sums_kernel<> col_sums{.scores = scores.data(),
                                                 .map = map.data(),
                                                 .rows = static_cast<long long>(NE / cols),
                                                 .columns = cols,
                                                 .sums = sums.data(),
                                                 .counts = counts.data()};
      run(col_sums, rng, 2);
      // host_exec (independent threads in a loop; one block strides over every column): the
      // same row-order sums, the same bits.
      std::vector<float> host_sums(static_cast<std::size_t>(cols), -7.0f);
      std::vector<double> host_counts(static_cast<std::size_t>(cols), -7.0);
      auto sums_on_host = col_sums;
      sums_on_host.sums = host_sums.data();
      sums_on_host.counts = host_counts.data();
      run_host(sums_on_host, 1);
      for (int c = 0; c < cols; ++c) {
        CHECK(same_bits(host_sums[c], sums[c]));
        CHECK(host_counts[c] == counts[c]);
      }
      std::vector<float> want(static_cast<std::size_t>(cols), 0.0f);
      for (std::size_t i = 0; i < NE; ++i) want[i % cols] += scores[i];
      const auto want_counts = column_counts(std::span<const std::uint8_t>(map), cols);
      for (int c = 0; c < cols; ++c) {
        CHECK(same_bits(sums[c], want[c]));
        CHECK(counts[c] == want_counts[c]);
      }
      return std::pair{sums, counts};
    };
    const auto [sums, counts] = sums_of(E);
    const auto [seq_sums, seq_counts] = sums_of(B * E);

    // Every load-balancing loss: the kernel from the summed counts (one rank: its own) against
    // the host group function on a one-rank world over the same scores.
    const double coeff = 0.01;
    aux_loss_term<float> lb, seq, glob1, glob2;
    global_aux_state gstate;
    const auto st = run_thread_world(1, [&](thread_communicator& c) {
      REQUIRE(load_balancing_loss(c, a, coeff, lb));
      REQUIRE(seq_load_balancing_loss(c, a, B, coeff, seq));
      REQUIRE(global_load_balancing_loss(c, a, coeff, gstate, glob1));
      REQUIRE(global_load_balancing_loss(c, a, coeff, gstate, glob2));
    });
    REQUIRE(st.size() == 1);
    REQUIRE(st[0]);
    const double total = pad ? 0.0 : N;  // 0: from the counts
    const auto lb_k = run_switch(sums, counts, total, kk, kk, E, coeff, 1.0, nullptr, rng);
    check_same(lb_k, lb);
    check_same(run_switch(seq_sums, seq_counts, pad ? 0.0 : static_cast<double>(N / B),
                          static_cast<double>(kk) * B, kk, E, coeff, B, nullptr, rng),
               seq);
    // The running state [E counts, micro-batches]: the kernel counts each micro-batch itself
    // (on the device, so a graph's replays advance it), even one with no valid token.
    std::vector<double> running(static_cast<std::size_t>(E) + 1, 0.0);
    check_same(run_switch(sums, counts, total, kk, kk, E, coeff, 1.0, &running, rng), glob1);
    CHECK(running[static_cast<std::size_t>(E)] == 1.0);
    check_same(run_switch(sums, counts, total, kk, kk, E, coeff, 1.0, &running, rng), glob2);
    CHECK(running[static_cast<std::size_t>(E)] == 2.0);
    if (lc.padding == 2) CHECK(lb_k.loss == 0.0f);

    // The aux-loss gradient into dlogits (added to what is there) against fp64.
    std::vector<float> init(NE);
    for (auto& x : init) x = 1e-3f * d(rng);
    const float seed = 0.75f;
    std::vector<float> dl = init;
    const AuxBw aux_bw{.logits = logits.data(),
                       .padding = pad,
                       .num_tokens = N,
                       .num_experts = E,
                       .score = score,
                       .dscores = lb_k.dscores.data(),
                       .columns = E,
                       .seed = seed,
                       .dlogits = dl.data()};
    run(aux_bw, rng, blocks);
    std::vector<float> host_dl = init;  // the same on host_exec, compared below
    auto aux_bw_on_host = aux_bw;
    aux_bw_on_host.dlogits = host_dl.data();
    run_host(aux_bw_on_host, 1);
    aux_loss_term<double> term64{.loss = 0,
                                 .columns = static_cast<std::size_t>(E),
                                 .dscores = {lb_k.dscores.begin(), lb_k.dscores.end()}};
    std::vector<double> dl64(init.begin(), init.end());
    REQUIRE(add_aux_loss_gradient<double>(lc.f, logits64, E, padding, term64, seed, dl64));
    for (int t = 0; t < N; ++t) {
      const auto row = static_cast<std::size_t>(t) * E;
      // The condition of each element: softmax s_e (|ds_e| + sum |s ds|); renormalised
      // (|ds_e| / D + sum |ds s| / D^2) |score'(x_e)| (score and score' in fp64; D and the sum
      // over E in fp32 are within log2 E roundings, inside the 16).
      const double* s = a64.scores.data() + row;
      double dot_abs = 0, D = 0;
      std::vector<double> raw(static_cast<std::size_t>(E)), grad(raw);
      for (int e = 0; e < E; ++e) {
        const double x = logits64[row + e], ds = seed * term64.dscores[e];
        if (lc.f == score_function::softmax) {
          dot_abs += std::abs(s[e] * ds);
        } else {
          raw[e] = detail::elementwise_score(lc.f, x);
          grad[e] = detail::elementwise_score_grad(lc.f, x, raw[e]);
          D += raw[e];
          dot_abs += std::abs(ds * raw[e]);
        }
      }
      for (int e = 0; e < E; ++e) {
        const auto at = row + static_cast<std::size_t>(e);
        const double ds = std::abs(seed * term64.dscores[e]);
        // A sigmoid's derivative s (1 - s) from the fp32 score s is off by about s eps in
        // absolute terms (1 - s cancels for s near 1), hence the s beside |score'|.
        const double cond =
            lc.f == score_function::softmax
                ? s[e] * (ds + dot_abs)
                : (ds / D + dot_abs / (D * D)) *
                      (std::abs(grad[e]) + (lc.f == score_function::sigmoid ? raw[e] : 0.0));
        const double bound = 16 * eps * (std::abs(dl64[at]) + cond) + 1e-30;
        const double err = std::abs(dl[at] - dl64[at]);
        w.aux_grad = std::max(w.aux_grad, err / bound);
        CHECK_MESSAGE(err <= bound, "aux grad token " << t << " expert " << e << ": " << dl[at]
                                                      << " vs " << dl64[at]);
        // host_exec: a padding token's dlogits untouched; else the scores within host_ulps(E)
        // relative and the dot product over E in another order (twice host_ulps(E) of the
        // condition), then the addition to what is there, which rounds each side once (half an
        // ulp each, of results that may lie on two sides of a power of two: two ulp).
        const double herr = std::abs(static_cast<double>(host_dl[at]) - dl[at]);
        const double hbound =
            pad != nullptr && pad[t]
                ? 0.0
                : host_ulps(E) * 2 * eps * (std::abs(dl[at] - init[at]) + 2 * cond) +
                      4 * eps * std::abs(dl[at]) + 1e-30;
        if (hbound > 0) w.host_aux_grad = std::max(w.host_aux_grad, herr / hbound);
        CHECK_MESSAGE(herr <= hbound, "host_exec aux grad token " << t << " expert " << e << ": "
                                                                  << host_dl[at] << " vs "
                                                                  << dl[at]);
      }
    }

    // z-loss: the per-token logsumexp, the total, the valid count; its gradient.
    std::vector<float> lse(static_cast<std::size_t>(N), -7.0f);
    const Lse lse_kernel{.logits = logits.data(),
                         .padding = pad,
                         .num_tokens = N,
                         .num_experts = E,
                         .lse = lse.data()};
    run(lse_kernel, rng, blocks);
    // host_exec: a padding token's 0; else within host_ulps(E) of |lse| + 1 (the sum over E in
    // expert order moves log(sum) by its relative error, absolutely).
    std::vector<float> host_lse(static_cast<std::size_t>(N), -7.0f);
    auto lse_on_host = lse_kernel;
    lse_on_host.lse = host_lse.data();
    run_host(lse_on_host, 1);
    for (int t = 0; t < N; ++t) {
      const double herr = std::abs(static_cast<double>(host_lse[t]) - lse[t]);
      const double hbound = pad != nullptr && pad[t]
                                ? 0.0
                                : host_ulps(E) * 2 * eps * (std::abs(lse[t]) + 1.0) + 1e-30;
      if (hbound > 0) w.host_lse = std::max(w.host_lse, herr / hbound);
      CHECK_MESSAGE(herr <= hbound,
                    "host_exec lse token " << t << ": " << host_lse[t] << " vs " << lse[t]);
    }
    const float zcoeff = 1e-3f;
    float z = -7.0f;
    int valid = -7;
    const k::z_loss_total_kernel<> z_total{.lse = lse.data(),
                                           .padding = pad,
                                           .num_tokens = N,
                                           .coeff = zcoeff,
                                           .loss = &z,
                                           .valid = &valid};
    run(z_total, rng, 1);
    CHECK(valid == a.valid_tokens);
    // host_exec from cpu_exec's lse: the same valid count; the sum of the N squares in token
    // order (cpu_exec: a tree) within host_ulps(N).
    float host_z = -7.0f;
    int host_valid = -7;
    auto z_total_on_host = z_total;
    z_total_on_host.loss = &host_z;
    z_total_on_host.valid = &host_valid;
    run_host(z_total_on_host, 1);
    CHECK(host_valid == valid);
    const int hzu = test::ulp_distance(host_z, z);
    w.host_z = std::max(w.host_z, static_cast<double>(hzu) / host_ulps(N));
    CHECK_MESSAGE(hzu <= host_ulps(N), "host_exec z-loss " << host_z << " vs " << z);
    const double z64 = z_loss<double>(logits64, E, zcoeff, padding).value();
    // Each lse within (4 + log2 E) half-ulps of its magnitude plus one; squared, doubled; the
    // sum of N positive terms in a tree of log2 N + 3 levels; the division and the product.
    const double zbound =
        eps * (8 + 2 * (4 + std::log2(static_cast<double>(E))) + std::log2(N + 1.0) + 3) *
            std::abs(z64) * 2 +
        1e-30;
    w.z = std::max(w.z, std::abs(z - z64) / zbound);
    CHECK(std::abs(z - z64) <= zbound);
    if (lc.padding == 2) CHECK(z == 0.0f);

    dl = init;
    const ZBw z_bw{.logits = logits.data(),
                   .padding = pad,
                   .lse = lse.data(),
                   .valid = &valid,
                   .num_tokens = N,
                   .num_experts = E,
                   .coeff = zcoeff,
                   .seed = seed,
                   .dlogits = dl.data()};
    run(z_bw, rng, blocks);
    host_dl = init;  // the same on host_exec from cpu_exec's lse and count, compared below
    auto z_bw_on_host = z_bw;
    z_bw_on_host.dlogits = host_dl.data();
    run_host(z_bw_on_host, 1);
    dl64.assign(init.begin(), init.end());
    REQUIRE(add_z_loss_gradient<double>(logits64, E, zcoeff, padding, seed, dl64));
    for (int t = 0; t < N; ++t) {
      const auto row = static_cast<std::size_t>(t) * E;
      const double l = detail::logsumexp(std::span<const double>(logits64.data() + row, E));
      for (int e = 0; e < E; ++e) {
        const auto at = row + static_cast<std::size_t>(e);
        // The added term c s_e: lse's error relative to (|l| + 1), the softmax's as for the
        // scores above, four roundings; then the addition to what is there.
        const double term = std::abs(dl64[at] - init[at]);
        const double rel =
            eps * (8 + 2 * std::log2(static_cast<double>(E)) + 8 + 2 * std::abs(logits64[at] - l));
        const double bound = rel * term * (1 + 1 / std::max(std::abs(l), 1e-3)) +
                             2 * eps * std::abs(dl64[at]) + 1e-30;
        const double err = std::abs(dl[at] - dl64[at]);
        w.z_grad = std::max(w.z_grad, err / bound);
        CHECK_MESSAGE(err <= bound, "z grad token " << t << " expert " << e << ": " << dl[at]
                                                    << " vs " << dl64[at]);
        // host_exec: the softmax within host_ulps(E) relative, times the same factor, then the
        // addition to what is there (two ulp, as for the aux gradient); padding tokens
        // untouched.
        const double herr = std::abs(static_cast<double>(host_dl[at]) - dl[at]);
        const double hbound = pad != nullptr && pad[t] ? 0.0
                                                       : host_ulps(E) * 2 * eps * term +
                                                             4 * eps * std::abs(dl[at]) + 1e-30;
        if (hbound > 0) w.host_z_grad = std::max(w.host_z_grad, herr / hbound);
        CHECK_MESSAGE(herr <= hbound, "host_exec z grad token " << t << " expert " << e << ": "
                                                                << host_dl[at] << " vs " << dl[at]);
      }
    }
  }
}

}  // namespace

TEST_CASE("router losses: aux scores, every load-balancing loss, z-loss, gradients vs the host") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  worst_seen w;
  // A warp per token: E 1/8/64/256 at 9 tokens (three sequences). Under TSan (each launch
  // costs more there) E 8, k 2 with padding, every score, and the all-padding case.
  const auto warp = test::simt_reduced ? cases_for({8}, 9, {2}) : cases_for({1, 8, 64, 256}, 9);
  check_losses<k::aux_scores_kernel, k::aux_loss_backward_kernel, k::logsumexp_kernel,
               k::z_loss_backward_kernel>(warp, rng, w);
  // A block per token: E 512/1024 at 3 tokens; under TSan 512, k 2, 2 tokens.
  const auto block = test::simt_reduced ? cases_for({512}, 2, {2}) : cases_for({512, 1024}, 3);
  check_losses<k::aux_scores_block_kernel, k::aux_loss_backward_block_kernel,
               k::logsumexp_block_kernel, k::z_loss_backward_block_kernel>(block, rng, w);
  MESSAGE(w.tokens << " tokens' maps compared, " << w.ties << " near-ties skipped; worst of the "
                   << "bound: scores " << w.scores << ", aux gradient " << w.aux_grad << ", z-loss "
                   << w.z << ", z gradient " << w.z_grad);
  MESSAGE("host_exec against cpu_exec, worst of the bound: scores "
          << w.host_scores << ", aux gradient " << w.host_aux_grad << ", lse " << w.host_lse
          << ", z-loss " << w.host_z << ", z gradient " << w.host_z_grad << "; " << w.host_map_ties
          << " maps differing (near-ties)");
  CHECK(w.tokens > 0);
}

TEST_CASE("expert bias: counts and update on an executor equal the host's bits") {
  // cpu_exec against the host's expert bias, and host_exec (the histogram a team of one, the
  // counts and update independent threads) against cpu_exec: integer counts and one float add
  // per element, so the same bits on both.
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 3);
  for (int E : {1, 8, 64, 256}) {
    CAPTURE(E);
    const int N = 37, kk = std::min(E, 4);
    auto host = expert_bias_state::zeros(E);
    std::vector<float> bias(static_cast<std::size_t>(E)), local(bias.size(), 0.0f);
    std::normal_distribution<float> d(0.0f, 1e-3f);
    for (int e = 0; e < E; ++e) host.bias[e] = bias[e] = d(rng);
    std::vector<float> h_bias = bias, h_local = local;  // the same chain on host_exec
    for (int forward = 0; forward < 2; ++forward) {
      // A dispatched record: k distinct experts per token, some pairs dropped (-1), padding
      // tokens all -1; the host sees the same as its final map and padding mask.
      std::vector<int> ids(static_cast<std::size_t>(N) * kk);
      std::vector<std::uint8_t> final_map(static_cast<std::size_t>(N) * E, 0), padding(N, 0);
      std::vector<int> perm(static_cast<std::size_t>(E));
      for (int t = 0; t < N; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        padding[t] = (t % 7 == 3) ? 1 : 0;
        for (int i = 0; i < kk; ++i) {
          const bool dropped = rng() % 5 == 0;
          ids[static_cast<std::size_t>(t) * kk + i] = padding[t] || dropped ? -1 : perm[i];
          // The host counts the final map: dropped pairs are not in it; padding rows are, and
          // the mask skips them.
          if (!dropped) final_map[static_cast<std::size_t>(t) * E + perm[i]] = 1;
        }
      }
      std::vector<int> hist(static_cast<std::size_t>(E), 0);
      int first_bad = INT_MAX;
      REQUIRE(
          launch(cpu_exec{rng()},
                 launch_grid{.blocks = 2, .smem_bytes = k::expert_histogram_kernel::smem_bytes(E)},
                 k::expert_histogram_kernel{.ids = ids.data(),
                                            .n = static_cast<long long>(ids.size()),
                                            .num_experts = E,
                                            .counts = hist.data(),
                                            .first_bad = &first_bad}));
      CHECK(first_bad == INT_MAX);
      REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = 2},
                     k::expert_counts_accumulate_kernel{
                         .counts = hist.data(), .num_experts = E, .local = local.data()}));
      std::vector<int> h_hist(static_cast<std::size_t>(E), 0);
      int h_first_bad = INT_MAX;
      REQUIRE(
          launch(host_exec{},
                 launch_grid{.blocks = 2, .smem_bytes = k::expert_histogram_kernel::smem_bytes(E)},
                 k::expert_histogram_kernel{.ids = ids.data(),
                                            .n = static_cast<long long>(ids.size()),
                                            .num_experts = E,
                                            .counts = h_hist.data(),
                                            .first_bad = &h_first_bad}));
      CHECK(h_first_bad == INT_MAX);
      CHECK(h_hist == hist);
      REQUIRE(launch(host_exec{}, launch_grid{.blocks = 2},
                     k::expert_counts_accumulate_kernel{
                         .counts = h_hist.data(), .num_experts = E, .local = h_local.data()}));
      REQUIRE(count_routed_tokens(host, final_map, padding));
    }
    for (int e = 0; e < E; ++e) CHECK(same_bits(local[e], host.local_tokens_per_expert[e]));
    const std::vector<float> summed = local;  // one rank: its own counts
    REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = 1},
                   k::expert_bias_update_kernel{.summed = summed.data(),
                                                .num_experts = E,
                                                .rate = 1e-3f,
                                                .bias = bias.data(),
                                                .local = local.data()}));
    for (int e = 0; e < E; ++e) CHECK(same_bits(h_local[e], summed[e]));  // before the update
    const std::vector<float> h_summed = h_local;
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = 1},
                   k::expert_bias_update_kernel{.summed = h_summed.data(),
                                                .num_experts = E,
                                                .rate = 1e-3f,
                                                .bias = h_bias.data(),
                                                .local = h_local.data()}));
    for (int e = 0; e < E; ++e) {
      CHECK(same_bits(h_bias[e], bias[e]));
      CHECK(h_local[e] == 0.0f);
    }
    const auto st = run_thread_world(
        1, [&](thread_communicator& c) { REQUIRE(update_expert_bias(c, host, 1e-3f)); });
    REQUIRE(st[0]);
    long differ = 0;
    for (int e = 0; e < E; ++e) {
      differ += same_bits(bias[e], host.bias[e]) ? 0 : 1;
      CHECK(local[e] == 0.0f);
    }
    CHECK(differ == 0);
  }
}

namespace {

// Aux scores kernel K on host_exec against cpu_exec over logits with exact ties (integers in
// [-3, 3]): equal logits give equal scores on each context and both take the lower expert first
// on a tie, so the maps are the same for every token, ties and all; scores within
// host_ulps_worst(E) (equal terms round alike, not as a random walk).
template <class K>
void check_aux_ties(std::initializer_list<int> experts, int N, std::mt19937_64& rng) {
  for (int E : experts)
    for (int kk : {1, 2, 8}) {
      if (kk > E) continue;
      for (auto f :
           {score_function::softmax, score_function::sigmoid, score_function::sqrt_softplus}) {
        CAPTURE(E);
        CAPTURE(kk);
        CAPTURE(static_cast<int>(f));
        const auto NE = static_cast<std::size_t>(N) * E;
        std::uniform_int_distribution<int> q(-3, 3);
        std::vector<float> logits(NE);
        for (auto& x : logits) x = static_cast<float>(q(rng));
        std::vector<float> scores(NE, -7.0f), host_scores(scores);
        std::vector<std::uint8_t> map(NE, 7), host_map(map);
        const K kernel{.logits = logits.data(),
                       .padding = nullptr,
                       .num_tokens = N,
                       .num_experts = E,
                       .topk = kk,
                       .score = f,
                       .scores = scores.data(),
                       .map = map.data()};
        run(kernel, rng, std::min(N, 3));
        auto on_host = kernel;
        on_host.scores = host_scores.data();
        on_host.map = host_map.data();
        run_host(on_host, 1);
        CHECK(host_map == map);
        long far = 0;
        for (std::size_t i = 0; i < NE; ++i)
          far += test::ulp_distance(host_scores[i], scores[i]) <= host_ulps_worst(E) ? 0 : 1;
        CHECK(far == 0);
      }
    }
}

}  // namespace

TEST_CASE("aux scores on host_exec: exact ties give cpu_exec's top-k map") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 4);
  check_aux_ties<k::aux_scores_kernel>({8, 64, 256}, 16, rng);
  check_aux_ties<k::aux_scores_block_kernel>({512, 1024}, 4, rng);
}
