// The MoE layer's optional parts on the thread world, against an fp64 reference written here:
// the per-sequence and global load-balancing losses (values and gradients, over two micro-batches
// and the end of a global batch), the shared expert with its sigmoid gate (inside the layer, its
// gradients reduced over their own groups), the expert bias (selection, post-drop counts, update),
// and evaluation mode. The router's decisions come from the routing code (checked on its own);
// the losses, their softmax chain, the shared MLP and the gate are plain loops here.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"
#include "../support/host_topk_router.hpp"
#include "../support/mlp_layout.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

constexpr int kBatch = 2;  // sequences per micro-batch: token n = s*B + b
constexpr double seq_coeff = 0.02, global_coeff = 0.03;
constexpr int shared_ffn = 6;
constexpr int micro_batches = 2;

std::vector<double> router_weight(const problem& p) {  // [E, H]
  std::vector<double> w;
  for (int e = 0; e < p.experts; ++e)
    for (int h = 0; h < p.hidden; ++h) w.push_back(2.0 * unit(9, e, h));
  return w;
}
std::vector<double> gate_weight(const problem& p) {  // [H]
  std::vector<double> w;
  for (int h = 0; h < p.hidden; ++h) w.push_back(unit(10, h, 0));
  return w;
}
std::vector<float> bias_values(int E) {  // large enough to change selections
  std::vector<float> b;
  for (int e = 0; e < E; ++e) b.push_back(e % 2 ? 0.4f : -0.1f * static_cast<float>(e));
  return b;
}
// Micro-batch m's tokens of rank r (keys distinct from the other micro-batches).
token_data token(const problem& p, int m, int r, int t) { return make_token(p, r + 97 * m, t); }

enum class variant { losses_and_shared, expert_bias };

struct rank_out {
  std::vector<double> out[micro_batches], dx[micro_batches];
  double seq_aux[micro_batches] = {}, global_aux[micro_batches] = {};
  double global_after_reset = 0;
  std::vector<double> dw_router, dw1, dw2, shared_dw1, shared_dw2, gate_dw;
  std::vector<double> eval_out;
  moe_forward_values eval_stats;
  int global_steps_before_eval = 0, global_steps_after_eval = 0;
  std::vector<float> counts_after_train, counts_after_eval, bias_after_update, counts_after_update;
};

topk_router_options router_options(const problem& p, variant v) {
  topk_router_options o{.num_experts = p.experts, .topk = p.topk};
  if (v == variant::expert_bias) {
    o.score = score_function::sigmoid;
    o.expert_bias = true;
  }
  return o;
}

