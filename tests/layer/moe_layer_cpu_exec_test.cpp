// moe_layer on cpu_exec (the GPU code path in CI: kernels on fibers over poisoned memory, the
// device-space thread world): the router, the losses, the drop policies, the dispatchers, the
// experts (mlp_experts, simt_gemm) and the combine as context objects, with the caller's router
// weight bound as views. Every rank's results against the single-rank fp64 reference of
// layer_harness.hpp and against the same layer on host_exec (reference_mlp experts, the host
// GEMM): the same routing and drop decisions, values within the two runs' fp32 error.
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "layer_harness.hpp"
#include "simt_layer_rank.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using dev_comm = thread_device_communicator;
using space = cpu_device_space;

// One rank of moe_layer on cpu_exec: the parameters uploaded to the context (the router weight
// bound from the caller's buffers), forward, backward (seed 1), the gradients reduced over their
// groups; everything read back and widened.
template <class T, template <class, class, class, class> class Disp, class Policy>
expected<layer_result> run_cpu_rank(const problem& p, const Policy& policy, dev_comm& world,
                                    cpu_exec& x, bool keys) {
  using layer_t = moe_layer<T, dev_comm, Policy, Disp<T, dev_comm, cpu_exec, float>,
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

template <class T, template <class, class, class, class> class Disp, class Policy>
std::vector<layer_result> run_cpu(const problem& p, const Policy& policy, bool keys = false) {
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
