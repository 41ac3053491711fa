// mlp_experts on host_exec, over caller-owned weight and gradient views (host spans): the shard
// layout stated per element (buffers built by hand here from Hugging Face gate_proj/up_proj/
// down_proj), the backward against fp64 finite differences of a formula written out here,
// accumulation (beta = 1) into the caller's gradient buffers (the seam's rule: the batch's
// gradient added once, bit for bit V + the gradient into zeros), bf16 weights with fp32
// main_grad, the views (no copy, in-place changes seen), and the errors. (What grouped_mlp, the
// host loops mlp_experts replaced, asserted; the kernels and both contexts against the fp64
// reference are mlp_experts_test.cpp.)
#include <moefold/exec/host_exec.hpp>
#include <moefold/experts/mlp_experts.hpp>
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
#include "../support/host_batch.hpp"

using namespace moefold;
using moefold::test::act_ref;
using moefold::test::all_acts;
using moefold::test::host_batch;

template <class T, class G = main_grad_t<T>>
using experts_t = mlp_experts<T, host_exec, host_gemms, G>;

static_assert(expert_fn<experts_t<double>, host_exec, double>);
static_assert(expert_fn<experts_t<float>, host_exec, float>);
static_assert(expert_fn<experts_t<bfloat16>, host_exec, bfloat16>);
static_assert(expert_fn<experts_t<bfloat16, float>, host_exec, bfloat16>);
static_assert(std::is_same_v<main_grad_t<bfloat16>, float>);
static_assert(std::is_same_v<main_grad_t<double>, double>);
static_assert(std::is_same_v<experts_t<bfloat16>::grad_type, float>);
static_assert(std::is_same_v<experts_t<double>::grad_type, double>);

