// moe_layer on cpu_exec (the GPU code path in CI: kernels on fibers over poisoned memory, the
// device-space thread world): the router, the losses, the drop policies, the dispatchers, the
// experts (mlp_experts, simt_gemm) and the combine as context objects, with the caller's router
// weight bound as views. Every rank's results against the single-rank fp64 reference of
// layer_harness.hpp and against the same layer on host_exec (reference_mlp experts, the host
// GEMM): the same routing and drop decisions, values within the two runs' fp32 error. A user
// router (a kernel body launched on the context) and user experts (recording the probabilities
// they are given around mlp_experts) plug in on cpu_exec as on host_exec, against the fp64
// reference fed the router's assignment.
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "../support/mlp_layout.hpp"
#include "layer_harness.hpp"
#include "simt_layer_rank.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using dev_comm = thread_device_communicator;
using space = cpu_device_space;

// One rank of moe_layer on cpu_exec: the parameters uploaded to the context (the router weight
// bound from the caller's buffers), forward, backward (seed 1), the gradients reduced over their
// groups; everything read back and widened. The three policies through one layer type.
template <class T, template <class, class, class, class> class Disp>
expected<layer_result> run_cpu_rank(const problem& p, const drop_policy_variant& policy,
                                    dev_comm& world, cpu_exec& x, bool keys) {
  using layer_t = moe_layer<T, dev_comm, drop_policy_variant, Disp<T, dev_comm, cpu_exec, float>,
                            simt_rank_experts<T, cpu_exec>>;
  using G = main_grad_t<T>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank(), H = p.hidden;
  auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
  auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep);
  auto tp_cp = get(group_kind::tp_cp), stage = get(group_kind::tp_dp_cp),
       edp = get(group_kind::edp);
  TRY_ASSIGN(par, (upload_rank_params<T>(p, fold, r, x)));
  TRY_ASSIGN(mlp, (rank_mlp(p, fold, r, x, *par)));
  TRY_ASSIGN(layer, (layer_t::make(x, options_of(p, fold), policy, std::move(*mlp))));
  TRY(layer->bind_parameters({.router_weight = par->w.view(), .router_grad = par->dw.view()}));
  std::vector<T> xs, douts;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    for (double v : d.x) xs.push_back(static_cast<T>(v));
    for (double v : d.dout) douts.push_back(static_cast<T>(v));
  }
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
  std::optional<exec_buffer<std::int64_t, cpu_exec>> d_keys;  // none: the group's rank order
  if (keys) {
    TRY_ASSIGN(k, upload(x, sequence_keys(p, fold, r), p.tokens, 1));
    d_keys = std::move(*k);
  }
  const auto key_view = d_keys ? d_keys->cview() : row_view<const std::int64_t, space>{};
  TRY_ASSIGN(d_out, (exec_buffer<T, cpu_exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<T, cpu_exec>::make(x, p.tokens, H)));
  const moe_layer_groups<dev_comm> g{tp_cp, {ep, etp, tp_ep}};
  TRY_ASSIGN(stats, layer->forward(d_x->cview(), key_view, g, d_out->view()));
  TRY(layer->device_status());  // the keys were good, the record whole
  layer_result res;
  res.aux = stats->aux_loss;
  res.z = stats->z_loss;
  res.dropped = stats->dropped.dropped_pairs;
  TRY_ASSIGN(idx, (download<int>(x, layer->last_context().indices())));
  res.indices = *idx;
  TRY_ASSIGN(kept, (download<int>(x, layer->last_kept_experts())));
  res.kept = *kept;
  if (stats->dropped.capacity) {
    res.capacity = *stats->dropped.capacity;
    res.rows_per_expert.resize(static_cast<std::size_t>(p.experts));
    for (int e = 0; e < p.experts; ++e) {
      const auto i = static_cast<std::size_t>(e);
      res.rows_per_expert[i] =
          stats->dropped.routed[i] - stats->dropped.dropped[i] + stats->dropped.padded[i];
    }
  }
  TRY(layer->backward(d_dout->cview(), 1.0f, g, d_dx->view()));
  TRY(layer->reduce_gradients(stage, edp, {par->g1.view(), par->g2.view()}));
  TRY_ASSIGN(out, (download<T>(x, d_out->cview())));
  TRY_ASSIGN(dx, (download<T>(x, d_dx->cview())));
  TRY_ASSIGN(dw, (download<G>(x, par->dw.cview())));
  TRY_ASSIGN(g1, (download<G>(x, par->g1.cview())));
  TRY_ASSIGN(g2, (download<G>(x, par->g2.cview())));
  res.out = widen_all(*out);
  res.dx = widen_all(*dx);
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  return res;
}

