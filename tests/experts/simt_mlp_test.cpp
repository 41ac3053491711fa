// The portable expert on the CPU executor (experts/simt_mlp.hpp: the SIMT grouped GEMM and the
// activation kernels over the executor's memory) against grouped_mlp, the host reference expert,
// on fresh random inputs (seed printed):
// - in fp64 (the kernels then accumulate in fp64): forward output, input and probability
//   gradients and both weight gradients (accumulated onto earlier values) agree with
//   grouped_mlp<double> to 1e-14 of each output's magnitude, for gated and plain activations,
//   both ETP shards of ETP 2, experts with 0 rows; this checks the wiring (operands, strides,
//   transposes, shards, the probability's placement) with nothing but fp64 rounding in between;
// - in fp32 and bf16: the forward output within a bound derived from the operands' magnitudes
//   (K roundings per GEMM, the activation's slope times fc1's error);
// - bad shapes are refused with the rule named.
#include <doctest/doctest.h>

#include <cmath>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/experts/grouped_mlp.hpp>
#include <moefold/experts/simt_mlp.hpp>
#include <random>
#include <string>
#include <vector>

#include "../support/simt_test_sizes.hpp"

using namespace moefold;

namespace {

using S = cpu_exec::memory_space;

template <class T>
exec_buffer<T, cpu_exec> upload(cpu_exec& x, const std::vector<T>& v, long long rows,
                                long long width) {
  auto b = exec_buffer<T, cpu_exec>::make(x, rows, width);
  REQUIRE(b);
  REQUIRE(x.copy(
      row_view<const T, host_space>(v.data(), static_cast<int>(rows), static_cast<int>(width)),
      b->view()));
  return std::move(*b);
}
template <class T>
std::vector<T> download(cpu_exec& x, row_view<const T, S> v) {
  std::vector<T> h(static_cast<std::size_t>(v.rows()) * static_cast<std::size_t>(v.width()));
  REQUIRE(x.copy(v, row_view<T, host_space>(h.data(), v.rows(), v.width())));
  return h;
}

template <class T>
std::vector<T> random_vec(std::size_t n, std::mt19937_64& rng, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(rng));
  return v;
}

// Each element of got against want within tol * (|want| + scale).
void check_close(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                 double tol, double& worst) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double bound = tol * (std::abs(want[i]) + scale) + 1e-300;
    const double err = std::abs(got[i] - want[i]);
    worst = std::max(worst, err / bound);
    CHECK_MESSAGE(err <= bound, what << "[" << i << "]: " << got[i] << " vs " << want[i]);
  }
}

}  // namespace

