// Backward of the router, the drop mask, the aux losses, the z-loss and the gating linear,
// against central finite differences in fp64 (docs/dispatch-semantics.md section 7, invariant 13).
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/routing/input_jitter.hpp>
#include "../support/host_drop_policy.hpp"
#include "../support/host_gating.hpp"
#include "../support/host_group_losses.hpp"
#include "../support/host_topk_router.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <vector>

#include "util.hpp"

using namespace moefold;
using moefold::test::all_variants;
using moefold::test::random_vector;

namespace {

constexpr int E = 8, N = 12;
constexpr double h = 1e-6;
// Central differences in double: truncation ~h^2 and rounding ~1e-16/h, so 1e-7 is generous for
// O(1) derivatives, yet far below any real error (a wrong term is O(1e-2) or larger).
constexpr double tol = 1e-7;

// d f / d x[i] for every i, by central differences.
std::vector<double> numeric_gradient(std::vector<double> x,
                                     const std::function<double(const std::vector<double>&)>& f) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = f(x);
    x[i] = x0 - h;
    const double down = f(x);
    x[i] = x0;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

void check_close(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(a[i] == doctest::Approx(b[i]).epsilon(tol).scale(1.0));
  }
}

// Runs fn on a one-rank thread world and requires success.
template <class F>
void on_one_rank(F&& fn) {
  const auto st = run_thread_world(1, [&](thread_communicator& c) { fn(c); });
  REQUIRE(st.size() == 1);
  REQUIRE(st[0]);
}

}  // namespace

TEST_CASE("router backward equals finite differences, every variant") {
  const auto logits = random_vector<double>(N * E, 101);
  const auto w = random_vector<double>(N * 4, 102);  // weights of the k probabilities
  const auto bias = random_vector<float>(E, 103, -0.3, 0.3);
  for (const auto& v : all_variants(E)) {
    CAPTURE(v.name);
    const auto router = host_topk_router<double>::make(v.opt).value();
    const auto b = v.opt.expert_bias ? std::span<const float>(bias) : std::span<const float>{};
    const int k = v.opt.topk;
    auto loss = [&](const std::vector<double>& l) {
      topk_routing<double> r;
      REQUIRE(router.route(l, r, b));
      double s = 0;
      for (int i = 0; i < N * k; ++i) s += w[i] * r.probs[i];
      return s;
    };
    topk_routing<double> r;
    REQUIRE(router.route(logits, r, b));
    std::vector<double> dprobs(w.begin(), w.begin() + N * k), dlogits(N * E);
    REQUIRE(router.backward(logits, r, dprobs, dlogits));
    check_close(dlogits, numeric_gradient(logits, loss));
  }
}

TEST_CASE("gradient through the drop mask: dropped pairs get none, survivors are unchanged") {
  const auto logits = random_vector<double>(N * E, 111);
  const auto w = random_vector<double>(N * E, 112);  // weights of final_probs [N, E]
  for (auto by : {drop_by::probs, drop_by::position})
    for (bool pad : {false, true}) {
      CAPTURE(static_cast<int>(by));
      CAPTURE(pad);
      const auto router = host_topk_router<double>::make({.num_experts = E, .topk = 2}).value();
      const sub_sequence policy{.capacity_factor = 0.75, .pad_to_capacity = pad, .by = by};
      auto loss = [&](const std::vector<double>& l) {
        topk_routing<double> r;
        drop_result<double> d;
        REQUIRE(router.route(l, r));
        REQUIRE(host_apply(policy, r, d));
        double s = 0;
        for (int i = 0; i < N * E; ++i) s += w[i] * d.final_probs[i];
        return s;
      };
      topk_routing<double> r;
      drop_result<double> d;
      REQUIRE(router.route(logits, r));
      REQUIRE(host_apply(policy, r, d));
      REQUIRE(d.report.dropped_pairs > 0);  // the case must actually drop something
      std::vector<double> dprobs(N * 2), dlogits(N * E);
      REQUIRE(d.mask_gradient(r, w, dprobs));
      for (int p = 0; p < N * 2; ++p)
        if (!d.kept[p]) CHECK(dprobs[p] == 0.0);
      REQUIRE(router.backward(logits, r, dprobs, dlogits));
      check_close(dlogits, numeric_gradient(logits, loss));
    }
}