template <class T, template <class, class, class, class> class Disp>
std::vector<layer_result> run_cpu(const problem& p, const drop_policy_variant& policy,
                                  bool keys = false) {
  const int W = p.fold.world;
  std::vector<layer_result> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    cpu_exec x(static_cast<std::uint64_t>(11 + dw.rank()));
    auto r = run_cpu_rank<T, Disp>(p, policy, dw, x, keys);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

const fold_config folds[] = {
    {.world = 8, .tp = 2, .ep = 4, .etp = 2},  // EP 4 x ETP 2
    {.world = 4, .cp = 2, .ep = 4, .etp = 1},  // CP 2: full-sequence dropping's true order
};

problem problem_of(const fold_config& f, int experts) {
  const auto fold = make_folded(f).value();
  problem p{.fold = f};
  p.experts = experts;
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 2 * fold.etp();
  p.tokens = 6;
  return p;
}

// A user router on any context: token t goes to experts t % E, (t + 1) % E, ... with
// probabilities 0.7 and the rest shared equally, whatever the logits (so the router weight gets
// no gradient). The assignment is a kernel body launched on the context, the backward a fill.
struct fixed_assignment_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "fixed_assignment";
  int* indices;  // [N, k] rows idx_stride apart
  float* probs;  // [N, k] rows prob_stride apart
  long long idx_stride, prob_stride;
  int n, k, experts;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long step = static_cast<long long>(c.grid_blocks()) * Ctx::block_threads;
    for (long long i = static_cast<long long>(c.block()) * Ctx::block_threads + c.thread();
         i < static_cast<long long>(n) * k; i += step) {
      const long long t = i / k, j = i % k;
      indices[t * idx_stride + j] = static_cast<int>((t + j) % experts);
      probs[t * prob_stride + j] = j == 0 ? 0.7f : 0.3f / static_cast<float>(k - 1);
    }
  }
};
struct fixed_router {
  using value_type = float;
  int experts = 0, k = 0;
  [[nodiscard]] int num_experts() const { return experts; }
  [[nodiscard]] int topk() const { return k; }
  template <class Exec>
  [[nodiscard]] status route(Exec& x,
                             const router_route_args<float, typename Exec::memory_space>& f) const {
    if (!f.expert_bias.empty())
      return make_error(errc::invalid_argument, "fixed_router: takes no expert bias");
    return launch(x, launch_grid{.blocks = 2},
                  fixed_assignment_kernel{.indices = f.indices.data(),
                                          .probs = f.probs.data(),
                                          .idx_stride = f.indices.stride(),
                                          .prob_stride = f.probs.stride(),
                                          .n = f.indices.rows(),
                                          .k = k,
                                          .experts = experts});
  }
  template <class Exec>
  [[nodiscard]] status backward(
      Exec& x, const router_backward_args<float, typename Exec::memory_space>& b) const {
    return x.fill(b.dlogits, 0.0f);
  }
};
static_assert(routing::router<fixed_router, cpu_exec>);
static_assert(routing::router<fixed_router, host_exec>);

// User experts on the context: mlp_experts, recording the probability of every row they are
// given (read back from the context's memory).
struct recording_experts {
  simt_rank_experts<float, cpu_exec> mlp;
  std::vector<float> seen{};
  [[nodiscard]] int num_local_experts() const { return mlp.num_local_experts(); }
  [[nodiscard]] int hidden() const { return mlp.hidden(); }
  [[nodiscard]] std::size_t workspace_bytes(int rows) const { return mlp.workspace_bytes(rows); }
  [[nodiscard]] status forward(cpu_exec& x, const expert_batch<float, float, space>& b,
                               row_view<float, space> y, std::span<std::byte> ws) {
    TRY_ASSIGN(p, (download<float>(x, b.probs)));
    seen = std::move(*p);
    return mlp.forward(x, b, y, ws);
  }
  [[nodiscard]] status backward(cpu_exec& x, const expert_batch<float, float, space>& b,
                                row_view<const float, space> dy, row_view<float, space> dx,
                                row_view<float, space> dprobs, std::span<std::byte> ws) {
    return mlp.backward(x, b, dy, dx, dprobs, ws);
  }
};
static_assert(expert_fn<recording_experts, cpu_exec, float, float>);

struct user_run {
  std::vector<double> out, dx, dw_router, dw1, dw2;
  std::vector<float> seen;
};

