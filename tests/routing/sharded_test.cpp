// Sharded equals whole, on the thread world: with the sequence split over TP x CP in
// {1, 2, 4, 8} (sequence parallelism over TP, load-balanced chunks over CP), the aux losses, the
// z-loss, their gradients, the expert-bias update and the full-sequence keep mask equal the
// single-rank computation on the full batch (invariants 11 and 12, and section 3.4).
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>
#include <moefold/routing/expert_bias.hpp>

#include "../support/host_drop_policy.hpp"
#include "../support/host_expert_bias.hpp"
#include "../support/host_group_losses.hpp"
#include "../support/host_topk_router.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "util.hpp"

using namespace moefold;
using moefold::test::random_vector;

namespace {

constexpr int E = 8, S = 16, B = 2, K = 2;

struct split {
  int tp, cp;
};
const std::vector<split> splits = {{1, 1}, {2, 1}, {1, 2}, {4, 1}, {2, 2},
                                   {1, 4}, {8, 1}, {4, 2}, {2, 4}, {1, 8}};

// The rows [key] of this rank, from its position in the TP x CP group (tp fastest, as
// Megatron-Core orders tp-cp groups).
std::vector<std::int64_t> keys_of(int group_rank, split sp) {
  return sequence_order_keys({.tp_rank = group_rank % sp.tp,
                              .tp = sp.tp,
                              .cp_rank = group_rank / sp.tp,
                              .cp = sp.cp,
                              .local_seq = S / (sp.tp * sp.cp),
                              .batch = B})
      .value();
}

std::vector<double> rows(const std::vector<double>& full, const std::vector<std::int64_t>& keys) {
  std::vector<double> out;
  for (auto key : keys) out.insert(out.end(), full.begin() + key * E, full.begin() + (key + 1) * E);
  return out;
}

// Relative agreement for sums taken in a different order (fp64).
void check_same(double a, double b) { CHECK(a == doctest::Approx(b).epsilon(1e-12)); }

template <class F>
void run_ok(int n, F&& fn) {
  const auto st = run_thread_world(n, std::forward<F>(fn));
  for (std::size_t r = 0; r < st.size(); ++r) {
    CAPTURE(r);
    CHECK(st[r]);
    if (!st[r]) MESSAGE(st[r].error().message);
  }
}

}  // namespace

TEST_CASE("full-sequence keep mask is independent of TP x CP and equals the whole-sequence one") {
  for (bool quantized : {false, true}) {
    // Quantized logits make exact probability ties, which must resolve by true sequence order.
    auto logits = random_vector<double>(S * B * E, 401);
    if (quantized)
      for (auto& x : logits) x = std::round(x * 2) / 2;
    const auto router = host_topk_router<double>::make({.num_experts = E, .topk = K}).value();
    topk_routing<double> whole;
    REQUIRE(router.route(logits, whole));
    for (auto by : {drop_by::probs, drop_by::position})
      for (bool pad : {false, true})
        for (double cf : {0.5, 1.0}) {
          const full_sequence policy{.capacity_factor = cf, .pad_to_capacity = pad, .by = by};
          drop_result<double> ref;  // single rank, rows in true order
          REQUIRE(host_apply(sub_sequence{.capacity_factor = cf, .pad_to_capacity = pad, .by = by},
                             whole, ref));
          REQUIRE(ref.report.dropped_pairs > 0);
          for (const auto sp : splits) {
            CAPTURE(quantized);
            CAPTURE(static_cast<int>(by));
            CAPTURE(pad);
            CAPTURE(cf);
            CAPTURE(sp.tp);
            CAPTURE(sp.cp);
            std::mutex m;
            run_ok(sp.tp * sp.cp, [&](thread_communicator& c) {
              const auto keys = keys_of(c.rank(), sp);
              const auto local_logits = rows(logits, keys);
              topk_routing<double> r;
              REQUIRE(router.route(local_logits, r));
              drop_result<double> d;
              const status s = host_apply(policy, c, keys, r, d);
              std::lock_guard lk(m);
              REQUIRE(s);
              CHECK(d.report.capacity == ref.report.capacity);
              for (std::size_t i = 0; i < keys.size(); ++i)
                for (int e = 0; e < E; ++e) {
                  CHECK(d.final_map[i * E + e] == ref.final_map[keys[i] * E + e]);
                  CHECK(d.final_probs[i * E + e] == ref.final_probs[keys[i] * E + e]);
                }
            });
          }
        }
  }
}

