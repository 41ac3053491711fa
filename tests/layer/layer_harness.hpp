// Shared by the thread-world and MPI layer tests: one rank's MoE layer (gating, router, aux and
// z-loss, drop policy, dispatcher, experts) on any communicator, and the check of every rank's
// results against a single-rank fp64 reference per pipeline stage: the router's decisions come
// from the routing code (checked on its own against Megatron-Core), everything else (gating,
// experts, permutation, combine, gradients) is a plain loop over tokens written here and in
// dispatch_harness.hpp.
#pragma once

#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/layer/moe_layer.hpp>
#include "../support/host_aux_loss.hpp"
#include "../support/host_drop_policy.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <type_traits>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"
#include "../support/mlp_layout.hpp"

namespace moefold::test {

constexpr double aux_coeff = 0.01, z_coeff = 0.001;

inline std::vector<double> router_weight(const problem& p) {  // [E, H]
  std::vector<double> w;
  for (int e = 0; e < p.experts; ++e)
    for (int h = 0; h < p.hidden; ++h) w.push_back(value_of(p, 2.0 * unit(9, e, h)));
  return w;
}

struct layer_result {
  std::vector<double> out, dx, dw_router, dw1, dw2;
  double aux = 0, z = 0;
  long long dropped = 0;
  std::vector<int> indices, kept;  // the implementation's routing and kept pairs [N*k]
  // With a drop policy, where a runner reports them: the capacity and the rows each expert gets
  // from this rank (kept pairs and pad mode's fillers) [E].
  int capacity = -1;
  std::vector<int> rows_per_expert;
};

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}
template <class T>
std::vector<double> widen(std::span<const T> v) {
  std::vector<double> w;
  w.reserve(v.size());
  for (const T& x : v) w.push_back(static_cast<double>(detail::widen(x)));  // bf16 via fp32
  return w;
}
template <class T>
std::vector<double> widen(std::span<T> v) {
  return widen(std::span<const T>(v));
}

// One rank's layer in T (double, float, or bf16 with its default fp32 router) on any
// communicator; results widened to double.
// `order_keys`: this rank's tokens' true sequence keys for full-sequence dropping (empty: rank
// order).
template <class T, class Policy, class Dispatcher, class Comm>
expected<layer_result> run_layer_rank(const problem& p, const Policy& policy, Comm& world,
                                      std::span<const std::int64_t> order_keys = {}) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const auto wr = router_weight(p);
  const int r = world.rank();
  auto comms = make_layer_communicators(world, groups);
  if (!comms) return unexpected<error>(comms.error());
  using P = typename Dispatcher::prob_type;  // T, or fp32 probabilities with bf16 tokens
  auto mlp = rank_experts<T, P>(p, fold, r, w.w1, w.w2).value();
  // moefold's three policies run through drop_policy_variant (one layer type for the three, as
  // a trainer choosing by flag has it: a third of the instantiations); a user policy as itself.
  using layer_policy = std::conditional_t<std::is_constructible_v<drop_policy_variant, Policy>,
                                          drop_policy_variant, Policy>;
  using layer_t =
      moe_layer<T, host_exec, Comm, layer_policy, Dispatcher, reference_mlp<T, main_grad_t<T>, P>>;
  host_exec hx;
  auto layer = layer_t::make(hx,
                             {.hidden = p.hidden,
                              .max_tokens = p.tokens,
                              .max_recv_rows = p.max_recv_rows,
                              .ep = fold.ep(),
                              .etp = fold.etp(),
                              .router = {.num_experts = p.experts, .topk = p.topk},
                              .aux_loss_coeff = aux_coeff,
                              .z_loss_coeff = z_coeff},
                             *comms, layer_policy(policy), std::move(mlp));
  if (!layer) return unexpected<error>(layer.error());
  std::transform(wr.begin(), wr.end(), layer->router_weight().flat().begin(),
                 [](double v) { return static_cast<T>(v); });
  std::vector<T> x, dout;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    for (double v : d.x) x.push_back(static_cast<T>(v));
    for (double v : d.dout) dout.push_back(static_cast<T>(v));
  }
  layer_result res;
  std::vector<T> out(x.size()), dx(x.size());
  auto stats = layer->forward(hx, p.tokens, x, order_keys, out);
  if (!stats) return unexpected<error>(stats.error());
  auto values = read_forward_stats(hx, *stats);
  if (!values) return unexpected<error>(values.error());
  res.aux = values->aux_loss;
  res.z = values->z_loss;
  res.dropped = values->dropped.dropped_pairs;
  res.indices = layer->last_routing().indices;
  res.kept.assign(layer->last_kept_experts().flat().begin(),
                  layer->last_kept_experts().flat().end());
  using R = typename layer_t::router_value_type;
  if (auto s = layer->backward(hx, dout, R(1), dx); !s) return unexpected<error>(s.error());
  if (auto s =
          layer->reduce_gradients(hx, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
      !s)
    return unexpected<error>(s.error());
  res.out = widen(std::span<const T>(out));
  res.dx = widen(std::span<const T>(dx));
  res.dw_router = widen(layer->router_weight_grad().flat());
  res.dw1 = widen(layer->experts().grads_fc1());
  res.dw2 = widen(layer->experts().grads_fc2());
  return res;
}