// One rank of the layer with the user router and experts: forward, backward, read back.
expected<user_run> run_user_rank(const problem& p, dev_comm& world, cpu_exec& x) {
  using layer_t = moe_layer<float, dev_comm, drop_policy_variant,
                            all_to_all_dispatcher<float, dev_comm, cpu_exec, float>,
                            recording_experts, fixed_router>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank(), H = p.hidden;
  TRY_ASSIGN(comms, make_layer_communicators(world, groups));
  TRY_ASSIGN(par, (upload_rank_params<float>(p, fold, r, x)));
  TRY_ASSIGN(mlp, (rank_mlp(p, fold, r, x, *par)));
  auto o = options_of(p, fold);
  o.aux_loss_coeff = o.z_loss_coeff = 0;  // no loss reaches the logits: dx has no router part
  TRY_ASSIGN(layer, (layer_t::make(x, o, dropless{}, recording_experts{std::move(*mlp)},
                                   fixed_router{.experts = p.experts, .k = p.topk})));
  TRY(layer->bind_parameters({.router_weight = par->w.view(), .router_grad = par->dw.view()}));
  std::vector<float> xs, douts;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    for (double v : d.x) xs.push_back(static_cast<float>(v));
    for (double v : d.dout) douts.push_back(static_cast<float>(v));
  }
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
  TRY_ASSIGN(d_out, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<float, cpu_exec>::make(x, p.tokens, H)));
  const auto g = comms->groups();
  TRY(layer->forward(d_x->cview(), {}, g, d_out->view()));
  TRY(layer->backward(d_dout->cview(), 1.0f, g, d_dx->view()));
  user_run res;
  res.seen = layer->experts().seen;
  TRY_ASSIGN(out, (download<float>(x, d_out->cview())));
  TRY_ASSIGN(dx, (download<float>(x, d_dx->cview())));
  TRY_ASSIGN(dw, (download<float>(x, par->dw.cview())));
  TRY_ASSIGN(g1, (download<float>(x, par->g1.cview())));
  TRY_ASSIGN(g2, (download<float>(x, par->g2.cview())));
  res.out = widen_all(*out);
  res.dx = widen_all(*dx);
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  return res;
}

}  // namespace

TEST_CASE(
    "moe_layer on cpu_exec, dropless: the fp64 reference and the host context, both "
    "dispatchers") {
  for (const auto& f : folds) {
    const auto p = problem_of(f, 2 * make_folded(f).value().ep());
    CAPTURE(f.world);
    layer_check judge;
    const auto a2a = run_cpu<float, all_to_all_dispatcher>(p, dropless{});
    CHECK(check_layer_results<float>(p, a2a, drop_mode::none, &judge) == 0);
    CHECK(judge.worst > 0);  // fp32 is not exact: the comparison is not vacuous
    check_same_layer(a2a, run_host<float, all_to_all_dispatcher>(p, dropless{}), 2e-5);
    const auto ag = run_cpu<float, all_gather_dispatcher>(p, dropless{});
    CHECK(check_layer_results<float>(p, ag, drop_mode::none) == 0);
    check_same_layer(ag, run_host<float, all_gather_dispatcher>(p, dropless{}), 2e-5);
  }
}

TEST_CASE(
    "moe_layer on cpu_exec with sub- and full-sequence dropping: the fp64 reference and "
    "the host context") {
  // Capacity factor 1 with 8 experts drops pairs on most ranks; by probability, by position and
  // in pad mode; full-sequence over the tp-cp group in its rank order and in true sequence order.
  const sub_sequence subs[] = {{.capacity_factor = 1.0, .by = drop_by::probs},
                               {.capacity_factor = 1.0, .by = drop_by::position},
                               {.capacity_factor = 1.0, .pad_to_capacity = true}};
  const full_sequence fulls[] = {
      {.capacity_factor = 1.0, .by = drop_by::position},
      {.capacity_factor = 1.0, .pad_to_capacity = true, .by = drop_by::probs}};
  long long dropped = 0;
  for (const auto& f : folds) {
    const auto p = problem_of(f, 8);
    CAPTURE(f.world);
    for (const auto& policy : subs) {
      CAPTURE(static_cast<int>(policy.by));
      CAPTURE(policy.pad_to_capacity);
      const auto cpu = run_cpu<float, all_to_all_dispatcher>(p, policy);
      dropped += check_layer_results<float>(p, cpu, drop_mode::per_rank);
      check_same_layer(cpu, run_host<float, all_to_all_dispatcher>(p, policy), 2e-5);
      if (policy.pad_to_capacity)  // every expert exactly C rows from this rank
        for (const auto& r : cpu)
          for (int rows : r.rows_per_expert) CHECK(rows == r.capacity);
    }
    for (const auto& policy : fulls)
      for (const bool keys : {false, true}) {
        CAPTURE(static_cast<int>(policy.by));
        CAPTURE(keys);
        const auto cpu = run_cpu<float, all_to_all_dispatcher>(p, policy, keys);
        dropped += check_layer_results<float>(p, cpu, drop_mode::per_sequence);
        check_same_layer(cpu, run_host<float, all_to_all_dispatcher>(p, policy, keys), 2e-5);
      }
  }
  MESSAGE("pairs dropped over all runs and ranks: ", dropped);
  CHECK(dropped > 0);  // pairs were dropped: the drop path was exercised
}

