// grouped_mlp, the expert functor over caller-owned weight and gradient views: the shard layout
// stated per element (buffers built by hand here from Hugging Face gate_proj/up_proj/down_proj),
// the backward against fp64 finite differences of a formula written out here, accumulation
// (beta = 1) into the caller's gradient buffers, bf16 weights with fp32 main_grad, the views (no
// copy, in-place changes seen), and the errors.
#include <moefold/experts/grouped_mlp.hpp>
#include <moefold/experts/reference_mlp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../support/activation_ref.hpp"

using namespace moefold;
using moefold::test::act_ref;
using moefold::test::all_acts;

static_assert(expert_fn<grouped_mlp<double>, double>);
static_assert(expert_fn<grouped_mlp<float>, float>);
static_assert(expert_fn<grouped_mlp<bfloat16>, bfloat16>);
static_assert(expert_fn<grouped_mlp<bfloat16, float>, bfloat16>);
static_assert(std::is_same_v<main_grad_t<bfloat16>, float>);
static_assert(std::is_same_v<main_grad_t<double>, double>);
static_assert(std::is_same_v<grouped_mlp<bfloat16>::grad_type, float>);
static_assert(std::is_same_v<grouped_mlp<double>::grad_type, double>);

namespace {

constexpr std::size_t uz(int n) { return static_cast<std::size_t>(n); }

std::vector<double> random_vec(std::mt19937& rng, std::size_t n, double scale = 1.0) {
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// One expert's full (unsharded) weights in Hugging Face's layout: gate_proj [F, H] (gated only),
// up_proj [F, H], down_proj [H, F].
struct hf_expert {
  std::vector<double> gate, up, down;
};

hf_expert random_expert(std::mt19937& rng, activation act, int H, int F) {
  hf_expert e;
  if (is_gated(act)) e.gate = random_vec(rng, uz(F * H));
  e.up = random_vec(rng, uz(F * H));
  e.down = random_vec(rng, uz(H * F));
  return e;
}

template <class T>
T from_double(double d) {
  if constexpr (std::is_same_v<T, double>)
    return d;
  else
    return T(static_cast<float>(d));
}
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return static_cast<double>(static_cast<float>(v));
}
// Rounds every value to bf16 and back (so the fp64 reference sees the same inputs).
void round_bf16(std::vector<double>& v) {
  for (auto& x : v) x = to_double(from_double<bfloat16>(x));
}

// ETP shard buffers of all local experts, built by hand from the documented rule: fc1 of local
// expert l = [gate rows r*Fs..(r+1)*Fs ; up rows the same] (only the up rows when not gated), each
// row H long; fc2 of local expert l = [H, Fs], columns r*Fs..(r+1)*Fs of down_proj. The experts
// follow each other. (Also maps gradients in HF layout to the shard layout.)
template <class T>
struct shard {
  std::vector<T> fc1, fc2;
};
template <class T>
shard<T> make_shard(const std::vector<hf_expert>& ex, activation act, int H, int F, int etp,
                    int r) {
  const int Fs = F / etp;
  shard<T> s;
  for (const hf_expert& e : ex) {
    if (is_gated(act))
      for (int c = 0; c < Fs; ++c)
        for (int h = 0; h < H; ++h) s.fc1.push_back(from_double<T>(e.gate[(r * Fs + c) * H + h]));
    for (int c = 0; c < Fs; ++c)
      for (int h = 0; h < H; ++h) s.fc1.push_back(from_double<T>(e.up[(r * Fs + c) * H + h]));
  }
  for (const hf_expert& e : ex)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < Fs; ++c) s.fc2.push_back(from_double<T>(e.down[h * F + r * Fs + c]));
  return s;
}

