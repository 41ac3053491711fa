// The activation kernels (kernels/activation.hpp) and their special functions (simt/erf.hpp, the
// double exp of simt/math.hpp) against long double references from the C library, on fresh
// random inputs (seed printed; MOEFOLD_TEST_SEED replays one). Every output element is checked:
// within one ulp of the exactly rounded value (the kernels round an fp64 result once, so nearly
// all are equal; the count of those that are not is printed), padding between rows untouched,
// outputs poisoned before each launch, and two executor seeds give the same bits.
//
// Every launch also runs on host_exec on the same inputs (the backward with a team of one), into
// its own poisoned outputs: h, da and the backward's h are per-element double math, cpu_exec's
// bits (padding included). dprobs is not: cpu_exec sums a row as 32 lane-strided fma chains and
// then the warp's butterfly, host_exec as one fma chain over the row (its warp_sum is the lane's
// own value), so the two double sums can differ in their last bits and, rounded to P, by one ulp
// of P (more only where the row's sum cancels). Asserted: |host - cpu| within the bound each has
// against the reference, 2^-23 |dp| + 2^-50 (width + 32) sum |act_out dh| (an ulp of fp32 plus
// the error bound of a double sum of at most width + 5 terms in either order); the rows whose
// bits differ are counted and printed.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/experts/activation.hpp>
#include <moefold/kernels/activation.hpp>
#include <random>
#include <vector>

#include "../support/simt_contexts.hpp"
#include "../support/simt_test_sizes.hpp"

using namespace moefold;
namespace k = moefold::kernels;
namespace simt = moefold::kernels::simt;

