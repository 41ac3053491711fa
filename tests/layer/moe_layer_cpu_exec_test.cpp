// The MoE layer on the CPU executor (the GPU code path in CI: kernels on fibers over poisoned
// memory, the device-space thread world): the router, the losses as device values, the drop
// policies, a dispatcher on cpu_exec, mlp_experts (simt_gemm) and the combine, over EP 4 x ETP 2
// and other folds, both dispatchers: every rank's output, input gradient, reduced router and
// expert gradients and losses against the same layer on host_exec (reference_mlp experts
// holding the same weights: the same routing and drop decisions, values within the two runs'
// fp32 error) and against the single-rank fp64 reference of layer_harness.hpp. Also: the losses
// with state and the expert bias over a global batch, the shared expert, forwards in flight on
// two contexts, the stream order of one GPU stream, a user router and user experts. Under
// ThreadSanitizer (MOEFOLD_TSAN_REDUCED) on 4-rank worlds with fewer runs.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/experts/reference_mlp.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "../support/stream_order_exec.hpp"
#include "device_layer_rank.hpp"
#include "fixed_router.hpp"
#include "layer_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using dev_comm = thread_device_communicator;
using space = cpu_device_space;

// Every rank of a thread world of W ranks in the device memory space, each on a cpu_exec of seed
// `seed` + its rank: rank(world, exec) -> expected<Out>; a rank's error fails the test with its
// message.
template <class Out, class Rank>
std::vector<Out> on_cpu_world(int W, std::uint64_t seed, const Rank& rank) {
  std::vector<Out> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    cpu_exec x(seed + static_cast<std::uint64_t>(dw.rank()));
    auto r = rank(dw, x);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// The same on stream_order_exec, one stream_order_fake per rank (a rank is one process with one
// stream): each rank's result and what the fake found once the rank's last pinned sources were
// compared (stream_order_exec::check).
template <class Out>
struct stream_order_run {
  Out out{};
  std::vector<std::string> violations;
};
template <class Out, class Rank>
std::vector<stream_order_run<Out>> on_stream_order_world(int W, std::uint64_t seed,
                                                         const Rank& rank) {
  std::vector<stream_order_run<Out>> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    auto& mine = res[static_cast<std::size_t>(dw.rank())];
    stream_order_fake fake;
    {
      stream_order_exec x(fake, seed + static_cast<std::uint64_t>(dw.rank()));
      auto r = rank(dw, x);
      if (!r) return unexpected<error>(r.error());
      x.check();
      mine.out = std::move(*r);
    }
    mine.violations = fake.violations();
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

template <class T, template <class, class, class, class> class Disp>
using layer_on_cpu = device_layer_t<T, Disp, cpu_exec, dev_comm>;

// Every rank's run_device_rank on cpu_exec.
template <class T, template <class, class, class, class> class Disp>
std::vector<layer_result> run_device(const problem& p,
                                     const std::optional<drop_policy_variant>& drop = {},
                                     bool keys = false) {
  return on_cpu_world<layer_result>(p.fold.world, 7, [&](dev_comm& world, cpu_exec& x) {
    return run_device_rank<T, Disp>(p, world, x, drop, keys);
  });
}

#if !defined(MOEFOLD_TSAN_REDUCED)
const fold_config layer_folds[] = {
    {.world = 8, .tp = 2, .ep = 4, .etp = 2},  // EP 4 x ETP 2
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 4, .pp = 2, .ep = 2, .etp = 2},
};
constexpr bool tsan_reduced = false;
#else
// Under ThreadSanitizer (layer-moe-layer-cpu-exec-tsan) worlds of 4 ranks: its runtime's cost per
// release and acquire grows with the thread identities alive (every rank has 2 x 256 fibers);
// the forwards-in-flight case took 202 s on 8 ranks, 30 s on 4 with half its runs (2026-12-04).
// Still EP and ETP sharded together, CP, and PP.
const fold_config layer_folds[] = {
    {.world = 4, .tp = 2, .ep = 2, .etp = 2},  // EP 2 x ETP 2
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},
    {.world = 4, .tp = 2, .pp = 2, .ep = 2, .etp = 1},
};
// And fewer runs where a test repeats a variant over folds: every policy, dispatcher and feature
// still runs once (each test says which runs it keeps).
constexpr bool tsan_reduced = true;
#endif

// EP = ETP = 1 (TP 2 over EDP 2): the All-to-All dispatcher's direct path, whose dropless
// forward waits for nothing (the batch is the N k rows, the experts take their row ranges from
// the context).
const fold_config unsharded_fold{.world = 2, .tp = 2, .ep = 1, .etp = 1};

template <template <class, class, class, class> class Disp>
void check_fp32(const std::string& name, std::span<const fold_config> folds, int hidden = 12) {
  CAPTURE(name);
  CAPTURE(hidden);
  for (const auto& f : folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = 2 * fold.ep();
    p.topk = 2;
    p.hidden = hidden;
    p.ffn = 2 * fold.etp();
    p.tokens = 5;
    const auto dev = run_device<float, Disp>(p);
    // Against the fp64 reference (normwise 1e-5, the float layer's bound there) ...
    layer_check judge;
    CHECK(check_layer_results<float>(p, dev, drop_mode::none, &judge) == 0);
    CHECK(judge.worst > 0);  // fp32 is not exact: the comparison is not vacuous
    // ... and against the host layer: the same routing, within both layers' error.
    check_same_layer(dev, run_host<float, Disp>(p), 2e-5);
  }
}

// The losses with state and the expert bias, over a global batch: two training micro-batches, an
// evaluation forward, the end of the global batch, one more training forward. Everything a rank
// can observe, from each layer: the host layer is the reference (tested against fp64 in
// moe_layer_features_test), the same routing, losses and gradients within both layers' fp32
// error, the counts, bias and running counts exactly (whole numbers, the same arithmetic).
constexpr int feature_micro_batches = 2;
struct feature_out {
  std::vector<int> indices[feature_micro_batches + 1];  // + the forward after the update
  std::vector<double> out[feature_micro_batches], dx[feature_micro_batches];
  double aux[feature_micro_batches] = {}, seq[feature_micro_batches] = {},
         global[feature_micro_batches] = {}, z[feature_micro_batches] = {};
  double global_after_reset = 0;
  std::vector<double> dw_router, dw1, dw2, eval_out;
  std::vector<double> shared_dw1, shared_dw2, gate_dw;  // with the shared expert (reduced)
  std::vector<float> counts_after_train, counts_after_eval, bias_after_update, counts_after_update;
  std::vector<double> running_after_train;
  int steps_after_train = 0, steps_after_eval = 0, steps_after_update = 0;
};

// The shared expert of the features run: SwiGLU, F_s = 6, the sigmoid gate, sharded over TP.
constexpr int shared_ffn = 6;
moe_layer_options feature_options(const problem& p, const dynamic_folded_mesh& fold, int r,
                                  bool shared) {
  auto o = options_of(p, fold);
  if (shared)
    o.shared_expert = {.ffn = shared_ffn,
                       .gate = true,
                       .tp = fold.tp(),
                       .tp_rank = megatron_groups(fold)(group_kind::tp).find(r).position};
  o.router.score = score_function::sigmoid;
  o.router.expert_bias = true;
  o.seq_aux_loss_coeff = 0.02;
  o.global_aux_loss_coeff = 0.03;
  o.batch = 2;
  o.expert_bias_update_rate = 0.05f;
  return o;
}
// Full shared-expert weights (fc1 [2 F_s, H], fc2 [H, F_s]) and the gate [H].
struct shared_weights {
  std::vector<float> fc1, fc2, gate;
};
shared_weights make_shared_weights(const problem& p) {
  problem ps = p;
  ps.experts = 1;
  ps.ffn = shared_ffn;
  const data ws = make_weights(ps);
  shared_weights w{cast<float>(megatron_fc1_from_columns(ws.w1, p.hidden, 2, shared_ffn)),
                   cast<float>(megatron_fc2_from_rows(ws.w2, shared_ffn, p.hidden)),
                   {}};
  for (int h = 0; h < p.hidden; ++h) w.gate.push_back(static_cast<float>(unit(10, h, 0)));
  return w;
}
std::vector<float> feature_bias(int E) {  // large enough to change selections
  std::vector<float> b;
  for (int e = 0; e < E; ++e) b.push_back(e % 2 ? 0.4f : -0.1f * static_cast<float>(e));
  return b;
}
// Micro-batch m's tokens of rank r, distinct from the other micro-batches'.
void feature_inputs(const problem& p, int m, int r, std::vector<float>& x,
                    std::vector<float>& dout) {
  x.clear();
  dout.clear();
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r + 97 * m, t);
    for (double v : d.x) x.push_back(static_cast<float>(v));
    for (double v : d.dout) dout.push_back(static_cast<float>(v));
  }
}

