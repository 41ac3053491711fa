// The MoE layer (gating, router, drop policy, dispatcher, experts, aux and z-loss) on the thread
// world against the single-rank fp64 reference of layer_harness.hpp, on a sweep of folds.
#include <moefold/comm/thread_world.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "layer_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// Every rank of the thread world.
template <class T, class Policy, class Dispatcher>
std::vector<layer_result> run_layer(const problem& p, const Policy& policy) {
  const int world_size = make_folded(p.fold).value().world_size();
  std::vector<layer_result> results(static_cast<std::size_t>(world_size));
  const auto st = run_thread_world(world_size, [&](thread_communicator& world) -> status {
    auto r = run_layer_rank<T, Policy, Dispatcher>(p, policy, world);
    if (!r) return unexpected<error>(r.error());
    results[static_cast<std::size_t>(world.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

template <class T, class Policy, class Dispatcher>
long long check_layer_in(const problem& p, const Policy& policy, drop_mode mode) {
  return check_layer_results<T>(p, run_layer<T, Policy, Dispatcher>(p, policy), mode);
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

TEST_CASE("a DeepSeek-V3 layer: its dispatcher workspace per part, queried without making it") {
  using a2a_bf16 = all_to_all_dispatcher<bfloat16, thread_communicator>;
  using layer_t = moe_layer<bfloat16, host_exec, thread_communicator, dropless, a2a_bf16,
                            reference_mlp<bfloat16>>;
  const int R = 2 * 4096 * 8;
  const moe_layer_options o{.hidden = 7168,
                            .max_tokens = 4096,
                            .max_recv_rows = R,
                            .ep = 64,
                            .router = {.num_experts = 256, .topk = 8}};
  auto w = layer_t::workspace_sizes(o);
  REQUIRE(w.has_value());
  auto d = a2a_bf16::make(layer_t::dispatch_shape_of(o));
  REQUIRE(d.has_value());
  CHECK(w->saved == d->workspace_sizes().saved);
  CHECK(w->scratch == d->workspace_sizes().scratch);
  CHECK(w->saved >= std::size_t{R} * 7168 * 2);  // the experts' batch, kept for the backward
  // A bound that leaves the worst case at 2^31 rows or more unset is refused.
  moe_layer_options big = o;
  big.max_recv_rows.reset();
  big.max_tokens = 1 << 23;  // 2^23 * 8 * 64 = 2^32 rows
  auto refused = layer_t::workspace_sizes(big);
  REQUIRE(!refused);
  CHECK(refused.error().code == errc::overflow);
}

TEST_CASE(
    "E 256, k 8 over EP 64: the layer on a 64-rank world with a receive bound equals the "
    "fp64 reference") {
  const problem p = ep64_problem(16);
  CHECK(check_layer<dropless, all_to_all_path<thread_communicator>>(p, dropless{},
                                                                    drop_mode::none) == 0);
  CHECK(check_layer<sub_sequence, all_to_all_path<thread_communicator>>(
            p, sub_sequence{.capacity_factor = 1.0}, drop_mode::per_rank) > 0);
}

namespace {

// bf16 tokens with an fp32 router, the kept probabilities travelling to the experts in P (fp32:
// never rounded to bf16, as Megatron-Core keeps them; bf16: rounded once at the dispatcher).
template <class P>
void check_bf16_layer() {
  // moe_router_dtype = fp32: bf16 tokens, experts and router weight (fp32 main_grad gradients),
  // logits, probabilities and losses in fp32. The reference is fed the same bf16-rounded inputs
  // and weights and computes in fp64; normwise <= 1e-2 for out, dx and every weight gradient.
  using a2a = all_to_all_dispatcher<bfloat16, thread_communicator, host_exec, P>;
  using ag = all_gather_dispatcher<bfloat16, thread_communicator, host_exec, P>;
  using layer_bf16 = moe_layer<bfloat16, host_exec, thread_communicator, dropless, a2a,
                               reference_mlp<bfloat16, float, P>>;
  static_assert(std::same_as<typename layer_bf16::router_value_type, float>);
  static_assert(std::same_as<typename layer_bf16::grad_type, float>);
  static_assert(std::same_as<typename layer_bf16::prob_type, P>);
  const fold_config folds[] = {
      {.world = 4, .tp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .ep = 4, .etp = 1},
      {.world = 8, .tp = 4, .ep = 2, .etp = 2},
  };
  int dropping_runs = 0;
  for (const auto& f : folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = 2 * fold.ep();
    p.topk = 2;
    p.hidden = 16;
    p.ffn = 4 * fold.etp();
    p.tokens = 6;
    p.bf16_values = true;
    const auto res = run_layer<bfloat16, dropless, a2a>(p, dropless{});
    layer_check judge;
    CHECK(check_layer_results<bfloat16>(p, res, drop_mode::none, &judge) == 0);
    MESSAGE("bf16 layer, probabilities of ", sizeof(P) * 8, " bits, worst normwise error ",
            judge.worst);
    CHECK(judge.worst > 0);  // bf16 is not exact: the comparison is not vacuous
    // A planted defect: each local expert's fc1 gradient with its gate and up rows swapped.
    auto swapped = res;
    const int fs = p.ffn / fold.etp(), L = p.experts / fold.ep();
    for (auto& r : swapped)
      for (int l = 0; l < L; ++l)
        for (int i = 0; i < fs * p.hidden; ++i)
          std::swap(r.dw1[static_cast<std::size_t>(l * 2 * fs * p.hidden + i)],
                    r.dw1[static_cast<std::size_t>((l * 2 + 1) * fs * p.hidden + i)]);
    layer_check planted{.assert_each = false};
    check_layer_results<bfloat16>(p, swapped, drop_mode::none, &planted);
    MESSAGE("with gate and up gradients swapped: ", planted.worst);
    CHECK(planted.worst > 1e-2);
    // Dropping on both paths (the reference takes the implementation's decisions).
    dropping_runs += check_layer_results<bfloat16>(
                         p, run_layer<bfloat16, sub_sequence, a2a>(p, {.capacity_factor = 1.0}),
                         drop_mode::per_rank) > 0;
    dropping_runs += check_layer_results<bfloat16>(
                         p, run_layer<bfloat16, full_sequence, ag>(p, {.capacity_factor = 1.0}),
                         drop_mode::per_sequence) > 0;
  }
  CHECK(dropping_runs >= 3);
}

}  // namespace

TEST_CASE("bf16 tokens with an fp32 router equal the fp64 reference fed the same bf16 values") {
  SUBCASE("fp32 probabilities (moe_router_dtype = fp32, as Megatron-Core)") {
    check_bf16_layer<float>();
  }
  SUBCASE("probabilities rounded to bf16 at the dispatcher") { check_bf16_layer<bfloat16>(); }
}

namespace {

// Experts that record the probabilities they are given, around the reference MLP.
template <class P>
struct recording_experts {
  reference_mlp<bfloat16, float, P> mlp;
  std::vector<P> seen{};
  [[nodiscard]] int num_local_experts() const { return mlp.num_local_experts(); }
  [[nodiscard]] int hidden() const { return mlp.hidden(); }
  [[nodiscard]] std::size_t workspace_bytes(int rows) const { return mlp.workspace_bytes(rows); }
  [[nodiscard]] status forward(host_exec& x, const expert_batch<bfloat16, P>& b,
                               row_view<bfloat16> y, std::span<std::byte> ws) {
    seen.assign(b.probs.flat().begin(), b.probs.flat().end());
    return mlp.forward(x, b, y, ws);
  }
  [[nodiscard]] status backward(host_exec& x, const expert_batch<bfloat16, P>& b,
                                row_view<const bfloat16> dy, row_view<bfloat16> dx,
                                row_view<P> dprobs, std::span<std::byte> ws) {
    return mlp.backward(x, b, dy, dx, dprobs, ws);
  }
};

struct probs_trace {
  std::vector<float> routed, seen;  // over all ranks, sorted
};

// A dropless forward of a bf16 layer with an fp32 router on EP 2: the probabilities every rank's
// router gave, and those every rank's experts received (the same multiset when nothing is
// rounded on the way).
template <class P>
probs_trace trace_probs() {
  problem p{.fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2};
  p.tokens = 6;
  p.bf16_values = true;
  using disp_t = all_to_all_dispatcher<bfloat16, thread_communicator, host_exec, P>;
  using layer_t =
      moe_layer<bfloat16, host_exec, thread_communicator, dropless, disp_t, recording_experts<P>>;
  std::vector<std::vector<float>> routed(2), seen(2);
  const auto st = run_thread_world(2, [&](thread_communicator& world) -> status {
    const auto fold = make_folded(p.fold).value();
    const megatron_groups groups(fold);
    const int r = world.rank();
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    const data w = make_weights(p);
    auto mlp = rank_experts<bfloat16, P>(p, fold, r, w.w1, w.w2);
    if (!mlp) return unexpected<error>(mlp.error());
    host_exec x;
    auto layer = layer_t::make(x,
                               {.hidden = p.hidden,
                                .max_tokens = p.tokens,
                                .ep = 2,
                                .router = {.num_experts = p.experts, .topk = p.topk}},
                               *comms, dropless{}, recording_experts<P>{std::move(*mlp)});
    if (!layer) return unexpected<error>(layer.error());
    const auto wr = router_weight(p);
    for (std::size_t i = 0; i < wr.size(); ++i)
      layer->router_weight().flat()[i] = bfloat16(static_cast<float>(wr[i]));
    std::vector<bfloat16> xs;
    for (int t = 0; t < p.tokens; ++t)
      for (double v : make_token(p, r, t).x) xs.push_back(bfloat16(static_cast<float>(v)));
    std::vector<bfloat16> out(xs.size());
    if (auto f = layer->forward(x, p.tokens, xs, {}, out); !f) return unexpected<error>(f.error());
    const auto& rt = layer->last_routing();
    routed[static_cast<std::size_t>(r)].assign(rt.probs.begin(), rt.probs.end());
    for (const P& v : layer->experts().seen)
      seen[static_cast<std::size_t>(r)].push_back(static_cast<float>(v));
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  probs_trace t;
  for (int r = 0; r < 2; ++r) {
    t.routed.insert(t.routed.end(), routed[r].begin(), routed[r].end());
    t.seen.insert(t.seen.end(), seen[r].begin(), seen[r].end());
  }
  std::sort(t.routed.begin(), t.routed.end());
  std::sort(t.seen.begin(), t.seen.end());
  return t;
}

}  // namespace

TEST_CASE("a bf16 layer with fp32 probabilities gives its experts the router's fp32 values") {
  const probs_trace f = trace_probs<float>();
  REQUIRE(f.routed.size() == 2u * 6u * 2u);  // dropless: every pair of both ranks
  CHECK(f.seen == f.routed);                 // bit for bit, none rounded on the way
  const auto in_bf16 = [](float v) { return static_cast<float>(bfloat16(v)) == v; };
  CHECK(std::count_if(f.routed.begin(), f.routed.end(), in_bf16) < 4);  // they need fp32
  // The control: through a bf16 dispatcher the same probabilities arrive rounded.
  const probs_trace b = trace_probs<bfloat16>();
  CHECK(b.routed == f.routed);
  CHECK(b.seen != b.routed);
  CHECK(std::all_of(b.seen.begin(), b.seen.end(), in_bf16));
}