TEST_CASE("aux losses, z-loss and their gradients: the sharded partials equal the whole batch") {
  const auto logits = random_vector<double>(S * B * E, 411);
  for (auto f : {score_function::softmax, score_function::sigmoid, score_function::sqrt_softplus}) {
    CAPTURE(to_string(f));
    // Whole batch on one rank: rows in true order, token n = s*B + b.
    aux_loss_term<double> whole_aux, whole_seq;
    double whole_z = 0;
    std::vector<double> grad_aux(S * B * E, 0.0), grad_seq(S * B * E, 0.0), grad_z(S * B * E, 0.0);
    run_ok(1, [&](thread_communicator& c) {
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(f, K, E, logits, {}, a));
      whole_aux = load_balancing_loss(c, a, 0.01).value();
      whole_seq = seq_load_balancing_loss(c, a, B, 0.01).value();
      whole_z = group_z_loss(c, std::span<const double>(logits), E, 0.001).value();
      REQUIRE(add_aux_loss_gradient<double>(f, logits, E, {}, whole_aux, 1.0, grad_aux));
      REQUIRE(add_aux_loss_gradient<double>(f, logits, E, {}, whole_seq, 1.0, grad_seq));
      REQUIRE(add_group_z_loss_gradient(c, std::span<const double>(logits), E, 0.001, {}, 1.0,
                                        std::span<double>(grad_z)));
    });
    for (const auto sp : splits) {
      CAPTURE(sp.tp);
      CAPTURE(sp.cp);
      std::mutex m;
      run_ok(sp.tp * sp.cp, [&](thread_communicator& c) {
        const auto keys = keys_of(c.rank(), sp);
        const auto local = rows(logits, keys);
        aux_scores<double> a;
        REQUIRE(compute_aux_scores<double>(f, K, E, local, {}, a));
        const auto aux = load_balancing_loss(c, a, 0.01).value();
        const auto seq = seq_load_balancing_loss(c, a, B, 0.01).value();
        const double z = group_z_loss(c, std::span<const double>(local), E, 0.001).value();
        std::vector<double> sums = {aux.loss, seq.loss, z};
        REQUIRE(c.all_reduce(std::span<double>(sums), reduce_op::sum));
        std::vector<double> ga(local.size(), 0.0), gs(local.size(), 0.0), gz(local.size(), 0.0);
        REQUIRE(add_aux_loss_gradient<double>(f, local, E, {}, aux, 1.0, ga));
        REQUIRE(add_aux_loss_gradient<double>(f, local, E, {}, seq, 1.0, gs));
        REQUIRE(add_group_z_loss_gradient(c, std::span<const double>(local), E, 0.001, {}, 1.0,
                                          std::span<double>(gz)));
        std::lock_guard lk(m);
        check_same(sums[0], whole_aux.loss);
        check_same(sums[1], whole_seq.loss);
        check_same(sums[2], whole_z);
        CHECK(aux.counts == whole_aux.counts);  // the reduced statistics themselves
        CHECK(seq.counts == whole_seq.counts);
        // Invariant 12: the local gradient is the matching slice of the whole-batch gradient.
        for (std::size_t i = 0; i < keys.size(); ++i)
          for (int e = 0; e < E; ++e) {
            check_same(ga[i * E + e], grad_aux[keys[i] * E + e]);
            check_same(gs[i * E + e], grad_seq[keys[i] * E + e]);
            check_same(gz[i * E + e], grad_z[keys[i] * E + e]);
          }
      });
    }
  }
}