TEST_CASE("simt_mlp in fp64 equals grouped_mlp<double>: forward, backward, both ETP shards") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  double worst = 0;
  const std::vector<int> counts = {0, 5, 34};  // an empty expert; one across a 32-row tile
  const int L = 3, H = 24, F = 20, M = 39;
  const auto acts = test::simt_reduced
                        ? std::vector<activation>{activation::swiglu}
                        : std::vector<activation>{activation::swiglu, activation::gelu};
  for (activation act : acts)
    for (int etp_rank = 0; etp_rank < 2; ++etp_rank) {
      CAPTURE(static_cast<int>(act));
      CAPTURE(etp_rank);
      const mlp_shape s{.hidden = H,
                        .ffn = F,
                        .num_local_experts = L,
                        .etp = 2,
                        .etp_rank = etp_rank,
                        .act = act};
      const auto n = mlp_sizes(s);
      const int fs = F / 2, f1 = (is_gated(act) ? 2 : 1) * fs;
      const auto w1 = random_vec<double>(n.fc1, rng, 0.3f),
                 w2 = random_vec<double>(n.fc2, rng, 0.3f);
      auto g1 = random_vec<double>(n.fc1, rng), g2 = random_vec<double>(n.fc2, rng);
      const auto x = random_vec<double>(static_cast<std::size_t>(M) * H, rng);
      const auto dy = random_vec<double>(static_cast<std::size_t>(M) * H, rng);
      std::vector<double> p(static_cast<std::size_t>(M));
      for (auto& v : p) v = std::abs(random_vec<double>(1, rng)[0]) / 2;

      // The host reference.
      auto hg1 = g1, hg2 = g2;
      auto ref = grouped_mlp<double>::make(s, {w1, w2}, {hg1, hg2});
      REQUIRE(ref);
      const expert_batch<double> hb{.hidden = H, .counts = counts, .x = x, .probs = p};
      std::vector<double> y_ref(x.size()), dx_ref(x.size()), dp_ref(p.size());
      REQUIRE(ref->forward(hb, y_ref));
      REQUIRE(ref->backward(hb, dy, dx_ref, dp_ref));

      // The same on the executor.
      cpu_exec ex(rng());
      auto dw1 = upload(ex, w1, static_cast<long long>(L) * f1, H);
      auto dw2 = upload(ex, w2, static_cast<long long>(L) * H, fs);
      auto dg1 = upload(ex, g1, static_cast<long long>(L) * f1, H);
      auto dg2 = upload(ex, g2, static_cast<long long>(L) * H, fs);
      auto dx_in = upload(ex, x, M, H);
      auto dp = upload(ex, p, M, 1);
      auto ddy = upload(ex, dy, M, H);
      auto dy_out = exec_buffer<double, cpu_exec>::make(ex, M, H);
      auto ddx = exec_buffer<double, cpu_exec>::make(ex, M, H);
      auto ddp = exec_buffer<double, cpu_exec>::make(ex, M, 1);
      REQUIRE(dy_out);
      REQUIRE(ddx);
      REQUIRE(ddp);
      auto m = simt_mlp<double, cpu_exec>::make(ex, s, {dw1.cview(), dw2.cview()},
                                                {dg1.view(), dg2.view()});
      REQUIRE(m);
      const device_expert_batch<double, double, S> db{
          .counts = counts, .x = dx_in.cview(), .probs = dp.cview()};
      REQUIRE(m->forward(db, dy_out->view()));
      REQUIRE(m->backward(db, ddy.cview(), ddx->view(), ddp->view()));
      const double tol = 1e-14;  // K fp64 roundings of the magnitude: K 2^-53 < 1e-14
      check_close("y", download(ex, dy_out->cview()), y_ref, tol, worst);
      check_close("dx", download(ex, ddx->cview()), dx_ref, tol, worst);
      check_close("dprobs", download(ex, ddp->cview()), dp_ref, tol, worst);
      check_close("fc1 grad", download(ex, dg1.cview()), hg1, tol, worst);
      check_close("fc2 grad", download(ex, dg2.cview()), hg2, tol, worst);

      // The row ranges on the context instead ([1, L + 1] int offsets, as a dispatch that read
      // no count back hands them over): the same bits, and nothing copied to the context.
      std::vector<int> offsets{0};
      for (int c : counts) offsets.push_back(offsets.back() + c);
      auto doff = upload(ex, offsets, 1, L + 1);
      auto og1 = upload(ex, g1, static_cast<long long>(L) * f1, H);
      auto og2 = upload(ex, g2, static_cast<long long>(L) * H, fs);
      auto oy = exec_buffer<double, cpu_exec>::make(ex, M, H);
      auto odx = exec_buffer<double, cpu_exec>::make(ex, M, H);
      auto odp = exec_buffer<double, cpu_exec>::make(ex, M, 1);
      REQUIRE(oy);
      REQUIRE(odx);
      REQUIRE(odp);
      auto mo = simt_mlp<double, cpu_exec>::make(ex, s, {dw1.cview(), dw2.cview()},
                                                 {og1.view(), og2.view()});
      REQUIRE(mo);
      const device_expert_batch<double, double, S> ob{
          .x = dx_in.cview(), .probs = dp.cview(), .offsets = doff.cview()};
      ex.reset_copies();
      REQUIRE(mo->forward(ob, oy->view()));
      REQUIRE(mo->backward(ob, ddy.cview(), odx->view(), odp->view()));
      CHECK(ex.copies().to_device == 0);
      CHECK(ex.copies().to_host == 0);
      CHECK(download(ex, oy->cview()) == download(ex, dy_out->cview()));
      CHECK(download(ex, odx->cview()) == download(ex, ddx->cview()));
      CHECK(download(ex, odp->cview()) == download(ex, ddp->cview()));
      CHECK(download(ex, og1.cview()) == download(ex, dg1.cview()));
      CHECK(download(ex, og2.cview()) == download(ex, dg2.cview()));
      const device_expert_batch<double, double, S> bad{
          .x = dx_in.cview(),
          .probs = dp.cview(),
          .offsets = row_view<const int, S>(doff.cview().data(), 1, L)};
      const status st = mo->forward(bad, oy->view());
      REQUIRE_FALSE(st.has_value());
      CHECK(st.error().message.find("offsets must be [1, L + 1] = [1, 4]") != std::string::npos);
    }
  MESSAGE("worst " << worst << " of 1e-14 of the magnitude");
}

