// The whole MoE layer on the thread world, checked without any analytic reference:
//  - invariant 13: central finite differences in fp64 of the scalar
//      L = sum over ranks of <dout, out> + (micro-batch, per-sequence and global aux losses +
//      z-loss)
//    against the gradients the layer's backward and reduce_gradients produce, for the input, the
//    router weight, the routed experts' weights (ETP shards, EDP replicas), the shared expert's
//    weights (TP shards) and its gate, on folds with TP, CP, EP, ETP and EDP;
//  - invariant 14: two runs are bitwise identical;
//  - invariant 5 at the layer: a capacity no expert reaches gives the dropless result bitwise,
//    tokens that lost all their experts get exactly the shared-expert output (0 without one), and
//    routed = kept + dropped on every rank.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

constexpr int kShared = 4;  // shared-expert FFN size
constexpr int kBatch = 2;   // sequences per micro-batch

// Every parameter of the layer in its full (unsharded) form, and every rank's input.
struct params {
  std::vector<double> router;      // [E, H]
  std::vector<double> w1, w2;      // routed experts, per expert [H, 2F] [gate | up], [F, H]
  std::vector<double> s1, s2, sg;  // shared expert [H, 2Fs], [Fs, H], gate [H]
  std::vector<std::vector<double>> x, dout;  // per rank [N, H]
};

params make_params(const problem& p, int world) {
  params q;
  const data w = make_weights(p);
  q.w1 = w.w1;
  q.w2 = w.w2;
  for (int e = 0; e < p.experts; ++e)
    for (int h = 0; h < p.hidden; ++h) q.router.push_back(2.0 * unit(9, e, h));
  for (int i = 0; i < p.hidden * 2 * kShared; ++i) q.s1.push_back(0.5 * unit(11, 0, i));
  for (int i = 0; i < kShared * p.hidden; ++i) q.s2.push_back(0.5 * unit(12, 0, i));
  for (int h = 0; h < p.hidden; ++h) q.sg.push_back(unit(13, 0, h));
  for (int r = 0; r < world; ++r) {
    q.x.emplace_back();
    q.dout.emplace_back();
    for (int t = 0; t < p.tokens; ++t) {
      const auto d = make_token(p, r, t);
      q.x.back().insert(q.x.back().end(), d.x.begin(), d.x.end());
      q.dout.back().insert(q.dout.back().end(), d.dout.begin(), d.dout.end());
    }
  }
  return q;
}

struct rank_grads {
  double loss = 0;  // this rank's part of L
  std::vector<double> out, dx, router, w1, w2, s1, s2, sg;
  drop_report report;
  std::vector<int> kept;  // [N*k]
};

struct layer_setup {
  bool shared = true;
  bool losses = true;
  double capacity = 0;  // 0: dropless; else sub-sequence with this factor
};