// The reference for one pipeline stage. Drop decisions: per rank (sub-sequence), per tp-cp group
// in rank order (full sequence), or none.
enum class drop_mode { none, per_rank, per_sequence };

// How check_layer_results judges: with `assert_each` it CHECKs every quantity against its
// tolerance; it always records the worst normwise error of the outputs and gradients (a test that
// plants a defect asks for the value without the CHECKs).
struct layer_check {
  bool assert_each = true;
  double worst = 0;  // max over ranks of the normwise errors of out, dx and the weight gradients
};

// Checks the layer in T against the fp64 reference: normwise relative errors <= 1e-12 in double,
// <= 1e-5 in float, <= 1e-2 in bf16 (whose reference is fed the same bf16-rounded values:
// problem::bf16_values). Below double the reference takes the implementation's routing and drop
// decisions (an fp32 score may order two near-equal experts differently) and recomputes their
// probabilities in fp64.
template <class T>
long long check_layer_results(const problem& p, const std::vector<layer_result>& res,
                              drop_mode mode, layer_check* judge = nullptr) {
  layer_check own;
  layer_check& jc = judge ? *judge : own;
  const auto expect_le = [&](double err, double bound) {
    jc.worst = std::max(jc.worst, err);
    if (jc.assert_each) CHECK(err <= bound);
  };
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.pp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  CAPTURE(static_cast<int>(mode));
  REQUIRE(res.size() == static_cast<std::size_t>(make_folded(p.fold).value().world_size()));
  constexpr bool fp64 = std::is_same_v<T, double>;
  const double tol = fp64 ? 1e-12 : std::is_same_v<T, float> ? 1e-5 : 1e-2;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const auto wr = router_weight(p);
  const int E = p.experts, H = p.hidden, K = p.topk, L = E / fold.ep();
  const auto router = host_topk_router<double>::make({.num_experts = E, .topk = K}).value();
  for (auto stage : groups(group_kind::tp_dp_cp)) {
    reference_grads g;
    std::vector<double> dw_router(static_cast<std::size_t>(E * H), 0.0);
    std::map<int, std::vector<double>> out_ref, dx_ref;
    const auto tpcp = groups(group_kind::tp_cp);
    for (int gi = 0; gi < tpcp.count(); ++gi) {
      const auto group = tpcp[gi];
      if (!stage.contains(group[0])) continue;
      // The group's tokens in group rank order: logits by a plain loop, then routing.
      std::vector<token_data> toks;
      std::vector<int> owner;
      std::vector<double> logits;
      for (int q : group)
        for (int t = 0; t < p.tokens; ++t) {
          toks.push_back(make_token(p, q, t));
          owner.push_back(q);
          for (int e = 0; e < E; ++e) {
            double z = 0;
            for (int h = 0; h < H; ++h) z += toks.back().x[h] * wr[e * H + h];
            logits.push_back(z);
          }
        }
      const int NG = static_cast<int>(toks.size());
      topk_routing<double> routing;
      REQUIRE(router.route(logits, routing));
      std::vector<int> kept(routing.indices);
      if (!fp64) {  // the implementation's decisions; fp64 probabilities (softmax over the k)
        std::vector<int> impl_idx, impl_kept;
        for (int q : group) {
          const auto& rq = res[static_cast<std::size_t>(q)];
          impl_idx.insert(impl_idx.end(), rq.indices.begin(), rq.indices.end());
          impl_kept.insert(impl_kept.end(), rq.kept.begin(), rq.kept.end());
        }
        REQUIRE(impl_idx.size() == routing.indices.size());
        for (int t = 0; t < NG; ++t) {
          double mx = -1e300, sum = 0;
          for (int j = 0; j < K; ++j)
            mx = std::max(mx, logits[static_cast<std::size_t>(t * E + impl_idx[t * K + j])]);
          for (int j = 0; j < K; ++j)
            sum += std::exp(logits[static_cast<std::size_t>(t * E + impl_idx[t * K + j])] - mx);
          for (int j = 0; j < K; ++j)
            routing.probs[static_cast<std::size_t>(t * K + j)] =
                std::exp(logits[static_cast<std::size_t>(t * E + impl_idx[t * K + j])] - mx) / sum;
        }
        routing.indices = impl_idx;
        kept = impl_kept;
      }
      if (fp64 && mode != drop_mode::none) {
        auto keep_over = [&](int first, int count) {
          topk_routing<double> part{
              count,
              E,
              K,
              {routing.indices.begin() + first * K, routing.indices.begin() + (first + count) * K},
              {routing.probs.begin() + first * K, routing.probs.begin() + (first + count) * K}};
          drop_result<double> d;
          REQUIRE(host_apply(sub_sequence{.capacity_factor = 1.0}, part, d));
          const auto ke = d.kept_experts(part);
          std::copy(ke.begin(), ke.end(), kept.begin() + first * K);
        };
        if (mode == drop_mode::per_sequence)
          keep_over(0, NG);
        else
          for (int i = 0; i < group.size(); ++i) keep_over(i * p.tokens, p.tokens);
      }
      // Aux loss of the group (full-batch formula) and its gradient, z-loss likewise.
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(score_function::softmax, K, E, logits, {}, a));
      const auto counts = column_counts(std::span<const std::uint8_t>(a.map), E);
      const auto term = switch_load_balancing<double>(a.scores, E, counts, NG, K, E, aux_coeff);
      double aux_sum = 0, z_sum = 0;
      for (int q : group) {
        aux_sum += res[static_cast<std::size_t>(q)].aux;
        z_sum += res[static_cast<std::size_t>(q)].z;
      }
      if (jc.assert_each) {
        CHECK(aux_sum == doctest::Approx(term.loss).epsilon(tol));
        CHECK(z_sum ==
              doctest::Approx(z_loss<double>(logits, E, z_coeff, {}).value()).epsilon(tol));
      }
      // Per token: experts' output and gradients with the kept pairs, then the router's chain.
      std::vector<double> dprobs(static_cast<std::size_t>(NG * K), 0.0);
      std::vector<std::vector<double>> dx_tok(static_cast<std::size_t>(NG));
      for (int t = 0; t < NG; ++t) {
        token_data d = toks[t];
        for (int j = 0; j < K; ++j) {
          d.expert[j] = kept[t * K + j];
          d.prob[j] = routing.prob(t, j);
        }
        std::vector<double> o, dx, dp;
        reference_token(w, d, o, dx, dp, g);
        for (int j = 0; j < K; ++j) dprobs[t * K + j] = dp[j];
        out_ref[owner[t]].insert(out_ref[owner[t]].end(), o.begin(), o.end());
        dx_tok[t] = dx;
      }
      std::vector<double> dlogits(static_cast<std::size_t>(NG * E), 0.0);
      REQUIRE(router.backward(logits, routing, dprobs, dlogits));
      REQUIRE(add_aux_loss_gradient<double>(score_function::softmax, logits, E, {}, term, 1.0,
                                            dlogits));
      REQUIRE(add_z_loss_gradient<double>(logits, E, z_coeff, {}, 1.0, dlogits));
      for (int t = 0; t < NG; ++t) {
        for (int h = 0; h < H; ++h) {
          double v = dx_tok[t][h];
          for (int e = 0; e < E; ++e) {
            v += dlogits[t * E + e] * wr[e * H + h];
            dw_router[e * H + h] += dlogits[t * E + e] * toks[t].x[h];
          }
          dx_ref[owner[t]].push_back(v);
        }
      }
    }
    for (int r : stage) {
      CAPTURE(r);
      const auto& got = res[static_cast<std::size_t>(r)];
      expect_le(rel_err(got.out, out_ref[r]), tol);
      expect_le(rel_err(got.dx, dx_ref[r]), tol);
      expect_le(rel_err(got.dw_router, dw_router), tol);
      // Expert shards (edp-reduced) against the reference's slices.
      // (In the library's layout: support/mlp_layout.hpp.)
      const auto mc = fold.moe_coord_of(r);
      std::vector<double> want1, want2;
      for (int l = 0; l < L; ++l) {
        auto d1 = g.dw1[mc.ep * L + l], d2 = g.dw2[mc.ep * L + l];
        d1.resize(static_cast<std::size_t>(H * 2 * p.ffn), 0.0);
        d2.resize(static_cast<std::size_t>(p.ffn * H), 0.0);
        append_fc1_shard<double>(d1, H, 2, p.ffn, fold.etp(), mc.etp, want1);
        append_fc2_shard<double>(d2, p.ffn, H, fold.etp(), mc.etp, want2);
      }
      expect_le(rel_err(got.dw1, want1), tol);
      expect_le(rel_err(got.dw2, want2), tol);
    }
  }
  long long dropped = 0;
  for (const auto& r : res) dropped += r.dropped;
  return dropped;
}

}  // namespace moefold::test