// The fp64 formula: row i of expert l: y = down_proj @ (act(gate_proj @ x) * (up_proj @ x) * p),
// or down_proj @ (act(up_proj @ x) * p) when not gated.
std::vector<double> ref_forward(const std::vector<hf_expert>& ex, activation act, int H, int F,
                                const std::vector<int>& counts, const std::vector<double>& x,
                                const std::vector<double>& p) {
  std::vector<double> y(x.size(), 0.0);
  std::vector<double> hid(uz(F), 0.0);
  int row = 0;
  for (std::size_t l = 0; l < counts.size(); ++l)
    for (int i = 0; i < counts[l]; ++i, ++row) {
      const hf_expert& e = ex[l];
      const double* xr = &x[uz(row * H)];
      for (int c = 0; c < F; ++c) {
        double g = 0, u = 0;
        for (int h = 0; h < H; ++h) {
          if (is_gated(act)) g += e.gate[c * H + h] * xr[h];
          u += e.up[c * H + h] * xr[h];
        }
        hid[uz(c)] = (is_gated(act) ? act_ref(act, g) * u : act_ref(act, u)) * p[row];
      }
      for (int o = 0; o < H; ++o) {
        double s = 0;
        for (int c = 0; c < F; ++c) s += e.down[o * F + c] * hid[uz(c)];
        y[uz(row * H + o)] = s;
      }
    }
  return y;
}

// Gradients of L = sum(y * dy) by central finite differences of ref_forward, in fp64.
struct ref_grads {
  std::vector<hf_expert> dw;
  std::vector<double> dx, dp;
};
ref_grads fd_grads(std::vector<hf_expert> ex, activation act, int H, int F,
                   const std::vector<int>& counts, std::vector<double> x, std::vector<double> p,
                   const std::vector<double>& dy) {
  auto loss = [&] {
    const auto y = ref_forward(ex, act, H, F, counts, x, p);
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
    return l;
  };
  const double eps = 1e-6;
  auto fd = [&](std::vector<double>& v) {
    std::vector<double> d(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + eps;
      const double lp = loss();
      v[i] = keep - eps;
      const double lm = loss();
      v[i] = keep;
      d[i] = (lp - lm) / (2 * eps);
    }
    return d;
  };
  ref_grads g;
  for (auto& e : ex) g.dw.push_back({fd(e.gate), fd(e.up), fd(e.down)});
  g.dx = fd(x);
  g.dp = fd(p);
  return g;
}

// max |a - b| / max |b|: every element within tol of the largest reference magnitude.
template <class T>
double max_rel(const std::vector<T>& a, const std::vector<double>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    d = std::max(d, std::abs(to_double(a[i]) - b[i]));
    m = std::max(m, std::abs(b[i]));
  }
  return d / m;
}
// ||a - b||_2 / ||b||_2
template <class T>
double norm_rel(const std::vector<T>& a, const std::vector<double>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const double e = to_double(a[i]) - b[i];
    d += e * e;
    m += b[i] * b[i];
  }
  return std::sqrt(d / m);
}
template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

int rows_of(const std::vector<int>& counts) {
  int m = 0;
  for (int c : counts) m += c;
  return m;
}

}  // namespace

TEST_CASE("layout per element: hand-built ETP shards of HF weights sum to the fp64 formula") {
  std::mt19937 rng(11);
  const int H = 5, F = 8, L = 2;
  const std::vector<int> counts = {3, 2};
  const int M = rows_of(counts);
  for (activation act : all_acts) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) ex.push_back(random_expert(rng, act, H, F));
    const auto x = random_vec(rng, uz(M * H));
    const auto p = random_vec(rng, uz(M));
    const auto want = ref_forward(ex, act, H, F, counts, x, p);
    const expert_batch<double> b{.hidden = H, .counts = counts, .x = x, .probs = p};
    for (int etp : {1, 2, 4}) {
      CAPTURE(etp);
      std::vector<double> y(uz(M * H), 0.0);
      for (int r = 0; r < etp; ++r) {
        const mlp_shape s{
            .hidden = H, .ffn = F, .num_local_experts = L, .etp = etp, .etp_rank = r, .act = act};
        auto w = make_shard<double>(ex, act, H, F, etp, r);
        const mlp_param_sizes n = mlp_sizes(s);
        REQUIRE(w.fc1.size() == n.fc1);
        REQUIRE(w.fc2.size() == n.fc2);
        std::vector<double> g1(n.fc1), g2(n.fc2);
        auto m = grouped_mlp<double, double>::make(s, {w.fc1, w.fc2}, {g1, g2});
        REQUIRE(m);
        std::vector<double> yr(uz(M * H));
        REQUIRE(m->forward(b, yr));
        for (std::size_t i = 0; i < y.size(); ++i) y[i] += yr[i];
      }
      CHECK(max_rel(y, want) <= 1e-12);
    }
  }
}

