// The whole MoE layer on the thread world, checked without any analytic reference:
//  - invariant 13: central finite differences in fp64 of the scalar
//      L = sum over ranks of <dout, out> + (micro-batch, per-sequence and global aux losses +
//      z-loss)
//    against the gradients the layer's backward and reduce_gradients produce, for the input, the
//    router weight, the routed experts' weights (ETP shards, EDP replicas), the shared expert's
//    weights (TP shards) and its gate, on folds with TP, CP, EP, ETP and EDP;
//    and the same check of the layer on cpu_exec (the GPU code path in CI: the kernels in fp64,
//    mlp_experts and the shared expert on the caller's parameters in device memory);
//  - invariant 14: two runs are bitwise identical;
//  - forwards in flight: F1 F2 B2 B1, a 1F1B schedule of 4 micro-batches and activation
//    recomputation equal the sequential F B F B ... bitwise, with each backward's gradients taken
//    (and zeroed) after it, so they are accumulated in the same order; per-loss seeds against
//    finite differences of the seed-weighted loss; the context's misuse refused;
//  - invariant 5 at the layer: a capacity no expert reaches gives the dropless result bitwise,
//    tokens that lost all their experts get exactly the shared-expert output (0 without one), and
//    routed = kept + dropped on every rank.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "../dispatch/dispatch_harness.hpp"
#include "../support/mlp_layout.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

constexpr int kShared = 4;  // shared-expert FFN size
constexpr int kBatch = 2;   // sequences per micro-batch

// Every parameter of the layer in its full (unsharded) form, and every rank's input. The MLP
// weights are in the tests' reference layout; they are converted to the library's when loaded
// (support/mlp_layout.hpp).
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

// The shared expert's TP shard, from q.s1 [H, 2Fs] [gate | up] and q.s2 [Fs, H].
template <class Shared>
status load_shared(Shared& se, const problem& p, const params& q) {
  return se.load_full(megatron_fc1_from_columns(q.s1, p.hidden, 2, kShared),
                      megatron_fc2_from_rows(q.s2, kShared, p.hidden));
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
  // Set: the caller's context form with these per-loss seeds, and L weighted by them.
  std::optional<moe_loss_seeds<double>> seeds{};
  bool cpu_exec = false;  // the layer on cpu_exec (no seeds) instead of host_exec
};

std::vector<rank_grads> run_cpu_exec(const problem& p, const params& q, const layer_setup& ls);
moe_layer_options options_for(const problem& p, const layer_setup& ls,
                              const dynamic_folded_mesh& fold, const megatron_groups& groups,
                              int r);