TEST_CASE("global aux loss over TP x DP x CP: running average, reset per global batch") {
  // Two micro-batches of the whole batch, then a reset and a third.
  const std::vector<std::vector<double>> mb = {random_vector<double>(S * B * E, 421),
                                               random_vector<double>(S * B * E, 422),
                                               random_vector<double>(S * B * E, 423)};
  std::vector<double> whole(3);
  run_ok(1, [&](thread_communicator& c) {
    global_aux_state st;
    for (int i = 0; i < 3; ++i) {
      if (i == 2) st.reset();
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(score_function::softmax, K, E, mb[i], {}, a));
      whole[i] = global_load_balancing_loss(c, a, 0.01, st).value().loss;
    }
    CHECK(st.steps == 1);
  });
  // Independent formula for micro-batch 1 (second): counts averaged over the two micro-batches.
  {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    for (int i = 0; i < 2; ++i) {
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(score_function::softmax, K, E, mb[i], {}, a));
      for (int t = 0; t < S * B; ++t)
        for (int e = 0; e < E; ++e) {
          f[e] += a.map[t * E + e] / 2.0;
          if (i == 1) P[e] += a.scores[t * E + e];
        }
    }
    const double T = S * B;
    double ref = 0;
    for (int e = 0; e < E; ++e) ref += P[e] * f[e];
    ref *= E * 0.01 / (K * T * T);
    check_same(whole[1], ref);
  }
  for (int n : {2, 4, 8}) {
    CAPTURE(n);
    std::mutex m;
    run_ok(n, [&](thread_communicator& c) {
      const split sp{n, 1};
      const auto keys = keys_of(c.rank(), sp);
      global_aux_state st;
      for (int i = 0; i < 3; ++i) {
        if (i == 2) st.reset();
        aux_scores<double> a;
        const auto local = rows(mb[i], keys);
        REQUIRE(compute_aux_scores<double>(score_function::softmax, K, E, local, {}, a));
        double loss = global_load_balancing_loss(c, a, 0.01, st).value().loss;
        REQUIRE(c.all_reduce(std::span<double>(&loss, 1), reduce_op::sum));
        std::lock_guard lk(m);
        check_same(loss, whole[i]);
      }
    });
  }
}

TEST_CASE("expert-bias update over TP x DP x CP equals the single-rank update") {
  // The production object (routing/expert_bias.hpp) on host_exec: the rows each expert received
  // added per forward, the update over the group.
  const auto logits = random_vector<double>(S * B * E, 431);
  const auto router =
      host_topk_router<double>::make(
          {.num_experts = E, .topk = K, .score = score_function::sigmoid, .expert_bias = true})
          .value();
  const auto bias0 = random_vector<float>(E, 432, -0.1, 0.1);
  const std::vector<float> zeros(E, 0.f);
  host_exec x;
  // The routed pairs per expert of a routing (what a dropless forward dispatches).
  const auto routed = [](const topk_routing<double>& r) {
    std::vector<int> c(E, 0);
    for (int e : r.indices) ++c[static_cast<std::size_t>(e)];
    return c;
  };
  const auto view = [](const std::vector<int>& c) {
    return row_view<const int, host_space>(c.data(), 1, E);
  };
  // Whole batch, and an independent expectation of the rule.
  auto whole = expert_bias<host_exec>::make(x, E, 1e-3f).value();
  REQUIRE(whole.load(x, bias0, zeros));
  topk_routing<double> r;
  REQUIRE(router.route(logits, r, bias0));
  const std::vector<int> counts = routed(r);
  REQUIRE(whole.add_counts(x, view(counts)));
  std::vector<float> saved_bias, saved_counts;
  REQUIRE(whole.save(x, saved_bias, saved_counts));
  CHECK(saved_counts == std::vector<float>(counts.begin(), counts.end()));
  run_ok(1, [&](thread_communicator& c) { REQUIRE(whole.update(x, c)); });
  REQUIRE(whole.save(x, saved_bias, saved_counts));
  float mean = 0;
  for (int v : counts) mean += static_cast<float>(v) / E;
  for (int e = 0; e < E; ++e) {
    const auto ce = static_cast<float>(counts[static_cast<std::size_t>(e)]);
    const float expect = bias0[e] + (ce < mean ? 1e-3f : ce > mean ? -1e-3f : 0.f);
    CHECK(saved_bias[static_cast<std::size_t>(e)] == expect);
    CHECK(saved_counts[static_cast<std::size_t>(e)] == 0.f);
  }
  for (const auto sp : splits) {
    CAPTURE(sp.tp);
    CAPTURE(sp.cp);
    std::mutex m;
    run_ok(sp.tp * sp.cp, [&](thread_communicator& c) {
      host_exec rx;
      const auto keys = keys_of(c.rank(), sp);
      auto st = expert_bias<host_exec>::make(rx, E, 1e-3f).value();
      REQUIRE(st.load(rx, bias0, zeros));
      topk_routing<double> lr;
      REQUIRE(router.route(rows(logits, keys), lr, bias0));
      const std::vector<int> mine = routed(lr);
      REQUIRE(st.add_counts(rx, view(mine)));
      REQUIRE(st.update(rx, c));
      std::vector<float> b, n;
      REQUIRE(st.save(rx, b, n));
      std::lock_guard lk(m);
      CHECK(b == saved_bias);  // integer counts: bitwise equal
    });
  }
  // Dropped and padded rows: routed - dropped + padded per expert; bad shapes refused.
  auto d = expert_bias<host_exec>::make(x, 4, 1e-3f).value();
  const std::vector<int> rt = {5, 3, 0, 2}, dr = {2, 0, 0, 1}, pd = {0, 1, 3, 0};
  const auto v4 = [](const std::vector<int>& c) {
    return row_view<const int, host_space>(c.data(), 1, 4);
  };
  REQUIRE(d.add_counts(x, v4(rt), v4(dr), v4(pd)));
  REQUIRE(d.save(x, saved_bias, saved_counts));
  CHECK(saved_counts == std::vector<float>{3, 4, 3, 1});
  CHECK(d.add_counts(x, row_view<const int, host_space>(rt.data(), 1, 3)).error().code ==
        errc::shape_mismatch);
  CHECK(d.load(x, std::vector<float>(3, 0.f), std::vector<float>(4, 0.f)).error().code ==
        errc::shape_mismatch);
  CHECK(d.load(x, std::vector<float>(4, 0.f), std::vector<float>{0, -1, 0, 0}).error().code ==
        errc::invalid_argument);
  CHECK(expert_bias<host_exec>::make(x, 4, -1.f).error().code == errc::invalid_argument);
}