TEST_CASE_TEMPLATE("simt_mlp forward in fp32 and bf16 within its derived bound of fp64", T, float,
                   bfloat16) {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 1);
  const std::vector<int> counts = {7, 0, 33};
  const int L = 3, H = 40, F = 24, M = 40;
  double worst = 0;
  for (activation act : {activation::swiglu, activation::relu}) {
    CAPTURE(static_cast<int>(act));
    const mlp_shape s{.hidden = H, .ffn = F, .num_local_experts = L, .act = act};
    const auto n = mlp_sizes(s);
    const int fs = F, f1 = (is_gated(act) ? 2 : 1) * fs;
    const auto w1 = random_vec<T>(n.fc1, rng, 0.3f), w2 = random_vec<T>(n.fc2, rng, 0.3f);
    const auto x = random_vec<T>(static_cast<std::size_t>(M) * H, rng);
    std::vector<T> p(static_cast<std::size_t>(M));
    for (auto& v : p) v = T(std::abs(static_cast<float>(random_vec<T>(1, rng)[0])) / 2);
    cpu_exec ex(rng());
    using G = main_grad_t<T>;
    std::vector<G> zeros1(n.fc1), zeros2(n.fc2);
    auto dw1 = upload(ex, w1, static_cast<long long>(L) * f1, H);
    auto dw2 = upload(ex, w2, static_cast<long long>(L) * H, fs);
    auto dg1 = upload(ex, zeros1, static_cast<long long>(L) * f1, H);
    auto dg2 = upload(ex, zeros2, static_cast<long long>(L) * H, fs);
    auto dx_in = upload(ex, x, M, H);
    auto dp = upload(ex, p, M, 1);
    auto dy_out = exec_buffer<T, cpu_exec>::make(ex, M, H);
    REQUIRE(dy_out);
    auto m =
        simt_mlp<T, cpu_exec>::make(ex, s, {dw1.cview(), dw2.cview()}, {dg1.view(), dg2.view()});
    REQUIRE(m);
    REQUIRE(
        m->forward({.counts = counts, .x = dx_in.cview(), .probs = dp.cview()}, dy_out->view()));
    const auto y = download(ex, dy_out->cview());

    // fp64 from the same (rounded) inputs, and each output's bound: fc1 within (H + 1) u of
    // sum |x w1|; the activation's output off by its slope times that plus 2 u (and the
    // product with up and p); fc2 within (Fs + 1) u of sum |h w2| plus sum |w2| |dh|; then
    // the output's own rounding to T. u = 2^-24 (fp32 arithmetic).
    const double u = 0x1p-24, uT = sizeof(T) == 4 ? 0x1p-24 : 0x1p-8;
    int row = 0;
    for (int l = 0; l < L; ++l)
      for (int i = 0; i < counts[l]; ++i, ++row) {
        std::vector<double> a(static_cast<std::size_t>(f1)), amag(a.size()), h(fs), herr(fs);
        for (int c = 0; c < f1; ++c)
          for (int k = 0; k < H; ++k) {
            const double t = static_cast<double>(detail::widen(x[row * H + k])) *
                             detail::widen(w1[(static_cast<std::size_t>(l) * f1 + c) * H + k]);
            a[c] += t;
            amag[c] += std::abs(t);
          }
        const double pr = detail::widen(p[row]);
        for (int c = 0; c < fs; ++c) {
          const double ea = (H + 1) * u * amag[c];
          const double act_v = activate(act, a[c]);
          const double slope = std::abs(activate_derivative(act, a[c]));
          if (is_gated(act)) {
            const double up = a[fs + c], eup = (H + 1) * u * amag[fs + c];
            h[c] = act_v * up * pr;
            herr[c] = ((slope * ea + 2 * u * std::abs(act_v)) * std::abs(up) +
                       (std::abs(act_v) + slope * ea) * eup) *
                          pr +
                      4 * u * std::abs(h[c]);
          } else {
            h[c] = act_v * pr;
            herr[c] = (slope * ea + 2 * u * std::abs(act_v)) * pr + 4 * u * std::abs(h[c]);
          }
        }
        for (int k = 0; k < H; ++k) {
          double y64 = 0, mag = 0, prop = 0;
          for (int c = 0; c < fs; ++c) {
            const double w = detail::widen(w2[(static_cast<std::size_t>(l) * H + k) * fs + c]);
            y64 += h[c] * w;
            mag += std::abs(h[c] * w);
            prop += std::abs(w) * herr[c];
          }
          const double bound = 2 * ((fs + 1) * u * mag + prop) + uT * std::abs(y64) + 1e-30;
          const double err = std::abs(detail::widen(y[row * H + k]) - y64);
          worst = std::max(worst, err / bound);
          CHECK(err <= bound);
        }
      }
  }
  MESSAGE("worst " << worst << " of the bound");
}