namespace {

constexpr activation all_activations[] = {activation::swiglu, activation::geglu,
                                          activation::gelu,   activation::silu,
                                          activation::relu,   activation::squared_relu};

// The independent reference: act and act' in long double from the C library's erfcl and expl.
long double ref_value(activation a, long double x) {
  switch (a) {
    case activation::swiglu:
    case activation::silu: return x / (1.0L + std::exp(-x));
    case activation::geglu:
    case activation::gelu: return 0.5L * x * std::erfc(-x / std::sqrt(2.0L));
    case activation::relu: return x > 0 ? x : 0.0L;
    case activation::squared_relu: return x > 0 ? x * x : 0.0L;
  }
  return x;
}
long double ref_derivative(activation a, long double x) {
  switch (a) {
    case activation::swiglu:
    case activation::silu: {
      const long double s = 1.0L / (1.0L + std::exp(-x));
      return s * (1.0L + x * (1.0L - s));
    }
    case activation::geglu:
    case activation::gelu:
      return 0.5L * std::erfc(-x / std::sqrt(2.0L)) +
             x * std::exp(-x * x / 2.0L) / std::sqrt(2.0L * 3.14159265358979323846264338327950288L);
    case activation::relu: return x > 0 ? 1.0L : 0.0L;
    case activation::squared_relu: return x > 0 ? 2.0L * x : 0.0L;
  }
  return 1.0L;
}

// Distance in units in the last place between two values of T (0 when equal, also +-0).
template <class T>
long ulps(T a, T b) {
  const float fa = static_cast<float>(detail::widen(a)), fb = static_cast<float>(detail::widen(b));
  if (fa == fb) return 0;
  if (std::isnan(fa) || std::isnan(fb)) return 1L << 40;
  std::int64_t x, y;
  if constexpr (sizeof(T) == 2) {
    std::uint16_t u, v;
    std::memcpy(&u, &a, 2);
    std::memcpy(&v, &b, 2);
    x = (u & 0x8000) ? -static_cast<std::int64_t>(u & 0x7fff) : u;
    y = (v & 0x8000) ? -static_cast<std::int64_t>(v & 0x7fff) : v;
  } else {
    std::uint32_t u, v;
    std::memcpy(&u, &fa, 4);
    std::memcpy(&v, &fb, 4);
    x = (u & 0x80000000u) ? -static_cast<std::int64_t>(u & 0x7fffffffu) : u;
    y = (v & 0x80000000u) ? -static_cast<std::int64_t>(v & 0x7fffffffu) : v;
  }
  return static_cast<long>(x > y ? x - y : y - x);
}

// A long double rounded to T as a correctly rounding kernel would (through float for 16-bit T,
// as the kernels do; the comparison allows the one ulp that double rounding can cost).
template <class T>
T round_ref(long double v) {
  return detail::narrow<T>(static_cast<float>(v));
}

template <class T>
struct mat {
  int rows, width, stride;
  std::vector<T> v;
  mat(int r, int w, int pad) : rows(r), width(w), stride(w + pad), v(std::size_t(r) * (w + pad)) {
    poison();
  }
  void poison() { std::memset(static_cast<void*>(v.data()), 0xFF, sizeof(T) * v.size()); }
  T& at(int r, int c) { return v[std::size_t(r) * stride + std::size_t(c)]; }
  k::rows_arg<T> arg() { return {v.data(), stride}; }
  k::rows_arg<const T> carg() const { return {v.data(), stride}; }
  // Every padding element still holds the poison pattern.
  bool padding_untouched() const {
    for (int r = 0; r < rows; ++r)
      for (int c = width; c < stride; ++c) {
        std::uint8_t b[sizeof(T)];
        std::memcpy(b, &v[std::size_t(r) * stride + std::size_t(c)], sizeof(T));
        for (auto x : b)
          if (x != 0xFF) return false;
      }
    return true;
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return std::memcmp(static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                     sizeof(T) * a.size()) == 0;
}

struct tally {
  long checked = 0, off_by_one = 0, worse = 0;
  long dprobs_rows = 0, dprobs_differ = 0;  // host_exec's dprobs against cpu_exec's
  template <class T>
  void add(T got, T want) {
    ++checked;
    const long u = ulps(got, want);
    if (u == 1) ++off_by_one;
    if (u > 1) ++worse;
  }
};

// One forward and one backward launch of (act, T, P) over [rows, width] against the references.
template <class T, class P>
void check_case(activation act, int rows, int width, bool with_probs, std::mt19937_64& rng,
                tally& t) {
  const bool gated = is_gated(act);
  const int f1 = gated ? 2 * width : width;
  const int pad = width % 2 == 1 ? 3 : 0;  // odd widths also get padding between rows
  mat<T> a(rows, f1, pad), h(rows, width, pad), dh(rows, width, pad), da(rows, f1, pad),
      h_again(rows, width, pad);
  std::normal_distribution<float> d(0.0f, 3.0f);
  const float specials[] = {0.0f, -0.0f, -20.0f, -9.5f, 12.0f, 1e-30f, -1e-30f};
  std::size_t n = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < f1; ++c, ++n) a.at(r, c) = static_cast<T>(n < 7 ? specials[n] : d(rng));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < width; ++c) dh.at(r, c) = static_cast<T>(d(rng) / 3.0f);
  std::vector<P> probs(static_cast<std::size_t>(rows)), dprobs(static_cast<std::size_t>(rows));
  for (auto& p : probs) p = static_cast<P>(std::uniform_real_distribution<float>(0.0f, 1.0f)(rng));
  std::memset(static_cast<void*>(dprobs.data()), 0xFF, sizeof(P) * dprobs.size());
  const P* pp = with_probs ? probs.data() : nullptr;

