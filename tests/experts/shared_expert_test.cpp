// The shared expert on the thread world, TP-sharded with sequence parallelism, against a
// single-rank fp64 reference written here (full SwiGLU MLP and sigmoid gate per token).
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/experts/shared_expert.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "../support/mlp_layout.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

double val(int a, int b, int c) {  // deterministic values in [-0.5, 0.5)
  unsigned z = static_cast<unsigned>(a) * 2654435761u ^ static_cast<unsigned>(b) * 40503u ^
               static_cast<unsigned>(c) * 2246822519u;
  z ^= z >> 15;
  z *= 2246822519u;
  z ^= z >> 13;
  return static_cast<double>(z % 10000u) / 10000.0 - 0.5;
}

struct setup {
  int H = 4, F = 8, tokens = 3;
  bool gate = true;
  std::vector<double> w1, w2, wg;  // [H, 2F] [gate | up], [F, H], [H]
  setup() {
    for (int i = 0; i < H * 2 * F; ++i) w1.push_back(val(1, i, 0));
    for (int i = 0; i < F * H; ++i) w2.push_back(val(2, i, 0));
    for (int i = 0; i < H; ++i) wg.push_back(val(3, i, 0));
  }
  double x(int rank, int t, int h) const { return val(4, rank * 100 + t, h); }
  double dout(int rank, int t, int h) const { return val(5, rank * 100 + t, h); }
};

double silu(double v) { return v / (1 + std::exp(-v)); }
double dsilu(double v) {
  const double s = 1 / (1 + std::exp(-v));
  return s * (1 + v * (1 - s));
}

// Reference for one token: output, dx, and += full gradients.
void reference(const setup& s, const double* x, const double* dout, double* out, double* dx,
               std::vector<double>& dw1, std::vector<double>& dw2, std::vector<double>& dwg) {
  const int H = s.H, F = s.F;
  std::vector<double> y(H, 0.0), a(F), gate(F), up(F);
  for (int c = 0; c < F; ++c) {
    gate[c] = up[c] = 0;
    for (int h = 0; h < H; ++h) {
      gate[c] += x[h] * s.w1[h * 2 * F + c];
      up[c] += x[h] * s.w1[h * 2 * F + F + c];
    }
    a[c] = silu(gate[c]) * up[c];
    for (int o = 0; o < H; ++o) y[o] += a[c] * s.w2[c * H + o];
  }
  double z = 0;
  for (int h = 0; h < H; ++h) z += x[h] * s.wg[h];
  const double g = s.gate ? 1 / (1 + std::exp(-z)) : 1.0;
  double dg = 0;
  for (int o = 0; o < H; ++o) {
    out[o] = g * y[o];
    dg += dout[o] * y[o];
    dx[o] = 0;
  }
  if (s.gate) {
    const double dpre = dg * g * (1 - g);
    for (int h = 0; h < H; ++h) {
      dwg[h] += dpre * x[h];
      dx[h] += dpre * s.wg[h];
    }
  }
  for (int c = 0; c < F; ++c) {
    double dh = 0;
    for (int o = 0; o < H; ++o) {
      dh += g * dout[o] * s.w2[c * H + o];
      dw2[c * H + o] += a[c] * g * dout[o];
    }
    const double dgate = dh * up[c] * dsilu(gate[c]), dup = dh * silu(gate[c]);
    for (int h = 0; h < H; ++h) {
      dw1[h * 2 * F + c] += x[h] * dgate;
      dw1[h * 2 * F + F + c] += x[h] * dup;
      dx[h] += dgate * s.w1[h * 2 * F + c] + dup * s.w1[h * 2 * F + F + c];
    }
  }
}

}  // namespace