// The host layer (moe_layer on host_exec, reference_mlp experts; the policies through one layer
// type, run_host's).
std::vector<feature_out> run_host_features(const problem& p, const drop_policy_variant& policy,
                                           bool shared = false) {
  using D = all_to_all_dispatcher<float, thread_communicator, host_exec, float>;
  using layer_t = moe_layer<float, host_exec, thread_communicator, drop_policy_variant, D,
                            reference_mlp<float>>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const auto wr = router_weight(p);
  std::vector<feature_out> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    host_exec hx;
    TRY_ASSIGN(comms, make_layer_communicators(world, groups));
    TRY_ASSIGN(mlp, (rank_experts<float, float>(p, fold, r, w.w1, w.w2)));
    TRY_ASSIGN(layer, layer_t::make(hx, feature_options(p, fold, r, shared), *comms, policy,
                                    std::move(*mlp)));
    std::transform(wr.begin(), wr.end(), layer->router_weight().flat().begin(),
                   [](double v) { return static_cast<float>(v); });
    TRY(layer->load_state(
        hx, {.expert_bias = feature_bias(p.experts),
             .expert_bias_counts = std::vector<float>(static_cast<std::size_t>(p.experts), 0.0f)}));
    if (auto* se = layer->shared()) {
      const shared_weights sw = make_shared_weights(p);
      TRY(se->load_full(sw.fc1, sw.fc2));
      std::copy(sw.gate.begin(), sw.gate.end(), se->own().gate.flat().begin());
    }
    auto& res = results[static_cast<std::size_t>(r)];
    std::vector<float> x, dout, out, dx;
    for (int m = 0; m < feature_micro_batches; ++m) {
      feature_inputs(p, m, r, x, dout);
      out.assign(x.size(), 0.0f);
      dx.assign(x.size(), 0.0f);
      TRY_ASSIGN(stats, layer->forward(hx, p.tokens, x, {}, out));
      TRY_ASSIGN(v, read_forward_stats(hx, *stats));
      res.aux[m] = v->aux_loss;
      res.seq[m] = v->seq_aux_loss;
      res.global[m] = v->global_aux_loss;
      res.z[m] = v->z_loss;
      res.indices[m] = layer->last_routing().indices;
      TRY(layer->backward(hx, dout, 1.0f, dx));
      res.out[m] = widen_all(out);
      res.dx[m] = widen_all(dx);
    }
    TRY(layer->reduce_gradients(hx, {layer->experts().grads_fc1(), layer->experts().grads_fc2()}));
    if (auto* se = layer->shared()) {
      res.shared_dw1 = widen(se->params().grads.fc1.flat());
      res.shared_dw2 = widen(se->params().grads.fc2.flat());
      res.gate_dw = widen(se->params().gate_grad.flat());
    }
    res.dw_router = widen(layer->router_weight_grad().flat());
    res.dw1 = widen(layer->experts().grads_fc1());
    res.dw2 = widen(layer->experts().grads_fc2());
    TRY_ASSIGN(trained, layer->save_state(hx));
    res.counts_after_train = trained->expert_bias_counts;
    res.running_after_train = trained->global_aux_counts;
    res.steps_after_train = trained->global_aux_steps;
    layer->set_training(false);
    feature_inputs(p, 0, r, x, dout);
    out.assign(x.size(), 0.0f);
    TRY(layer->forward(hx, p.tokens, x, {}, out));
    res.eval_out = widen_all(out);
    TRY_ASSIGN(evaluated, layer->save_state(hx));
    res.steps_after_eval = evaluated->global_aux_steps;
    res.counts_after_eval = evaluated->expert_bias_counts;
    layer->set_training(true);
    TRY(layer->end_global_batch(hx));
    TRY_ASSIGN(updated, layer->save_state(hx));
    res.bias_after_update = updated->expert_bias;
    res.counts_after_update = updated->expert_bias_counts;
    res.steps_after_update = updated->global_aux_steps;
    feature_inputs(p, 1, r, x, dout);
    TRY_ASSIGN(again, layer->forward(hx, p.tokens, x, {}, out));
    TRY_ASSIGN(again_values, read_forward_stats(hx, *again));
    res.global_after_reset = again_values->global_aux_loss;
    res.indices[feature_micro_batches] = layer->last_routing().indices;
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

drop_policy_variant drop_policy_of(const std::optional<sub_sequence>& drop) {
  return drop ? drop_policy_variant(*drop) : drop_policy_variant{};
}

// The shared expert's TP shard (the host expert's loader cuts it) and its gate on the context,
// with zeroed gradients: `sp` holds fc1, fc2, the gate and their gradients; the result views them.
template <class Exec>
expected<shared_expert_views<float, space>> upload_shared(
    const problem& p, const dynamic_folded_mesh& fold, int tp_rank, Exec& x,
    std::vector<exec_buffer<float, Exec>>& sp) {
  const int H = p.hidden, fs = shared_ffn / fold.tp();
  const shared_weights sw = make_shared_weights(p);
  TRY_ASSIGN(ref, (reference_mlp<float, float>::make({.hidden = H,
                                                      .ffn = shared_ffn,
                                                      .num_local_experts = 1,
                                                      .etp = fold.tp(),
                                                      .etp_rank = tp_rank})));
  TRY(ref->load_full(0, sw.fc1, sw.fc2));
  const std::vector<float> fc1(ref->weights_fc1().begin(), ref->weights_fc1().end()),
      fc2(ref->weights_fc2().begin(), ref->weights_fc2().end());
  sp.clear();
  for (auto [v, rows, width] :
       {std::tuple{fc1, 2 * fs, H}, std::tuple{fc2, H, fs}, std::tuple{sw.gate, 1, H},
        std::tuple{std::vector<float>(fc1.size(), 0.0f), 2 * fs, H},
        std::tuple{std::vector<float>(fc2.size(), 0.0f), H, fs},
        std::tuple{std::vector<float>(sw.gate.size(), 0.0f), 1, H}}) {
    TRY_ASSIGN(b, upload(x, v, rows, width));
    sp.push_back(std::move(*b));
  }
  return shared_expert_views<float, space>{.mlp = {sp[0].cview(), sp[1].cview()},
                                           .grads = {sp[3].view(), sp[4].view()},
                                           .gate = sp[2].cview(),
                                           .gate_grad = sp[5].view()};
}

// One rank's layer on a context (cpu_exec; stream_order_exec) with the features' options, on the
// caller's parameters (the router weight, and the shared expert's when `shared`, bound as views
// of buffers on the context). The layer refers to `comms`.
template <class Exec = cpu_exec>
struct device_feature_rank {
  simt_rank_params<float, Exec> par;
  std::vector<exec_buffer<float, Exec>> sp;  // the shared expert's (with one)
  std::optional<device_layer_t<float, all_to_all_dispatcher, Exec, dev_comm>> layer;
};
template <class Exec>
status make_feature_rank(const problem& p, moe_layer_communicators<dev_comm>& comms, int r, Exec& x,
                         const drop_policy_variant& policy, bool shared,
                         device_feature_rank<Exec>& out) {
  using layer_t = device_layer_t<float, all_to_all_dispatcher, Exec, dev_comm>;
  const auto fold = make_folded(p.fold).value();
  TRY_ASSIGN(par, (upload_rank_params<float>(p, fold, r, x)));
  out.par = std::move(*par);
  TRY_ASSIGN(mlp, (rank_mlp(p, fold, r, x, out.par)));
  const moe_layer_options o = feature_options(p, fold, r, shared);
  shared_expert_views<float, space> sh{};
  if (shared) {
    TRY_ASSIGN(v, upload_shared(p, fold, o.shared_expert.tp_rank, x, out.sp));
    sh = *v;
  }
  TRY_ASSIGN(layer, layer_t::make(x, o, comms, policy, std::move(*mlp)));
  TRY(layer->bind_parameters(
      {.router_weight = out.par.w.view(), .router_grad = out.par.dw.view(), .shared = sh}));
  TRY(layer->expert_bias()->load(x, feature_bias(p.experts), std::vector<float>(p.experts, 0.f)));
  out.layer.emplace(std::move(*layer));
  return {};
}

// The same sequence as run_host_features on cpu_exec.
expected<feature_out> run_device_features_rank(const problem& p, dev_comm& world, cpu_exec& x,
                                               std::optional<sub_sequence> drop, bool shared) {
  using G = float;
  const int r = world.rank(), H = p.hidden;
  const auto fold = make_folded(p.fold).value();
  TRY_ASSIGN(comms, make_layer_communicators(world, megatron_groups(fold)));
  device_feature_rank<> in;
  TRY(make_feature_rank(p, *comms, r, x, drop_policy_of(drop), shared, in));
  auto& layer = *in.layer;
  auto &d_g1 = in.par.g1, &d_g2 = in.par.g2, &d_dw = in.par.dw;
  const auto& sp = in.sp;
  feature_out res;
  std::vector<float> xs, douts;
  TRY_ASSIGN(d_out, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
  for (int m = 0; m < feature_micro_batches; ++m) {
    feature_inputs(p, m, r, xs, douts);
    TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
    TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
    TRY_ASSIGN(stats, layer.forward(x, d_x->cview(), {}, d_out->view()));
    TRY_ASSIGN(v, read_forward_stats(x, *stats));
    res.aux[m] = v->aux_loss;
    res.seq[m] = v->seq_aux_loss;
    res.global[m] = v->global_aux_loss;
    res.z[m] = v->z_loss;
    TRY_ASSIGN(idx, (download<int>(x, layer.last_context().indices())));
    res.indices[m] = *idx;
    TRY(layer.backward(x, d_dout->cview(), 1.0f, d_dx->view()));
    TRY_ASSIGN(out, (download<float>(x, d_out->cview())));
    TRY_ASSIGN(dx, (download<float>(x, d_dx->cview())));
    res.out[m] = widen_all(*out);
    res.dx[m] = widen_all(*dx);
  }
  TRY(layer.reduce_gradients(x, {d_g1.view(), d_g2.view()}));
  if (shared) {
    TRY_ASSIGN(s1, (download<G>(x, sp[3].cview())));
    TRY_ASSIGN(s2, (download<G>(x, sp[4].cview())));
    TRY_ASSIGN(sg, (download<G>(x, sp[5].cview())));
    res.shared_dw1 = widen_all(*s1);
    res.shared_dw2 = widen_all(*s2);
    res.gate_dw = widen_all(*sg);
  }
  TRY_ASSIGN(dw, (download<G>(x, d_dw.cview())));
  TRY_ASSIGN(g1, (download<G>(x, d_g1.cview())));
  TRY_ASSIGN(g2, (download<G>(x, d_g2.cview())));
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  TRY_ASSIGN(trained, layer.save_state(x));
  res.counts_after_train = trained->expert_bias_counts;
  res.running_after_train = trained->global_aux_counts;
  res.steps_after_train = trained->global_aux_steps;
  layer.set_training(false);
  feature_inputs(p, 0, r, xs, douts);
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(ev, layer.forward(x, d_x->cview(), {}, d_out->view()));
  // Evaluation computes no loss: the values are zero.
  TRY_ASSIGN(ev_losses, (download<float>(x, ev->losses)));
  if (*ev_losses != std::vector<float>(moe_loss_count, 0.0f))
    return make_error(errc::invalid_argument, "an evaluation forward gave loss values");
  TRY_ASSIGN(eval_out, (download<float>(x, d_out->cview())));
  res.eval_out = widen_all(*eval_out);
  TRY_ASSIGN(evaluated, layer.save_state(x));
  res.steps_after_eval = evaluated->global_aux_steps;
  res.counts_after_eval = evaluated->expert_bias_counts;
  layer.set_training(true);
  TRY(layer.end_global_batch(x));
  TRY_ASSIGN(updated, layer.save_state(x));
  res.bias_after_update = updated->expert_bias;
  res.counts_after_update = updated->expert_bias_counts;
  res.steps_after_update = updated->global_aux_steps;
  feature_inputs(p, 1, r, xs, douts);
  TRY_ASSIGN(d_x1, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(again, layer.forward(x, d_x1->cview(), {}, d_out->view()));
  TRY_ASSIGN(again_values, read_forward_stats(x, *again));
  res.global_after_reset = again_values->global_aux_loss;
  TRY_ASSIGN(idx_after, (download<int>(x, layer.last_context().indices())));
  res.indices[feature_micro_batches] = *idx_after;
  return res;
}

std::vector<feature_out> run_device_features(const problem& p, std::optional<sub_sequence> drop,
                                             bool shared = false) {
  return on_cpu_world<feature_out>(p.fold.world, 11, [&](dev_comm& world, cpu_exec& x) {
    return run_device_features_rank(p, world, x, drop, shared);
  });
}

// Forwards in flight: two micro-batches through one rank's layer with every loss and the expert
// bias, either one at a time on one execution context (forward, backward, forward, backward: the
// one-in-flight form) or both forwards first, each into its own forward context and storage and
// on its own execution context (two streams on a GPU), then the backwards in reverse order, each
// on its forward's execution context, the first one's forward context moved before its backward.
// What each forward reports and each backward computes.
struct flight_out {
  std::vector<double> out[2], dx[2], losses[2];  // losses: aux, per sequence, global, z
  std::vector<int> kept[2];
  std::vector<double> dw_router, dw1, dw2;
  std::vector<float> counts;
  std::vector<double> running;
  std::vector<std::vector<double>> shared_grads;  // fc1, fc2, gate (with the shared expert)
  bool contexts_ok = true;  // ready() where it should be, a consumed context refused
};
expected<flight_out> run_flight_rank(const problem& p, dev_comm& world, cpu_exec& x,
                                     std::optional<sub_sequence> drop, bool shared,
                                     bool in_flight) {
  using layer_t = layer_on_cpu<float, all_to_all_dispatcher>;
  const int r = world.rank(), H = p.hidden;
  const auto fold = make_folded(p.fold).value();
  TRY_ASSIGN(comms, make_layer_communicators(world, megatron_groups(fold)));
  device_feature_rank<> in;
  TRY(make_feature_rank(p, *comms, r, x, drop_policy_of(drop), shared, in));
  layer_t& layer = *in.layer;
  // The second execution context of this rank (another seed: another block order).
  cpu_exec x2(1000 + static_cast<std::uint64_t>(r));
  cpu_exec* ex[2] = {&x, in_flight ? &x2 : &x};
  std::vector<exec_buffer<float, cpu_exec>> xs, douts, outs, dxs;
  for (int m = 0; m < 2; ++m) {
    std::vector<float> hx, hd;
    feature_inputs(p, m, r, hx, hd);
    TRY_ASSIGN(a, upload(x, hx, p.tokens, H));
    TRY_ASSIGN(b, upload(x, hd, p.tokens, H));
    TRY_ASSIGN(c, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
    TRY_ASSIGN(d, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
    xs.push_back(std::move(*a));
    douts.push_back(std::move(*b));
    outs.push_back(std::move(*c));
    dxs.push_back(std::move(*d));
  }
  flight_out res;
  // The stats' views are the forward context's: read before its next forward.
  const auto read = [&](int m, const layer_t::stats_type& st,
                        row_view<const int, space> kept) -> status {
    TRY_ASSIGN(v, read_forward_stats(*ex[m], st));
    res.losses[m] = {v->aux_loss, v->seq_aux_loss, v->global_aux_loss, v->z_loss};
    TRY_ASSIGN(k, (download<int>(*ex[m], kept)));
    res.kept[m] = *k;
    return {};
  };
  if (in_flight) {
    // Each forward's storage (saved_sizes: in pad mode for the capacity it will report).
    std::vector<forward_storage<cpu_exec>> storage;
    for (int m = 0; m < 2; ++m) {
      TRY_ASSIGN(st, make_forward_storage(
                         layer, *ex[m], p,
                         drop ? std::optional<drop_policy_variant>(*drop) : std::nullopt, 1));
      storage.push_back(std::move(*st));
    }
    layer_t::context_type c[2];
    for (int m = 0; m < 2; ++m) {
      TRY_ASSIGN(st,
                 layer.forward(*ex[m], xs[m].cview(), {}, outs[m].view(), c[m], storage[m].view()));
      TRY(read(m, *st, c[m].kept_experts()));
    }
    res.contexts_ok = c[0].ready() && c[1].ready() && c[1].num_tokens() == p.tokens;
    TRY(layer.backward(*ex[1], c[1], douts[1].cview(), {}, dxs[1].view()));
    layer_t::context_type later = std::move(c[0]);
    res.contexts_ok = res.contexts_ok && !c[1].ready() && !c[0].ready() && later.ready();
    TRY(layer.backward(*ex[0], later, douts[0].cview(), {}, dxs[0].view()));
    // Consumed contexts and the moved-from one are refused, naming the rule.
    for (auto* ctx : {&c[0], &c[1], &later}) {
      const status again = layer.backward(x, *ctx, douts[0].cview(), {}, dxs[0].view());
      res.contexts_ok = res.contexts_ok && !again &&
                        again.error().message.find("no forward filled") != std::string::npos;
    }
  } else {
    for (int m = 0; m < 2; ++m) {
      TRY_ASSIGN(st, layer.forward(x, xs[m].cview(), {}, outs[m].view()));
      TRY(read(m, *st, layer.last_kept_experts()));
      TRY(layer.backward(x, douts[m].cview(), 1.0f, dxs[m].view()));
    }
  }
  for (int m = 0; m < 2; ++m) {
    TRY_ASSIGN(o, (download<float>(x, outs[m].cview())));
    TRY_ASSIGN(d, (download<float>(x, dxs[m].cview())));
    res.out[m] = widen_all(*o);
    res.dx[m] = widen_all(*d);
  }
  TRY_ASSIGN(dw, (download<float>(x, in.par.dw.cview())));
  TRY_ASSIGN(g1, (download<float>(x, in.par.g1.cview())));
  TRY_ASSIGN(g2, (download<float>(x, in.par.g2.cview())));
  TRY_ASSIGN(state, layer.save_state(x));
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  res.counts = state->expert_bias_counts;
  res.running = state->global_aux_counts;
  for (std::size_t i = 3; i < in.sp.size(); ++i) {  // the shared expert's local gradients
    TRY_ASSIGN(gs, (download<float>(x, in.sp[i].cview())));
    res.shared_grads.push_back(widen_all(*gs));
  }
  return res;
}
std::vector<flight_out> run_flight(const problem& p, std::optional<sub_sequence> drop, bool shared,
                                   bool in_flight) {
  return on_cpu_world<flight_out>(p.fold.world, 5, [&](dev_comm& world, cpu_exec& x) {
    return run_flight_rank(p, world, x, drop, shared, in_flight);
  });
}
}  // namespace

TEST_CASE("the layer on cpu_exec, dropless: the host context and the fp64 reference, All-to-All") {
  check_fp32<all_to_all_dispatcher>("all_to_all", layer_folds);
}

TEST_CASE("the layer on cpu_exec, dropless: the host context and the fp64 reference, AllGather") {
  // EP 4 x ETP 2 and CP 2 x EP 4 (EP 2 x ETP 2 only under TSan): the dispatchers are compared fold
  // by fold in dispatch-device-dispatcher, and each fold of the thread world on cpu_exec costs
  // seconds under the sanitizers.
  check_fp32<all_gather_dispatcher>("all_gather",
                                    std::span(layer_folds).first(tsan_reduced ? 1 : 2));
}

TEST_CASE("the layer on cpu_exec with rows of H = 7 (28 bytes): padded row strides, the same") {
  // The layer's row buffers pad each row to 32 bytes here; the experts, router and dispatcher
  // read and write them through the stride (run_device_rank checks the stride and the saved
  // input).
  check_fp32<all_to_all_dispatcher>("all_to_all", std::span(layer_folds).first(1), 7);
}

TEST_CASE("the layer on cpu_exec in bf16 (fp32 router and probabilities): the fp64 reference") {
  // bf16 tokens, experts and router weight; the router's logits, probabilities and losses in
  // fp32 (the default router type) and the probabilities dispatched in fp32.
  const fold_config f = layer_folds[0];
  problem p{.fold = f};
  p.experts = 8;
  p.topk = 2;
  p.ffn = 4;
  p.tokens = 6;
  p.bf16_values = true;
  for (const int hidden : {16, 12}) {  // rows of 32 bytes, and of 24 (padded to 32)
    CAPTURE(hidden);
    p.hidden = hidden;
    const auto dev = run_device<bfloat16, all_to_all_dispatcher>(p);
    layer_check judge;
    CHECK(check_layer_results<bfloat16>(p, dev, drop_mode::none, &judge) == 0);
    MESSAGE("bf16 layer on cpu_exec, worst normwise error against fp64: ", judge.worst);
    CHECK(judge.worst > 0);
  }
}

TEST_CASE("the layer on cpu_exec refuses bad options and misuse, naming the rule") {
  using layer_t = layer_on_cpu<float, all_to_all_dispatcher>;
  using mlp_t = simt_rank_experts<float, cpu_exec>;
  const int H = 4, E = 2, F = 2;
  const moe_layer_options ok{.hidden = H, .max_tokens = 3, .router = {.num_experts = E, .topk = 2}};
  // One rank: its communicators, the experts' and the router's parameters on the context.
  const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    auto d = std::move(world).in_space<space>();
    cpu_exec xx(2);
    const auto fold = make_folded({.world = 1}).value();
    TRY_ASSIGN(comms, make_layer_communicators(d, megatron_groups(fold)));
    auto fc1 = exec_buffer<float, cpu_exec>::make(xx, E * 2 * F, H).value();
    auto fc2 = exec_buffer<float, cpu_exec>::make(xx, E * H, F).value();
    auto g1 = exec_buffer<float, cpu_exec>::make(xx, E * 2 * F, H).value();
    auto g2 = exec_buffer<float, cpu_exec>::make(xx, E * H, F).value();
    auto w = exec_buffer<float, cpu_exec>::make(xx, E, H).value();
    auto dw = exec_buffer<float, cpu_exec>::make(xx, E, H).value();
    const auto experts = [&] {
      return mlp_t::make({.hidden = H, .ffn = F, .num_local_experts = E},
                         {fc1.cview(), fc2.cview()}, {g1.view(), g2.view()})
          .value();
    };
    const auto make = [&](const moe_layer_options& o, drop_policy_variant drop = {}) {
      auto l = layer_t::make(xx, o, *comms, drop, experts());
      if (l) (void)l->bind_parameters({.router_weight = w.view(), .router_grad = dw.view()});
      return l;
    };
    const auto refused = [&](moe_layer_options o, const std::string& words,
                             drop_policy_variant drop = {}) {
      auto l = make(o, drop);
      REQUIRE_FALSE(l.has_value());
      CHECK_MESSAGE(l.error().message.find(words) != std::string::npos, l.error().message);
    };
    {
      auto o = ok;
      o.global_aux_loss_coeff = std::numeric_limits<double>::infinity();
      refused(o, "finite and >= 0");
    }
    {
      auto o = ok;
      o.batch = 0;
      refused(o, "batch (sequences per micro-batch) must be >= 1");
    }
    {
      auto o = ok;
      o.router.expert_bias = true;
      o.router.score = score_function::sigmoid;
      o.expert_bias_update_rate = std::numeric_limits<float>::quiet_NaN();
      refused(o, "expert_bias_update_rate must be finite and >= 0");
    }
    {  // the shared expert's rules
      auto o = ok;
      o.shared_expert.ffn = -1;
      refused(o, "shared_expert.ffn must be >= 0");
      o.shared_expert.ffn = 4;
      o.shared_expert.tp_rank = 1;  // the TP communicator says rank 0
      refused(o, "shared_expert.tp_rank = 1, the TP communicator 0");
      o.shared_expert = {.ffn = 2, .tp = 2};  // the options say TP 2, the communicator 1 rank
      refused(o, "the options say shared_expert.tp = 2, the communicators 1");
      // The caller's shared-expert parameters: a gate without a gate, a gate of the wrong shape,
      // and any shared parameter to a layer without a shared expert.
      o.shared_expert = {.ffn = 2, .gate = true};
      TRY_ASSIGN(lg, make(o));
      auto s1 = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
      auto s2 = exec_buffer<float, cpu_exec>::make(xx, H, 2).value();
      auto sg1 = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
      auto sg2 = exec_buffer<float, cpu_exec>::make(xx, H, 2).value();
      const status bad_gate =
          lg->bind_parameters({.router_weight = w.view(),
                               .router_grad = dw.view(),
                               .shared = {.mlp = {s1.cview(), s2.cview()},
                                          .grads = {sg1.view(), sg2.view()},
                                          .gate = w.cview(),  // [2, H], not [1, H]
                                          .gate_grad = dw.view()}});
      REQUIRE_FALSE(bad_gate.has_value());
      CHECK_MESSAGE(bad_gate.error().message.find("[1, H]") != std::string::npos,
                    bad_gate.error().message);
      TRY_ASSIGN(plain, make(ok));
      const status gate_only = plain->bind_parameters(
          {.router_weight = w.view(),
           .router_grad = dw.view(),
           .shared = {.gate = w.cview().first(1), .gate_grad = dw.view().first(1)}});
      REQUIRE_FALSE(gate_only.has_value());
      CHECK(gate_only.error().message.find("without a shared expert") != std::string::npos);
    }
    // The drop policies' rules, checked when the layer is made.
    refused(ok, "capacity_factor must be finite and > 0", sub_sequence{.capacity_factor = 0.0});
    refused(ok, "drop.by must be", sub_sequence{.by = static_cast<drop_by>(7)});
    refused(ok, "drop.by must be", full_sequence{.by = static_cast<drop_by>(7)});
    refused(ok, "capacity_factor must be finite and > 0", full_sequence{.capacity_factor = -1.0});
    {
      auto o = ok;
      o.aux_loss_coeff = -1;
      refused(o, "finite and >= 0");
    }
    {
      auto o = ok;
      o.hidden = 8;
      refused(o, "the experts hold");
    }
    {
      auto o = ok;
      o.router.topk = 3;  // k > E: the router's own rule
      CHECK_FALSE(make(o).has_value());
    }
    // Misuse of a made layer: a backward with no forward, shapes that do not fit.
    TRY_ASSIGN(l, make(ok));
    auto in = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
    auto out = exec_buffer<float, cpu_exec>::make(xx, 4, H).value();
    layer_t::context_type never;
    auto b = l->backward(xx, never, in.cview().first(2), {}, out.view().first(2));
    REQUIRE_FALSE(b.has_value());
    CHECK(b.error().message.find("no forward filled") != std::string::npos);
    auto f = l->forward(xx, in.cview(), {}, out.view());  // 4 tokens > max_tokens 3
    REQUIRE_FALSE(f.has_value());
    CHECK(f.error().message.find("N <= max_tokens") != std::string::npos);
    auto f2 = l->forward(xx, in.cview().first(2), {}, out.view().first(3));
    REQUIRE_FALSE(f2.has_value());
    CHECK(f2.error().code == errc::shape_mismatch);
    // The per-sequence loss needs whole sequences.
    auto seq_opts = ok;
    seq_opts.seq_aux_loss_coeff = 0.1;
    seq_opts.batch = 2;
    TRY_ASSIGN(ls, make(seq_opts));
    auto f3 = ls->forward(xx, in.cview().first(3), {}, out.view().first(3));
    REQUIRE_FALSE(f3.has_value());
    CHECK(f3.error().message.find("N a multiple of batch (N = 3, batch = 2") != std::string::npos);
    ls->set_training(false);                // evaluation computes no loss: any N
    TRY(xx.fill<float>(in.view(), 0.25f));  // finite tokens and router weight: valid routing
    TRY(xx.fill<float>(w.view(), 0.1f));
    auto f3e = ls->forward(xx, in.cview().first(3), {}, out.view().first(3));
    CHECK_MESSAGE(f3e.has_value(), (f3e ? std::string() : f3e.error().message));
    // A refused forward changes no state: the global loss's running counts stay empty.
    auto global_opts = ok;
    global_opts.global_aux_loss_coeff = 0.1;
    TRY_ASSIGN(lg, make(global_opts));
    auto f4 = lg->forward(xx, in.cview().first(2), {}, out.view().first(3));
    REQUIRE_FALSE(f4.has_value());
    TRY_ASSIGN(untouched, lg->save_state(xx));
    CHECK(untouched->global_aux_steps == 0);
    // Pad mode with a capacity above the tokens: C = ceil(2 * 2 / 2 * 1.5) = 3 > N = 2.
    TRY_ASSIGN(lp, make(ok, sub_sequence{.capacity_factor = 1.5, .pad_to_capacity = true}));
    auto f5 = lp->forward(xx, in.cview().first(2), {}, out.view().first(2));
    REQUIRE_FALSE(f5.has_value());
    CHECK(f5.error().message.find("pad_to_capacity: capacity 3 exceeds the 2 tokens") !=
          std::string::npos);
    // Tokens the router cannot route (NaN: no expert id in [0, E)) are an error, not pairs
    // silently dropped: the dispatcher names the pair at the forward (cpu_exec checks indices
    // before a launch), and the drop decision's sticky fault word names it to device_status.
    TRY_ASSIGN(lnan, make(ok, sub_sequence{.capacity_factor = 1.0}));
    TRY(xx.fill<float>(in.view(), std::numeric_limits<float>::quiet_NaN()));
    auto fnan = lnan->forward(xx, in.cview().first(2), {}, out.view().first(2));
    REQUIRE_FALSE(fnan.has_value());
    CHECK_MESSAGE(fnan.error().message.find("outside [0, 2)") != std::string::npos,
                  fnan.error().message);
    const status nan_status = lnan->device_status(xx);
    REQUIRE_FALSE(nan_status.has_value());
    CHECK_MESSAGE(nan_status.error().message.find("outside [0, E)") != std::string::npos,
                  nan_status.error().message);
    TRY(lnan->device_status(xx));  // read once, then cleared
    TRY(xx.fill<float>(in.view(), 0.25f));
    // Full-sequence dropping's order keys: [N, 1], contiguous.
    auto keys = exec_buffer<std::int64_t, cpu_exec>::make(xx, 3, 1).value();
    // A group of one by position at capacity 1 (E = k = 2: every token on both experts; C =
    // ceil(2 x 2 / 2 x 0.5) = 1): each expert keeps the earliest token of the true order.
    TRY_ASSIGN(lf, make(ok, full_sequence{.capacity_factor = 0.5, .by = drop_by::position}));
    auto fs2 = lf->forward(xx, in.cview().first(2), keys.cview(), out.view().first(2));
    REQUIRE_FALSE(fs2.has_value());
    CHECK(fs2.error().message.find("must be contiguous [N, 1] = [2, 1]") != std::string::npos);
    const auto kept_with = [&](std::vector<std::int64_t> k) -> expected<std::vector<int>> {
      TRY_ASSIGN(kb, upload(xx, k, 2, 1));
      TRY_ASSIGN(st, lf->forward(xx, in.cview().first(2), kb->cview(), out.view().first(2)));
      return download<int>(xx, lf->last_kept_experts());
    };
    TRY_ASSIGN(plain, (lf->forward(xx, in.cview().first(2), {}, out.view().first(2))));
    TRY_ASSIGN(kept_plain, download<int>(xx, lf->last_kept_experts()));
    CHECK(*kept_plain == std::vector<int>{0, 1, -1, -1});  // rank order: token 0 first
    TRY(lf->device_status(xx));
    TRY_ASSIGN(kept_reversed, kept_with({1, 0}));
    CHECK(*kept_reversed == std::vector<int>{-1, -1, 0, 1});  // token 1 first
    TRY(lf->device_status(xx));
    // Keys that are not a permutation of [0, 2): the group's rank order, and the fault named by
    // device_status once (then cleared).
    const std::pair<std::vector<std::int64_t>, std::string> bad[] = {
        {{5, 0}, "the group's token 0 has a key outside [0, M)"},
        {{1, 1}, "no token or more than one token has key 0"}};
    for (const auto& [k, words] : bad) {
      TRY_ASSIGN(kept_bad, kept_with(k));
      CHECK(*kept_bad == *kept_plain);
      const status ds = lf->device_status(xx);
      REQUIRE_FALSE(ds.has_value());
      CHECK_MESSAGE(ds.error().message.find(words) != std::string::npos, ds.error().message);
      CHECK(ds.error().message.find("permutation of [0, M)") != std::string::npos);
      TRY(lf->device_status(xx));
    }
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
}

TEST_CASE(
    "the layer on cpu_exec: per-sequence and global losses and the expert bias over a global "
    "batch") {
  // Dropless over two folds; sub-sequence dropping in pad mode (the bias counts the kept and
  // filler rows, Megatron-Core's post-drop map) over EP 4 x ETP 2.
  // With the gated shared expert too (sequence parallel over TP 2 on EP 4 x ETP 2, TP 1 on
  // CP 2 x EP 4): its output, input gradient and reduced gradients against moe_layer's.
  const sub_sequence pad{.capacity_factor = 1.0, .pad_to_capacity = true};
  const std::tuple<fold_config, std::optional<sub_sequence>, bool> runs[] = {
      {layer_folds[0], std::nullopt, false},
      {layer_folds[1], std::nullopt, false},
      {layer_folds[0], pad, false},
      {layer_folds[0], std::nullopt, true},
      {layer_folds[1], pad, true}};
  for (std::size_t i = 0; i < std::size(runs); ++i) {
    if (tsan_reduced && i != 0 && i != 4) continue;  // dropless; pad mode with the shared expert
    const auto& [f, drop, shared] = runs[i];
    const auto fold = make_folded(f).value();
    CAPTURE(fold.ep());
    CAPTURE(fold.etp());
    CAPTURE(drop.has_value());
    CAPTURE(shared);
    problem p{.fold = f};
    p.experts = 2 * fold.ep();
    p.topk = 2;
    p.hidden = 12;
    p.ffn = 2 * fold.etp();
    p.tokens = 6;  // three sequences of batch 2
    const auto dev = run_device_features(p, drop, shared);
    const auto host =
        drop ? run_host_features(p, *drop, shared) : run_host_features(p, dropless{}, shared);
    const double tol = 2e-5;
    bool bias_moved = false, bias_steered = false;
    for (std::size_t r = 0; r < dev.size(); ++r) {
      CAPTURE(r);
      const feature_out &a = dev[r], &b = host[r];
      for (int m = 0; m <= feature_micro_batches; ++m) CHECK(a.indices[m] == b.indices[m]);
      for (int m = 0; m < feature_micro_batches; ++m) {
        CAPTURE(m);
        CHECK(rel_err(a.out[m], b.out[m]) <= tol);
        CHECK(rel_err(a.dx[m], b.dx[m]) <= tol);
        CHECK(a.aux[m] == doctest::Approx(b.aux[m]).epsilon(tol));
        CHECK(a.seq[m] == doctest::Approx(b.seq[m]).epsilon(tol));
        CHECK(a.global[m] == doctest::Approx(b.global[m]).epsilon(tol));
        CHECK(a.z[m] == doctest::Approx(b.z[m]).epsilon(tol));
        CHECK(b.seq[m] > 0);
        CHECK(b.global[m] > 0);
      }
      // The global loss of micro-batch 1 uses the running average of two micro-batches: it
      // differs from what micro-batch 1 alone gives (after the restart, the same tokens).
      CHECK(a.global_after_reset == doctest::Approx(b.global_after_reset).epsilon(tol));
      CHECK(b.global_after_reset != doctest::Approx(b.global[1]).epsilon(1e-6));
      CHECK(rel_err(a.dw_router, b.dw_router) <= tol);
      CHECK(rel_err(a.dw1, b.dw1) <= tol);
      CHECK(rel_err(a.dw2, b.dw2) <= tol);
      CHECK(rel_err(a.eval_out, b.eval_out) <= tol);
      CHECK(a.shared_dw1.size() == (shared ? b.shared_dw1.size() : 0));
      CHECK(b.gate_dw.size() == (shared ? static_cast<std::size_t>(p.hidden) : 0));
      if (shared) {
        CHECK(rel_err(a.shared_dw1, b.shared_dw1) <= tol);
        CHECK(rel_err(a.shared_dw2, b.shared_dw2) <= tol);
        CHECK(rel_err(a.gate_dw, b.gate_dw) <= tol);
      }
      CHECK(a.counts_after_train == b.counts_after_train);
      CHECK(a.counts_after_eval == b.counts_after_train);  // evaluation counts nothing
      CHECK(a.running_after_train == b.running_after_train);
      CHECK(a.steps_after_train == feature_micro_batches);
      CHECK(a.steps_after_eval == feature_micro_batches);
      CHECK(a.steps_after_update == b.steps_after_update);
      CHECK(a.steps_after_update == 0);
      CHECK(a.bias_after_update == b.bias_after_update);
      CHECK(a.counts_after_update == std::vector<float>(static_cast<std::size_t>(p.experts), 0.0f));
      bias_moved = bias_moved || a.bias_after_update != feature_bias(p.experts);
      // Counts are this rank's rows over both micro-batches: 2 N k routed pairs dropless, 2 C E
      // in pad mode (C = ceil(N k / E) at capacity factor 1).
      double rows = 0;
      for (float c : a.counts_after_train) rows += c;
      const int C = (p.tokens * p.topk + p.experts - 1) / p.experts;
      CHECK(rows == (drop ? 2.0 * C * p.experts : 2.0 * p.tokens * p.topk));
      for (int m = 0; m < feature_micro_batches; ++m)
        for (int id : a.indices[m]) bias_steered = bias_steered || id % 2 == 1;
    }
    // Pad mode gives every expert C rows from every rank: equal counts, so the bias stays.
    CHECK(bias_moved == !drop.has_value());
    CHECK(bias_steered);
  }
}

TEST_CASE("the layer on cpu_exec with EP = ETP = 1: dropless without a host wait, the same") {
  // Both dispatchers dropless, and the All-to-All one with sub-sequence dropping (which reads its
  // counts back once; none in pad mode), against the host layer and the fp64 reference;
  // run_device_rank checks the waits (none dropless, for either dispatcher) and that the batch
  // is N k rows with its row ranges on the context.
  const auto fold = make_folded(unsharded_fold).value();
  problem p{.fold = unsharded_fold};
  p.experts = 6;
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 2;
  p.tokens = 7;
  check_same_layer(run_device<float, all_to_all_dispatcher>(p),
                   run_host<float, all_to_all_dispatcher>(p), 2e-5);
  check_same_layer(run_device<float, all_gather_dispatcher>(p),
                   run_host<float, all_gather_dispatcher>(p), 2e-5);
  layer_check judge;
  CHECK(check_layer_results<float>(p, run_device<float, all_to_all_dispatcher>(p), drop_mode::none,
                                   &judge) == 0);
  CHECK(judge.worst > 0);
  const sub_sequence drops[] = {{.capacity_factor = 1.0},
                                {.capacity_factor = 1.0, .pad_to_capacity = true}};
  long long dropped = 0;
  for (const auto& d : drops) {
    CAPTURE(d.pad_to_capacity);
    const auto dev = run_device<float, all_to_all_dispatcher>(p, d);
    dropped += check_layer_results<float>(p, dev, drop_mode::per_rank);
    check_same_layer(dev, run_host<float, all_to_all_dispatcher>(p, d), 2e-5);
  }
  CHECK(dropped > 0);
  CHECK(fold.ep() * fold.etp() == 1);
}

TEST_CASE(
    "the layer on cpu_exec with sub-sequence dropping: the host context and the fp64 "
    "reference") {
  // By probability, by position, and pad mode (every expert exactly C rows): capacity factor 1
  // with 8 experts drops pairs on most ranks.
  const sub_sequence policies[] = {{.capacity_factor = 1.0, .by = drop_by::probs},
                                   {.capacity_factor = 1.0, .by = drop_by::position},
                                   {.capacity_factor = 1.0, .pad_to_capacity = true}};
  long long dropped = 0;
  for (const auto& f : std::span(layer_folds).first(tsan_reduced ? 1 : 2)) {
    const auto fold = make_folded(f).value();
    for (const auto& policy : policies) {
      CAPTURE(fold.ep());
      CAPTURE(static_cast<int>(policy.by));
      CAPTURE(policy.pad_to_capacity);
      problem p{.fold = f};
      p.experts = 8;
      p.topk = 2;
      p.hidden = 12;
      p.ffn = 2 * fold.etp();
      p.tokens = 6;
      const auto dev = run_device<float, all_to_all_dispatcher>(p, policy);
      layer_check judge;
      dropped += check_layer_results<float>(p, dev, drop_mode::per_rank, &judge);
      check_same_layer(dev, run_host<float, all_to_all_dispatcher>(p, policy), 2e-5);
      if (policy.pad_to_capacity)  // every expert exactly C rows from this rank
        for (const auto& r : dev)
          for (int rows : r.rows_per_expert) CHECK(rows == r.capacity);
    }
  }
  MESSAGE("pairs dropped over all runs and ranks: ", dropped);
  CHECK(dropped > 0);  // pairs were dropped: the drop path was exercised
}

TEST_CASE(
    "the layer on cpu_exec with full-sequence dropping: the host context and the fp64 "
    "reference") {
  // The decision over the tp-cp group (2, 2 and 4 ranks on the three folds): by probability, by
  // position, pad mode (by either), in the group's rank order and in true sequence order (the
  // ranks' sequence_order_keys: CP 2's load-balanced chunks put rank 1's tokens in the middle).
  const full_sequence policies[] = {
      {.capacity_factor = 1.0, .by = drop_by::probs},
      {.capacity_factor = 1.0, .by = drop_by::position},
      {.capacity_factor = 1.0, .pad_to_capacity = true},
      {.capacity_factor = 1.0, .pad_to_capacity = true, .by = drop_by::position}};
  long long dropped = 0;
  int keys_mattered = 0;
  // Reduced: CP 2 x EP 4 only, where the true order differs from the group's rank order.
  for (const auto& f : std::span(layer_folds).subspan(tsan_reduced ? 1 : 0, tsan_reduced ? 1 : 3)) {
    const auto fold = make_folded(f).value();
    const megatron_groups groups(fold);
    const auto tpcp = groups(group_kind::tp_cp);
    for (const auto& policy : policies) {
      std::vector<int> kept_in_rank_order;
      for (const bool keys : {false, true}) {
        CAPTURE(fold.ep());
        CAPTURE(fold.tp());
        CAPTURE(fold.cp());
        CAPTURE(static_cast<int>(policy.by));
        CAPTURE(policy.pad_to_capacity);
        CAPTURE(keys);
        problem p{.fold = f};
        p.experts = 8;
        p.topk = 2;
        p.hidden = 12;
        p.ffn = 2 * fold.etp();
        p.tokens = 6;
        const int G = tpcp[0].size();
        const auto dev = run_device<float, all_to_all_dispatcher>(p, policy, keys);
        layer_check judge;
        dropped += check_layer_results<float>(p, dev, drop_mode::per_sequence, &judge);
        check_same_layer(dev, run_host<float, all_to_all_dispatcher>(p, policy, keys), 2e-5);
        // The group's decision: each expert gets min(routed, C) kept rows from the group, and
        // in pad mode exactly C rows (kept and fillers).
        for (int gi = 0; gi < tpcp.count(); ++gi) {
          const auto group = tpcp[gi];
          std::vector<int> routed(static_cast<std::size_t>(p.experts)),
              rows(static_cast<std::size_t>(p.experts)), kept(static_cast<std::size_t>(p.experts));
          int C = -1;
          for (int q : group) {
            const auto& r = dev[static_cast<std::size_t>(q)];
            REQUIRE(r.rows_per_expert.size() == routed.size());
            CHECK((C < 0 || C == r.capacity));
            C = r.capacity;
            for (int id : r.indices) ++routed[static_cast<std::size_t>(id)];
            for (int id : r.kept)
              if (id >= 0) ++kept[static_cast<std::size_t>(id)];
            for (std::size_t e = 0; e < rows.size(); ++e) rows[e] += r.rows_per_expert[e];
          }
          CHECK(C == (G * p.tokens * p.topk + p.experts - 1) / p.experts);  // factor 1
          for (std::size_t e = 0; e < rows.size(); ++e) {
            CAPTURE(e);
            CHECK(kept[e] == std::min(routed[e], C));
            CHECK(rows[e] == (policy.pad_to_capacity ? C : kept[e]));
          }
        }
        std::vector<int> all_kept;
        for (const auto& r : dev) all_kept.insert(all_kept.end(), r.kept.begin(), r.kept.end());
        if (!keys)
          kept_in_rank_order = all_kept;
        else
          keys_mattered += all_kept != kept_in_rank_order ? 1 : 0;
      }
    }
  }
  MESSAGE("pairs dropped over all runs and ranks: ", dropped,
          "; runs where the true order changed the decision: ", keys_mattered);
  CHECK(dropped > 0);        // pairs were dropped: the drop path was exercised
  CHECK(keys_mattered > 0);  // the keys were used, not ignored
}

TEST_CASE(
    "the layer on cpu_exec: fc1's output saved or recomputed, the same bits (dropless, pad "
    "mode)") {
  // The experts save their pre-activation for the backward by default and recompute fc1 with
  // recompute_fc1: the same GEMMs on the same inputs, so every output and gradient is the same
  // bits; both against the fp64 reference too. run_device_rank checks on the way the saved bytes
  // per received row each way and that the forward grew none of the layer's storage (pad mode's
  // largest capacity was sized at make).
  const fold_config& f = layer_folds[0];
  const auto fold = make_folded(f).value();
  problem p{.fold = f};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 4 * fold.etp();
  p.tokens = 6;
  const std::optional<drop_policy_variant> policies[] = {
      std::nullopt, sub_sequence{.capacity_factor = 2.0, .pad_to_capacity = true}};
  for (const auto& drop : policies) {
    CAPTURE(drop.has_value());
    std::vector<layer_result> runs[2];
    for (const bool recompute : {false, true})
      runs[recompute ? 1 : 0] =
          on_cpu_world<layer_result>(p.fold.world, 7, [&](dev_comm& world, cpu_exec& x) {
            return run_device_rank<float, all_to_all_dispatcher>(p, world, x, drop, false,
                                                                 {.recompute_fc1 = recompute});
          });
    (void)check_layer_results<float>(p, runs[0], drop ? drop_mode::per_rank : drop_mode::none);
    for (std::size_t r = 0; r < runs[0].size(); ++r) {
      CAPTURE(r);
      const layer_result &saved = runs[0][r], &again = runs[1][r];
      CHECK(saved.out == again.out);
      CHECK(saved.dx == again.dx);
      CHECK(saved.dw_router == again.dw_router);
      CHECK(saved.dw1 == again.dw1);
      CHECK(saved.dw2 == again.dw2);
    }
  }
}

TEST_CASE("stream order: the whole layer on the GPU code path, dropless and in pad mode") {
  // stream_order_exec runs the kernels as cpu_exec does but takes cuda_exec's path (no
  // host-addressable memory: results only through copies, bad indices into a device word) and
  // checks every read against the stream order of one GPU stream. The layer's results equal
  // cpu_exec's bit for bit and no operation reads what the stream has not yet written. EP 4 x
  // ETP 2 dropless and in pad mode; EP = ETP = 1 dropless (no wait at all).
  const sub_sequence pad{.capacity_factor = 1.0, .pad_to_capacity = true};
  const std::pair<fold_config, std::optional<sub_sequence>> runs[] = {
      {layer_folds[0], std::nullopt}, {layer_folds[0], pad}, {unsharded_fold, std::nullopt}};
  for (const auto& [f, drop] : runs) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = 8;
    p.topk = 2;
    p.hidden = 12;
    p.ffn = 2 * fold.etp();
    p.tokens = 6;
    CAPTURE(fold.ep());
    CAPTURE(drop.has_value());
    const auto ref = run_device<float, all_to_all_dispatcher>(p, drop);
    const auto got = on_stream_order_world<layer_result>(
        f.world, 7, [&](dev_comm& dw, stream_order_exec& x) -> expected<layer_result> {
          TRY_ASSIGN(
              res, (run_device_rank<float, all_to_all_dispatcher>(
                       p, dw, x, drop ? std::optional<drop_policy_variant>(*drop) : std::nullopt)));
          TRY(x.device_status());
          return std::move(*res);
        });
    for (int r = 0; r < f.world; ++r) {
      CAPTURE(r);
      const auto i = static_cast<std::size_t>(r);
      for (const std::string& v : got[i].violations) FAIL_CHECK(v);
      const layer_result &a = ref[i], &b = got[i].out;
      CHECK(a.indices == b.indices);
      CHECK(a.kept == b.kept);
      CHECK(a.out == b.out);
      CHECK(a.dx == b.dx);
      CHECK(a.dw_router == b.dw_router);
      CHECK(a.dw1 == b.dw1);
      CHECK(a.dw2 == b.dw2);
      CHECK(a.aux == b.aux);
      CHECK(a.z == b.z);
    }
  }
}

// What a CUDA graph needs of the steps after the first, counted by stream_order_exec on the GPU
// code path (one rank is one process with one stream): the copies to the host and synchronize()
// (waits), the host-to-device copies from pageable memory (capture refuses them) and the
// allocations through the context (a captured step must find every buffer made). `same_out`: every
// step's output is step 1's, bit for bit (the input and the router weight do not change; a buffer
// reused but left stale would show).
struct capture_counts {
  long long to_host = 0, synchronizations = 0, allocations = 0;
  std::vector<std::string> pageable;  // the copies from pageable memory, named by shape
  bool same_out = true;
};

// One rank: the features' layer (sigmoid scores, the expert bias and its counts, the micro-batch,
// per-sequence, global and z losses, B = 2, the gated shared expert over TP) on `x`, three steps
// of forward, backward and gradient reduction; counted from step 2 on.
expected<capture_counts> capture_steps_rank(const problem& p, dev_comm& world, stream_order_exec& x,
                                            const drop_policy_variant& policy) {
  const int r = world.rank(), H = p.hidden;
  const auto fold = make_folded(p.fold).value();
  TRY_ASSIGN(comms, make_layer_communicators(world, megatron_groups(fold)));
  device_feature_rank<stream_order_exec> in;
  TRY(make_feature_rank(p, *comms, r, x, policy, /*shared=*/true, in));
  auto& layer = *in.layer;
  std::vector<float> xs, douts;
  feature_inputs(p, 0, r, xs, douts);
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
  TRY_ASSIGN(d_out, (exec_buffer<float, stream_order_exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<float, stream_order_exec>::make(x, p.tokens, H)));
  capture_counts res;
  std::vector<float> first_out;
  for (int step = 0; step < 3; ++step) {
    x.reset_copies();
    TRY(layer.forward(x, d_x->cview(), {}, d_out->view()));
    TRY(layer.backward(x, d_dout->cview(), 1.0f, d_dx->view()));
    TRY(layer.reduce_gradients(x, {in.par.g1.view(), in.par.g2.view()}));
    if (step > 0) {  // the layer's counts, before the test's own read below
      res.to_host += x.copies().to_host;
      res.synchronizations += x.synchronizations();
      res.allocations += x.allocations();
      for (const std::string& c : x.pageable_copies_to_device()) res.pageable.push_back(c);
    }
    TRY_ASSIGN(out, (download<float>(x, d_out->cview())));
    if (step == 0)
      first_out = *out;
    else
      res.same_out = res.same_out && *out == first_out;
  }
  TRY(layer.device_status(x));
  return res;
}

TEST_CASE(
    "capture: after step 1 the GPU code path waits for nothing in pad mode, copies from no "
    "pageable memory and allocates nothing (EP > 1, the stream-order context)") {
  // A trainer captures a step after a first eager one (which sizes every buffer). With EP > 1 a
  // capture needs several GPUs; here each rank's steps run on stream_order_exec (cuda_exec's code
  // path, one stream) over the thread world, with every feature that keeps state across steps.
  // Pad mode (a static shape, sub-sequence and full-sequence): steps 2-3 make no copy to the host,
  // no copy from pageable memory, no allocation, and no operation reads what the stream has not
  // yet written. Dropless, the forward reads the routed counts back (one wait each: not
  // capturable with EP > 1) but still copies nothing from pageable memory and allocates nothing.
  const auto f = layer_folds[0];
  const auto fold = make_folded(f).value();
  problem p{.fold = f};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 2 * fold.etp();
  p.tokens = 6;
  REQUIRE(fold.ep() > 1);
  const std::pair<drop_policy_variant, long long> runs[] = {
      {sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}, 0},
      {full_sequence{.capacity_factor = 1.5, .pad_to_capacity = true}, 0},
      {dropless{}, 2}};  // one wait per forward, steps 2 and 3
  // Reduced (TSan: 51 s for the three): sub-sequence pad mode only.
  for (const auto& [policy, waits] : std::span(runs).first(tsan_reduced ? 1 : 3)) {
    CAPTURE(policy.policy.index());
    const auto got = on_stream_order_world<capture_counts>(
        f.world, 11,
        [&](dev_comm& dw, stream_order_exec& x) { return capture_steps_rank(p, dw, x, policy); });
    for (int r = 0; r < f.world; ++r) {
      CAPTURE(r);
      const auto& g = got[static_cast<std::size_t>(r)];
      for (const std::string& v : g.violations) FAIL_CHECK(v);
      CHECK(g.out.to_host == waits);
      if (waits == 0) CHECK(g.out.synchronizations == 0);
      CHECK(g.out.allocations == 0);
      for (const std::string& c : g.out.pageable) FAIL_CHECK("a copy from pageable memory: " << c);
      CHECK(g.out.same_out);
    }
  }
}

TEST_CASE("the layer on cpu_exec: forwards in flight on two contexts, each backward its own") {
  // Both forwards before either backward, each on its own execution context (two streams on a
  // GPU), backwards in reverse order: every output, input
  // gradient, loss and kept record equals the one-at-a-time run bit for bit, and so do the
  // accumulated gradients (two terms per element: their sum does not depend on the order), the
  // bias's counts and the running counts. Dropless, sub-sequence dropping and pad mode, and
  // dropless with the gated shared expert (its gathered input, output and gates per context).
  const std::pair<std::optional<sub_sequence>, bool> runs[] = {
      {std::nullopt, false},
      {sub_sequence{.capacity_factor = 1.0, .by = drop_by::probs}, false},
      {sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true}, false},
      {std::nullopt, true}};
  const auto fold = make_folded(layer_folds[0]).value();  // EP 4 x ETP 2 (reduced: 2 x 2)
  problem p{.fold = layer_folds[0]};
  p.experts = 2 * fold.ep();
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 2 * fold.etp();
  p.tokens = 6;
  for (std::size_t i = 0; i < std::size(runs); ++i) {
    if (tsan_reduced && i != 2 && i != 3) continue;  // pad mode; the shared expert
    const auto& [drop, shared] = runs[i];
    CAPTURE(drop.has_value());
    CAPTURE(drop && drop->pad_to_capacity);
    CAPTURE(shared);
    const auto one = run_flight(p, drop, shared, false), two = run_flight(p, drop, shared, true);
    bool differ = false;  // the two micro-batches differ, so a mixed-up context would show
    for (std::size_t r = 0; r < one.size(); ++r) {
      CAPTURE(r);
      const flight_out &a = one[r], &b = two[r];
      CHECK(b.contexts_ok);
      for (int m = 0; m < 2; ++m) {
        CAPTURE(m);
        CHECK(a.out[m] == b.out[m]);
        CHECK(a.dx[m] == b.dx[m]);
        CHECK(a.losses[m] == b.losses[m]);
        CHECK(a.kept[m] == b.kept[m]);
        CHECK(a.losses[m].size() == 4);
      }
      CHECK(a.dw_router == b.dw_router);
      CHECK(a.dw1 == b.dw1);
      CHECK(a.dw2 == b.dw2);
      CHECK(a.counts == b.counts);
      CHECK(a.running == b.running);
      CHECK(a.shared_grads.size() == (shared ? 3 : 0));
      for (std::size_t i = 0; i < a.shared_grads.size() && i < b.shared_grads.size(); ++i) {
        CAPTURE(i);
        CHECK(a.shared_grads[i] == b.shared_grads[i]);
      }
      differ = differ || a.dx[0] != a.dx[1] || a.losses[0] != a.losses[1];
    }
    CHECK(differ);
  }
}

// A user router (a kernel body launched on the context) and user experts (recording the
// probabilities they are given around mlp_experts) plug in on cpu_exec as on host_exec, against
// the fp64 reference fed the router's assignment. Not in the TSan build.
#if !defined(MOEFOLD_TSAN_REDUCED)
namespace {

// The user router of fixed_router.hpp, a kernel body, here on cpu_exec.
static_assert(routing::router<fixed_router<float>, cpu_exec>);

// User experts on the context: mlp_experts, recording the probability of every row they are
// given (read back from the context's memory). They keep activations (mlp_experts' saved
// pre-activation), so the layer gives them the saved form's calls.
struct recording_experts {
  simt_rank_experts<float, cpu_exec> mlp;
  std::vector<float> seen{};
  [[nodiscard]] int num_local_experts() const { return mlp.num_local_experts(); }
  [[nodiscard]] int hidden() const { return mlp.hidden(); }
  [[nodiscard]] std::size_t workspace_bytes(int rows) const { return mlp.workspace_bytes(rows); }
  [[nodiscard]] std::size_t saved_bytes(int rows) const { return mlp.saved_bytes(rows); }
  [[nodiscard]] status forward(cpu_exec& x, const expert_batch<float, float, space>& b,
                               row_view<float, space> y, std::span<std::byte> saved,
                               std::span<std::byte> ws) {
    TRY_ASSIGN(p, (download<float>(x, b.probs)));
    seen = std::move(*p);
    return mlp.forward(x, b, y, saved, ws);
  }
  [[nodiscard]] status backward(cpu_exec& x, const expert_batch<float, float, space>& b,
                                row_view<const float, space> dy, row_view<float, space> dx,
                                row_view<float, space> dprobs, std::span<std::byte> saved,
                                std::span<std::byte> ws) {
    return mlp.backward(x, b, dy, dx, dprobs, saved, ws);
  }
};
static_assert(keeps_activations<recording_experts, cpu_exec, float, float>);

struct user_run {
  layer_result res;
  std::vector<float> seen;  // the probabilities the experts were given
};

// One rank of the layer with the user router and experts: forward, backward, read back.
expected<user_run> run_user_rank(const problem& p, dev_comm& world, cpu_exec& x) {
  using layer_t = moe_layer<float, cpu_exec, dev_comm, drop_policy_variant,
                            all_to_all_dispatcher<float, dev_comm, cpu_exec, float>,
                            recording_experts, fixed_router<float>>;
  TRY_ASSIGN(in, (make_layer_rank_setup<float>(p, world, x, false)));
  auto o = options_of(p, in->fold);
  o.aux_loss_coeff = o.z_loss_coeff = 0;  // no loss reaches the logits: dx has no router part
  TRY_ASSIGN(layer,
             (layer_t::make(x, o, in->comms, dropless{}, recording_experts{std::move(*in->mlp)},
                            fixed_router<float>{.experts = p.experts, .k = p.topk})));
  TRY(layer->bind_parameters(
      {.router_weight = in->par.w.view(), .router_grad = in->par.dw.view()}));
  TRY(layer->forward(x, in->x.cview(), {}, in->out.view()));
  TRY(layer->backward(x, in->dout.cview(), 1.0f, in->dx.view()));
  user_run res;
  res.seen = layer->experts().seen;
  TRY(read_back(x, *in, res.res));
  return res;
}

}  // namespace

TEST_CASE(
    "moe_layer on cpu_exec with a user router and user experts: the fp64 reference fed the "
    "router's assignment") {
  problem p{.fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2};
  p.hidden = 12;
  p.tokens = 6;
  const auto res = on_cpu_world<user_run>(
      2, 21, [&](dev_comm& world, cpu_exec& x) { return run_user_rank(p, world, x); });
  const fixed_reference ref = fixed_assignment_reference(p, 2);
  std::vector<float> seen, given;
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    const layer_result& got = res[i].res;
    CHECK(rel_err(got.out, ref.out[i]) <= 1e-5);
    CHECK(rel_err(got.out, ref.out[i]) > 0);    // fp32 is not exact: the comparison is not vacuous
    CHECK(rel_err(got.dx, ref.dx[i]) <= 1e-5);  // no router part: the logits are ignored
    CHECK(got.dw_router == std::vector<double>(got.dw_router.size(), 0.0));
    CHECK(rel_err(got.dw1, ref.dw1[i]) <= 1e-5);  // each rank's experts saw both ranks' tokens
    CHECK(rel_err(got.dw2, ref.dw2[i]) <= 1e-5);
    seen.insert(seen.end(), res[i].seen.begin(), res[i].seen.end());
    for (int t = 0; t < p.tokens; ++t) given.insert(given.end(), {0.7f, 0.3f});
  }
  // The user experts were given the user router's probabilities, every pair's, bit for bit.
  std::sort(seen.begin(), seen.end());
  std::sort(given.begin(), given.end());
  CHECK(seen == given);
}
#endif  // !MOEFOLD_TSAN_REDUCED