std::vector<rank_grads> run(const problem& p, const params& q, const layer_setup& ls) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  std::vector<rank_grads> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
    auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep);
    auto tp_cp = get(group_kind::tp_cp), stage = get(group_kind::tp_dp_cp),
         edp = get(group_kind::edp), tp = get(group_kind::tp), dp_cp = get(group_kind::dp_cp);
    auto mlp = rank_experts<double>(p, fold, r, q.w1, q.w2).value();
    moe_layer_options o{.hidden = p.hidden,
                        .max_tokens = p.tokens,
                        .ep = fold.ep(),
                        .etp = fold.etp(),
                        .router = {.num_experts = p.experts, .topk = p.topk},
                        .batch = kBatch};
    if (ls.losses) {
      o.aux_loss_coeff = 0.05;
      o.z_loss_coeff = 0.01;
      o.seq_aux_loss_coeff = 0.04;
      o.global_aux_loss_coeff = 0.03;
    }
    if (ls.shared)
      o.shared_expert = {.ffn = kShared,
                         .gate = true,
                         .tp = fold.tp(),
                         .tp_rank = groups(group_kind::tp).find(r).position};
    const moe_layer_groups<thread_communicator> g{
        .tp_cp = tp_cp, .dispatch = {ep, etp, tp_ep}, .tp = &tp, .tp_dp_cp = &stage};
    auto& res = results[static_cast<std::size_t>(r)];
    auto body = [&](auto policy) -> status {
      using layer_t =
          moe_layer<double, thread_communicator, decltype(policy),
                    all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
      auto layer = layer_t::make(o, policy, std::move(mlp));
      if (!layer) return unexpected<error>(layer.error());
      std::copy(q.router.begin(), q.router.end(), layer->router_weight().begin());
      if (auto* se = layer->shared()) {
        if (auto s = se->mlp().load_full(0, q.s1, q.s2); !s) return s;
        std::copy(q.sg.begin(), q.sg.end(), se->gate_weight().begin());
      }
      const auto& x = q.x[static_cast<std::size_t>(r)];
      const auto& dout = q.dout[static_cast<std::size_t>(r)];
      res.out.resize(x.size());
      res.dx.resize(x.size());
      auto stats = layer->forward(p.tokens, x, {}, g, res.out);
      if (!stats) return unexpected<error>(stats.error());
      res.report = stats->dropped.to_report();
      res.kept.assign(layer->last_kept_experts().begin(), layer->last_kept_experts().end());
      res.loss = stats->aux_loss + stats->seq_aux_loss + stats->global_aux_loss + stats->z_loss;
      for (std::size_t i = 0; i < x.size(); ++i) res.loss += dout[i] * res.out[i];
      if (auto s = layer->backward(dout, 1.0, g, res.dx); !s) return s;
      if (auto s = layer->reduce_gradients(
              stage, edp, {layer->experts().grads_fc1(), layer->experts().grads_fc2()}, &dp_cp);
          !s)
        return s;
      auto take = [](std::span<double> v) { return std::vector<double>(v.begin(), v.end()); };
      res.router = take(layer->router_weight_grad());
      res.w1 = take(layer->experts().grads_fc1());
      res.w2 = take(layer->experts().grads_fc2());
      if (auto* se = layer->shared()) {
        res.s1 = take(se->mlp().grads_fc1());
        res.s2 = take(se->mlp().grads_fc2());
        res.sg = take(se->gate_grad());
      }
      return {};
    };
    if (ls.capacity > 0) return body(sub_sequence{.capacity_factor = ls.capacity});
    return body(dropless{});
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

double total_loss(const std::vector<rank_grads>& res) {
  double l = 0;
  for (const auto& r : res) l += r.loss;
  return l;
}

// Where the gradient of full fc1 entry (h, c) of an MLP with F columns per half, sharded over
// `parts`, sits: the shard index and the offset inside that shard's [H, 2F/parts] block.
std::pair<int, std::size_t> fc1_slot(int H, int F, int parts, int h, int c) {
  const int fs = F / parts, half = c / F, col = c % F;
  (void)H;
  return {col / fs, static_cast<std::size_t>(h * 2 * fs + half * fs + col % fs)};
}
std::pair<int, std::size_t> fc2_slot(int H, int F, int parts, int c, int h) {
  const int fs = F / parts;
  (void)F;
  return {c / fs, static_cast<std::size_t>((c % fs) * H + h)};
}