  const k::activation_forward_kernel<T, P> fwd{
      .act = act, .a = a.carg(), .probs = pp, .h = h.arg(), .rows = rows, .width = width};
  const launch_grid grid{.blocks = 2};
  REQUIRE(launch(cpu_exec{rng()}, grid, fwd));
  const k::activation_backward_kernel<T, P> bwd{.act = act,
                                                .a = a.carg(),
                                                .dh = dh.carg(),
                                                .probs = pp,
                                                .da = da.arg(),
                                                .dprobs = with_probs ? dprobs.data() : nullptr,
                                                .rows = rows,
                                                .width = width,
                                                .h = h_again.arg()};
  REQUIRE(launch(cpu_exec{rng()}, grid, bwd));
  // The same two launches on host_exec into their own poisoned outputs.
  mat<T> host_h(rows, width, pad), host_da(rows, f1, pad), host_h_again(rows, width, pad);
  std::vector<P> host_dprobs(dprobs.size());
  std::memset(static_cast<void*>(host_dprobs.data()), 0xFF, sizeof(P) * host_dprobs.size());
  auto host_fwd = fwd;
  host_fwd.h = host_h.arg();
  auto host_bwd = bwd;
  host_bwd.da = host_da.arg();
  host_bwd.dprobs = with_probs ? host_dprobs.data() : nullptr;
  host_bwd.h = host_h_again.arg();
  REQUIRE(launch(host_exec{}, grid, host_fwd));
  REQUIRE(launch(host_exec{}, grid, host_bwd));
  {
    INFO("host_exec against cpu_exec");
    CHECK(same_bits(host_h.v, h.v));
    CHECK(same_bits(host_da.v, da.v));
    CHECK(same_bits(host_h_again.v, h_again.v));
  }
  CHECK(h.padding_untouched());
  CHECK(da.padding_untouched());
  CHECK(h_again.padding_untouched());
  // The backward's h (for the fc2 weight gradient) is the forward's, bit for bit.
  CHECK(same_bits(h_again.v, h.v));

  for (int r = 0; r < rows; ++r) {
    const long double p = with_probs ? static_cast<long double>(detail::widen(probs[r])) : 1.0L;
    long double dp = 0, dp_abs = 0;
    for (int c = 0; c < width; ++c) {
      const long double x = detail::widen(a.at(r, c));
      const long double up =
          gated ? static_cast<long double>(detail::widen(a.at(r, width + c))) : 1.0L;
      const long double g = detail::widen(dh.at(r, c));
      const long double f = ref_value(act, x), fd = ref_derivative(act, x);
      t.add(h.at(r, c), round_ref<T>(f * up * p));
      if (gated) {
        t.add(da.at(r, c), round_ref<T>(p * g * up * fd));
        t.add(da.at(r, width + c), round_ref<T>(p * g * f));
      } else {
        t.add(da.at(r, c), round_ref<T>(p * g * fd));
      }
      dp += f * up * g;
      dp_abs += std::fabs(f * up * g);
    }
    if (with_probs) {
      // A sum in double in a different order than the reference's: within one ulp of the
      // rounded reference plus the sum's own error bound.
      const long double got = detail::widen(dprobs[std::size_t(r)]);
      const long double tol =
          std::ldexp(std::fabs(dp), -23) + std::ldexp(dp_abs, -50) * (width + 32) + 1e-38L;
      CHECK_MESSAGE(std::fabs(got - dp) <= tol,
                    "dprobs row " << r << ": " << double(got) << " vs " << double(dp));
      // host_exec's sum, in the order of one thread: the same bound, against cpu_exec's.
      const long double host_got = detail::widen(host_dprobs[std::size_t(r)]);
      CHECK_MESSAGE(std::fabs(host_got - got) <= tol, "dprobs row "
                                                          << r << ": host_exec " << double(host_got)
                                                          << " vs cpu_exec " << double(got));
      ++t.dprobs_rows;
      if (std::memcmp(&host_dprobs[std::size_t(r)], &dprobs[std::size_t(r)], sizeof(P)) != 0)
        ++t.dprobs_differ;
    }
  }
  if (!with_probs) {  // nothing written where no probability was given
    std::vector<P> poison(dprobs.size());
    std::memset(static_cast<void*>(poison.data()), 0xFF, sizeof(P) * poison.size());
    CHECK(same_bits(dprobs, poison));
    CHECK(same_bits(host_dprobs, poison));
  }
}

}  // namespace