TEST_CASE("counts exclude padding tokens and a padding mask changes the token total") {
  auto st = expert_bias_state::zeros(4);
  const std::vector<std::uint8_t> map = {1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1};
  const std::vector<std::uint8_t> padding = {0, 1, 0};
  REQUIRE(count_routed_tokens(st, map, padding));
  CHECK(st.local_tokens_per_expert == std::vector<float>{2, 1, 0, 1});
  CHECK(count_routed_tokens(st, std::span<const std::uint8_t>(map.data(), 11)).error().code ==
        errc::shape_mismatch);
  // Aux loss with a padding mask: T counts valid tokens only.
  const auto logits = random_vector<double>(3 * 4, 441);
  run_ok(1, [&](thread_communicator& c) {
    aux_scores<double> a;
    REQUIRE(compute_aux_scores<double>(score_function::softmax, 2, 4, logits, padding, a));
    CHECK(a.valid_tokens == 2);
    const auto t = load_balancing_loss(c, a, 1.0).value();
    CHECK(t.total_tokens == 2.0);
    for (int e = 0; e < 4; ++e) CHECK(a.scores[1 * 4 + e] == 0.0);
  });
}

TEST_CASE("folded groups: TP x CP and TP x DP x CP communicators from a Megatron fold") {
  // World 16: attention TP2 x CP2 x DP4, MoE EP4. Each DP replica has its own batch; full-sequence
  // dropping over each tp-cp group equals the whole-sequence decision of that replica.
  const auto fold = make_folded({.world = 16, .tp = 2, .cp = 2, .ep = 4, .etp = 1}).value();
  const megatron_groups groups(fold);
  const auto router = host_topk_router<double>::make({.num_experts = E, .topk = K}).value();
  const full_sequence policy{.capacity_factor = 0.75, .by = drop_by::position};
  std::vector<drop_result<double>> ref(4);
  std::vector<std::vector<double>> batch(4);
  for (int dp = 0; dp < 4; ++dp) {
    batch[dp] = random_vector<double>(S * B * E, 450 + static_cast<std::uint64_t>(dp));
    topk_routing<double> r;
    REQUIRE(router.route(batch[dp], r));
    REQUIRE(host_apply(sub_sequence{.capacity_factor = 0.75, .by = drop_by::position}, r, ref[dp]));
  }
  std::mutex m;
  run_ok(16, [&](thread_communicator& world) {
    auto tp_cp = group_communicator(world, groups, {group_kind::tp_cp}).value();
    auto dp = group_communicator(world, groups, {group_kind::dp}).value();
    REQUIRE(tp_cp.size() == 4);
    const auto keys = keys_of(tp_cp.rank(), {2, 2});
    const int replica = dp.rank();
    topk_routing<double> r;
    REQUIRE(router.route(rows(batch[replica], keys), r));
    drop_result<double> d;
    REQUIRE(host_apply(policy, tp_cp, keys, r, d));
    std::lock_guard lk(m);
    for (std::size_t i = 0; i < keys.size(); ++i)
      for (int e = 0; e < E; ++e)
        CHECK(d.final_map[i * E + e] == ref[replica].final_map[keys[i] * E + e]);
  });
}