TEST_CASE("aux losses and z-loss: gradients with respect to the logits") {
  const int B = 3;  // N = 12 tokens = 4 positions x 3 sequences
  const auto logits = random_vector<double>(N * E, 121);
  for (auto f : {score_function::softmax, score_function::sigmoid, score_function::sqrt_softplus})
    for (int kind = 0; kind < 3; ++kind) {
      CAPTURE(to_string(f));
      CAPTURE(kind);
      const double coeff = 0.01 * (kind + 1);
      global_aux_state prior{.tokens_per_expert = std::vector<double>(E, 5.0), .steps = 2};
      auto term_of = [&](thread_communicator& c, const std::vector<double>& l) {
        aux_scores<double> a;
        REQUIRE(compute_aux_scores<double>(f, 2, E, l, {}, a));
        if (kind == 0) return load_balancing_loss(c, a, coeff).value();
        if (kind == 1) return seq_load_balancing_loss(c, a, B, coeff).value();
        global_aux_state st = prior;  // each evaluation starts from the same running counts
        return global_load_balancing_loss(c, a, coeff, st).value();
      };
      on_one_rank([&](thread_communicator& c) {
        const auto term = term_of(c, logits);
        CHECK(term.loss > 0);
        std::vector<double> dl(N * E, 0.0);
        REQUIRE(add_aux_loss_gradient<double>(f, logits, E, {}, term, 1.0, dl));
        check_close(dl, numeric_gradient(logits, [&](const std::vector<double>& l) {
                      return term_of(c, l).loss;
                    }));
      });
    }
  // z-loss, with a padding mask: padding tokens get no gradient.
  std::vector<std::uint8_t> padding(N, 0);
  padding[3] = padding[7] = 1;
  std::vector<double> dl(N * E, 0.0);
  REQUIRE(add_z_loss_gradient<double>(logits, E, 1e-3, padding, 2.0, dl));
  check_close(dl, numeric_gradient(logits, [&](const std::vector<double>& l) {
                return 2.0 * z_loss<double>(l, E, 1e-3, padding).value();
              }));
  for (int e = 0; e < E; ++e) CHECK(dl[3 * E + e] == 0.0);
}

TEST_CASE("gating backward: dx, dW and db equal finite differences") {
  const gating_shape g{.num_tokens = 4, .hidden = 5, .num_experts = 3};
  const auto x = random_vector<double>(20, 131);
  const auto W = random_vector<double>(15, 132);
  const auto b = random_vector<double>(3, 133);
  const auto w = random_vector<double>(12, 134);
  auto loss = [&](const std::vector<double>& xx, const std::vector<double>& WW,
                  const std::vector<double>& bb) {
    std::vector<double> l(12);
    REQUIRE(gating_forward<double, double, double>(g, xx, WW, bb, l));
    double s = 0;
    for (int i = 0; i < 12; ++i) s += w[i] * l[i];
    return s;
  };
  std::vector<double> dx(20), dW(15), db(3);
  REQUIRE(gating_backward<double, double, double>(g, x, W, w, dx, dW, db));
  check_close(dx, numeric_gradient(x, [&](const std::vector<double>& v) { return loss(v, W, b); }));
  check_close(dW, numeric_gradient(W, [&](const std::vector<double>& v) { return loss(x, v, b); }));
  check_close(db, numeric_gradient(b, [&](const std::vector<double>& v) { return loss(x, W, v); }));
}

TEST_CASE("the whole router step: d(probs . w + aux + z) / d router weight") {
  // x -> gating -> route -> sub-sequence drop -> weighted probs, plus aux loss and z-loss.
  const int H = 6;
  const gating_shape g{.num_tokens = N, .hidden = H, .num_experts = E};
  const auto x = random_vector<double>(N * H, 141);
  const auto W = random_vector<double>(E * H, 142, -0.5, 0.5);
  const auto w = random_vector<double>(N * E, 143);
  const auto router = host_topk_router<double>::make(
                          {.num_experts = E, .topk = 2, .score = score_function::sigmoid})
                          .value();
  const sub_sequence policy{.capacity_factor = 1.0};
  on_one_rank([&](thread_communicator& c) {
    auto forward = [&](const std::vector<double>& WW, std::vector<double>& logits,
                       topk_routing<double>& r, drop_result<double>& d,
                       aux_loss_term<double>& term) {
      logits.assign(N * E, 0.0);
      REQUIRE(gating_forward<double, double, double>(g, x, WW, {}, logits));
      REQUIRE(router.route(logits, r));
      REQUIRE(host_apply(policy, r, d));
      aux_scores<double> a;
      REQUIRE(compute_aux_scores<double>(score_function::sigmoid, 2, E, logits, {}, a));
      term = load_balancing_loss(c, a, 0.1).value();
      double s = term.loss + group_z_loss(c, std::span<const double>(logits), E, 0.01).value();
      for (int i = 0; i < N * E; ++i) s += w[i] * d.final_probs[i];
      return s;
    };
    std::vector<double> logits;
    topk_routing<double> r;
    drop_result<double> d;
    aux_loss_term<double> term;
    forward(W, logits, r, d, term);
    std::vector<double> dprobs(N * 2), dlogits(N * E), dx(N * H), dW(E * H);
    REQUIRE(d.mask_gradient(r, w, dprobs));
    REQUIRE(router.backward(logits, r, dprobs, dlogits));
    REQUIRE(
        add_aux_loss_gradient<double>(score_function::sigmoid, logits, E, {}, term, 1.0, dlogits));
    REQUIRE(add_group_z_loss_gradient(c, std::span<const double>(logits), E, 0.01, {}, 1.0,
                                      std::span<double>(dlogits)));
    REQUIRE(gating_backward<double, double, double>(g, x, W, dlogits, dx, dW, {}));
    check_close(dW, numeric_gradient(W, [&](const std::vector<double>& v) {
                  std::vector<double> l;
                  topk_routing<double> rr;
                  drop_result<double> dd;
                  aux_loss_term<double> tt;
                  return forward(v, l, rr, dd, tt);
                }));
  });
}