TEST_CASE("simt::exp (double), erf and erfc against the C library in long double") {
  // erfc(z) for z > 2 is e^-z^2 times a fraction: z^2's rounding (2^-52 relative) becomes an
  // error of z^2 2^-52 relative; the kernels' z = -x / sqrt 2 of a float x is not worse.
  double worst_exp = 0, worst_erf = 0, worst_erfc = 0;
  for (double z = -40.0; z <= 40.0; z += 0.000731) {
    const long double e = std::exp(static_cast<long double>(z));
    worst_exp = std::max(worst_exp, double(std::fabs((simt::exp(z) - e) / e)));
    const long double rf = std::erf(static_cast<long double>(z));
    if (rf != 0) worst_erf = std::max(worst_erf, double(std::fabs((simt::erf(z) - rf) / rf)));
    const long double rc = std::erfc(static_cast<long double>(z));
    if (rc > 1e-300L)  // where erfc is still a normal double
      worst_erfc = std::max(
          worst_erfc, double(std::fabs((simt::erfc(z) - rc) / rc)) / (2e-13 + z * z * 0x1p-52));
  }
  MESSAGE("relative error: exp " << worst_exp << ", erf " << worst_erf
                                 << ", erfc (over 2e-13 + z^2 2^-52) " << worst_erfc);
  CHECK(worst_exp <= 4e-16);
  CHECK(worst_erf <= 1e-13);
  CHECK(worst_erfc <= 1.0);
  // Special values.
  CHECK(simt::exp(0.0) == 1.0);
  CHECK(simt::exp(710.0) == std::numeric_limits<double>::infinity());
  CHECK(simt::exp(-746.0) == 0.0);
  CHECK(simt::exp(-740.0) > 0.0);  // subnormal results survive
  CHECK(std::isnan(simt::exp(std::numeric_limits<double>::quiet_NaN())));
  CHECK(simt::erfc(std::numeric_limits<double>::infinity()) == 0.0);
  CHECK(simt::erfc(-std::numeric_limits<double>::infinity()) == 2.0);
  CHECK(simt::erf(0.0) == 0.0);
  CHECK(std::isnan(simt::erfc(std::numeric_limits<double>::quiet_NaN())));
}

TEST_CASE("activation functions: fp32 results equal the exactly rounded value but at boundaries") {
  for (activation a : all_activations) {
    CAPTURE(to_string(a));
    long n = 0, off = 0, worse = 0;
    for (float x = -60.0f; x <= 60.0f; x += 0.00917f) {
      for (bool deriv : {false, true}) {
        const float got =
            static_cast<float>(deriv ? k::activation_derivative(a, x) : k::activation_value(a, x));
        const float want = static_cast<float>(deriv ? ref_derivative(a, x) : ref_value(a, x));
        const long u = ulps(got, want);
        ++n;
        off += u == 1;
        worse += u > 1;
      }
    }
    MESSAGE(to_string(a) << ": " << n << " values, " << off << " one ulp off");
    CHECK(worse == 0);
    CHECK(off * 10000 <= n);  // a boundary case is rarer than 1 in 10^4
    // The host's fp64 activation agrees where its 1 + erf form does not cancel (x > -5).
    for (double x = -5.0; x <= 20.0; x += 0.0137) {
      CHECK(std::fabs(k::activation_value(a, x) - activate(a, x)) <=
            1e-12 * std::max(1.0, std::fabs(activate(a, x))));
      CHECK(std::fabs(k::activation_derivative(a, x) - activate_derivative(a, x)) <= 1e-12);
    }
  }
}

