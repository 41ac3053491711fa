// The MoE layer (gating, router, drop policy, dispatcher, experts, aux and z-loss) on the thread
// world against a single-rank fp64 reference per pipeline stage: the router's decisions come from
// the routing code (checked on its own against Megatron-Core), everything else (gating, experts,
// permutation, combine, gradients) is a plain loop over tokens written here and in
// dispatch_harness.hpp.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <type_traits>

#include "../dispatch/dispatch_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

constexpr double aux_coeff = 0.01, z_coeff = 0.001;

std::vector<double> router_weight(const problem& p) {  // [E, H]
  std::vector<double> w;
  for (int e = 0; e < p.experts; ++e)
    for (int h = 0; h < p.hidden; ++h) w.push_back(2.0 * unit(9, e, h));
  return w;
}

struct layer_result {
  std::vector<double> out, dx, dw_router, dw1, dw2;
  double aux = 0, z = 0;
  long long dropped = 0;
  std::vector<int> indices, kept;  // the implementation's routing and kept pairs [N*k]
};

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}
template <class T>
std::vector<double> widen(std::span<const T> v) {
  return std::vector<double>(v.begin(), v.end());
}

// The layer in T (double or float) on every rank; results widened to double.
template <class T, class Policy, class Dispatcher>
std::vector<layer_result> run_layer(const problem& p, const Policy& policy) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const auto wr = router_weight(p);
  std::vector<layer_result> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
    auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep);
    auto tp_cp = get(group_kind::tp_cp), stage = get(group_kind::tp_dp_cp),
         edp = get(group_kind::edp);
    const int L = p.experts / fold.ep();
    const auto mc = fold.moe_coord_of(r);
    auto mlp = reference_mlp<T>::make({.hidden = p.hidden,
                                       .ffn = p.ffn,
                                       .num_local_experts = L,
                                       .etp = fold.etp(),
                                       .etp_rank = mc.etp})
                   .value();
    for (int l = 0; l < L; ++l) {
      const auto e = static_cast<std::size_t>(mc.ep * L + l);
      const auto n1 = static_cast<std::size_t>(p.hidden * 2 * p.ffn),
                 n2 = static_cast<std::size_t>(p.ffn * p.hidden);
      const auto w1 = cast<T>(w.w1), w2 = cast<T>(w.w2);
      if (auto s = mlp.load_full(l, std::span<const T>(w1).subspan(e * n1, n1),
                                 std::span<const T>(w2).subspan(e * n2, n2));
          !s)
        return s;
    }
    using layer_t = moe_layer<T, thread_communicator, Policy, Dispatcher, reference_mlp<T>>;
    auto layer = layer_t::make({.hidden = p.hidden,
                                .max_tokens = p.tokens,
                                .ep = fold.ep(),
                                .etp = fold.etp(),
                                .router = {.num_experts = p.experts, .topk = p.topk},
                                .aux_loss_coeff = aux_coeff,
                                .z_loss_coeff = z_coeff},
                               policy, std::move(mlp));
    if (!layer) return unexpected<error>(layer.error());
    std::copy(wr.begin(), wr.end(), layer->router_weight().begin());
    std::vector<T> x, dout;
    for (int t = 0; t < p.tokens; ++t) {
      const auto d = make_token(p, r, t);
      x.insert(x.end(), d.x.begin(), d.x.end());
      dout.insert(dout.end(), d.dout.begin(), d.dout.end());
    }
    const moe_layer_groups<thread_communicator> g{tp_cp, {ep, etp, tp_ep}};
    auto& res = results[static_cast<std::size_t>(r)];
    std::vector<T> out(x.size()), dx(x.size());
    auto stats = layer->forward(p.tokens, x, {}, g, out);
    if (!stats) return unexpected<error>(stats.error());
    res.aux = stats->aux_loss;
    res.z = stats->z_loss;
    res.dropped = stats->dropped.dropped_pairs;
    res.indices = layer->last_routing().indices;
    res.kept = layer->last_drop().kept_experts(layer->last_routing());
    if (auto s = layer->backward(dout, T(1), g, dx); !s) return s;
    if (auto s = layer->reduce_gradients(
            stage, edp, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
        !s)
      return s;
    res.out = widen<T>(out);
    res.dx = widen<T>(dx);
    res.dw_router = widen<T>(layer->router_weight_grad());
    res.dw1 = widen<T>(layer->experts().grads_fc1());
    res.dw2 = widen<T>(layer->experts().grads_fc2());
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

// The reference for one pipeline stage. Drop decisions: per rank (sub-sequence), per tp-cp group
// in rank order (full sequence), or none.
enum class drop_mode { none, per_rank, per_sequence };

// Checks the layer in T against the fp64 reference: relative errors <= 1e-12 in double and
// <= 1e-5 in float. In float the reference takes the implementation's routing and drop decisions
// (an fp32 score may order two near-equal experts differently) and recomputes their
// probabilities in fp64.
template <class T, class Policy, class Dispatcher>
long long check_layer_in(const problem& p, const Policy& policy, drop_mode mode) {
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.pp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  CAPTURE(static_cast<int>(mode));
  const auto res = run_layer<T, Policy, Dispatcher>(p, policy);
  constexpr bool fp64 = std::is_same_v<T, double>;
  const double tol = fp64 ? 1e-12 : 1e-5;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const auto wr = router_weight(p);
  const int E = p.experts, H = p.hidden, K = p.topk, L = E / fold.ep();
  const auto router = topk_router<double>::make({.num_experts = E, .topk = K}).value();
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
          REQUIRE(sub_sequence{.capacity_factor = 1.0}.apply(part, d));
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
      CHECK(aux_sum == doctest::Approx(term.loss).epsilon(tol));
      CHECK(z_sum == doctest::Approx(z_loss<double>(logits, E, z_coeff, {}).value()).epsilon(tol));
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
      CHECK(rel_err(got.out, out_ref[r]) <= tol);
      CHECK(rel_err(got.dx, dx_ref[r]) <= tol);
      CHECK(rel_err(got.dw_router, dw_router) <= tol);
      // Expert shards (edp-reduced) against the reference's slices.
      const auto mc = fold.moe_coord_of(r);
      const int fs = p.ffn / fold.etp();
      std::vector<double> want1, want2;
      for (int l = 0; l < L; ++l) {
        auto d1 = g.dw1[mc.ep * L + l], d2 = g.dw2[mc.ep * L + l];
        d1.resize(static_cast<std::size_t>(H * 2 * p.ffn), 0.0);
        d2.resize(static_cast<std::size_t>(p.ffn * H), 0.0);
        for (int h = 0; h < H; ++h)
          for (int gu = 0; gu < 2; ++gu)
            for (int c = 0; c < fs; ++c)
              want1.push_back(
                  d1[static_cast<std::size_t>(h * 2 * p.ffn + gu * p.ffn + mc.etp * fs + c)]);
        for (int c = 0; c < fs; ++c)
          for (int h = 0; h < H; ++h)
            want2.push_back(d2[static_cast<std::size_t>((mc.etp * fs + c) * H + h)]);
      }
      CHECK(rel_err(got.dw1, want1) <= tol);
      CHECK(rel_err(got.dw2, want2) <= tol);
    }
  }
  long long dropped = 0;
  for (const auto& r : res) dropped += r.dropped;
  return dropped;
}