TEST_CASE("backward: fp64 finite differences, beta = 1 accumulation, weights never written") {
  std::mt19937 rng(12);
  const int H = 4, F = 4, L = 3;
  const std::vector<int> counts = {2, 0, 3};  // a local expert without rows
  const int M = rows_of(counts);
  for (activation act : all_acts) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) ex.push_back(random_expert(rng, act, H, F));
    const auto x = random_vec(rng, uz(M * H));
    const auto p = random_vec(rng, uz(M));
    const auto dy = random_vec(rng, uz(M * H));
    const expert_batch<double> b{.hidden = H, .counts = counts, .x = x, .probs = p};
    const ref_grads fd = fd_grads(ex, act, H, F, counts, x, p, dy);
    for (int etp : {1, 2, 4}) {
      CAPTURE(etp);
      std::vector<double> dx(uz(M * H), 0.0), dp(uz(M), 0.0);
      for (int r = 0; r < etp; ++r) {
        CAPTURE(r);
        const mlp_shape s{
            .hidden = H, .ffn = F, .num_local_experts = L, .etp = etp, .etp_rank = r, .act = act};
        const auto w = make_shard<double>(ex, act, H, F, etp, r);
        const auto w_before = w;
        const auto want = make_shard<double>(fd.dw, act, H, F, etp, r);  // FD grads, shard layout
        // The caller's gradient buffers hold V != 0 before the backward.
        const auto v1 = random_vec(rng, w.fc1.size(), 4.0);
        const auto v2 = random_vec(rng, w.fc2.size(), 4.0);
        std::vector<double> g1 = v1, g2 = v2;
        std::vector<double> f1(w.fc1.size(), 0.0), f2(w.fc2.size(), 0.0);  // fresh, from 0
        auto m = grouped_mlp<double>::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
        auto fresh = grouped_mlp<double>::make(s, {w.fc1, w.fc2}, {f1, f2}).value();
        std::vector<double> dxr(uz(M * H)), dpr(uz(M));
        std::vector<double> dxf(uz(M * H)), dpf(uz(M));
        REQUIRE(m.backward(b, dy, dxr, dpr));
        REQUIRE(fresh.backward(b, dy, dxf, dpf));
        CHECK(bitwise_equal(dxr, dxf));
        CHECK(bitwise_equal(dpr, dpf));
        for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += dxr[i];
        for (std::size_t i = 0; i < dp.size(); ++i) dp[i] += dpr[i];
        // Weights untouched, bytewise.
        CHECK(bitwise_equal(w.fc1, w_before.fc1));
        CHECK(bitwise_equal(w.fc2, w_before.fc2));
        // The fresh gradient against finite differences (eps = 1e-6: roundoff ~1e-8 of the scale).
        CHECK(max_rel(f1, want.fc1) <= 1e-6);
        CHECK(max_rel(f2, want.fc2) <= 1e-6);
        // Accumulated: g == V + fresh. The fresh gradient is a sum over at most 3 rows, so the
        // two sum orders differ by a few ulps of |V| + |fresh| (here within 1e-15 of that).
        // Where the expert has no rows (l = 1) the buffer must still hold V exactly.
        for (auto [g, v, f] : {std::tuple{&g1, &v1, &f1}, std::tuple{&g2, &v2, &f2}}) {
          const std::size_t per = g->size() / uz(L);
          int bad = 0, untouched_bad = 0;
          for (std::size_t i = 0; i < g->size(); ++i) {
            const double want_i = (*v)[i] + (*f)[i];
            const double scale = std::abs((*v)[i]) + std::abs((*f)[i]);
            if (std::abs((*g)[i] - want_i) > 4 * std::numeric_limits<double>::epsilon() * scale)
              ++bad;
            if (i / per == 1 && (*g)[i] != (*v)[i]) ++untouched_bad;
          }
          CHECK(bad == 0);
          CHECK(untouched_bad == 0);
        }
      }
      CHECK(max_rel(dx, fd.dx) <= 1e-6);
      CHECK(max_rel(dp, fd.dp) <= 1e-6);
    }
  }
}