TEST_CASE("the shared expert under TP x DP equals the single-rank reference, gate included") {
  for (auto [world, tp, gate] :
       {std::tuple{1, 1, true}, std::tuple{2, 2, true}, std::tuple{4, 2, false},
        std::tuple{4, 4, true}, std::tuple{8, 2, true}}) {
    CAPTURE(world);
    CAPTURE(tp);
    setup s;
    s.gate = gate;
    const auto fold = make_folded({.world = world, .tp = tp}).value();
    const megatron_groups groups(fold);
    // Reference over the whole world (one stage): outputs per rank and summed gradients.
    std::vector<double> dw1(s.H * 2 * s.F, 0.0), dw2(s.F * s.H, 0.0), dwg(s.H, 0.0);
    std::vector<std::vector<double>> ref_out(world), ref_dx(world);
    for (int r = 0; r < world; ++r) {
      ref_out[r].resize(s.tokens * s.H);
      ref_dx[r].resize(s.tokens * s.H);
      for (int t = 0; t < s.tokens; ++t) {
        std::vector<double> x(s.H), d(s.H);
        for (int h = 0; h < s.H; ++h) {
          x[h] = s.x(r, t, h);
          d[h] = s.dout(r, t, h);
        }
        reference(s, x.data(), d.data(), &ref_out[r][t * s.H], &ref_dx[r][t * s.H], dw1, dw2, dwg);
      }
    }
    const auto st = run_thread_world(world, [&](thread_communicator& comm) -> status {
      const int r = comm.rank();
      auto tpc = group_communicator(comm, groups, {group_kind::tp}).value();
      auto dpcp = group_communicator(comm, groups, {group_kind::dp_cp}).value();
      const int tp_rank = fold.attention_coord_of(r).tp;
      host_exec hx;  // the context every call runs on
      auto se =
          shared_expert<double, host_exec, thread_communicator>::make(hx, {.max_tokens = s.tokens,
                                                                           .hidden = s.H,
                                                                           .ffn = s.F,
                                                                           .tp = tp,
                                                                           .tp_rank = tp_rank,
                                                                           .gate = gate})
              .value();
      const std::vector<double> wg = gate ? s.wg : std::vector<double>{};
      if (auto e = se.load_full(megatron_fc1_from_columns(s.w1, s.H, 2, s.F),
                                megatron_fc2_from_rows(s.w2, s.F, s.H), wg);
          !e)
        return e;
      std::vector<double> x, dout, out(s.tokens * s.H), dx(s.tokens * s.H);
      for (int t = 0; t < s.tokens; ++t)
        for (int h = 0; h < s.H; ++h) {
          x.push_back(s.x(r, t, h));
          dout.push_back(s.dout(r, t, h));
        }
      std::vector<std::byte> saved(se.saved_bytes()), scratch(se.scratch_bytes());
      const auto rows = [&](std::vector<double>& v) {
        return row_view<double>(v.data(), s.tokens, s.H);
      };
      // out and dx start at 0: the shared expert adds its part.
      if (auto e = se.forward(hx, rows(x), tpc, rows(out), saved, scratch); !e) return e;
      if (auto e = se.backward(hx, rows(dout), tpc, rows(dx), saved, scratch); !e) return e;
      // MLP shards: summed over dp-cp. Gate: summed over the whole stage (tp-dp-cp).
      const auto& pg = se.params();
      if (auto e = dpcp.all_reduce<double>(pg.grads.fc1.flat(), reduce_op::sum); !e) return e;
      if (auto e = dpcp.all_reduce<double>(pg.grads.fc2.flat(), reduce_op::sum); !e) return e;
      if (auto e = comm.all_reduce<double>(pg.gate_grad.flat(), reduce_op::sum); !e) return e;
      for (std::size_t i = 0; i < out.size(); ++i) {
        CHECK(out[i] == doctest::Approx(ref_out[r][i]).epsilon(1e-12));
        CHECK(dx[i] == doctest::Approx(ref_dx[r][i]).epsilon(1e-12));
      }
      // The shard's entries, found in the library's layout (support/mlp_layout.hpp).
      const int fs = s.F / tp;
      for (int h = 0; h < s.H; ++h)
        for (int gu = 0; gu < 2; ++gu)
          for (int c = 0; c < fs; ++c)
            CHECK(pg.grads.fc1.flat()[fc1_offset(h, gu * fs + c, s.H)] ==
                  doctest::Approx(dw1[h * 2 * s.F + gu * s.F + tp_rank * fs + c]).epsilon(1e-12));
      for (int c = 0; c < fs; ++c)
        for (int h = 0; h < s.H; ++h)
          CHECK(pg.grads.fc2.flat()[fc2_offset(c, h, fs)] ==
                doctest::Approx(dw2[(tp_rank * fs + c) * s.H + h]).epsilon(1e-12));
      for (int h = 0; h < s.H && gate; ++h)
        CHECK(pg.gate_grad.flat()[h] == doctest::Approx(dwg[h]).epsilon(1e-12));
      return {};
    });
    for (const auto& e : st) CHECK_MESSAGE(e.has_value(), e.error().message);
  }
}

TEST_CASE("shared expert misuse is rejected") {
  using se_t = shared_expert<double, host_exec, thread_communicator>;
  host_exec hx;
  CHECK(se_t::make(hx, {.max_tokens = 2, .hidden = 4, .ffn = 6, .tp = 4}).error().code ==
        errc::invalid_argument);  // F not divisible by TP
  CHECK(se_t::make(hx, {.max_tokens = 2, .hidden = 4, .ffn = 4, .tp = 2, .tp_rank = 2})
            .error()
            .code == errc::invalid_argument);  // tp_rank outside [0, tp)
  auto st = run_thread_world(1, [&](thread_communicator& comm) -> status {
    auto se =
        se_t::make(hx, {.max_tokens = 2, .hidden = 2, .ffn = 2, .tp = 2, .tp_rank = 0}).value();
    std::vector<double> x(4), out(4), dx(4);
    std::vector<std::byte> saved(se.saved_bytes()), scratch(se.scratch_bytes());
    const row_view<double> xv(x.data(), 2, 2), ov(out.data(), 2, 2);
    CHECK(se.forward(hx, xv, comm, ov, saved, scratch).error().code ==
          errc::shape_mismatch);  // TP 1 != 2
    // Full weights of the wrong shape, a saved part too small, a bound form's load.
    CHECK(se.load_full(std::vector<double>(4), std::vector<double>(2), std::vector<double>(2))
              .error()
              .code == errc::shape_mismatch);
    auto one = se_t::make(hx, {.max_tokens = 2, .hidden = 2, .ffn = 2}).value();
    std::vector<std::byte> small(one.saved_bytes() / 2);
    CHECK(one.forward(hx, xv, comm, ov, small, scratch).error().code == errc::workspace_too_small);
    std::vector<double> w1(8), w2(4), g1(8), g2(4);  // fc1 [2F, H], fc2 [H, F]
    CHECK(
        one.bind(shared_expert_params<double>{.mlp = {w1, w2}, .mlp_grad = {g1, g2}}).has_value());
    CHECK(one.bound());
    CHECK(one.own().fc1.empty());
    CHECK(one.load_full(std::vector<double>(4), std::vector<double>(2)).error().code ==
          errc::invalid_argument);
    return {};
  });
  CHECK(st[0].has_value());
}
