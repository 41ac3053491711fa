// The shared expert's gate kernels (kernels/shared_gate.hpp) on the CPU executor against the
// host shared expert's arithmetic (experts/shared_expert.hpp), written out here on fresh random
// inputs (seed printed; MOEFOLD_TEST_SEED replays one), outputs poisoned before each launch.
// The gates against fp64 (the sigmoids differ: moefold's exp on the kernel side); everything
// after them bit for bit, given the kernel's gates (the same sums in the same order; the gate
// weight's gradient summed per backward, then added once). Tokens 1, 7,
// 513 (<= 64 under TSan), hidden 1, 7, 8, 264, odd row strides, fp32 and bf16, gate on and off.
// Each launch also runs on host_exec on the same inputs (the earlier launches' cpu_exec outputs),
// into its own copy of the outputs: cpu_exec's bits (one thread per token or column, each sum in
// ascending order on every context).
#include <doctest/doctest.h>

#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/shared_gate.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../support/simt_test_sizes.hpp"

using namespace moefold;

namespace {

template <class T>
std::vector<T> random_rows(std::mt19937_64& rng, std::size_t n, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(static_cast<float>(d(rng)));
  return v;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                     sizeof(T) * a.size()) == 0;
}
template <class T>
void poison(std::vector<T>& v) {
  std::memset(static_cast<void*>(v.data()), 0xFF, sizeof(T) * v.size());
}