TEST_CASE("backward accumulates beta = 1 bitwise: V + one row's gradient, then the next row's") {
  // Each row's own gradient c_r (a one-row batch into zeroed buffers) added to V in row order
  // gives exactly what one backward over all rows accumulates into buffers holding V.
  std::mt19937 rng(13);
  const int H = 3, F = 4, L = 2;
  const std::vector<int> counts = {1, 2};
  const int M = rows_of(counts);
  for (activation act : {activation::swiglu, activation::gelu}) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) ex.push_back(random_expert(rng, act, H, F));
    const auto x = random_vec(rng, uz(M * H));
    const auto p = random_vec(rng, uz(M));
    const auto dy = random_vec(rng, uz(M * H));
    const mlp_shape s{
        .hidden = H, .ffn = F, .num_local_experts = L, .etp = 2, .etp_rank = 1, .act = act};
    const auto w = make_shard<double>(ex, act, H, F, 2, 1);
    const auto v1 = random_vec(rng, w.fc1.size(), 4.0);
    const auto v2 = random_vec(rng, w.fc2.size(), 4.0);
    std::vector<double> g1 = v1, g2 = v2;
    auto m = grouped_mlp<double>::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
    std::vector<double> dx(uz(M * H)), dp(uz(M));
    REQUIRE(m.backward({.hidden = H, .counts = counts, .x = x, .probs = p}, dy, dx, dp));
    std::vector<double> e1 = v1, e2 = v2;  // expected, summed here row by row
    int row = 0;
    for (int l = 0; l < L; ++l)
      for (int i = 0; i < counts[uz(l)]; ++i, ++row) {
        std::vector<int> one(uz(L), 0);
        one[uz(l)] = 1;
        const std::span<const double> xr(&x[uz(row * H)], uz(H));
        const std::span<const double> pr(&p[uz(row)], 1);
        const std::span<const double> dyr(&dy[uz(row * H)], uz(H));
        std::vector<double> c1(w.fc1.size(), 0.0), c2(w.fc2.size(), 0.0);
        auto single = grouped_mlp<double>::make(s, {w.fc1, w.fc2}, {c1, c2}).value();
        std::vector<double> dxr(uz(H)), dpr(1);
        REQUIRE(single.backward({.hidden = H, .counts = one, .x = xr, .probs = pr}, dyr, dxr, dpr));
        for (std::size_t k = 0; k < e1.size(); ++k) e1[k] += c1[k];
        for (std::size_t k = 0; k < e2.size(); ++k) e2[k] += c2[k];
      }
    CHECK(bitwise_equal(g1, e1));
    CHECK(bitwise_equal(g2, e2));
    // A second backward adds the same again (never zeroes).
    const auto once1 = g1;
    REQUIRE(m.backward({.hidden = H, .counts = counts, .x = x, .probs = p}, dy, dx, dp));
    int not_added = 0;
    for (std::size_t k = 0; k < g1.size(); ++k) {
      const double d = once1[k] - v1[k];
      if (d != 0 && std::abs((g1[k] - once1[k]) - d) > 1e-12 * (std::abs(once1[k]) + 1))
        ++not_added;
    }
    CHECK(not_added == 0);
  }
}