std::vector<rank_grads> run(const problem& p, const params& q, const layer_setup& ls) {
  if (ls.cpu_exec) return run_cpu_exec(p, q, ls);
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  std::vector<rank_grads> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec hx;
    // The layer holds the bundle by reference: it lives (unmoved) until the lambda returns.
    TRY_ASSIGN(comms, make_layer_communicators(world, groups));
    auto mlp = rank_experts<double>(p, fold, r, q.w1, q.w2).value();
    const moe_layer_options o = options_for(p, ls, fold, groups, r);
    auto& res = results[static_cast<std::size_t>(r)];
    auto body = [&](auto policy) -> status {
      using layer_t =
          moe_layer<double, host_exec, thread_communicator, decltype(policy),
                    all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
      auto layer = layer_t::make(hx, o, *comms, policy, std::move(mlp));
      if (!layer) return unexpected<error>(layer.error());
      std::copy(q.router.begin(), q.router.end(), layer->router_weight().flat().begin());
      if (auto* se = layer->shared()) {
        if (auto s = load_shared(*se, p, q); !s) return s;
        std::copy(q.sg.begin(), q.sg.end(), se->own().gate.flat().begin());
      }
      const auto& x = q.x[static_cast<std::size_t>(r)];
      const auto& dout = q.dout[static_cast<std::size_t>(r)];
      res.out.resize(x.size());
      res.dx.resize(x.size());
      if (ls.seeds) {  // L = sum of each loss times its seed
        const moe_loss_seeds<double>& sd = *ls.seeds;
        typename layer_t::context_type ctx;
        const auto sb = layer->saved_sizes();
        std::vector<std::byte> saved(sb.saved), host(sb.host);
        auto stats =
            layer->forward(hx, {.num_tokens = p.tokens, .x = x}, res.out, ctx, {saved, host});
        if (!stats) return unexpected<error>(stats.error());
        // The stats are views of the context's values: read before its backward.
        TRY_ASSIGN(v, read_forward_stats(hx, *stats));
        res.report = v->dropped;
        res.loss = sd.aux * v->aux_loss + sd.seq_aux * v->seq_aux_loss +
                   sd.global_aux * v->global_aux_loss + sd.z * v->z_loss;
        for (std::size_t i = 0; i < x.size(); ++i) res.loss += sd.output * dout[i] * res.out[i];
        if (auto s = layer->backward(hx, ctx, dout, sd, res.dx); !s) return s;
      } else {
        auto stats = layer->forward(hx, p.tokens, x, {}, res.out);
        if (!stats) return unexpected<error>(stats.error());
        TRY_ASSIGN(v, read_forward_stats(hx, *stats));
        res.report = v->dropped;
        res.kept.assign(layer->last_kept_experts().flat().begin(),
                        layer->last_kept_experts().flat().end());
        res.loss = v->aux_loss + v->seq_aux_loss + v->global_aux_loss + v->z_loss;
        for (std::size_t i = 0; i < x.size(); ++i) res.loss += dout[i] * res.out[i];
        if (auto s = layer->backward(hx, dout, 1.0, res.dx); !s) return s;
      }
      // Router over tp-dp-cp, experts over edp, the shared expert over dp-cp (its gate over
      // tp-dp-cp): the bundle's groups.
      if (auto s = layer->reduce_gradients(
              hx, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
          !s)
        return s;
      auto take = [](std::span<double> v) { return std::vector<double>(v.begin(), v.end()); };
      res.router = take(layer->router_weight_grad().flat());
      res.w1 = take(layer->experts().grads_fc1());
      res.w2 = take(layer->experts().grads_fc2());
      if (auto* se = layer->shared()) {
        res.s1 = take(se->params().grads.fc1.flat());
        res.s2 = take(se->params().grads.fc2.flat());
        res.sg = take(se->params().gate_grad.flat());
      }
      return {};
    };
    if (ls.capacity > 0) return body(sub_sequence{.capacity_factor = ls.capacity});
    return body(dropless{});
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

// The layer's options for a rank of the fold (run's, with the shared expert's TP position).
moe_layer_options options_for(const problem& p, const layer_setup& ls,
                              const dynamic_folded_mesh& fold, const megatron_groups& groups,
                              int r) {
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
  return o;
}

// run() on cpu_exec over the device-space thread world: the parameters in the library's layout
// (from the host reference MLP's loader) uploaded as the caller's, the layer bound to them,
// forward, backward, gradients reduced over the bundle's groups, everything read back.
std::vector<rank_grads> run_cpu_exec(const problem& p, const params& q, const layer_setup& ls) {
  using dev_comm = thread_device_communicator;
  using experts_t = mlp_experts<double, cpu_exec>;
  using layer_t = moe_layer<double, cpu_exec, dev_comm, drop_policy_variant,
                            all_to_all_dispatcher<double, dev_comm, cpu_exec, double>, experts_t>;
  REQUIRE_FALSE(ls.seeds.has_value());
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int H = p.hidden;
  std::vector<rank_grads> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& tw) -> status {
    auto world = std::move(tw).in_space<cpu_device_space>();
    const int r = world.rank();
    cpu_exec x(static_cast<std::uint64_t>(3 + r));
    TRY_ASSIGN(comms, make_layer_communicators(world, groups));
    const moe_layer_options o = options_for(p, ls, fold, groups, r);
    // Host copies in the library's layout, uploaded with zeroed gradients: [rows, width] each.
    auto routed = rank_experts<double>(p, fold, r, q.w1, q.w2).value();
    const int L = p.experts / fold.ep(), fs = p.ffn / fold.etp(), ss = kShared / fold.tp();
    std::vector<double> s1, s2;
    if (ls.shared) {
      TRY_ASSIGN(sh, (reference_mlp<double>::make({.hidden = H,
                                                   .ffn = kShared,
                                                   .num_local_experts = 1,
                                                   .etp = fold.tp(),
                                                   .etp_rank = o.shared_expert.tp_rank})));
      TRY(sh->load_full(0, megatron_fc1_from_columns(q.s1, H, 2, kShared),
                        megatron_fc2_from_rows(q.s2, kShared, H)));
      s1.assign(sh->weights_fc1().begin(), sh->weights_fc1().end());
      s2.assign(sh->weights_fc2().begin(), sh->weights_fc2().end());
    }
    const auto vec = [](std::span<const double> v) {
      return std::vector<double>(v.begin(), v.end());
    };
    const std::vector<double> w1 = vec(routed.weights_fc1()), w2 = vec(routed.weights_fc2());
    const std::vector<double> sg = ls.shared ? q.sg : std::vector<double>{};
    // fc1, fc2, router, shared fc1, shared fc2, gate; then their gradients.
    const std::vector<const std::vector<double>*> host = {&w1, &w2, &q.router, &s1, &s2, &sg};
    const int dims[6][2] = {{L * 2 * fs, H}, {L * H, fs}, {p.experts, H},
                            {2 * ss, H},     {H, ss},     {1, H}};
    std::vector<exec_buffer<double, cpu_exec>> b;
    for (int i = 0; i < 12; ++i) {
      const auto& v = *host[static_cast<std::size_t>(i % 6)];
      const int rows = v.empty() ? 0 : dims[i % 6][0], width = v.empty() ? 0 : dims[i % 6][1];
      TRY_ASSIGN(u, upload(x, i < 6 ? v : std::vector<double>(v.size(), 0.0), rows, width));
      b.push_back(std::move(*u));
    }
    TRY_ASSIGN(experts, experts_t::make({.hidden = H,
                                         .ffn = p.ffn,
                                         .num_local_experts = L,
                                         .etp = fold.etp(),
                                         .etp_rank = fold.moe_coord_of(r).etp,
                                         .act = activation::swiglu},
                                        {b[0].cview(), b[1].cview()}, {b[6].view(), b[7].view()}));
    drop_policy_variant policy = dropless{};
    if (ls.capacity > 0) policy = sub_sequence{.capacity_factor = ls.capacity};
    TRY_ASSIGN(layer, layer_t::make(x, o, *comms, policy, std::move(*experts)));
    moe_layer_param_views<double, cpu_device_space> pv{.router_weight = b[2].view(),
                                                       .router_grad = b[8].view()};
    if (ls.shared)
      pv.shared = {.mlp = {b[3].cview(), b[4].cview()},
                   .grads = {b[9].view(), b[10].view()},
                   .gate = b[5].cview(),
                   .gate_grad = b[11].view()};
    TRY(layer->bind_parameters(pv));
    const auto& xs = q.x[static_cast<std::size_t>(r)];
    const auto& dout = q.dout[static_cast<std::size_t>(r)];
    TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
    TRY_ASSIGN(d_dout, upload(x, dout, p.tokens, H));
    TRY_ASSIGN(d_out, (exec_buffer<double, cpu_exec>::make(x, p.tokens, H)));
    TRY_ASSIGN(d_dx, (exec_buffer<double, cpu_exec>::make(x, p.tokens, H)));
    TRY_ASSIGN(stats, layer->forward(x, d_x->cview(), {}, d_out->view()));
    // The stats are views of the context's device values: read before the backward.
    TRY_ASSIGN(v, read_forward_stats(x, *stats));
    TRY(layer->backward(x, d_dout->cview(), 1.0, d_dx->view()));
    TRY(layer->reduce_gradients(x));
    auto& res = results[static_cast<std::size_t>(r)];
    res.report = v->dropped;
    TRY_ASSIGN(out, (download<double>(x, d_out->cview())));
    TRY_ASSIGN(dx, (download<double>(x, d_dx->cview())));
    res.out = *out;
    res.dx = *dx;
    res.loss = v->aux_loss + v->seq_aux_loss + v->global_aux_loss + v->z_loss;
    for (std::size_t i = 0; i < xs.size(); ++i) res.loss += dout[i] * res.out[i];
    std::vector<double>* into[6] = {&res.w1, &res.w2, &res.router, &res.s1, &res.s2, &res.sg};
    for (int i = 0; i < 6; ++i) {
      if (b[static_cast<std::size_t>(6 + i)].cview().rows() == 0) continue;
      TRY_ASSIGN(v, (download<double>(x, b[static_cast<std::size_t>(6 + i)].cview())));
      *into[i] = std::move(*v);
    }
    return {};
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
// `parts`, sits: the shard index and the offset inside that shard's block in the library's layout
// ([2F/parts, H]; column half * fs + col % fs of the reference's [H, 2F/parts] shard).
std::pair<int, std::size_t> fc1_slot(int H, int F, int parts, int h, int c) {
  const int fs = F / parts, half = c / F, col = c % F;
  return {col / fs, fc1_offset(h, half * fs + col % fs, H)};
}
// The same for full fc2 entry (c, h): the offset inside the shard's [H, F/parts] block.
std::pair<int, std::size_t> fc2_slot(int H, int F, int parts, int c, int h) {
  const int fs = F / parts;
  (void)H;
  return {c / fs, fc2_offset(c % fs, h, fs)};
}

void gradcheck(const problem& p, const layer_setup& ls = {}, int every_input = -1) {
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int W = fold.world_size(), H = p.hidden, F = p.ffn, L = p.experts / fold.ep();
  const params q = make_params(p, W);
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
  const int all_inputs = every_input < 0 ? p.tokens * H : every_input;
  for (int j = 0; j < all_inputs; ++j)  // every input of the last rank
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
  CHECK(checked >= 16 - (p.tokens * H - all_inputs));
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

TEST_CASE("MoE layer on cpu_exec: gradients equal central finite differences (fp64)") {
  // The GPU code path in CI (the kernels on fibers over device memory, the device-space thread
  // world) in fp64: the router, losses and expert bias kernels, mlp_experts through simt_gemm,
  // the shared expert with its gate, on the caller's parameters; TP, EP and ETP, every loss.
  const fold_config f{.world = 4, .tp = 2, .ep = 2, .etp = 2};
  const auto fold = make_folded(f).value();
  problem p{.fold = f, .experts = 2 * fold.ep(), .topk = 2, .hidden = 3, .tokens = 4};
  p.ffn = 2 * fold.etp();
  gradcheck(p, {.cpu_exec = true}, 4);
}

TEST_CASE(
    "MoE layer per-loss seeds: gradients of the seed-weighted loss equal finite differences") {
  // Each loss weighted by its own seed, one dropped (0) and the main output scaled, on a fold with
  // TP, EP, ETP and EDP; then the same with the seeds permuted, so a seed applied to the wrong
  // loss shows.
  const fold_config f{.world = 8, .tp = 2, .ep = 2, .etp = 2};
  const auto fold = make_folded(f).value();
  problem p{.fold = f, .experts = 2 * fold.ep(), .topk = 2, .hidden = 3, .tokens = 4};
  p.ffn = 2 * fold.etp();
  gradcheck(p,
            {.seeds =
                 moe_loss_seeds<double>{
                     .output = 0.5, .aux = 3.0, .seq_aux = 0.0, .global_aux = 2.0, .z = 7.0}},
            4);
  gradcheck(p,
            {.seeds =
                 moe_loss_seeds<double>{
                     .output = 1.5, .aux = 0.0, .seq_aux = 5.0, .global_aux = 0.25, .z = 0.0}},
            4);
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

// ---- Forwards in flight ----------------------------------------------------------------------

namespace {

// One step of a schedule: forward, backward, or drop the activations, poison their storage and
// recompute into fresh storage, then backward.
struct op {
  char kind;  // 'F', 'B', 'R'
  int mb;     // micro-batch
};

struct micro_result {
  std::vector<double> out, dx, router, w1, w2, s1, s2, sg;
  double loss = 0;
  bool operator==(const micro_result&) const = default;
};

// Micro-batch m's input and output gradient on rank r: the rank's data, scaled and shifted by m
// (so each micro-batch routes differently).
std::vector<double> micro_input(const std::vector<double>& v, int m) {
  std::vector<double> out(v);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = out[i] * (1.0 + 0.25 * m) + 0.1 * m * unit(21, static_cast<std::uint64_t>(m), i);
  return out;
}

// Runs `schedule` on every rank with a context and storage per micro-batch; results per rank and
// micro-batch. The gradients are read and zeroed after each backward.
std::vector<std::vector<micro_result>> run_schedule(const problem& p, const params& q,
                                                    const std::vector<op>& schedule, int micro,
                                                    double capacity, bool pad = false) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  std::vector<std::vector<micro_result>> results(
      static_cast<std::size_t>(fold.world_size()),
      std::vector<micro_result>(static_cast<std::size_t>(micro)));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec hx;
    TRY_ASSIGN(comms, make_layer_communicators(world, groups));  // outlives the layer, unmoved
    const moe_layer_options o{
        .hidden = p.hidden,
        .max_tokens = p.tokens,
        .ep = fold.ep(),
        .etp = fold.etp(),
        .router = {.num_experts = p.experts, .topk = p.topk},
        .aux_loss_coeff = 0.05,
        .z_loss_coeff = 0.01,
        .seq_aux_loss_coeff = 0.04,
        .global_aux_loss_coeff = 0.03,
        .batch = kBatch,
        .shared_expert = {.ffn = kShared,
                          .gate = true,
                          .tp = fold.tp(),
                          .tp_rank = groups(group_kind::tp).find(r).position}};
    using layer_t =
        moe_layer<double, host_exec, thread_communicator, sub_sequence,
                  all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    auto layer = layer_t::make(hx, o, *comms,
                               sub_sequence{.capacity_factor = capacity, .pad_to_capacity = pad},
                               rank_experts<double>(p, fold, r, q.w1, q.w2).value());
    if (!layer) return unexpected<error>(layer.error());
    std::copy(q.router.begin(), q.router.end(), layer->router_weight().flat().begin());
    auto* se = layer->shared();
    if (auto s = load_shared(*se, p, q); !s) return s;
    std::copy(q.sg.begin(), q.sg.end(), se->own().gate.flat().begin());
    // Pad mode: each micro-batch's storage sized for the policy's capacity up front (the
    // dispatched rows grow with it). Nothing else is reserved: each context owns its scratch and
    // grows it at its own forward, so the contexts in flight share no buffer.
    std::optional<int> c;
    if (pad)
      c = expert_capacity(static_cast<long long>(p.tokens) * p.topk, p.experts, capacity).value();
    const auto sb = layer->saved_sizes(c);
    const auto M = static_cast<std::size_t>(micro);
    std::vector<typename layer_t::context_type> ctx(M);
    std::vector<std::vector<std::byte>> saved(M, std::vector<std::byte>(sb.saved)),
        host(M, std::vector<std::byte>(sb.host));
    std::vector<std::vector<double>> x(M), dout(M);
    for (std::size_t m = 0; m < M; ++m) {
      x[m] = micro_input(q.x[static_cast<std::size_t>(r)], static_cast<int>(m));
      dout[m] = micro_input(q.dout[static_cast<std::size_t>(r)], static_cast<int>(m) + 7);
    }
    auto& res = results[static_cast<std::size_t>(r)];
    auto take = [](std::span<double> v) {
      std::vector<double> c(v.begin(), v.end());
      std::fill(v.begin(), v.end(), 0.0);  // zeroed: the next backward starts from 0
      return c;
    };
    for (const op& step : schedule) {
      const auto m = static_cast<std::size_t>(step.mb);
      auto& mr = res[m];
      const moe_forward_input<double> in{.num_tokens = p.tokens, .x = x[m]};
      if (step.kind == 'F') {
        mr.out.resize(x[m].size());
        auto stats = layer->forward(hx, in, mr.out, ctx[m], {saved[m], host[m]});
        if (!stats) return unexpected<error>(stats.error());
        TRY_ASSIGN(v, read_forward_stats(hx, *stats));
        mr.loss = v->aux_loss + v->seq_aux_loss + v->global_aux_loss + v->z_loss;
        continue;
      }
      if (step.kind == 'R') {  // the trainer dropped the activations: recompute into new storage
        ctx[m].drop_activations();
        std::fill(saved[m].begin(), saved[m].end(), std::byte{0xff});
        std::fill(host[m].begin(), host[m].end(), std::byte{0xff});
        std::vector<std::byte> saved2(sb.saved), host2(sb.host);
        std::vector<double> out2(x[m].size());
        if (auto s = layer->recompute(hx, ctx[m], in, out2, {saved2, host2}); !s) return s;
        if (out2 != mr.out)
          return make_error(errc::invalid_argument, "test: recompute changed the output");
        saved[m].swap(saved2);  // the storage stays until the backward
        host[m].swap(host2);
      }
      mr.dx.resize(x[m].size());
      if (auto s = layer->backward(hx, ctx[m], dout[m], {}, mr.dx); !s) return s;
      mr.router = take(layer->router_weight_grad().flat());
      mr.w1 = take(layer->experts().grads_fc1());
      mr.w2 = take(layer->experts().grads_fc2());
      mr.s1 = take(se->params().grads.fc1.flat());
      mr.s2 = take(se->params().grads.fc2.flat());
      mr.sg = take(se->params().gate_grad.flat());
    }
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

std::vector<op> sequential(int micro) {
  std::vector<op> s;
  for (int m = 0; m < micro; ++m) s.insert(s.end(), {{'F', m}, {'B', m}});
  return s;
}

void check_same(const std::vector<std::vector<micro_result>>& a,
                const std::vector<std::vector<micro_result>>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::size_t m = 0; m < a[r].size(); ++m) {
      CAPTURE(r);
      CAPTURE(m);
      const auto& x = a[r][m];
      const auto& y = b[r][m];
      CHECK(!x.dx.empty());
      CHECK(x.loss == y.loss);
      for (auto f :
           {&micro_result::out, &micro_result::dx, &micro_result::router, &micro_result::w1,
            &micro_result::w2, &micro_result::s1, &micro_result::s2, &micro_result::sg}) {
        REQUIRE((x.*f).size() == (y.*f).size());
        CHECK(std::memcmp((x.*f).data(), (y.*f).data(), (x.*f).size() * sizeof(double)) == 0);
      }
    }
}

const problem in_flight_problem = [] {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 2, .etp = 2}, .experts = 4, .topk = 2};
  p.ffn = 4;
  p.tokens = 6;
  return p;
}();

}  // namespace

TEST_CASE("MoE layer forwards in flight: F1 F2 B2 B1 and 1F1B equal the sequential run bitwise") {
  // EP 2 x ETP 2 x EDP 2 over TP 2 (a folded mapping), a gated shared expert, every loss, tokens
  // dropped by capacity; the global aux loss's running counts make micro-batch order matter.
  const problem& p = in_flight_problem;
  const params q = make_params(p, 8);
  for (auto [cap, pad] : {std::pair{0.75, false}, {2.0, false}, {0.75, true}}) {
    CAPTURE(cap);
    CAPTURE(pad);
    const auto seq2 = run_schedule(p, q, sequential(2), 2, cap, pad);
    check_same(run_schedule(p, q, {{'F', 0}, {'F', 1}, {'B', 1}, {'B', 0}}, 2, cap, pad), seq2);
    // 1F1B for 4 micro-batches on the second of two pipeline stages: warm-up of one, steady
    // state F B F B, cool-down.
    const std::vector<op> one_f_one_b{{'F', 0}, {'F', 1}, {'B', 0}, {'F', 2},
                                      {'B', 1}, {'F', 3}, {'B', 2}, {'B', 3}};
    check_same(run_schedule(p, q, one_f_one_b, 4, cap, pad),
               run_schedule(p, q, sequential(4), 4, cap, pad));
    // The micro-batches differ (a schedule that mixed them up would show).
    const auto& r0 = seq2[0];
    CHECK(r0[0].out != r0[1].out);
    CHECK(r0[0].w1 != r0[1].w1);
  }
}

TEST_CASE("MoE layer recomputation: forward again from the input equals the stored backward") {
  // Micro-batch 0's activations are dropped (their storage poisoned) while micro-batch 1 is in
  // flight, then recomputed into new storage inside its backward.
  const problem& p = in_flight_problem;
  const params q = make_params(p, 8);
  const auto stored = run_schedule(p, q, {{'F', 0}, {'F', 1}, {'B', 1}, {'B', 0}}, 2, 0.75);
  check_same(run_schedule(p, q, {{'F', 0}, {'F', 1}, {'B', 1}, {'R', 0}}, 2, 0.75), stored);
  check_same(run_schedule(p, q, {{'F', 0}, {'F', 1}, {'R', 0}, {'R', 1}}, 2, 0.75), stored);
}

TEST_CASE("MoE layer forward contexts: misuse is refused with the rule broken, on every rank") {
  problem p{.fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2};
  p.ffn = 2;
  p.tokens = 4;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const params q = make_params(p, 2);
  std::vector<std::string> errors[2];
  const auto st = run_thread_world(2, [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec hx;
    TRY_ASSIGN(comms, make_layer_communicators(world, groups));  // outlives the layer, unmoved
    using layer_t =
        moe_layer<double, host_exec, thread_communicator, sub_sequence,
                  all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    auto layer = layer_t::make(hx,
                               {.hidden = p.hidden,
                                .max_tokens = p.tokens,
                                .ep = 2,
                                .router = {.num_experts = p.experts, .topk = p.topk}},
                               *comms, sub_sequence{.capacity_factor = 2.0},
                               rank_experts<double>(p, fold, r, q.w1, q.w2).value());
    if (!layer) return unexpected<error>(layer.error());
    std::copy(q.router.begin(), q.router.end(), layer->router_weight().flat().begin());
    const auto sb = layer->saved_sizes();
    std::vector<std::byte> s1(sb.saved), h1(sb.host), s2(sb.saved), h2(sb.host);
    const auto& x = q.x[static_cast<std::size_t>(r)];
    std::vector<double> out(x.size()), dx(x.size());
    const moe_forward_input<double> in{.num_tokens = p.tokens, .x = x};
    auto& errs = errors[r];
    auto note = [&](const auto& s) { errs.push_back(s ? "ok" : s.error().message); };
    typename layer_t::context_type a, b;
    note(layer->backward(hx, a, x, {}, dx));  // nothing forwarded
    std::vector<std::byte> small(sb.saved / 2);
    note(layer->forward(hx, in, out, a, {small, h1}));
    // Two forwards given the same storage: the first one's backward is refused.
    if (auto f = layer->forward(hx, in, out, a, {s1, h1}); !f) return unexpected<error>(f.error());
    if (auto f = layer->forward(hx, in, out, b, {s1, h1}); !f) return unexpected<error>(f.error());
    note(layer->backward(hx, a, x, {}, dx));
    note(layer->backward(hx, b, x, {}, dx));
    note(layer->backward(hx, b, x, {}, dx));  // consumed
    if (auto f = layer->forward(hx, in, out, a, {s2, h2}); !f) return unexpected<error>(f.error());
    a.drop_activations();
    note(layer->backward(hx, a, x, {}, dx));  // dropped, not recomputed
    note(layer->recompute(hx, a,
                          {.num_tokens = p.tokens - 1, .x = std::span(x).first(x.size() - 3)},
                          std::span(out).first(out.size() - 3), {s2, h2}));
    note(layer->recompute(hx, a, in, out, {s2, h2}));
    note(layer->backward(hx, a, x, {.aux = std::nan("")}, dx));
    note(layer->backward(hx, a, x, {}, dx));
    note(layer->recompute(hx, a, in, out, {s2, h2}));  // consumed: nothing to recompute
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  CHECK(errors[0] == errors[1]);  // the same outcome on every rank, in the same words
  const std::vector<std::string> want = {"no forward filled",          "saved_sizes() asks for",
                                         "reused by a later dispatch", "ok",
                                         "whose backward already ran", "activations were dropped",
                                         "recompute with N = 3",       "ok",
                                         "loss seeds must be finite",  "ok",
                                         "recompute needs a context"};
  REQUIRE(errors[0].size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CAPTURE(errors[0][i]);
    CHECK(errors[0][i].find(want[i]) != std::string::npos);
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
