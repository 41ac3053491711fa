// Reference experts: the backward against fp64 finite differences, the ETP shards against the
// unsharded expert, and the unsharded expert against a formula written out here.
#include <moefold/experts/reference_mlp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "../support/activation_ref.hpp"
#include "../support/host_batch.hpp"
#include "../support/mlp_layout.hpp"

using namespace moefold;
using namespace moefold::test;

static_assert(expert_fn<reference_mlp<double>, host_exec, double>);
static_assert(expert_fn<reference_mlp<float>, host_exec, float>);
static_assert(expert_fn<reference_mlp<bfloat16, float, float>, host_exec, bfloat16, float>);

namespace {

std::vector<double> random_vec(std::mt19937& rng, std::size_t n, double scale = 1.0) {
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// The full weights in this test's layout, converted to load_full's (rows [gate; up] [G*F, H],
// [H, F]) by support/mlp_layout.hpp.
struct full_expert {
  std::vector<double> fc1, fc2;  // [H, G*F] with columns [gate | up], [F, H]
  int H, G, F;
  status load_into(reference_mlp<double>& m) const {
    return m.load_full(0, megatron_fc1_from_columns(fc1, H, G, F),
                       megatron_fc2_from_rows(fc2, F, H));
  }
};

}  // namespace

TEST_CASE("the unsharded expert computes fc2(act(fc1 x) * p) as written out") {
  std::mt19937 rng(1);
  const int H = 5, F = 6;
  for (activation act : all_acts) {
    CAPTURE(to_string(act));
    const int G = is_gated(act) ? 2 : 1;
    full_expert w{random_vec(rng, H * G * F), random_vec(rng, F * H), H, G, F};
    auto m =
        reference_mlp<double>::make({.hidden = H, .ffn = F, .num_local_experts = 1, .act = act})
            .value();
    REQUIRE(w.load_into(m));
    const int M = 4;
    const auto x = random_vec(rng, M * H);
    const auto p = random_vec(rng, M);
    const std::vector<int> counts = {M};
    std::vector<double> y(M * H);
    REQUIRE(m.forward(host_batch(H, counts, x, p), y));
    for (int r = 0; r < M; ++r)
      for (int o = 0; o < H; ++o) {
        double want = 0;
        for (int c = 0; c < F; ++c) {
          double gate = 0, up = 0;
          for (int h = 0; h < H; ++h) {
            gate += x[r * H + h] * w.fc1[h * G * F + c];
            if (G == 2) up += x[r * H + h] * w.fc1[h * G * F + F + c];
          }
          const double hid = (G == 2 ? act_ref(act, gate) * up : act_ref(act, gate)) * p[r];
          want += hid * w.fc2[c * H + o];
        }
        CHECK(y[r * H + o] == doctest::Approx(want).epsilon(1e-13));
      }
  }
}

TEST_CASE("backward equals fp64 finite differences, for every activation") {
  std::mt19937 rng(2);
  const int H = 3, F = 4, L = 2;
  for (activation act : all_acts) {
    CAPTURE(to_string(act));
    auto m =
        reference_mlp<double>::make(
            {.hidden = H, .ffn = F, .num_local_experts = L, .etp = 2, .etp_rank = 1, .act = act})
            .value();
    // Random weights drawn in the order of the reference's shard layout ([L, H, F1], [L, Fs, H]),
    // placed in the library's (support/mlp_layout.hpp).
    const int G = is_gated(act) ? 2 : 1, Fs = F / 2;
    std::vector<double> v1(m.weights_fc1().size()), v2(m.weights_fc2().size());
    for (auto& v : v1) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    for (auto& v : v2) v = std::uniform_real_distribution<double>(-1, 1)(rng);
    const auto c1 = fc1_shards_from_columns<double>(v1, L, H, G * Fs);
    const auto c2 = fc2_shards_from_rows<double>(v2, L, Fs, H);
    std::copy(c1.begin(), c1.end(), m.weights_fc1().begin());
    std::copy(c2.begin(), c2.end(), m.weights_fc2().begin());
    const std::vector<int> counts = {2, 3};  // M = 5
    const int M = 5;
    auto x = random_vec(rng, M * H);
    auto p = random_vec(rng, M);
    const auto g = random_vec(rng, M * H);
    auto loss = [&](reference_mlp<double>& mm, const std::vector<double>& xx,
                    const std::vector<double>& pp) {
      std::vector<double> y(M * H);
      REQUIRE(mm.forward(host_batch(H, counts, xx, pp), y));
      double l = 0;
      for (int i = 0; i < M * H; ++i) l += g[i] * y[i];
      return l;
    };
    std::vector<double> dx(M * H), dp(M);
    m.zero_grad();
    REQUIRE(m.backward(host_batch(H, counts, x, p), g, dx, dp));
    const double eps = 1e-6, tol = 1e-6;
    // (relu kinks: inputs at exactly 0 have probability 0 here.)
    for (std::size_t i = 0; i < x.size(); ++i) {
      auto xp = x, xm = x;
      xp[i] += eps;
      xm[i] -= eps;
      CHECK(dx[i] == doctest::Approx((loss(m, xp, p) - loss(m, xm, p)) / (2 * eps)).epsilon(tol));
    }
    for (std::size_t i = 0; i < p.size(); ++i) {
      auto pp = p, pm = p;
      pp[i] += eps;
      pm[i] -= eps;
      CHECK(dp[i] == doctest::Approx((loss(m, x, pp) - loss(m, x, pm)) / (2 * eps)).epsilon(tol));
    }
    for (auto [w, gw] :
         {std::pair{m.weights_fc1(), m.grads_fc1()}, std::pair{m.weights_fc2(), m.grads_fc2()}})
      for (std::size_t i = 0; i < w.size(); ++i) {
        const double keep = w[i];
        w[i] = keep + eps;
        const double lp = loss(m, x, p);
        w[i] = keep - eps;
        const double lm = loss(m, x, p);
        w[i] = keep;
        CHECK(gw[i] == doctest::Approx((lp - lm) / (2 * eps)).epsilon(tol));
      }
  }
}

TEST_CASE("ETP shards: partial outputs and gradients add up to the unsharded expert's") {
  std::mt19937 rng(3);
  const int H = 4, F = 6, M = 7;
  for (activation act : {activation::swiglu, activation::gelu}) {
    const int G = is_gated(act) ? 2 : 1;
    full_expert w{random_vec(rng, H * G * F), random_vec(rng, F * H), H, G, F};
    const auto x = random_vec(rng, M * H);
    const auto p = random_vec(rng, M);
    const auto dy = random_vec(rng, M * H);
    const std::vector<int> counts = {M};
    const auto b = host_batch(H, counts, x, p);
    auto whole =
        reference_mlp<double>::make({.hidden = H, .ffn = F, .num_local_experts = 1, .act = act})
            .value();
    REQUIRE(w.load_into(whole));
    std::vector<double> y1(M * H), dx1(M * H), dp1(M);
    REQUIRE(whole.forward(b, y1));
    REQUIRE(whole.backward(b, dy, dx1, dp1));
    for (int etp : {2, 3}) {
      std::vector<double> y(M * H, 0.0), dx(M * H, 0.0), dp(M, 0.0);
      for (int r = 0; r < etp; ++r) {
        auto shard = reference_mlp<double>::make({.hidden = H,
                                                  .ffn = F,
                                                  .num_local_experts = 1,
                                                  .etp = etp,
                                                  .etp_rank = r,
                                                  .act = act})
                         .value();
        REQUIRE(w.load_into(shard));
        std::vector<double> yr(M * H), dxr(M * H), dpr(M);
        REQUIRE(shard.forward(b, yr));
        REQUIRE(shard.backward(b, dy, dxr, dpr));
        for (int i = 0; i < M * H; ++i) {
          y[i] += yr[i];
          dx[i] += dxr[i];
        }
        for (int i = 0; i < M; ++i) dp[i] += dpr[i];
        // The shard's fc2 gradient is the matching block (rows of [F, H]: columns of the
        // library's [H, F]) of the whole expert's.
        const int fs = F / etp;
        for (int c = 0; c < fs; ++c)
          for (int h = 0; h < H; ++h)
            CHECK(shard.fc2_grad(0)[fc2_offset(c, h, fs)] ==
                  doctest::Approx(whole.fc2_grad(0)[fc2_offset(r * fs + c, h, F)]).epsilon(1e-12));
      }
      for (int i = 0; i < M * H; ++i) {
        CHECK(y[i] == doctest::Approx(y1[i]).epsilon(1e-12));
        CHECK(dx[i] == doctest::Approx(dx1[i]).epsilon(1e-12));
      }
      for (int i = 0; i < M; ++i) CHECK(dp[i] == doctest::Approx(dp1[i]).epsilon(1e-12));
    }
  }
}

TEST_CASE("experts with zero rows: zero weight gradients, no NaN; M = 0 works") {
  auto m = reference_mlp<float>::make({.hidden = 2, .ffn = 2, .num_local_experts = 3}).value();
  for (auto& v : m.weights_fc1()) v = 0.5f;
  for (auto& v : m.weights_fc2()) v = 0.25f;
  const std::vector<int> counts = {0, 1, 0};
  const std::vector<float> x = {1.f, -1.f}, p = {0.5f}, dy = {1.f, 1.f};
  std::vector<float> y(2), dx(2), dp(1);
  REQUIRE(m.forward(host_batch(2, counts, x, p), y));
  REQUIRE(m.backward(host_batch(2, counts, x, p), dy, dx, dp));
  for (int l : {0, 2}) {
    for (float v : m.fc1_grad(l)) CHECK(v == 0.f);
    for (float v : m.fc2_grad(l)) CHECK(v == 0.f);
  }
  const std::vector<int> none = {0, 0, 0};
  REQUIRE(m.forward(host_batch(2, none, std::span<const float>{}, std::span<const float>{}),
                    std::span<float>{}));
}

TEST_CASE("bad shapes and batches are rejected") {
  CHECK(reference_mlp<double>::make({.hidden = 4, .ffn = 6, .etp = 4})
            .error()
            .message.find("not divisible by etp = 4") != std::string::npos);
  CHECK(reference_mlp<double>::make({.hidden = 0, .ffn = 6}).error().code == errc::invalid_size);
  CHECK(
      reference_mlp<double>::make({.hidden = 2, .ffn = 6, .etp = 2, .etp_rank = 2}).error().code ==
      errc::rank_out_of_range);
  auto m = reference_mlp<double>::make({.hidden = 2, .ffn = 2, .num_local_experts = 2}).value();
  const std::vector<int> counts = {1, 1}, wrong_counts = {2};
  const std::vector<double> x(4), p(2);
  std::vector<double> y(4), short_y(3);
  CHECK(m.forward(host_batch(2, wrong_counts, x, p), y).error().code == errc::shape_mismatch);
  CHECK(m.forward(host_batch(2, counts, x, p), short_y).error().code == errc::shape_mismatch);
  CHECK(m.forward(host_batch(3, counts, x, p), y).error().code == errc::shape_mismatch);
  const std::vector<int> negative = {-1, 3};
  CHECK(m.forward(host_batch(2, negative, x, p), y).error().code == errc::invalid_argument);
  CHECK(m.load_full(0, x, x).error().code == errc::shape_mismatch);
}