std::vector<rank_out> run(const problem& p, variant v) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  problem ps = p;
  ps.experts = 1;
  ps.ffn = shared_ffn;
  const data ws = make_weights(ps);
  const auto wr = router_weight(p), wg = gate_weight(p);
  std::vector<rank_out> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec ex;
    // Every group the layer uses (tp for the shared expert, tp-dp-cp for the global loss, the
    // gradients' groups), held by the layer by reference: it outlives the layer.
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    auto mlp = rank_experts<double>(p, fold, r, w.w1, w.w2).value();
    moe_layer_options o{.hidden = p.hidden,
                        .max_tokens = p.tokens,
                        .ep = fold.ep(),
                        .etp = fold.etp(),
                        .router = router_options(p, v),
                        .batch = kBatch};
    if (v == variant::losses_and_shared) {
      o.seq_aux_loss_coeff = seq_coeff;
      o.global_aux_loss_coeff = global_coeff;
      o.shared_expert = {.ffn = shared_ffn,
                         .gate = true,
                         .tp = fold.tp(),
                         .tp_rank = groups(group_kind::tp).find(r).position};
    }
    using layer_t =
        moe_layer<double, host_exec, thread_communicator, dropless,
                  all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    auto layer = layer_t::make(ex, o, *comms, dropless{}, std::move(mlp));
    if (!layer) return unexpected<error>(layer.error());
    std::copy(wr.begin(), wr.end(), layer->router_weight().flat().begin());
    if (auto* se = layer->shared()) {
      if (auto s = se->load_full(megatron_fc1_from_columns(ws.w1, p.hidden, 2, shared_ffn),
                                 megatron_fc2_from_rows(ws.w2, shared_ffn, p.hidden));
          !s)
        return s;
      std::copy(wg.begin(), wg.end(), se->own().gate.flat().begin());
    }
    if (v == variant::expert_bias)
      if (auto s = layer->load_state(ex, {.expert_bias = bias_values(p.experts),
                                          .expert_bias_counts = std::vector<float>(
                                              static_cast<std::size_t>(p.experts), 0.f)});
          !s)
        return s;
    auto& res = results[static_cast<std::size_t>(r)];
    auto inputs = [&](int m, std::vector<double>& x, std::vector<double>& dout) {
      x.clear();
      dout.clear();
      for (int t = 0; t < p.tokens; ++t) {
        const auto d = token(p, m, r, t);
        x.insert(x.end(), d.x.begin(), d.x.end());
        dout.insert(dout.end(), d.dout.begin(), d.dout.end());
      }
    };
    std::vector<double> x, dout;
    for (int m = 0; m < micro_batches; ++m) {
      inputs(m, x, dout);
      res.out[m].resize(x.size());
      res.dx[m].resize(x.size());
      auto stats = layer->forward(ex, p.tokens, x, {}, res.out[m]);
      if (!stats) return unexpected<error>(stats.error());
      // The losses are views of the context's values until its next forward: read them now.
      auto values = read_forward_stats(ex, *stats);
      if (!values) return unexpected<error>(values.error());
      res.seq_aux[m] = values->seq_aux_loss;
      res.global_aux[m] = values->global_aux_loss;
      if (auto s = layer->backward(ex, dout, 1.0, res.dx[m]); !s) return s;
    }
    // The bundle's groups: router over tp-dp-cp, experts over edp, shared MLP over dp-cp.
    if (auto s = layer->reduce_gradients(
            ex, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
        !s)
      return s;
    res.dw_router.assign(layer->router_weight_grad().flat().begin(),
                         layer->router_weight_grad().flat().end());
    res.dw1.assign(layer->experts().grads_fc1().begin(), layer->experts().grads_fc1().end());
    res.dw2.assign(layer->experts().grads_fc2().begin(), layer->experts().grads_fc2().end());
    if (auto* se = layer->shared()) {
      res.shared_dw1.assign(se->params().grads.fc1.flat().begin(),
                            se->params().grads.fc1.flat().end());
      res.shared_dw2.assign(se->params().grads.fc2.flat().begin(),
                            se->params().grads.fc2.flat().end());
      res.gate_dw.assign(se->params().gate_grad.flat().begin(),
                         se->params().gate_grad.flat().end());
    }
    const auto state = [&]() -> expected<moe_layer_state> { return layer->save_state(ex); };
    auto after_train = state();
    if (!after_train) return unexpected<error>(after_train.error());
    res.counts_after_train = after_train->expert_bias_counts;
    // Evaluation: micro-batch 0 again; same output, no losses, no counting.
    res.global_steps_before_eval = after_train->global_aux_steps;
    layer->set_training(false);
    inputs(0, x, dout);
    res.eval_out.resize(x.size());
    auto ev = layer->forward(ex, p.tokens, x, {}, res.eval_out);
    if (!ev) return unexpected<error>(ev.error());
    auto ev_values = read_forward_stats(ex, *ev);
    if (!ev_values) return unexpected<error>(ev_values.error());
    res.eval_stats = *ev_values;
    auto after_eval = state();
    if (!after_eval) return unexpected<error>(after_eval.error());
    res.global_steps_after_eval = after_eval->global_aux_steps;
    res.counts_after_eval = after_eval->expert_bias_counts;
    layer->set_training(true);
    // End of the global batch: bias update, running counts restart.
    if (auto s = layer->end_global_batch(ex); !s) return s;
    auto after_update = state();
    if (!after_update) return unexpected<error>(after_update.error());
    res.bias_after_update = after_update->expert_bias;
    res.counts_after_update = after_update->expert_bias_counts;
    if (v == variant::losses_and_shared) {
      inputs(1, x, dout);
      std::vector<double> out(x.size());
      auto again = layer->forward(ex, p.tokens, x, {}, out);
      if (!again) return unexpected<error>(again.error());
      auto again_values = read_forward_stats(ex, *again);
      if (!again_values) return unexpected<error>(again_values.error());
      res.global_after_reset = again_values->global_aux_loss;
    }
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

// Softmax over one row of logits.
std::vector<double> softmax(const double* z, int E) {
  double mx = z[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, z[e]);
  std::vector<double> s(static_cast<std::size_t>(E));
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += s[static_cast<std::size_t>(e)] = std::exp(z[e] - mx);
  for (auto& v : s) v /= sum;
  return s;
}

void check(const problem& p, variant v) {
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.ep);
  CAPTURE(static_cast<int>(v));
  const auto res = run(p, v);
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int E = p.experts, H = p.hidden, K = p.topk, N = p.tokens, W = fold.world_size();
  const int L = E / fold.ep();
  const data w = make_weights(p);
  problem ps = p;
  ps.experts = 1;
  ps.ffn = shared_ffn;
  const data ws = make_weights(ps);
  const auto wr = router_weight(p), wg = gate_weight(p);
  const bool losses = v == variant::losses_and_shared;
  const auto bias = bias_values(E);
  const auto router = host_topk_router<double>::make(router_options(p, v)).value();
  REQUIRE(fold.pp() == 1);  // one stage: the whole world

  reference_grads g, gs;  // routed experts, shared expert
  std::vector<double> dw_router(static_cast<std::size_t>(E * H), 0.0), dgate(H, 0.0);
  std::vector<double> global_counts(static_cast<std::size_t>(E), 0.0);  // running sum
  std::vector<std::vector<float>> bias_counts(static_cast<std::size_t>(W),
                                              std::vector<float>(E, 0.f));
  for (int m = 0; m < micro_batches; ++m) {
    // Logits, routing and aux statistics of every token of the stage, rank-major.
    std::vector<double> logits(static_cast<std::size_t>(W * N * E));
    std::vector<token_data> toks;
    for (int r = 0; r < W; ++r)
      for (int t = 0; t < N; ++t) {
        toks.push_back(token(p, m, r, t));
        for (int e = 0; e < E; ++e) {
          double z = 0;
          for (int h = 0; h < H; ++h) z += toks.back().x[h] * wr[e * H + h];
          logits[static_cast<std::size_t>((r * N + t) * E + e)] = z;
        }
      }
    topk_routing<double> routing;
    REQUIRE(router.route(
        logits, routing,
        v == variant::expert_bias ? std::span<const float>(bias) : std::span<const float>()));
    // Aux scores (softmax) and their plain top-k map.
    std::vector<std::vector<double>> sc;
    std::vector<std::vector<int>> top;
    for (int i = 0; i < W * N; ++i) {
      sc.push_back(softmax(&logits[static_cast<std::size_t>(i * E)], E));
      std::vector<int> idx(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) idx[static_cast<std::size_t>(e)] = e;
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int a, int b) { return sc.back()[a] > sc.back()[b]; });
      idx.resize(static_cast<std::size_t>(K));
      top.push_back(idx);
    }
    // dlogits of the losses, by the formulas of docs/dispatch-semantics.md 2.5 and the softmax
    // chain.
    std::vector<double> dscore(static_cast<std::size_t>(W * N * E), 0.0);
    if (losses) {
      // Per sequence, per tp-cp group: S = N/B * |tp_cp| tokens per sequence.
      for (auto grp : groups(group_kind::tp_cp)) {
        const double S = static_cast<double>(N / kBatch) * grp.size();
        double loss = 0, partial_sum = 0;
        for (int b = 0; b < kBatch; ++b) {
          std::vector<double> P(E, 0.0), c(E, 0.0);
          for (int r : grp)
            for (int t = b; t < N; t += kBatch) {
              for (int e = 0; e < E; ++e) P[e] += sc[r * N + t][e];
              for (int e : top[r * N + t]) c[e] += 1;
            }
          const double f = seq_coeff * E / (K * S * S * kBatch);
          for (int e = 0; e < E; ++e) loss += f * P[e] * c[e];
          for (int r : grp)
            for (int t = b; t < N; t += kBatch)
              for (int e = 0; e < E; ++e)
                dscore[static_cast<std::size_t>((r * N + t) * E + e)] += f * c[e];
        }
        for (int r : grp) partial_sum += res[static_cast<std::size_t>(r)].seq_aux[m];
        CHECK(partial_sum == doctest::Approx(loss).epsilon(1e-12));
      }
      // Global: counts over the stage, running average over the micro-batches so far.
      for (int i = 0; i < W * N; ++i)
        for (int e : top[i]) global_counts[e] += 1;
      const double T = static_cast<double>(N) * W, f = global_coeff * E / (K * T * T);
      double loss = 0, partial_sum = 0;
      for (int i = 0; i < W * N; ++i)
        for (int e = 0; e < E; ++e) {
          const double avg = global_counts[e] / (m + 1);
          loss += f * sc[i][e] * avg;
          dscore[static_cast<std::size_t>(i * E + e)] += f * avg;
        }
      for (int r = 0; r < W; ++r) partial_sum += res[static_cast<std::size_t>(r)].global_aux[m];
      CHECK(partial_sum == doctest::Approx(loss).epsilon(1e-12));
    }
    // Per token: routed experts, shared expert with gate, router chain.
    std::vector<double> dprobs(static_cast<std::size_t>(W * N * K));
    std::vector<std::vector<double>> out_ref(static_cast<std::size_t>(W)),
        dx_tok(static_cast<std::size_t>(W * N));
    for (int i = 0; i < W * N; ++i) {
      const int r = i / N;
      token_data d = toks[static_cast<std::size_t>(i)];
      for (int j = 0; j < K; ++j) {
        d.expert[j] = routing.expert(i, j);
        d.prob[j] = routing.prob(i, j);
        bias_counts[r][d.expert[j]] += 1.f;
      }
      std::vector<double> o, dx, dp;
      reference_token(w, d, o, dx, dp, g);
      for (int j = 0; j < K; ++j) dprobs[static_cast<std::size_t>(i * K + j)] = dp[j];
      if (losses) {
        double z = 0;
        for (int h = 0; h < H; ++h) z += d.x[h] * wg[h];
        const double gt = 1 / (1 + std::exp(-z));
        token_data sd{d.x, {0}, {1.0}, d.dout};
        for (auto& v2 : sd.dout) v2 *= gt;
        std::vector<double> so, sdx, sdp;
        reference_token(ws, sd, so, sdx, sdp, gs);
        const double dpre = sdp[0] * (1 - gt);
        for (int h = 0; h < H; ++h) {
          o[h] += gt * so[h];
          dx[h] += sdx[h] + dpre * wg[h];
          dgate[h] += dpre * d.x[h];
        }
      }
      out_ref[r].insert(out_ref[r].end(), o.begin(), o.end());
      dx_tok[static_cast<std::size_t>(i)] = dx;
    }
    std::vector<double> dlogits(static_cast<std::size_t>(W * N * E), 0.0);
    REQUIRE(router.backward(logits, routing, dprobs, dlogits));
    for (int i = 0; i < W * N; ++i) {  // softmax Jacobian: s_e (g_e - sum_j s_j g_j)
      double dot = 0;
      for (int e = 0; e < E; ++e) dot += sc[i][e] * dscore[static_cast<std::size_t>(i * E + e)];
      for (int e = 0; e < E; ++e)
        dlogits[static_cast<std::size_t>(i * E + e)] +=
            sc[i][e] * (dscore[static_cast<std::size_t>(i * E + e)] - dot);
    }
    for (int r = 0; r < W; ++r) {
      CAPTURE(m);
      CAPTURE(r);
      std::vector<double> dx_ref;
      for (int t = 0; t < N; ++t) {
        const int i = r * N + t;
        for (int h = 0; h < H; ++h) {
          double val = dx_tok[static_cast<std::size_t>(i)][h];
          for (int e = 0; e < E; ++e)
            val += dlogits[static_cast<std::size_t>(i * E + e)] * wr[e * H + h];
          dx_ref.push_back(val);
        }
      }
      CHECK(rel_err(res[static_cast<std::size_t>(r)].out[m], out_ref[r]) <= 1e-12);
      CHECK(rel_err(res[static_cast<std::size_t>(r)].dx[m], dx_ref) <= 1e-12);
    }
    for (int i = 0; i < W * N; ++i)
      for (int e = 0; e < E; ++e)
        for (int h = 0; h < H; ++h)
          dw_router[e * H + h] +=
              dlogits[static_cast<std::size_t>(i * E + e)] * toks[static_cast<std::size_t>(i)].x[h];
  }
  // Gradients after reduce_gradients, summed over both micro-batches; the reference's shards in
  // the library's layout (support/mlp_layout.hpp).
  auto shard = [](const std::vector<double>& d1, const std::vector<double>& d2, int Hh, int F,
                  int parts, int part, std::vector<double>& w1, std::vector<double>& w2) {
    append_fc1_shard<double>(d1, Hh, 2, F, parts, part, w1);
    append_fc2_shard<double>(d2, F, Hh, parts, part, w2);
  };
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto& got = res[static_cast<std::size_t>(r)];
    CHECK(rel_err(got.dw_router, dw_router) <= 1e-12);
    const auto mc = fold.moe_coord_of(r);
    std::vector<double> want1, want2;
    for (int l = 0; l < L; ++l) {
      auto d1 = g.dw1[mc.ep * L + l], d2 = g.dw2[mc.ep * L + l];
      d1.resize(static_cast<std::size_t>(H * 2 * p.ffn), 0.0);
      d2.resize(static_cast<std::size_t>(p.ffn * H), 0.0);
      shard(d1, d2, H, p.ffn, fold.etp(), mc.etp, want1, want2);
    }
    CHECK(rel_err(got.dw1, want1) <= 1e-12);
    CHECK(rel_err(got.dw2, want2) <= 1e-12);
    if (losses) {
      std::vector<double> s1, s2;
      shard(gs.dw1[0], gs.dw2[0], H, shared_ffn, fold.tp(), groups(group_kind::tp).find(r).position,
            s1, s2);
      CHECK(rel_err(got.shared_dw1, s1) <= 1e-12);
      CHECK(rel_err(got.shared_dw2, s2) <= 1e-12);
      CHECK(rel_err(got.gate_dw, dgate) <= 1e-12);
    }
    // Evaluation: the same output as training on the same tokens, no losses, no statistics.
    CHECK(got.eval_out == got.out[0]);
    CHECK(got.eval_stats.aux_loss == 0.0);
    CHECK(got.eval_stats.seq_aux_loss == 0.0);
    CHECK(got.eval_stats.global_aux_loss == 0.0);
    CHECK(got.eval_stats.z_loss == 0.0);
    CHECK(got.global_steps_after_eval == got.global_steps_before_eval);
    CHECK(got.counts_after_eval == got.counts_after_train);
    if (losses) {
      CHECK(got.global_steps_before_eval == micro_batches);
      // After end_global_batch the running average restarts from this micro-batch alone: the
      // partials of micro-batch 1 with its own counts (m = 0 in the average).
      CHECK(got.global_after_reset != 0.0);
    } else {
      // Expert bias: post-drop counts of this rank over both micro-batches, then the update
      // from the stage's counts, and the counts reset.
      CHECK(got.counts_after_train == bias_counts[static_cast<std::size_t>(r)]);
      std::vector<float> c(static_cast<std::size_t>(E), 0.f);
      for (int q = 0; q < W; ++q)
        for (int e = 0; e < E; ++e) c[e] += bias_counts[static_cast<std::size_t>(q)][e];
      float mean = 0;
      for (float x : c) mean += x;
      mean /= static_cast<float>(E);
      for (int e = 0; e < E; ++e) {
        const float want = bias[e] + (mean > c[e] ? 1e-3f : mean < c[e] ? -1e-3f : 0.f);
        CHECK(got.bias_after_update[e] == want);
        CHECK(got.counts_after_update[e] == 0.f);
      }
    }
  }
  if (losses) {  // the restarted global loss: micro-batch 1's counts as the whole average
    double sum = 0;
    for (const auto& r : res) sum += r.global_after_reset;
    std::vector<double> counts(static_cast<std::size_t>(E), 0.0),
        P(static_cast<std::size_t>(E), 0.0);
    for (int r = 0; r < W; ++r)
      for (int t = 0; t < N; ++t) {
        const auto d = token(p, 1, r, t);
        std::vector<double> z(static_cast<std::size_t>(E), 0.0);
        for (int e = 0; e < E; ++e)
          for (int h = 0; h < H; ++h) z[e] += d.x[h] * wr[e * H + h];
        const auto s = softmax(z.data(), E);
        std::vector<int> idx(static_cast<std::size_t>(E));
        for (int e = 0; e < E; ++e) idx[e] = e;
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
        for (int j = 0; j < K; ++j) counts[idx[j]] += 1;
        for (int e = 0; e < E; ++e) P[e] += s[e];
      }
    const double T = static_cast<double>(N) * W;
    double want = 0;
    for (int e = 0; e < E; ++e) want += global_coeff * E / (K * T * T) * P[e] * counts[e];
    CHECK(sum == doctest::Approx(want).epsilon(1e-12));
  }
}