TEST_CASE("bf16 weights and rows, fp32 main_grad: within 1e-2 of fp64 on the same inputs") {
  std::mt19937 rng(14);
  const int H = 8, F = 8, L = 2;
  const std::vector<int> counts = {3, 4};
  const int M = rows_of(counts);
  for (activation act : all_acts) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) {
      ex.push_back(random_expert(rng, act, H, F));
      round_bf16(ex.back().gate);
      round_bf16(ex.back().up);
      round_bf16(ex.back().down);
    }
    auto x = random_vec(rng, uz(M * H));
    auto p = random_vec(rng, uz(M));
    auto dy = random_vec(rng, uz(M * H));
    round_bf16(x);
    round_bf16(p);
    round_bf16(dy);
    std::vector<bfloat16> xb, pb, dyb;
    for (double v : x) xb.push_back(from_double<bfloat16>(v));
    for (double v : p) pb.push_back(from_double<bfloat16>(v));
    for (double v : dy) dyb.push_back(from_double<bfloat16>(v));
    const expert_batch<bfloat16> b{.hidden = H, .counts = counts, .x = xb, .probs = pb};

    const auto y_ref = ref_forward(ex, act, H, F, counts, x, p);
    const ref_grads fd = fd_grads(ex, act, H, F, counts, x, p, dy);
    // The planted defect: the same reference with gate and up swapped (gated only).
    std::vector<hf_expert> swapped = ex;
    if (is_gated(act))
      for (auto& e : swapped) std::swap(e.gate, e.up);
    const auto y_bad = ref_forward(swapped, act, H, F, counts, x, p);
    const ref_grads fd_bad = is_gated(act) ? fd_grads(swapped, act, H, F, counts, x, p, dy) : fd;

    for (int etp : {1, 2}) {
      CAPTURE(etp);
      std::vector<double> y(uz(M * H), 0.0), dx(uz(M * H), 0.0), dp(uz(M), 0.0);
      for (int r = 0; r < etp; ++r) {
        CAPTURE(r);
        const mlp_shape s{
            .hidden = H, .ffn = F, .num_local_experts = L, .etp = etp, .etp_rank = r, .act = act};
        const auto w = make_shard<bfloat16>(ex, act, H, F, etp, r);
        const auto want = make_shard<double>(fd.dw, act, H, F, etp, r);
        const auto want_bad = make_shard<double>(fd_bad.dw, act, H, F, etp, r);
        std::vector<float> g1(w.fc1.size(), 0.f), g2(w.fc2.size(), 0.f);
        auto m = grouped_mlp<bfloat16>::make(s, {w.fc1, w.fc2}, {g1, g2});
        REQUIRE(m);
        std::vector<bfloat16> yr(uz(M * H)), dxr(uz(M * H)), dpr(uz(M));
        REQUIRE(m->forward(b, yr));
        REQUIRE(m->backward(b, dyb, dxr, dpr));
        for (std::size_t i = 0; i < y.size(); ++i) y[i] += to_double(yr[i]);
        for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += to_double(dxr[i]);
        for (std::size_t i = 0; i < dp.size(); ++i) dp[i] += to_double(dpr[i]);
        CHECK(norm_rel(g1, want.fc1) <= 1e-2);
        CHECK(norm_rel(g2, want.fc2) <= 1e-2);
        if (is_gated(act)) {
          CHECK(norm_rel(g1, want_bad.fc1) > 1e-2);
          CHECK(norm_rel(g2, want_bad.fc2) > 1e-2);
        }
      }
      CHECK(norm_rel(y, y_ref) <= 1e-2);
      CHECK(norm_rel(dx, fd.dx) <= 1e-2);
      CHECK(norm_rel(dp, fd.dp) <= 1e-2);
      if (is_gated(act)) {  // the check can fail
        CHECK(norm_rel(y, y_bad) > 1e-2);
        CHECK(norm_rel(dx, fd_bad.dx) > 1e-2);
      }
    }
  }
}