template <class T>
void check_gate(std::mt19937_64& rng, int N, int H, bool gated) {
  using A = accumulator_t<T>;
  using detail::narrow;
  using detail::widen;
  CAPTURE(N);
  CAPTURE(H);
  CAPTURE(gated);
  const int S = H + 3;  // odd row strides
  const auto at = [S](long long t, int h) { return static_cast<std::size_t>(t * S + h); };
  const auto NS = static_cast<std::size_t>(N) * S, Hs = static_cast<std::size_t>(H);
  const double scale = 1.0 / std::sqrt(static_cast<double>(H));  // logits of order 1
  const auto x = random_rows<T>(rng, NS), y = random_rows<T>(rng, NS),
             dout = random_rows<T>(rng, NS), out0 = random_rows<T>(rng, NS),
             dx0 = random_rows<T>(rng, NS);
  const auto w = random_rows<T>(rng, Hs, scale);
  const auto grad0 = random_rows<float>(rng, Hs);
  const int blocks = 3;  // fewer than the tokens' blocks at N = 513: the grid strides

  // Forward.
  std::vector<float> gates(static_cast<std::size_t>(N));
  std::vector<T> out = out0;
  poison(gates);
  const kernels::shared_gate_forward_kernel<T> fwd{.x = {x.data(), S},
                                                   .gate = gated ? w.data() : nullptr,
                                                   .y = {y.data(), S},
                                                   .num_tokens = N,
                                                   .hidden = H,
                                                   .gates = gates.data(),
                                                   .out = {out.data(), S}};
  REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = blocks}, fwd));
  {
    std::vector<float> host_gates(gates.size());
    std::vector<T> host_out = out0;
    poison(host_gates);
    auto on_host = fwd;
    on_host.gates = host_gates.data();
    on_host.out.p = host_out.data();
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = blocks}, on_host));
    INFO("host_exec against cpu_exec");
    CHECK(same_bits(host_gates, gates));
    CHECK(same_bits(host_out, out));
  }
  std::vector<T> want_out = out0;
  for (int t = 0; t < N; ++t) {
    double z = 0;
    for (int h = 0; h < H; ++h)
      z += static_cast<double>(widen(x[at(t, h)])) * static_cast<double>(widen(w[Hs * 0 + h]));
    const double g64 = gated ? 1.0 / (1.0 + std::exp(-z)) : 1.0;
    const float g = gates[static_cast<std::size_t>(t)];
    // fp32: within a few ulp of fp64 (the fp32 dot product's error, then the sigmoid's 2 ulp);
    // bf16: the gate is rounded to bf16 (2^-8 relative).
    const double tol = std::is_same_v<T, float> ? 1e-6 + 4e-7 * H : 8e-3;
    CHECK(std::abs(static_cast<double>(g) - g64) <= tol * std::max(1.0, g64));
    if (!gated) CHECK(g == 1.0f);
    for (int h = 0; h < H; ++h) {
      const T shared = narrow<T>(static_cast<A>(g) * A(widen(y[at(t, h)])));
      want_out[at(t, h)] = narrow<T>(A(widen(want_out[at(t, h)])) + A(widen(shared)));
    }
  }
  CHECK(same_bits(out, want_out));  // padding columns untouched too

  // Backward: dy and dpre per token, the weight's gradient, the gate's part of dx.
  std::vector<T> dy(NS);
  std::vector<A> dpre(static_cast<std::size_t>(N));
  poison(dy);
  poison(dpre);
  std::vector<T> want_dy = dy;
  std::vector<A> want_dpre = dpre;
  const kernels::shared_gate_backward_kernel<T> bwd{.dout = {dout.data(), S},
                                                    .y = {y.data(), S},
                                                    .gates = gates.data(),
                                                    .num_tokens = N,
                                                    .hidden = H,
                                                    .gated = gated,
                                                    .dy = {dy.data(), S},
                                                    .dpre = dpre.data()};
  REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = blocks}, bwd));
  {
    std::vector<T> host_dy(dy.size());
    std::vector<A> host_dpre(dpre.size());
    poison(host_dy);
    poison(host_dpre);
    auto on_host = bwd;
    on_host.dy.p = host_dy.data();
    on_host.dpre = host_dpre.data();
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = blocks}, on_host));
    INFO("host_exec against cpu_exec");
    CHECK(same_bits(host_dy, dy));
    CHECK(same_bits(host_dpre, dpre));
  }
  for (int t = 0; t < N; ++t) {
    const A g = static_cast<A>(gates[static_cast<std::size_t>(t)]);
    A dg = A(0);
    for (int h = 0; h < H; ++h) {
      want_dy[at(t, h)] = narrow<T>(g * A(widen(dout[at(t, h)])));
      dg += A(widen(dout[at(t, h)])) * A(widen(y[at(t, h)]));
    }
    if (gated) want_dpre[static_cast<std::size_t>(t)] = dg * g * (A(1) - g);
  }
  CHECK(same_bits(dy, want_dy));
  CHECK(same_bits(dpre, want_dpre));
  if (!gated) return;
  std::vector<float> grad = grad0, want_grad = grad0;
  const kernels::shared_gate_weight_grad_kernel<T, float> wg{
      .x = {x.data(), S}, .dpre = dpre.data(), .num_tokens = N, .hidden = H, .grad = grad.data()};
  REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = 1}, wg));
  {
    std::vector<float> host_grad = grad0;
    auto on_host = wg;
    on_host.grad = host_grad.data();
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = 1}, on_host));
    CHECK_MESSAGE(same_bits(host_grad, grad), "host_exec against cpu_exec");
  }
  for (int h = 0; h < H; ++h) {  // this backward's sum, then one add
    A sum = A(0);
    for (int t = 0; t < N; ++t)
      sum += want_dpre[static_cast<std::size_t>(t)] * A(widen(x[at(t, h)]));
    want_grad[static_cast<std::size_t>(h)] =
        static_cast<float>(static_cast<A>(want_grad[static_cast<std::size_t>(h)]) + sum);
  }
  CHECK(same_bits(grad, want_grad));
  std::vector<T> dx = dx0, want_dx = dx0;
  const kernels::shared_gate_dx_kernel<T> gdx{
      .dpre = dpre.data(), .gate = w.data(), .num_tokens = N, .hidden = H, .dx = {dx.data(), S}};
  REQUIRE(launch(cpu_exec{rng()}, launch_grid{.blocks = blocks}, gdx));
  {
    std::vector<T> host_dx = dx0;
    auto on_host = gdx;
    on_host.dx.p = host_dx.data();
    REQUIRE(launch(host_exec{}, launch_grid{.blocks = blocks}, on_host));
    CHECK_MESSAGE(same_bits(host_dx, dx), "host_exec against cpu_exec");
  }
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < H; ++h)
      want_dx[at(t, h)] = narrow<T>(A(widen(want_dx[at(t, h)])) +
                                    A(widen(narrow<T>(want_dpre[static_cast<std::size_t>(t)]))) *
                                        A(widen(w[Hs * 0 + h])));
  CHECK(same_bits(dx, want_dx));
}

}  // namespace

TEST_CASE("shared gate kernels on cpu_exec equal the host shared expert's arithmetic") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int N : {1, 7, test::simt_reduced ? 64 : 513})
    for (const int H : {1, 7, 8, 264})
      for (const bool gated : {true, false}) {
        check_gate<float>(rng, N, H, gated);
        check_gate<bfloat16>(rng, N, H, gated);
      }
}