const fold_config feature_folds[] = {
    {.world = 1},
    {.world = 4, .tp = 2, .ep = 2, .etp = 2},
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 2, .ep = 2, .etp = 2},
};

}  // namespace

TEST_CASE("MoE layer: per-sequence and global aux losses and the gated shared expert match fp64") {
  for (const auto& f : feature_folds) {
    problem p{.fold = f};
    p.experts = 4;
    p.topk = 2;
    p.ffn = 4;
    p.tokens = 4;
    check(p, variant::losses_and_shared);
  }
}

TEST_CASE("MoE layer: the expert bias steers selection, counts post-drop tokens, updates") {
  for (const auto& f : feature_folds) {
    problem p{.fold = f};
    p.experts = 4;
    p.topk = 2;
    p.ffn = 4;
    p.tokens = 4;
    check(p, variant::expert_bias);
  }
}

TEST_CASE("MoE layer: missing communicators and bad options are named") {
  using layer_t =
      moe_layer<double, host_exec, thread_communicator, dropless,
                all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
  auto mlp = [] {
    return reference_mlp<double>::make({.hidden = 2, .ffn = 2, .num_local_experts = 2}).value();
  };
  const topk_router_options ro{.num_experts = 2, .topk = 1, .pre_softmax = true};
  // make() takes the communicators now, so the refusals are made on the world's rank; their
  // statuses are judged on the test's thread (a REQUIRE there stops the test case).
  const auto status_of = [](const expected<layer_t>& l) -> status {
    if (l) return {};
    return unexpected<error>(l.error());
  };
  status bad, bad_batch, bad_tp;
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    host_exec ex;
    // A one-rank world: every group of the bundle is this rank alone.
    auto comms =
        make_layer_communicators(world, megatron_groups(make_folded({.world = 1}).value()));
    if (!comms) return unexpected<error>(comms.error());
    bad = status_of(
        layer_t::make(ex, {.hidden = 2, .max_tokens = 2, .router = ro, .seq_aux_loss_coeff = -1},
                      *comms, dropless{}, mlp()));
    bad_batch = status_of(layer_t::make(
        ex, {.hidden = 2, .max_tokens = 2, .router = ro, .batch = 0}, *comms, dropless{}, mlp()));
    // No layer call takes a group any more: every one comes from the bundle, so none can be
    // missing at a forward. What can still be wrong is a bundle that disagrees with the options
    // (a TP group other than the one the shared expert is sharded over): make() names it.
    bad_tp = status_of(layer_t::make(
        ex, {.hidden = 2, .max_tokens = 1, .router = ro, .shared_expert = {.ffn = 2, .tp = 2}},
        *comms, dropless{}, mlp()));
    const std::vector<double> x = {1, 2};
    std::vector<double> out(2);
    // The shared expert takes the bundle's TP group, the global loss its tp-dp-cp group.
    auto shared =
        layer_t::make(ex, {.hidden = 2, .max_tokens = 1, .router = ro, .shared_expert = {.ffn = 2}},
                      *comms, dropless{}, mlp())
            .value();
    CHECK(&shared.communicators() == &*comms);
    CHECK(shared.forward(ex, 1, x, {}, out).has_value());
    auto global =
        layer_t::make(ex,
                      {.hidden = 2, .max_tokens = 1, .router = ro, .global_aux_loss_coeff = 0.1},
                      *comms, dropless{}, mlp())
            .value();
    const auto trained = global.forward(ex, 1, x, {}, out);
    CHECK(trained.has_value());
    if (trained) {  // the loss ran over the stage group (one token: coeff * E * P(selected) > 0)
      const auto values = read_forward_stats(ex, *trained);
      CHECK(values.has_value());
      if (values) CHECK(values->global_aux_loss > 0.0);
    }
    global.set_training(false);  // evaluation computes no aux loss
    CHECK(global.forward(ex, 1, x, {}, out).has_value());
    return {};
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), s.error().message);
  REQUIRE_FALSE(bad);
  CHECK_MESSAGE(bad.error().message.find("finite and >= 0") != std::string::npos,
                bad.error().message);
  REQUIRE_FALSE(bad_batch);
  CHECK(bad_batch.error().code == errc::invalid_argument);
  REQUIRE_FALSE(bad_tp);
  CHECK_MESSAGE(bad_tp.error().message.find("shared_expert.tp") != std::string::npos,
                bad_tp.error().message);
}