template <class Policy, class Path>
long long check_layer(const problem& p, const Policy& policy, drop_mode mode) {
  return check_layer_in<double, Policy, typename Path::type>(p, policy, mode);
}

const fold_config layer_folds[] = {
    {.world = 1},
    {.world = 2, .tp = 2, .ep = 2, .etp = 1},
    {.world = 4, .tp = 2, .ep = 2, .etp = 2},
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1},
    {.world = 8, .tp = 2, .cp = 2, .ep = 8, .etp = 1},
    {.world = 8, .tp = 4, .ep = 2, .etp = 2},
    {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-cp-ep-pp-dp"},
    {.world = 12, .tp = 3, .ep = 4, .etp = 3},
    {.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1},
};

}  // namespace

TEST_CASE("the MoE layer equals the fp64 reference: dropless, sub-sequence and full-sequence") {
  int i = 0, dropping_runs = 0;
  for (const auto& f : layer_folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = fold.ep() * (1 + i % 2) < 2 ? 2 : fold.ep() * (1 + i % 2);
    p.topk = 2;
    p.ffn = 2 * fold.etp();
    p.tokens = 4;
    CHECK(check_layer<dropless, all_to_all_path<thread_communicator>>(p, dropless{},
                                                                      drop_mode::none) == 0);
    dropping_runs += check_layer<sub_sequence, all_to_all_path<thread_communicator>>(
                         p, sub_sequence{.capacity_factor = 1.0}, drop_mode::per_rank) > 0;
    dropping_runs += check_layer<full_sequence, all_gather_path<thread_communicator>>(
                         p, full_sequence{.capacity_factor = 1.0}, drop_mode::per_sequence) > 0;
    ++i;
  }
  CHECK(dropping_runs >= 12);  // tokens were actually dropped in most runs
}