TEST_CASE("views: grouped_mlp over a caller's vectors equals reference_mlp bitwise, no copy") {
  std::mt19937 rng(15);
  const int H = 4, F = 6, L = 2, etp = 2, rank = 1;
  const std::vector<int> counts = {2, 3};
  const int M = rows_of(counts);
  for (activation act : {activation::swiglu, activation::gelu}) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) ex.push_back(random_expert(rng, act, H, F));
    const mlp_shape s{
        .hidden = H, .ffn = F, .num_local_experts = L, .etp = etp, .etp_rank = rank, .act = act};
    auto w = make_shard<double>(ex, act, H, F, etp, rank);
    std::vector<double> g1(w.fc1.size(), 0.0), g2(w.fc2.size(), 0.0);
    auto view = grouped_mlp<double>::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
    CHECK(view.weights().fc1.data() == w.fc1.data());
    CHECK(view.weights().fc2.data() == w.fc2.data());
    CHECK(view.grads().fc1.data() == g1.data());
    CHECK(view.grads().fc2.data() == g2.data());

    auto own = reference_mlp<double>::make(s).value();
    for (int l = 0; l < L; ++l) {
      std::vector<double> full1 = ex[uz(l)].gate;  // [gate; up] rows, [G*F, H]
      full1.insert(full1.end(), ex[uz(l)].up.begin(), ex[uz(l)].up.end());
      REQUIRE(own.load_full(l, full1, ex[uz(l)].down));
    }
    CHECK(
        std::equal(w.fc1.begin(), w.fc1.end(), own.weights_fc1().begin(), own.weights_fc1().end()));
    CHECK(
        std::equal(w.fc2.begin(), w.fc2.end(), own.weights_fc2().begin(), own.weights_fc2().end()));

    const auto x = random_vec(rng, uz(M * H));
    const auto p = random_vec(rng, uz(M));
    const auto dy = random_vec(rng, uz(M * H));
    const expert_batch<double> b{.hidden = H, .counts = counts, .x = x, .probs = p};
    std::vector<double> ya(uz(M * H)), yb(uz(M * H)), dxa(uz(M * H)), dxb(uz(M * H)), dpa(uz(M)),
        dpb(uz(M));
    REQUIRE(view.forward(b, ya));
    REQUIRE(own.forward(b, yb));
    REQUIRE(view.backward(b, dy, dxa, dpa));
    REQUIRE(own.backward(b, dy, dxb, dpb));
    CHECK(bitwise_equal(ya, yb));
    CHECK(bitwise_equal(dxa, dxb));
    CHECK(bitwise_equal(dpa, dpb));
    const std::vector<double> og1(own.grads_fc1().begin(), own.grads_fc1().end());
    const std::vector<double> og2(own.grads_fc2().begin(), own.grads_fc2().end());
    CHECK(bitwise_equal(g1, og1));  // landed in the caller's buffers
    CHECK(bitwise_equal(g2, og2));
    CHECK(std::any_of(g1.begin(), g1.end(), [](double v) { return v != 0; }));

    // A weight changed in place by the caller is seen by the next forward.
    w.fc1[3] += 0.75;
    w.fc2[5] -= 0.5;
    std::vector<double> y2(uz(M * H)), y_fresh(uz(M * H));
    REQUIRE(view.forward(b, y2));
    const auto w_copy = w;  // a fresh functor over other storage holding the new values
    std::vector<double> h1(w.fc1.size()), h2(w.fc2.size());
    auto fresh = grouped_mlp<double>::make(s, {w_copy.fc1, w_copy.fc2}, {h1, h2}).value();
    REQUIRE(fresh.forward(b, y_fresh));
    CHECK(bitwise_equal(y2, y_fresh));
    CHECK_FALSE(bitwise_equal(y2, ya));
  }
}