TEST_CASE("MoE layer: the expert bias counts the pairs that survive the drop policy") {
  using layer_t =
      moe_layer<double, host_exec, thread_communicator, sub_sequence,
                all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
  const int E = 4, H = 3, N = 8, K = 2;
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    host_exec ex;
    auto comms =
        make_layer_communicators(world, megatron_groups(make_folded({.world = 1}).value()));
    if (!comms) return unexpected<error>(comms.error());
    auto layer = layer_t::make(
        ex,
        {.hidden = H,
         .max_tokens = N,
         .router =
             {.num_experts = E, .topk = K, .score = score_function::sigmoid, .expert_bias = true}},
        *comms, sub_sequence{.capacity_factor = 0.5},
        reference_mlp<double>::make({.hidden = H, .ffn = 2, .num_local_experts = E}).value());
    if (!layer) return unexpected<error>(layer.error());
    for (std::size_t i = 0; i < layer->router_weight().flat().size(); ++i)
      layer->router_weight().flat()[i] = unit(20, i, 0);
    std::vector<double> x, out(static_cast<std::size_t>(N * H));
    for (int i = 0; i < N * H; ++i) x.push_back(unit(21, i, 0));
    auto stats = layer->forward(ex, N, x, {}, out);
    if (!stats) return unexpected<error>(stats.error());
    auto values = read_forward_stats(ex, *stats);
    if (!values) return unexpected<error>(values.error());
    CHECK(values->dropped.dropped_pairs > 0);  // the capacity bound
    std::vector<float> kept(E, 0.f), routed(E, 0.f);
    const auto ke = layer->last_kept_experts().flat();
    for (int e : ke)
      if (e >= 0) kept[static_cast<std::size_t>(e)] += 1.f;
    for (int e : layer->last_routing().indices) routed[static_cast<std::size_t>(e)] += 1.f;
    auto state = layer->save_state(ex);
    if (!state) return unexpected<error>(state.error());
    CHECK(state->expert_bias_counts == kept);
    CHECK(state->expert_bias_counts != routed);
    return {};
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), s.error().message);
}