void gradcheck(const problem& p) {
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int W = fold.world_size(), H = p.hidden, F = p.ffn, L = p.experts / fold.ep();
  const params q = make_params(p, W);
  const layer_setup ls{};
  const auto base = run(p, q, ls);
  const double eps = 1e-6;
  int checked = 0;
  // d L / d theta by central differences, against `analytic`.
  auto fd = [&](auto&& perturb, double analytic) {
    params plus = q, minus = q;
    perturb(plus, eps);
    perturb(minus, -eps);
    const double num = (total_loss(run(p, plus, ls)) - total_loss(run(p, minus, ls))) / (2 * eps);
    CHECK(std::abs(num - analytic) <= 1e-6 * std::max(1.0, std::abs(analytic)));
    ++checked;
  };
  // A rank holding (ep, etp) of the MoE mesh: an EDP replica of that shard.
  auto owner = [&](int ep, int etp) {
    for (int r = 0; r < W; ++r)
      if (fold.moe_coord_of(r).ep == ep && fold.moe_coord_of(r).etp == etp) return r;
    return -1;
  };
  auto tp_owner = [&](int tp_rank) {
    for (int r = 0; r < W; ++r)
      if (groups(group_kind::tp).find(r).position == tp_rank) return r;
    return -1;
  };
  for (int i = 0; i < 3; ++i) {  // inputs of three ranks
    const int r = (i * 5) % W, j = (i * 7 + 2) % (p.tokens * H);
    CAPTURE(r);
    fd([&](params& v, double d) { v.x[r][j] += d; }, base[r].dx[j]);
  }
  for (int j = 0; j < p.tokens * H; ++j)  // every input of the last rank
    fd([&](params& v, double d) { v.x[W - 1][j] += d; }, base[W - 1].dx[j]);
  for (int i = 0; i < 4; ++i) {  // router weight (reduced: the same on every rank)
    const int j = (i * 5 + 1) % (p.experts * H);
    fd([&](params& v, double d) { v.router[j] += d; }, base[W - 1].router[j]);
  }
  for (int e = 0; e < p.experts; e += std::max(1, p.experts / 3)) {  // routed experts' weights
    const int h = e % H, c1 = (3 * e + 1) % (2 * F), c2 = (e + 2) % F;
    const auto [s1, o1] = fc1_slot(H, F, fold.etp(), h, c1);
    const auto [s2, o2] = fc2_slot(H, F, fold.etp(), c2, h);
    const auto l = static_cast<std::size_t>(e % L);
    const int fs = F / fold.etp();
    CAPTURE(e);
    fd([&](params& v, double d) { v.w1[static_cast<std::size_t>((e * H + h) * 2 * F + c1)] += d; },
       base[owner(e / L, s1)].w1[l * static_cast<std::size_t>(H * 2 * fs) + o1]);
    fd([&](params& v, double d) { v.w2[static_cast<std::size_t>((e * F + c2) * H + h)] += d; },
       base[owner(e / L, s2)].w2[l * static_cast<std::size_t>(fs * H) + o2]);
  }
  for (int i = 0; i < 3; ++i) {  // shared expert (TP shards) and its gate
    const int h = i % H, c1 = (5 * i + 3) % (2 * kShared), c2 = (2 * i + 1) % kShared;
    const auto [s1, o1] = fc1_slot(H, kShared, fold.tp(), h, c1);
    const auto [s2, o2] = fc2_slot(H, kShared, fold.tp(), c2, h);
    fd([&](params& v, double d) { v.s1[static_cast<std::size_t>(h * 2 * kShared + c1)] += d; },
       base[tp_owner(s1)].s1[o1]);
    fd([&](params& v, double d) { v.s2[static_cast<std::size_t>(c2 * H + h)] += d; },
       base[tp_owner(s2)].s2[o2]);
    fd([&](params& v, double d) { v.sg[static_cast<std::size_t>(h)] += d; }, base[0].sg[h]);
  }
  CHECK(checked >= 16);
}

}  // namespace

TEST_CASE("MoE layer gradients equal central finite differences of the whole pipeline (fp64)") {
  const fold_config folds[] = {
      {.world = 1},
      {.world = 4, .tp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 1},
      {.world = 8, .tp = 2, .ep = 2, .etp = 2},  // EDP = 2
      {.world = 6, .tp = 2, .ep = 3, .etp = 1},
  };
  for (const auto& f : folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f, .experts = 2 * fold.ep(), .topk = 2, .hidden = 3, .tokens = 4};
    p.ffn = 2 * fold.etp();
    gradcheck(p);
  }
}