TEST_CASE("moe_layer on cpu_exec in bf16 (fp32 router and probabilities): the fp64 reference") {
  // bf16 tokens, experts and router weight; the router's logits, probabilities and losses in
  // fp32 (the default router type) and the probabilities dispatched in fp32.
  problem p = problem_of(folds[0], 8);
  p.ffn = 4;
  p.bf16_values = true;
  for (const int hidden : {16, 12}) {  // rows of 32 bytes, and of 24
    CAPTURE(hidden);
    p.hidden = hidden;
    const auto cpu = run_cpu<bfloat16, all_to_all_dispatcher>(p, dropless{});
    layer_check judge;
    CHECK(check_layer_results<bfloat16>(p, cpu, drop_mode::none, &judge) == 0);
    MESSAGE("bf16 layer on cpu_exec, worst normwise error against fp64: ", judge.worst);
    CHECK(judge.worst > 0);
  }
}

TEST_CASE(
    "moe_layer on cpu_exec with a user router and user experts: the fp64 reference fed the "
    "router's assignment") {
  problem p{.fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2};
  p.hidden = 12;
  p.tokens = 6;
  std::vector<user_run> res(2);
  const auto st = run_thread_world(2, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    cpu_exec x(static_cast<std::uint64_t>(21 + dw.rank()));
    TRY_ASSIGN(r, run_user_rank(p, dw, x));
    res[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  const data w = make_weights(p);
  reference_grads g;
  const int L = p.experts / 2, H = p.hidden, F = p.ffn;
  std::vector<float> seen, given;
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    std::vector<double> out, dx;
    for (int t = 0; t < p.tokens; ++t) {
      token_data d = make_token(p, r, t);
      d.expert = {t % p.experts, (t + 1) % p.experts};
      d.prob = {0.7, 0.3};
      std::vector<double> o1, dx1, dp;
      reference_token(w, d, o1, dx1, dp, g);
      out.insert(out.end(), o1.begin(), o1.end());
      dx.insert(dx.end(), dx1.begin(), dx1.end());
      given.insert(given.end(), {0.7f, 0.3f});
    }
    const auto& got = res[static_cast<std::size_t>(r)];
    CHECK(rel_err(got.out, out) <= 1e-5);
    CHECK(rel_err(got.out, out) > 0);    // fp32 is not exact: the comparison is not vacuous
    CHECK(rel_err(got.dx, dx) <= 1e-5);  // no router part: the assignment ignores the logits
    CHECK(got.dw_router == std::vector<double>(got.dw_router.size(), 0.0));
    seen.insert(seen.end(), got.seen.begin(), got.seen.end());
  }
  for (int r = 0; r < 2; ++r) {        // each rank's experts saw both ranks' tokens (EDP = 1)
    std::vector<double> want1, want2;  // in the library's layout (support/mlp_layout.hpp)
    for (int l = 0; l < L; ++l) {
      auto d1 = g.dw1[r * L + l], d2 = g.dw2[r * L + l];
      d1.resize(static_cast<std::size_t>(H * 2 * F), 0.0);
      d2.resize(static_cast<std::size_t>(F * H), 0.0);
      append_fc1_shard<double>(d1, H, 2, F, 1, 0, want1);
      append_fc2_shard<double>(d2, F, H, 1, 0, want2);
    }
    CHECK(rel_err(res[static_cast<std::size_t>(r)].dw1, want1) <= 1e-5);
    CHECK(rel_err(res[static_cast<std::size_t>(r)].dw2, want2) <= 1e-5);
  }
  // The user experts were given the user router's probabilities, every pair's, bit for bit.
  std::sort(seen.begin(), seen.end());
  std::sort(given.begin(), given.end());
  CHECK(seen == given);
}