TEST_CASE("MoE layer state: save, load into a fresh layer, and the run continues bitwise") {
  // The expert bias (after one update and with this global batch's counts) and the global aux
  // loss's running counts, saved mid global batch; a fresh layer that loads them computes the
  // next micro-batch and the next bias update exactly as the original; one that does not,
  // differs.
  using layer_t =
      moe_layer<double, host_exec, thread_communicator, sub_sequence,
                all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
  const int E = 4, H = 3, N = 8, K = 2;
  const moe_layer_options o{.hidden = H,
                            .max_tokens = N,
                            .router = {.num_experts = E,
                                       .topk = K,
                                       .score = score_function::sigmoid,
                                       .expert_bias = true},
                            .global_aux_loss_coeff = 0.05,
                            .expert_bias_update_rate = 0.05f};
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    host_exec ex;
    // One bundle for the three layers (each holds it by reference; it outlives them).
    auto comms =
        make_layer_communicators(world, megatron_groups(make_folded({.world = 1}).value()));
    if (!comms) return unexpected<error>(comms.error());
    auto make = [&] {
      auto l =
          layer_t::make(
              ex, o, *comms, sub_sequence{.capacity_factor = 1.0},
              reference_mlp<double>::make({.hidden = H, .ffn = 2, .num_local_experts = E}).value())
              .value();
      for (std::size_t i = 0; i < l.router_weight().flat().size(); ++i)
        l.router_weight().flat()[i] = unit(30, i, 0);
      // Values by position in the reference's shard layout ([E, H, 2F], [E, F, H] with F = 2),
      // converted to the library's (support/mlp_layout.hpp).
      auto w1 = l.experts().weights_fc1(), w2 = l.experts().weights_fc2();
      std::vector<double> v1(w1.size()), v2(w2.size());
      for (std::size_t i = 0; i < v1.size(); ++i) v1[i] = 0.5 * unit(31, i, 0);
      for (std::size_t i = 0; i < v2.size(); ++i) v2[i] = 0.5 * unit(32, i, 0);
      const auto c1 = fc1_shards_from_columns<double>(v1, E, H, 2 * 2);
      const auto c2 = fc2_shards_from_rows<double>(v2, E, 2, H);
      std::copy(c1.begin(), c1.end(), w1.begin());
      std::copy(c2.begin(), c2.end(), w2.begin());
      return l;
    };
    auto micro = [&](int m) {
      std::vector<double> x;
      for (int i = 0; i < N * H; ++i) x.push_back(unit(33, static_cast<std::uint64_t>(m), i));
      return x;
    };
    struct step_out {
      std::vector<double> out, dx, dw;
      double global_aux = 0;
      bool operator==(const step_out&) const = default;
    };
    auto step = [&](layer_t& l, int m) -> expected<step_out> {
      const auto x = micro(m);
      step_out s{
          .out = std::vector<double>(x.size()), .dx = std::vector<double>(x.size()), .dw = {}};
      auto f = l.forward(ex, N, x, {}, s.out);
      if (!f) return unexpected<error>(f.error());
      auto values = read_forward_stats(ex, *f);
      if (!values) return unexpected<error>(values.error());
      s.global_aux = values->global_aux_loss;
      if (auto b = l.backward(ex, x, 1.0, s.dx); !b) return unexpected<error>(b.error());
      s.dw.assign(l.router_weight_grad().flat().begin(), l.router_weight_grad().flat().end());
      std::fill(l.router_weight_grad().flat().begin(), l.router_weight_grad().flat().end(), 0.0);
      return s;
    };
    layer_t a = make();
    for (int m : {0, 1})
      if (auto s = step(a, m); !s) return unexpected<error>(s.error());
    if (auto s = a.end_global_batch(ex); !s) return s;
    if (auto s = step(a, 2); !s) return unexpected<error>(s.error());
    // save_state copies through the context and may fail: a failure throws here, which the
    // world reports as this rank's error.
    const auto state_of = [&](const layer_t& l) { return l.save_state(ex).value(); };
    const moe_layer_state saved = state_of(a);
    CHECK(saved.expert_bias != std::vector<float>(E, 0.f));  // the update happened
    CHECK(saved.global_aux_steps == 1);
    CHECK(saved.expert_bias_counts != std::vector<float>(E, 0.f));
    layer_t b = make(), c = make();
    if (auto s = b.load_state(ex, saved); !s) return s;
    CHECK(state_of(b) == saved);
    const auto sa = step(a, 3), sb = step(b, 3), sc = step(c, 3);
    if (!sa || !sb || !sc) return make_error(errc::invalid_argument, "test: a step failed");
    CHECK(*sa == *sb);
    CHECK(!(*sa == *sc));  // without the state the step differs
    for (layer_t* l : {&a, &b})
      if (auto s = l->end_global_batch(ex); !s) return s;
    CHECK(state_of(a) == state_of(b));
    // Refused states change nothing.
    const moe_layer_state before = state_of(b);
    moe_layer_state bad = before;
    bad.expert_bias.pop_back();
    CHECK(b.load_state(ex, bad).error().message.find("expert bias and its counts") !=
          std::string::npos);
    bad = before;
    bad.global_aux_counts = {1.0};
    CHECK(b.load_state(ex, bad).error().code == errc::shape_mismatch);
    bad = before;
    bad.expert_bias[0] = std::nanf("");
    CHECK(b.load_state(ex, bad).error().message.find("finite") != std::string::npos);
    bad = before;
    bad.global_aux_steps = -1;
    CHECK(b.load_state(ex, bad).error().code == errc::invalid_argument);
    CHECK(state_of(b) == before);
    return {};
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), s.error().message);
}