TEST_CASE("errors name the rule; a refused bind keeps the old binding") {
  const int H = 4, F = 6, L = 2;
  const mlp_shape s{.hidden = H, .ffn = F, .num_local_experts = L, .etp = 2, .etp_rank = 0};
  const mlp_param_sizes n = mlp_sizes(s);  // swiglu: fc1 = 2 * 2 * 3 * 4 = 48, fc2 = 2 * 4 * 3
  CHECK(n.fc1 == 48);
  CHECK(n.fc2 == 24);
  std::vector<double> w1(n.fc1, 0.25), w2(n.fc2, -0.5), g1(n.fc1), g2(n.fc2);
  std::vector<double> short1(n.fc1 - 1), long2(n.fc2 + 1);

  SUBCASE("wrong-sized views") {
    auto check_msg = [&](const expected<grouped_mlp<double>>& r) {
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::shape_mismatch);
      const std::string& msg = r.error().message;
      CAPTURE(msg);
      CHECK(msg.find("fc1") != std::string::npos);
      CHECK(msg.find("= 48") != std::string::npos);
      CHECK(msg.find("= 24") != std::string::npos);
    };
    check_msg(grouped_mlp<double>::make(s, {short1, w2}, {g1, g2}));
    check_msg(grouped_mlp<double>::make(s, {w1, long2}, {g1, g2}));
    check_msg(grouped_mlp<double>::make(s, {w1, w2}, {short1, g2}));
    check_msg(grouped_mlp<double>::make(s, {w1, w2}, {g1, long2}));
    // fp32 gradients for bf16 weights are sized the same way.
    std::vector<bfloat16> b1(n.fc1), b2(n.fc2);
    std::vector<float> f1(n.fc1), f2(n.fc2 - 1);
    auto rb = grouped_mlp<bfloat16>::make(s, {b1, b2}, {f1, f2});
    REQUIRE_FALSE(rb);
    CHECK(rb.error().message.find("fc1") != std::string::npos);
  }
  SUBCASE("ETP must divide F") {
    mlp_shape bad = s;
    bad.etp = 4;
    auto r = grouped_mlp<double>::make(bad, {w1, w2}, {g1, g2});
    REQUIRE_FALSE(r);
    CHECK(r.error().code == errc::invalid_argument);
    CAPTURE(r.error().message);
    CHECK(r.error().message.find("not divisible by etp = 4") != std::string::npos);
  }
  SUBCASE("etp_rank in [0, etp)") {
    for (int rank : {-1, 2, 3}) {
      mlp_shape bad = s;
      bad.etp_rank = rank;
      auto r = grouped_mlp<double>::make(bad, {w1, w2}, {g1, g2});
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::rank_out_of_range);
      CHECK(r.error().message.find("etp_rank") != std::string::npos);
    }
  }
  SUBCASE("bad sizes") {
    for (mlp_shape bad : {mlp_shape{.hidden = 0, .ffn = 6}, mlp_shape{.hidden = 4, .ffn = 0},
                          mlp_shape{.hidden = 4, .ffn = 6, .etp = 0}}) {
      auto r = grouped_mlp<double>::make(bad, {}, {});
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::invalid_size);
    }
  }
  SUBCASE("bind: refused keeps the old binding, accepted rebinds") {
    auto m = grouped_mlp<double>::make(s, {w1, w2}, {g1, g2}).value();
    const std::vector<int> counts = {1, 1};
    const std::vector<double> x = {1, -2, 0.5, 3, -1, 0.25, 2, -0.5}, p = {0.5, -1.5};
    const expert_batch<double> b{.hidden = H, .counts = counts, .x = x, .probs = p};
    std::vector<double> y_old(8), y(8);
    REQUIRE(m.forward(b, y_old));
    std::vector<double> o1(n.fc1, -0.125), o2(n.fc2, 0.75), h1(n.fc1), h2(n.fc2);
    for (std::size_t i = 0; i < o1.size(); ++i) o1[i] = 0.01 * double(i) - 0.2;
    auto st = m.bind({o1, o2}, {short1, h2});  // gradients the wrong size
    REQUIRE_FALSE(st);
    CHECK(st.error().message.find("fc1") != std::string::npos);
    CHECK_FALSE(m.bind({o1, long2}, {h1, h2}));
    CHECK(m.weights().fc1.data() == w1.data());
    CHECK(m.grads().fc1.data() == g1.data());
    REQUIRE(m.forward(b, y));
    CHECK(bitwise_equal(y, y_old));
    // Accepted: the functor now computes over the other buffers.
    REQUIRE(m.bind({o1, o2}, {h1, h2}));
    CHECK(m.weights().fc1.data() == o1.data());
    REQUIRE(m.forward(b, y));
    std::vector<double> y_want(8), k1(n.fc1), k2(n.fc2);
    auto other = grouped_mlp<double>::make(s, {o1, o2}, {k1, k2}).value();
    REQUIRE(other.forward(b, y_want));
    CHECK(bitwise_equal(y, y_want));
    CHECK_FALSE(bitwise_equal(y, y_old));
  }
}