namespace {

// The expert_fn calls on a host_exec and a workspace of workspace_bytes(M), over vectors. A
// backward needs its forward's saved part: bwd runs the forward first (into a throwaway y).
template <class E, class B, class Y>
status fwd(E& m, const B& b, Y& y) {
  using T = typename E::value_type;
  host_exec x;
  std::vector<std::byte> ws(m.workspace_bytes(b.rows())), sv(expert_saved_bytes(m, b.rows()));
  return detail::expert_forward(m, x, b, row_view<T>(y.data(), b.rows(), m.hidden()), sv, ws);
}
template <class E, class B, class DY, class DX, class DP>
status bwd(E& m, const B& b, const DY& dy, DX& dx, DP& dp) {
  using T = typename E::value_type;
  using P = typename E::prob_type;
  host_exec x;
  const int M = b.rows(), H = m.hidden();
  std::vector<std::byte> ws(m.workspace_bytes(M)), sv(expert_saved_bytes(m, M));
  std::vector<T> y(static_cast<std::size_t>(M) * static_cast<std::size_t>(H));
  if (auto st = detail::expert_forward(m, x, b, row_view<T>(y.data(), M, H), sv, ws); !st)
    return st;
  return detail::expert_backward(m, x, b, row_view<const T>(dy.data(), M, H),
                                 row_view<T>(dx.data(), M, H), row_view<P>(dp.data(), M, 1), sv,
                                 ws);
}

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
    const auto b = host_batch(H, counts, x, p);
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
        auto m = experts_t<double, double>::make(s, {w.fc1, w.fc2}, {g1, g2});
        REQUIRE(m);
        std::vector<double> yr(uz(M * H));
        REQUIRE(fwd(*m, b, yr));
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
    const auto b = host_batch(H, counts, x, p);
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
        auto m = experts_t<double>::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
        auto fresh = experts_t<double>::make(s, {w.fc1, w.fc2}, {f1, f2}).value();
        std::vector<double> dxr(uz(M * H)), dpr(uz(M));
        std::vector<double> dxf(uz(M * H)), dpf(uz(M));
        REQUIRE(bwd(m, b, dy, dxr, dpr));
        REQUIRE(bwd(fresh, b, dy, dxf, dpf));
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

TEST_CASE_TEMPLATE("backward accumulates beta = 1 bitwise: V + the batch's gradient, rounded once",
                   Gemms, host_gemms, simt_gemms) {
  // The seam's rule for weight gradients (exec/grouped_gemm.hpp): each gradient element is the
  // batch's sum over its expert's rows, added to the buffer once. So one backward into buffers
  // holding V gives exactly V + c, c the same backward's gradient into zeroed buffers; a second
  // backward adds c again; an expert without rows leaves V untouched. 150 rows for one expert
  // cross host_gemm's k blocks of 128.
  std::mt19937 rng(13);
  const int H = 3, F = 4, L = 3;
  const std::vector<int> counts = {1, 0, 150};
  const int M = rows_of(counts);
  for (activation act : {activation::swiglu, activation::gelu}) {
    CAPTURE(to_string(act));
    std::vector<hf_expert> ex;
    for (int l = 0; l < L; ++l) ex.push_back(random_expert(rng, act, H, F));
    const auto x = random_vec(rng, uz(M * H));
    const auto p = random_vec(rng, uz(M));
    const auto dy = random_vec(rng, uz(M * H));
    const auto b = host_batch(H, counts, x, p);
    const mlp_shape s{
        .hidden = H, .ffn = F, .num_local_experts = L, .etp = 2, .etp_rank = 1, .act = act};
    const auto w = make_shard<double>(ex, act, H, F, 2, 1);
    using E = mlp_experts<double, host_exec, Gemms>;
    const auto v1 = random_vec(rng, w.fc1.size(), 4.0);
    const auto v2 = random_vec(rng, w.fc2.size(), 4.0);
    std::vector<double> g1 = v1, g2 = v2, c1(w.fc1.size(), 0.0), c2(w.fc2.size(), 0.0);
    auto m = E::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
    auto zero = E::make(s, {w.fc1, w.fc2}, {c1, c2}).value();
    std::vector<double> dx(uz(M * H)), dp(uz(M)), dxc(uz(M * H)), dpc(uz(M));
    REQUIRE(bwd(m, b, dy, dx, dp));
    REQUIRE(bwd(zero, b, dy, dxc, dpc));
    CHECK(bitwise_equal(dx, dxc));  // the data gradients do not depend on the buffers
    CHECK(bitwise_equal(dp, dpc));
    auto plus = [](std::vector<double> v, const std::vector<double>& c) {
      for (std::size_t k = 0; k < v.size(); ++k) v[k] += c[k];
      return v;
    };
    CHECK(bitwise_equal(g1, plus(v1, c1)));
    CHECK(bitwise_equal(g2, plus(v2, c2)));
    const std::size_t per1 = w.fc1.size() / uz(L), per2 = w.fc2.size() / uz(L);
    CHECK(std::equal(g1.begin() + per1, g1.begin() + 2 * per1, v1.begin() + per1));
    CHECK(std::equal(g2.begin() + per2, g2.begin() + 2 * per2, v2.begin() + per2));
    // A second backward adds the same again (never zeroes).
    const auto once1 = g1, once2 = g2;
    REQUIRE(bwd(m, b, dy, dx, dp));
    CHECK(bitwise_equal(g1, plus(once1, c1)));
    CHECK(bitwise_equal(g2, plus(once2, c2)));
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
    const auto b = host_batch(H, counts, xb, pb);

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
        auto m = experts_t<bfloat16>::make(s, {w.fc1, w.fc2}, {g1, g2});
        REQUIRE(m);
        std::vector<bfloat16> yr(uz(M * H)), dxr(uz(M * H)), dpr(uz(M));
        REQUIRE(fwd(*m, b, yr));
        REQUIRE(bwd(*m, b, dyb, dxr, dpr));
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

TEST_CASE("views: mlp_experts over a caller's vectors equals reference_mlp bitwise, no copy") {
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
    auto view = experts_t<double>::make(s, {w.fc1, w.fc2}, {g1, g2}).value();
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
    const auto b = host_batch(H, counts, x, p);
    std::vector<double> ya(uz(M * H)), yb(uz(M * H)), dxa(uz(M * H)), dxb(uz(M * H)), dpa(uz(M)),
        dpb(uz(M));
    REQUIRE(fwd(view, b, ya));
    REQUIRE(own.forward(b, yb));
    REQUIRE(bwd(view, b, dy, dxa, dpa));
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
    REQUIRE(fwd(view, b, y2));
    const auto w_copy = w;  // a fresh functor over other storage holding the new values
    std::vector<double> h1(w.fc1.size()), h2(w.fc2.size());
    auto fresh = experts_t<double>::make(s, {w_copy.fc1, w_copy.fc2}, {h1, h2}).value();
    REQUIRE(fwd(fresh, b, y_fresh));
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
    auto check_msg = [&](const expected<experts_t<double>>& r) {
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::shape_mismatch);
      const std::string& msg = r.error().message;
      CAPTURE(msg);
      CHECK(msg.find("fc1") != std::string::npos);
      CHECK(msg.find("= 48") != std::string::npos);
      CHECK(msg.find("= 24") != std::string::npos);
    };
    check_msg(experts_t<double>::make(s, {short1, w2}, {g1, g2}));
    check_msg(experts_t<double>::make(s, {w1, long2}, {g1, g2}));
    check_msg(experts_t<double>::make(s, {w1, w2}, {short1, g2}));
    check_msg(experts_t<double>::make(s, {w1, w2}, {g1, long2}));
    // fp32 gradients for bf16 weights are sized the same way.
    std::vector<bfloat16> b1(n.fc1), b2(n.fc2);
    std::vector<float> f1(n.fc1), f2(n.fc2 - 1);
    auto rb = experts_t<bfloat16>::make(s, {b1, b2}, {f1, f2});
    REQUIRE_FALSE(rb);
    CHECK(rb.error().message.find("fc1") != std::string::npos);
  }
  SUBCASE("ETP must divide F") {
    mlp_shape bad = s;
    bad.etp = 4;
    auto r = experts_t<double>::make(bad, {w1, w2}, {g1, g2});
    REQUIRE_FALSE(r);
    CHECK(r.error().code == errc::invalid_argument);
    CAPTURE(r.error().message);
    CHECK(r.error().message.find("not divisible by etp = 4") != std::string::npos);
  }
  SUBCASE("etp_rank in [0, etp)") {
    for (int rank : {-1, 2, 3}) {
      mlp_shape bad = s;
      bad.etp_rank = rank;
      auto r = experts_t<double>::make(bad, {w1, w2}, {g1, g2});
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::rank_out_of_range);
      CHECK(r.error().message.find("etp_rank") != std::string::npos);
    }
  }
  SUBCASE("bad sizes") {
    for (mlp_shape bad : {mlp_shape{.hidden = 0, .ffn = 6}, mlp_shape{.hidden = 4, .ffn = 0},
                          mlp_shape{.hidden = 4, .ffn = 6, .etp = 0}}) {
      auto r = experts_t<double>::make(bad, mlp_weights<double>{}, mlp_grads<double>{});
      REQUIRE_FALSE(r);
      CHECK(r.error().code == errc::invalid_size);
    }
  }
  SUBCASE("bind: refused keeps the old binding, accepted rebinds") {
    auto m = experts_t<double>::make(s, {w1, w2}, {g1, g2}).value();
    const std::vector<int> counts = {1, 1};
    const std::vector<double> x = {1, -2, 0.5, 3, -1, 0.25, 2, -0.5}, p = {0.5, -1.5};
    const auto b = host_batch(H, counts, x, p);
    std::vector<double> y_old(8), y(8);
    REQUIRE(fwd(m, b, y_old));
    std::vector<double> o1(n.fc1, -0.125), o2(n.fc2, 0.75), h1(n.fc1), h2(n.fc2);
    for (std::size_t i = 0; i < o1.size(); ++i) o1[i] = 0.01 * double(i) - 0.2;
    auto st = m.bind({o1, o2}, {short1, h2});  // gradients the wrong size
    REQUIRE_FALSE(st);
    CHECK(st.error().message.find("fc1") != std::string::npos);
    CHECK_FALSE(m.bind({o1, long2}, {h1, h2}));
    CHECK(m.weights().fc1.data() == w1.data());
    CHECK(m.grads().fc1.data() == g1.data());
    REQUIRE(fwd(m, b, y));
    CHECK(bitwise_equal(y, y_old));
    // Accepted: the functor now computes over the other buffers.
    REQUIRE(m.bind({o1, o2}, {h1, h2}));
    CHECK(m.weights().fc1.data() == o1.data());
    REQUIRE(fwd(m, b, y));
    std::vector<double> y_want(8), k1(n.fc1), k2(n.fc2);
    auto other = experts_t<double>::make(s, {o1, o2}, {k1, k2}).value();
    REQUIRE(fwd(other, b, y_want));
    CHECK(bitwise_equal(y, y_want));
    CHECK_FALSE(bitwise_equal(y, y_old));
  }
}