TEST_CASE("activation kernels: forward and backward, every activation, fp32 and bf16") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  // (rows, width): one row, a partial warp of columns, a 16-byte multiple, 4096 + 8 columns; 513
  // rows (more rows than the 3 x 8 warps of the grid) with narrow rows. TSan: rows <= 64.
  std::vector<std::pair<int, int>> shapes = {{1, 1}, {7, 7}, {7, 8}, {1, 4104}, {7, 4104}};
  if (!test::simt_reduced) {
    shapes.push_back({513, 1});
    shapes.push_back({513, 8});
    shapes.push_back({513, 37});
  } else {
    shapes = {{1, 1}, {7, 7}, {33, 8}, {2, 100}};
  }
  tally fp32, bf16;
  // Each activation with and without the probability, alternating over the shapes (every launch
  // on the CPU executor starts 512 threads).
  for (std::size_t ai = 0; ai < std::size(all_activations); ++ai)
    for (std::size_t si = 0; si < shapes.size(); ++si) {
      const activation act = all_activations[ai];
      const auto [rows, width] = shapes[si];
      const bool with_probs = (ai + si) % 2 == 1;
      CAPTURE(to_string(act));
      CAPTURE(rows);
      CAPTURE(width);
      CAPTURE(with_probs);
      check_case<float, float>(act, rows, width, with_probs, rng, fp32);
      check_case<bfloat16, float>(act, rows, width, with_probs, rng, bf16);
    }
  MESSAGE("fp32: " << fp32.checked << " elements, " << fp32.off_by_one << " one ulp off; bf16: "
                   << bf16.checked << " elements, " << bf16.off_by_one << " one ulp off");
  MESSAGE("dprobs on host_exec: " << fp32.dprobs_rows + bf16.dprobs_rows << " rows, "
                                  << fp32.dprobs_differ + bf16.dprobs_differ
                                  << " not cpu_exec's bits (within the bound)");
  CHECK(fp32.worse == 0);
  CHECK(bf16.worse == 0);
  CHECK(fp32.off_by_one * 1000 <= fp32.checked);
  CHECK(bf16.off_by_one * 1000 <= bf16.checked);
}

TEST_CASE("activation kernels: two executor seeds give the same bits") {
  std::mt19937_64 rng(test::simt_seed());
  const int rows = 9, width = 40;
  std::vector<float> a(static_cast<std::size_t>(rows) * 2 * width),
      dh(static_cast<std::size_t>(rows) * width), p(static_cast<std::size_t>(rows));
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (auto& x : a) x = d(rng);
  for (auto& x : dh) x = d(rng);
  for (auto& x : p) x = std::fabs(d(rng));
  auto run = [&](const test::simt_launcher& on) {
    std::vector<float> h(dh.size()), da(a.size()), dp(p.size());
    const k::activation_forward_kernel<float> f{.act = activation::geglu,
                                                .a = {a.data(), 2 * width},
                                                .probs = p.data(),
                                                .h = {h.data(), width},
                                                .rows = rows,
                                                .width = width};
    const k::activation_backward_kernel<float> b{.act = activation::geglu,
                                                 .a = {a.data(), 2 * width},
                                                 .dh = {dh.data(), width},
                                                 .probs = p.data(),
                                                 .da = {da.data(), 2 * width},
                                                 .dprobs = dp.data(),
                                                 .rows = rows,
                                                 .width = width};
    REQUIRE(on(launch_grid{.blocks = 2}, f));
    REQUIRE(on(launch_grid{.blocks = 2}, b));
    h.insert(h.end(), da.begin(), da.end());
    h.insert(h.end(), dp.begin(), dp.end());
    return h;
  };
  const auto one = run({test::simt_on::cpu_exec, 1});
  CHECK(same_bits(one, run({test::simt_on::cpu_exec, 987654321})));
  // host_exec: h and da are cpu_exec's bits; dprobs within the bound of check_case (the sums'
  // orders differ: see the top of this file).
  const auto host = run({test::simt_on::host_exec, 0});
  const std::size_t per_elem = dh.size() + a.size();
  CHECK(std::memcmp(host.data(), one.data(), sizeof(float) * per_elem) == 0);
  for (int r = 0; r < rows; ++r) {
    CAPTURE(r);
    double dp_abs = 0;  // sum |act_out dh| with the kernel's own act
    for (int c = 0; c < width; ++c) {
      const auto i = static_cast<std::size_t>(r) * 2 * width + static_cast<std::size_t>(c);
      dp_abs += std::fabs(k::activation_value(activation::geglu, a[i]) * a[i + width] *
                          dh[static_cast<std::size_t>(r * width + c)]);
    }
    const double got = one[per_elem + static_cast<std::size_t>(r)],
                 host_got = host[per_elem + static_cast<std::size_t>(r)];
    CHECK(std::fabs(host_got - got) <=
          std::ldexp(std::fabs(got), -23) + std::ldexp(dp_abs, -50) * (width + 32) + 1e-38);
  }
}