TEST_CASE("simt_mlp refuses bad shapes with the rule named") {
  cpu_exec ex(1);
  const mlp_shape s{.hidden = 8, .ffn = 6, .num_local_experts = 2, .act = activation::relu};
  auto w1 = exec_buffer<float, cpu_exec>::make(ex, 12, 8);
  auto w2 = exec_buffer<float, cpu_exec>::make(ex, 16, 6);
  REQUIRE(w1);
  REQUIRE(w2);
  // fc2 given as fc1's shape.
  auto bad =
      simt_mlp<float, cpu_exec>::make(ex, s, {w1->cview(), w1->cview()}, {w1->view(), w2->view()});
  REQUIRE(!bad);
  CHECK(bad.error().code == errc::shape_mismatch);
  CHECK(std::string(bad.error().message).find("fc2 [L H, F / ETP]") != std::string::npos);
  auto ffn = simt_mlp<float, cpu_exec>::make(ex, {.hidden = 8, .ffn = 5, .etp = 2},
                                             {w1->cview(), w2->cview()}, {w1->view(), w2->view()});
  REQUIRE(!ffn);
  CHECK(std::string(ffn.error().message).find("not divisible by etp") != std::string::npos);
  auto m =
      simt_mlp<float, cpu_exec>::make(ex, s, {w1->cview(), w2->cview()}, {w1->view(), w2->view()});
  REQUIRE(m);
  auto x = exec_buffer<float, cpu_exec>::make(ex, 5, 8);
  auto p = exec_buffer<float, cpu_exec>::make(ex, 5, 1);
  auto y = exec_buffer<float, cpu_exec>::make(ex, 5, 8);
  REQUIRE(x);
  REQUIRE(p);
  REQUIRE(y);
  const std::vector<int> three = {1, 2, 2}, short_counts = {1, 2};
  auto st = m->forward({.counts = three, .x = x->cview(), .probs = p->cview()}, y->view());
  CHECK(st.error().code == errc::shape_mismatch);
  CHECK(std::string(st.error().message).find("local experts") != std::string::npos);
  st = m->forward({.counts = short_counts, .x = x->cview(), .probs = p->cview()}, y->view());
  CHECK(std::string(st.error().message).find("M = sum(counts)") != std::string::npos);
  const std::vector<int> negative = {6, -1};
  st = m->forward({.counts = negative, .x = x->cview(), .probs = p->cview()}, y->view());
  CHECK(st.error().code == errc::invalid_argument);
}