TEST_CASE("the MoE layer equals the reference on a sweep of 100+ folded mappings") {
  // Every legal fold of worlds up to 16 with tp, cp, ep, etp, pp from their divisors (pp <= 2),
  // both trainer orders, taken in a fixed order; each with one of the three policies.
  std::vector<fold_config> folds;
  for (int world : {1, 2, 3, 4, 6, 8, 12, 16})
    for (int pp : {1, 2})
      for (int tp = 1; tp <= world; ++tp)
        for (int cp = 1; cp <= 2; ++cp)
          for (int ep = 1; ep <= world; ++ep)
            for (int etp = 1; etp <= 4; ++etp)
              for (const char* order : {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"}) {
                const fold_config f{.world = world,
                                    .tp = tp,
                                    .cp = cp,
                                    .pp = pp,
                                    .ep = ep,
                                    .etp = etp,
                                    .order = order};
                if (world % (tp * cp * pp) || world % (ep * etp * pp) || !make_folded(f)) continue;
                if (pp == 1 && std::string(order) != "tp-cp-ep-dp-pp") continue;  // same groups
                folds.push_back(f);
              }
  int runs = 0, etp_gt_1 = 0, several_local = 0, ep_spans = 0, dropping = 0, pp_not_last = 0,
      fp32_runs = 0;
  using a2a_d = all_to_all_dispatcher<double, thread_communicator>;
  using a2a_f = all_to_all_dispatcher<float, thread_communicator>;
  using ag_d = all_gather_dispatcher<double, thread_communicator>;
  using ag_f = all_gather_dispatcher<float, thread_communicator>;
  // Even folds in fp64, odd folds in fp32: 100+ of each, the policies rotating over both.
  for (std::size_t i = 0; i < folds.size(); ++i) {
    const bool fp32 = i % 2 == 1;
    const auto fold = make_folded(folds[i]).value();
    problem p{.fold = folds[i]};
    p.experts = fold.ep() * (1 + static_cast<int>(i / 2) % 2);
    if (p.experts < 2) p.experts = 2;
    p.topk = 2;
    p.ffn = 2 * fold.etp();
    p.tokens = 4;
    CAPTURE(fp32);
    long long dropped = 0;
    const sub_sequence sub{.capacity_factor = 1.0, .pad_to_capacity = i % 4 >= 2};
    const full_sequence full{.capacity_factor = 1.0, .pad_to_capacity = i % 4 < 2};
    switch (i / 2 % 3) {
      case 0:
        dropped = fp32 ? check_layer_in<float, dropless, a2a_f>(p, dropless{}, drop_mode::none)
                       : check_layer_in<double, dropless, a2a_d>(p, dropless{}, drop_mode::none);
        break;
      case 1:
        dropped = fp32 ? check_layer_in<float, sub_sequence, a2a_f>(p, sub, drop_mode::per_rank)
                       : check_layer_in<double, sub_sequence, a2a_d>(p, sub, drop_mode::per_rank);
        break;
      default:
        dropped =
            fp32 ? check_layer_in<float, full_sequence, ag_f>(p, full, drop_mode::per_sequence)
                 : check_layer_in<double, full_sequence, ag_d>(p, full, drop_mode::per_sequence);
    }
    fp32_runs += fp32;
    if (fp32) continue;
    ++runs;
    etp_gt_1 += fold.etp() > 1;
    several_local += p.experts / fold.ep() > 1;
    ep_spans += fold.ep() > 1 && fold.ep() * fold.etp() > fold.tp() * fold.cp();
    dropping += dropped > 0;
    pp_not_last += std::string(folds[i].order) == "tp-cp-ep-pp-dp";
  }
  MESSAGE(runs << " fp64 mappings (and " << fp32_runs << " in fp32): " << etp_gt_1
               << " with ETP > 1, " << several_local << " with several experts per rank, "
               << ep_spans << " with EP spanning TP/CP/DP, " << dropping << " that dropped tokens, "
               << pp_not_last << " with pp not last");
  CHECK(runs >= 100);
  CHECK(fp32_runs >= 100);
  CHECK(etp_gt_1 >= 20);
  CHECK(several_local >= 20);
  CHECK(ep_spans >= 20);
  CHECK(dropping >= 20);
  CHECK(pp_not_last >= 5);
}