TEST_CASE("MoE layer: two runs are bitwise identical (invariant 14)") {
  problem p{.fold = {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 1},
            .experts = 8,
            .ffn = 2,
            .tokens = 4};
  const params q = make_params(p, 8);
  for (double cap : {0.0, 0.75}) {
    const auto a = run(p, q, {.capacity = cap}), b = run(p, q, {.capacity = cap});
    for (std::size_t r = 0; r < a.size(); ++r)
      for (auto m : {&rank_grads::out, &rank_grads::dx, &rank_grads::router, &rank_grads::w1,
                     &rank_grads::w2, &rank_grads::s1, &rank_grads::s2, &rank_grads::sg}) {
        REQUIRE(a[r].*m == b[r].*m);  // same sizes and values; then the bits
        CHECK(std::memcmp((a[r].*m).data(), (b[r].*m).data(), (a[r].*m).size() * sizeof(double)) ==
              0);
      }
  }
}

TEST_CASE("MoE layer drop accounting (invariant 5): no-op capacity, fully dropped tokens") {
  const fold_config folds[] = {
      {.world = 4, .tp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 1},
  };
  int fully_dropped = 0;
  for (const auto& f : folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f, .experts = 2 * fold.ep(), .topk = 2, .hidden = 3, .tokens = 8};
    p.ffn = 2 * fold.etp();
    const params q = make_params(p, fold.world_size());
    // C >= N: nothing can overflow, so the result is the dropless one, bitwise.
    const double big = static_cast<double>(p.experts) / p.topk;
    const auto dropless_run = run(p, q, {}), capped = run(p, q, {.capacity = big});
    for (std::size_t r = 0; r < capped.size(); ++r) {
      CHECK(capped[r].report.dropped_pairs == 0);
      CHECK(capped[r].out == dropless_run[r].out);
      CHECK(capped[r].dx == dropless_run[r].dx);
      CHECK(capped[r].w1 == dropless_run[r].w1);
    }
    // A tight capacity: a token that lost all its experts outputs exactly 0 without a shared
    // expert, and the shared expert's output (computed here per token) with one.
    const data shared_w{p.hidden, kShared, 1, 1, q.s1, q.s2};
    for (bool shared : {false, true}) {
      const auto tight = run(p, q, {.shared = shared, .capacity = 0.25});
      for (std::size_t r = 0; r < tight.size(); ++r) {
        const auto& rep = tight[r].report;
        long long routed = 0, dropped = 0;
        for (std::size_t e = 0; e < rep.routed.size(); ++e) {
          routed += rep.routed[e];
          dropped += rep.dropped[e];
        }
        long long kept = 0;
        for (int e : tight[r].kept) kept += e >= 0;
        CHECK(routed == static_cast<long long>(p.tokens) * p.topk);
        CHECK(kept + dropped == routed);
        CHECK(dropped == rep.dropped_pairs);
        for (int t = 0; t < p.tokens; ++t) {
          bool any = false;
          for (int j = 0; j < p.topk; ++j) any = any || tight[r].kept[t * p.topk + j] >= 0;
          if (any) continue;
          fully_dropped += !shared;
          const auto first = tight[r].out.begin() + t * p.hidden;
          const std::vector<double> got(first, first + p.hidden);
          if (!shared) {
            CHECK(got == std::vector<double>(static_cast<std::size_t>(p.hidden), 0.0));
            continue;
          }
          token_data d = make_token(p, static_cast<int>(r), t);
          double z = 0;
          for (int h = 0; h < p.hidden; ++h) z += d.x[h] * q.sg[h];
          const double gate = 1 / (1 + std::exp(-z));
          d.expert = {0};
          d.prob = {1.0};
          std::vector<double> o, dx, dp;
          reference_grads unused;
          reference_token(shared_w, d, o, dx, dp, unused);
          for (auto& v : o) v *= gate;
          CHECK(rel_err(got, o) <= 1e-12);
        }
      }
    }
  }
  CHECK(fully_dropped >= 3);  // the case actually occurred
}
