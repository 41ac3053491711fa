// No heap allocation in steady state, for the whole MoE layer: global operator new is counted
// across the whole process while every rank of a thread world runs training steps 2-5 (forward,
// backward, reduce_gradients, end_global_batch). Step 1 sizes every buffer (the layer's records
// and scratch, the router's and the drop policy's scratch, the communicators' schedules); after
// it the count must be 0. Two layers cover the paths:
//   - EP 4 x ETP 2 on 8 ranks, TP 2: a gated shared expert, full-sequence dropping over TP
//     (collective), the micro-batch, global and z losses, the All-to-All dispatcher;
//   - EP 2 x ETP 2 on 4 ranks: sigmoid scores with the expert bias and group-limited routing,
//     sub-sequence dropping in pad mode, the per-sequence loss, the AllGather dispatcher.
// Each step's output is also checked to be the first step's (the same input), so a buffer that
// is reused but left stale would show.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <vector>

#include "dispatch/dispatch_harness.hpp"
#include "support/count_new.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

constexpr int steps = 5;

struct run_result {
  std::vector<long long> news_per_step = std::vector<long long>(steps, -1);
  bool same_output = true;  // every step's forward output equals step 1's (on every rank)
};

template <class Dispatcher, class Policy>
run_result count_layer_steps(const problem& p, const moe_layer_options& base, Policy policy) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  run_result res;
  std::atomic<bool> same{true};
  const int W = fold.world_size();
  const auto sts = run_thread_world(W, [&](thread_communicator& world) -> status {
    const int r = world.rank();
    // The layer's eight groups, by name; the layer holds the bundle by reference, so it lives
    // (unmoved) until the end of this rank's run.
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    auto mlp = rank_experts<float>(p, fold, r, w.w1, w.w2);
    if (!mlp) return unexpected<error>(mlp.error());
    // EP, ETP and the shared expert's TP and TP rank come from the bundle.
    const moe_layer_options& o = base;
    using layer_t =
        moe_layer<float, host_exec, thread_communicator, Policy, Dispatcher, reference_mlp<float>>;
    host_exec ex;
    auto layer = layer_t::make(ex, o, *comms, policy, std::move(*mlp));
    if (!layer) return unexpected<error>(layer.error());
    for (std::size_t i = 0; i < layer->router_weight().flat().size(); ++i)
      layer->router_weight().flat()[i] = 0.3f * static_cast<float>(unit(9, static_cast<int>(i), 0));
    std::vector<float> x, dout;
    for (int t = 0; t < p.tokens; ++t) {
      const auto d = make_token(p, r, t);
      x.insert(x.end(), d.x.begin(), d.x.end());
      dout.insert(dout.end(), d.dout.begin(), d.dout.end());
    }
    std::vector<float> out(x.size()), first_out(x.size()), dx(x.size());
    std::vector<std::span<float>> grads{layer->experts().grads_fc1(), layer->experts().grads_fc2()};
    for (int step = 0; step < steps; ++step) {
      // All ranks line up; rank 0 reads the last step's count and counts from step 2 on.
      if (auto s = world.barrier(); !s) return s;
      if (r == 0) {
        if (step > 0) res.news_per_step[static_cast<std::size_t>(step - 1)] = news.exchange(0);
        counting.store(true);
      }
      if (auto s = world.barrier(); !s) return s;
      // The one-in-flight form: the layer's own context and storage (sized at make for every
      // forward, pad mode's largest capacity included).
      auto stats = layer->forward(ex, p.tokens, x, {}, out);
      if (!stats) return unexpected<error>(stats.error());
      if (auto s = layer->backward(ex, dout, 1.f, dx); !s) return s;
      // The bundle's groups: the router over tp-dp-cp, the experts over edp, the shared expert's
      // MLP over dp-cp and its gate over tp-dp-cp.
      if (auto s = layer->reduce_gradients(ex, {grads[0], grads[1]}); !s) return s;
      if (auto s = layer->end_global_batch(ex); !s) return s;
      // The router weight does not change (no optimizer step), so every step routes the same
      // tokens; the expert bias does change, and its layer's output may then too.
      if (step == 0)
        first_out = out;
      else if (!o.router.expert_bias && out != first_out)
        same.store(false);
    }
    if (auto s = world.barrier(); !s) return s;
    if (r == 0) {
      res.news_per_step[steps - 1] = news.exchange(0);
      counting.store(false);
    }
    return {};
  });
  for (const auto& s : sts) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  res.same_output = same.load();
  return res;
}

void check_counts(const run_result& res) {
  MESSAGE("operator new calls per step: ", res.news_per_step[0], " ", res.news_per_step[1], " ",
          res.news_per_step[2], " ", res.news_per_step[3], " ", res.news_per_step[4]);
  CHECK(res.news_per_step[0] > 0);  // the counter counts: step 1 sizes every buffer
  for (std::size_t s = 1; s < res.news_per_step.size(); ++s) CHECK(res.news_per_step[s] == 0);
  CHECK(res.same_output);
}

}  // namespace

TEST_CASE("MoE layer: steps 2-5 allocate nothing (EP 4 x ETP 2, shared expert, full sequence)") {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 4, .etp = 2}};
  p.experts = 8;
  p.topk = 2;
  p.ffn = 4;
  p.tokens = 8;
  const moe_layer_options o{.hidden = p.hidden,
                            .max_tokens = p.tokens,
                            .router = {.num_experts = p.experts, .topk = p.topk},
                            .aux_loss_coeff = 0.01,
                            .z_loss_coeff = 0.001,
                            .global_aux_loss_coeff = 0.02,
                            .batch = 2,
                            .shared_expert = {.ffn = 6, .gate = true}};
  const auto res = count_layer_steps<all_to_all_dispatcher<float, thread_communicator>>(
      p, o, full_sequence{.capacity_factor = 1.0});
  check_counts(res);
}

TEST_CASE("MoE layer: steps 2-5 allocate nothing (AllGather, expert bias, groups, pad mode)") {
  problem p{.fold = {.world = 4, .ep = 2, .etp = 2}};
  p.experts = 8;
  p.topk = 4;
  p.ffn = 4;
  p.tokens = 8;
  const moe_layer_options o{.hidden = p.hidden,
                            .max_tokens = p.tokens,
                            .router = {.num_experts = p.experts,
                                       .topk = p.topk,
                                       .score = score_function::sigmoid,
                                       .num_groups = 4,
                                       .group_topk = 2,
                                       .expert_bias = true},
                            .seq_aux_loss_coeff = 0.01,
                            .batch = 2};
  const auto res = count_layer_steps<all_gather_dispatcher<float, thread_communicator>>(
      p, o, sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true});
  check_counts(res);
}