TEST_CASE("bad input to the losses and the bias update: clear errors") {
  const auto logits = random_vector<double>(6 * E, 461);
  run_ok(1, [&](thread_communicator& c) {
    aux_scores<double> a;
    const std::vector<std::uint8_t> short_mask(5, 0);
    CHECK(compute_aux_scores<double>(score_function::softmax, K, E, logits, short_mask, a)
              .error()
              .code == errc::shape_mismatch);
    CHECK(
        compute_aux_scores<double>(score_function::softmax, E + 1, E, logits, {}, a).error().code ==
        errc::invalid_argument);
    auto bad = logits;
    bad[7] = std::nan("");
    CHECK(compute_aux_scores<double>(score_function::sigmoid, K, E, bad, {}, a).error().code ==
          errc::non_finite_input);
    CHECK(z_loss<double>(bad, E, 1e-3).error().code == errc::non_finite_input);
    CHECK(z_loss<double>(std::span<const double>(logits.data(), 6 * E - 1), E, 1e-3).error().code ==
          errc::shape_mismatch);
    REQUIRE(compute_aux_scores<double>(score_function::softmax, K, E, logits, {}, a));
    CHECK(seq_load_balancing_loss(c, a, 4, 0.01).error().code == errc::shape_mismatch);  // 6 % 4
    global_aux_state st{.tokens_per_expert = std::vector<double>(E + 1, 0.0), .steps = 0};
    CHECK(global_load_balancing_loss(c, a, 0.01, st).error().code == errc::shape_mismatch);
    const auto t = load_balancing_loss(c, a, 0.01).value();
    std::vector<double> dl(5 * E);
    CHECK(add_aux_loss_gradient<double>(score_function::softmax, logits, E, {}, t, 1.0, dl)
              .error()
              .code == errc::shape_mismatch);
    expert_bias_state b{.bias = std::vector<float>(E, 0.f),
                        .local_tokens_per_expert = std::vector<float>(E - 1, 0.f)};
    CHECK(update_expert_bias(c, b, 1e-3f).error().code == errc::shape_mismatch);
  });
}

TEST_CASE("the per-sequence loss is the mean over sequences of each sequence's own loss") {
  const auto logits = random_vector<double>(S * B * E, 471);
  run_ok(1, [&](thread_communicator& c) {
    for (auto f : {score_function::softmax, score_function::sigmoid}) {
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(f, K, E, logits, {}, a));
      const double seq = seq_load_balancing_loss(c, a, B, 0.01).value().loss;
      double mean = 0;
      for (int b = 0; b < B; ++b) {
        std::vector<double> one;  // sequence b alone: tokens s*B + b
        for (int s = 0; s < S; ++s)
          one.insert(one.end(), logits.begin() + (s * B + b) * E,
                     logits.begin() + (s * B + b + 1) * E);
        aux_scores<double> ab;
        REQUIRE(compute_aux_scores<double>(f, K, E, one, {}, ab));
        mean += load_balancing_loss(c, ab, 0.01).value().loss / B;
      }
      check_same(seq, mean);
    }
  });
}
