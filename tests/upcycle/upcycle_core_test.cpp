// The upcycling core (include/moefold/upcycle/): the option rules, the weight scale of
// docs/upcycling.md against its formula, rounding once from fp64, the router generator, and each
// rank's expert shards against slices of the dense weights taken independently here.
#include <moefold/upcycle/megatron_source.hpp>
#include <moefold/upcycle/pipeline_layers.hpp>
#include <moefold/upcycle/router_init.hpp>
#include <moefold/upcycle/upcycle_biases.hpp>
#include <moefold/upcycle/upcycle_experts.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <tuple>
#include <vector>

using namespace moefold;

namespace {}  // namespace

TEST_CASE("upcycle options: each rule broken is an error naming it") {
  const dense_ffn_shape d{.hidden = 8, .ffn = 12, .gated = true};
  const upcycle_options ok{.num_experts = 8, .topk = 2, .granularity = 2};
  CHECK(detail::check_upcycle(d, ok).has_value());
  auto bad = [&](upcycle_options o, dense_ffn_shape dd, errc want, const char* word) {
    const status st = detail::check_upcycle(dd, o);
    REQUIRE(!st);
    CHECK(st.error().code == want);
    CHECK(st.error().message.find(word) != std::string::npos);
  };
  bad({.num_experts = 8, .topk = 2, .granularity = 5}, d, errc::invalid_argument,
      "does not divide the dense FFN");
  bad({.num_experts = 8, .topk = 2, .granularity = 3}, d, errc::invalid_argument,
      "does not divide num_experts");
  bad({.num_experts = 8, .topk = 9}, d, errc::invalid_argument, "exceeds");
  bad({.num_experts = 8, .topk = 2, .act = activation::relu}, d, errc::invalid_argument,
      "not gated");
  bad({.num_experts = 8, .topk = 2}, {.hidden = 8, .ffn = 12, .gated = false},
      errc::invalid_argument, "is gated");
  bad({.num_experts = 8, .topk = 2, .score = score_function::sigmoid}, d, errc::invalid_argument,
      "sigmoid");
  bad({.num_experts = 8, .topk = 1}, d, errc::invalid_argument, "k = 1");
  bad({.num_experts = 0}, d, errc::invalid_size, ">= 1");
  // Rank rules.
  CHECK(upcycle_slices(d, ok, {.ep = 3}).error().code == errc::invalid_argument);   // 8 % 3
  CHECK(upcycle_slices(d, ok, {.etp = 4}).error().code == errc::invalid_argument);  // F = 6
  CHECK(upcycle_slices(d, ok, {.ep = 2, .ep_rank = 2}).error().code == errc::rank_out_of_range);
  CHECK(upcycle_slices(d, ok, {.etp = 2, .etp_rank = -1}).error().code == errc::rank_out_of_range);
}

TEST_CASE("upcycle weight scale: A = G after top-k, R G^2 / k before; s = A^(1/3) or A^(1/2)") {
  struct row {
    int E, k, G;
    activation act;
    bool gated, pre;
    double want;
  };
  const row rows[] = {
      {8, 2, 1, activation::swiglu, true, false, 1.0},                    // G 1: the identity
      {8, 4, 4, activation::relu, false, false, 2.0},                     // sqrt(4)
      {8, 4, 4, activation::squared_relu, false, false, std::cbrt(4.0)},  // degree 3
      {8, 4, 4, activation::swiglu, true, false, std::cbrt(4.0)},         // gate, up, fc2
      {8, 4, 4, activation::geglu, true, false, std::cbrt(4.0)},
      {8, 4, 4, activation::gelu, false, false, 2.0},
      {8, 4, 4, activation::swiglu, true, true, 2.0},             // A = 2*16/4 = 8
      {16, 2, 2, activation::relu, false, true, 4.0},             // A = 8*4/2 = 16
      {64, 8, 1, activation::silu, false, true, std::sqrt(8.0)},  // A = 64/8
  };
  for (const row& r : rows) {
    CAPTURE(r.E);
    CAPTURE(r.G);
    CAPTURE(r.pre);
    const dense_ffn_shape d{.hidden = 4, .ffn = 8, .gated = r.gated};
    const auto s = upcycle_weight_scale(
        d,
        {.num_experts = r.E, .topk = r.k, .granularity = r.G, .act = r.act, .pre_softmax = r.pre});
    REQUIRE(s.has_value());
    CHECK(*s == doctest::Approx(r.want).epsilon(1e-15));
  }
}

TEST_CASE("round_once: fp64 to bf16 in one rounding, ties to even, where fp32 first would not") {
  // The exact nearest bf16 of v: the two neighbours of v's truncation, compared in fp64 (exact:
  // both neighbours are within a factor 2 of v).
  auto nearest = [](double v) {
    const float t = static_cast<float>(v);  // near v; find the bf16 bracket around v itself
    std::uint32_t u = std::bit_cast<std::uint32_t>(t) & 0xFFFF0000u;
    float lo = std::bit_cast<float>(u);
    if (std::fabs(static_cast<double>(lo)) > std::fabs(v)) lo = std::bit_cast<float>(u - 0x10000u);
    const float hi = std::bit_cast<float>(std::bit_cast<std::uint32_t>(lo) + 0x10000u);
    const double dl = std::fabs(v - lo), dh = std::fabs(hi - v);
    if (dl != dh) return dl < dh ? lo : hi;
    return (std::bit_cast<std::uint32_t>(lo) & 0x10000u) == 0 ? lo : hi;  // even last bit
  };
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  int double_rounding_cases = 0;
  for (int i = 0; i < 200000; ++i) {
    double v = std::ldexp(mant(gen), static_cast<int>(gen() % 40) - 20);
    if (i % 4 == 0) {
      // Just above or below a bf16 tie, closer than fp32's resolution: fp32 first lands on the
      // tie and then rounds to even, the wrong way half the time.
      const float lo =
          std::bit_cast<float>(std::bit_cast<std::uint32_t>(static_cast<float>(v)) & 0xFFFF0000u);
      const double ulp = std::ldexp(1.0, std::ilogb(lo) - 7);  // bf16 has 7 stored bits
      const double tie = static_cast<double>(lo) + ulp / 2;
      v = tie + (i % 8 == 0 ? 1 : -1) * std::ldexp(tie, -40);
    }
    if (i % 3 == 0) v = -v;
    const float want = nearest(v);
    const bfloat16 got = detail::round_once<bfloat16>(v);
    REQUIRE(static_cast<float>(got) == want);
    double_rounding_cases += static_cast<float>(bfloat16(static_cast<float>(v))) != want;
  }
  MESSAGE("values where rounding through fp32 first is wrong: ", double_rounding_cases);
  CHECK(double_rounding_cases > 1000);  // the test exercises the case round_once exists for
  CHECK(detail::round_once<float>(1.0 + 0x1p-30) == 1.0f);
  CHECK(detail::round_once<double>(0.1) == 0.1);
}

TEST_CASE("upcycle router: normal(0, 0.02), rows shared within each virtual group, or uniform") {
  const dense_ffn_shape d{.hidden = 64, .ffn = 16, .gated = true};
  const upcycle_options o{.num_experts = 16, .topk = 4, .granularity = 4, .seed = 11};
  std::vector<float> w(16 * 64);
  REQUIRE(upcycle_router(d, o, w).has_value());
  auto row = [&](int e) {
    return std::vector<float>(w.begin() + e * 64, w.begin() + (e + 1) * 64);
  };
  for (int e = 0; e < 16; ++e) CHECK(row(e) == row(e / 4 * 4));       // within a group
  for (int q = 1; q < 4; ++q) CHECK(row(q * 4) != row((q - 1) * 4));  // across groups
  // Moments of many draws of the generator (deterministic: fixed seed).
  double s1 = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double z = upcycle_normal(3, static_cast<std::uint64_t>(i));
    s1 += z;
    s2 += z * z;
  }
  CHECK(std::fabs(s1 / n) < 0.01);
  CHECK(std::fabs(s2 / n - 1.0) < 0.01);
  // Another seed, another router; the same seed, the same router.
  std::vector<float> w2(w.size()), w3(w.size());
  upcycle_options o2 = o;
  o2.seed = 12;
  REQUIRE(upcycle_router(d, o2, w2).has_value());
  REQUIRE(upcycle_router(d, o, w3).has_value());
  CHECK(w2 != w);
  CHECK(w3 == w);
  o2.init = router_init::uniform;
  REQUIRE(upcycle_router(d, o2, w2).has_value());
  CHECK(w2 == std::vector<float>(w.size(), 0.0f));
  CHECK(!upcycle_router(d, o, std::span<float>(w).first(10)));
}

namespace {

// The dense FFN of the test, in fp64: gate, up [F_d, H], down [H, F_d].
struct dense {
  int H, Fd;
  std::vector<double> gate, up, down;
};
dense make_dense(int H, int Fd) {
  dense m{H, Fd, {}, {}, {}};
  std::mt19937_64 g(5);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int i = 0; i < Fd * H; ++i) m.gate.push_back(u(g));
  for (int i = 0; i < Fd * H; ++i) m.up.push_back(u(g));
  for (int i = 0; i < H * Fd; ++i) m.down.push_back(u(g));
  return m;
}

// The data of a plan's slices, cut from the full tensors.
std::vector<std::vector<double>> cut(const dense& m, const std::vector<dense_slice>& plan) {
  std::vector<std::vector<double>> out;
  for (const dense_slice& s : plan) {
    const std::vector<double>& t = s.tensor == dense_tensor::gate ? m.gate
                                   : s.tensor == dense_tensor::up ? m.up
                                                                  : m.down;
    const int cols = s.tensor == dense_tensor::down ? m.Fd : m.H;
    std::vector<double> v;
    for (int r = 0; r < s.rows; ++r)
      for (int c = 0; c < s.cols; ++c)
        v.push_back(t[static_cast<std::size_t>(s.first_row + r) * cols + s.first_col + c]);
    out.push_back(v);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "upcycled experts: each shard is its dense slice times s; all ranks cover the FFN E/G "
    "times") {
  const int H = 6, Fd = 24;
  const dense m = make_dense(H, Fd);
  for (const auto& [E, G, ep, etp] : {std::tuple{8, 2, 4, 2}, std::tuple{8, 4, 2, 3},
                                      std::tuple{4, 1, 2, 1}, std::tuple{12, 3, 3, 2}}) {
    CAPTURE(E);
    CAPTURE(G);
    CAPTURE(ep);
    CAPTURE(etp);
    const dense_ffn_shape d{.hidden = H, .ffn = Fd, .gated = true};
    const upcycle_options o{.num_experts = E, .topk = std::max(G, 2), .granularity = G};
    const double s = upcycle_weight_scale(d, o).value();
    const int F = Fd / G, Fs = F / etp, L = E / ep;
    std::map<std::tuple<int, int>, int> cover;  // (tensor, dense neuron) -> shards holding it
    for (int er = 0; er < ep; ++er)
      for (int tr = 0; tr < etp; ++tr) {
        const upcycle_rank r{.ep = ep, .ep_rank = er, .etp = etp, .etp_rank = tr};
        const auto plan = upcycle_slices(d, o, r).value();
        const auto data = cut(m, plan);
        std::vector<std::span<const double>> views(data.begin(), data.end());
        const mlp_param_sizes n = mlp_sizes(upcycled_shape(d, o, r).value());
        std::vector<float> fc1(n.fc1), fc2(n.fc2);
        REQUIRE(upcycle_experts<double, float>(d, o, r, views, {fc1, fc2}).has_value());
        for (int l = 0; l < L; ++l) {
          const int e = er * L + l, i = e % G, n0 = i * F + tr * Fs;
          for (int c = 0; c < Fs; ++c) {
            ++cover[{0, n0 + c}];
            for (int h = 0; h < H; ++h) {
              const auto at = [&](int row) {
                return fc1[static_cast<std::size_t>((l * 2 * Fs + row) * H + h)];
              };
              CHECK(at(c) ==
                    static_cast<float>(m.gate[static_cast<std::size_t>(n0 + c) * H + h] * s));
              CHECK(at(Fs + c) ==
                    static_cast<float>(m.up[static_cast<std::size_t>(n0 + c) * H + h] * s));
              CHECK(fc2[static_cast<std::size_t>((l * H + h) * Fs + c)] ==
                    static_cast<float>(m.down[static_cast<std::size_t>(h) * Fd + n0 + c] * s));
            }
          }
        }
        // The plan reads each distinct slice once: gate, up, down per distinct part (L
        // consecutive experts hold min(L, G) slice indices).
        CHECK(plan.size() == static_cast<std::size_t>(3 * std::min(L, G)));
      }
    CHECK(cover.size() == static_cast<std::size_t>(Fd));
    for (const auto& [k, c] : cover) CHECK(c == E / G);
  }
}

TEST_CASE(
    "Megatron-Core TP-sharded source: the pieces of each slice assemble to the Hugging Face "
    "slice") {
  const int H = 5, Fd = 24;
  const dense m = make_dense(H, Fd);
  for (const bool gated : {true, false}) {
    const dense_ffn_shape d{.hidden = H, .ffn = Fd, .gated = gated};
    for (const auto& [tp, E, G, ep, etp] :
         {std::tuple{4, 4, 2, 2, 1}, std::tuple{3, 8, 2, 4, 2}, std::tuple{2, 4, 1, 2, 3},
          std::tuple{6, 6, 3, 3, 2}, std::tuple{1, 4, 4, 1, 2}, std::tuple{8, 2, 2, 1, 3}}) {
      CAPTURE(gated);
      CAPTURE(tp);
      CAPTURE(G);
      CAPTURE(etp);
      // The TP shards as Megatron-Core stores them, built here from the dense tensors:
      // fc1_t [(gated ? 2 : 1) F_d / TP, H] = [gate rows of t; up rows of t], fc2_t [H, F_d / TP].
      const int per = Fd / tp;
      std::vector<std::vector<double>> fc1(static_cast<std::size_t>(tp)),
          fc2(static_cast<std::size_t>(tp));
      for (int t = 0; t < tp; ++t) {
        auto& a = fc1[static_cast<std::size_t>(t)];
        for (const auto* src : gated ? std::vector{&m.gate, &m.up} : std::vector{&m.up})
          for (int n = t * per; n < (t + 1) * per; ++n)
            for (int h = 0; h < H; ++h) a.push_back((*src)[static_cast<std::size_t>(n) * H + h]);
        for (int h = 0; h < H; ++h)
          for (int n = t * per; n < (t + 1) * per; ++n)
            fc2[static_cast<std::size_t>(t)].push_back(
                m.down[static_cast<std::size_t>(h) * Fd + n]);
      }
      const upcycle_options o{.num_experts = E,
                              .topk = 2,
                              .granularity = G,
                              .act = gated ? activation::swiglu : activation::relu};
      bool straddles = false;
      for (int er = 0; er < ep; ++er)
        for (int tr = 0; tr < etp; ++tr) {
          const upcycle_rank r{.ep = ep, .ep_rank = er, .etp = etp, .etp_rank = tr};
          const auto plan = upcycle_slices(d, o, r).value();
          const auto want = cut(m, plan);
          for (std::size_t j = 0; j < plan.size(); ++j) {
            const dense_slice& s = plan[j];
            auto pieces = megatron_pieces(d, tp, s);
            REQUIRE(pieces.has_value());
            straddles = straddles || pieces->size() > 1;
            std::vector<double> got(static_cast<std::size_t>(s.rows * s.cols), -99.0);
            std::size_t area = 0;
            for (const megatron_piece& p : *pieces) {
              const auto& src =
                  (p.tensor == megatron_tensor::fc1 ? fc1
                                                    : fc2)[static_cast<std::size_t>(p.tp_rank)];
              const int src_cols = p.tensor == megatron_tensor::fc1 ? H : per;
              CHECK(p.tensor ==
                    (s.tensor == dense_tensor::down ? megatron_tensor::fc2 : megatron_tensor::fc1));
              for (int i = 0; i < p.rows; ++i)
                for (int c = 0; c < p.cols; ++c)
                  got[static_cast<std::size_t>((p.dst_row + i) * s.cols + p.dst_col + c)] = src.at(
                      static_cast<std::size_t>((p.first_row + i) * src_cols + p.first_col + c));
              area += static_cast<std::size_t>(p.rows * p.cols);
            }
            CHECK(area == got.size());  // the pieces tile the slice, no byte read twice
            CHECK(got == want[j]);
          }
        }
      // Slices of F / ETP neurons cross TP shard boundaries whenever F_d / TP does not divide
      // them evenly; the cases include such crossings.
      if (tp == 4 || tp == 3 || tp == 8) CHECK(straddles);
    }
  }
  const dense_ffn_shape d{.hidden = H, .ffn = Fd, .gated = false};
  const auto bad = megatron_pieces(d, 5, {.tensor = dense_tensor::up, .rows = 1, .cols = H});
  REQUIRE(!bad);
  CHECK(bad.error().message.find("divide the dense FFN width 24") != std::string::npos);
  const auto gate = megatron_pieces(d, 2, {.tensor = dense_tensor::gate, .rows = 1, .cols = H});
  REQUIRE(!gate);
  CHECK(gate.error().message.find("without a gate") != std::string::npos);
  const auto out =
      megatron_pieces(d, 2, {.tensor = dense_tensor::down, .rows = H, .first_col = 20, .cols = 5});
  REQUIRE(!out);
  CHECK(out.error().message.find("outside") != std::string::npos);
}

TEST_CASE(
    "pipeline stages: Megatron-Core's even split, and a layer off this rank's stage refused") {
  // 12 layers over 4 stages: [0, 3), [3, 6), [6, 9), [9, 12).
  for (int stage = 0; stage < 4; ++stage) {
    const auto s = pipeline_stage_layers(12, 4, stage);
    REQUIRE(s.has_value());
    CHECK(s->first == 3 * stage);
    CHECK(s->count == 3);
    for (int layer = 0; layer < 12; ++layer)
      CHECK(check_layer_on_stage(12, 4, stage, layer).has_value() == (layer / 3 == stage));
  }
  const auto off = check_layer_on_stage(12, 4, 1, 7);
  REQUIRE(!off);
  CHECK(off.error().message.find("layer 7 is on pipeline stage 2, not this rank's stage 1") !=
        std::string::npos);
  const auto uneven = pipeline_stage_layers(10, 4, 0);
  REQUIRE(!uneven);
  CHECK(uneven.error().message.find("10 layers do not split evenly over pp = 4") !=
        std::string::npos);
  const auto range = check_layer_on_stage(12, 4, 0, 12);
  REQUIRE(!range);
  CHECK(range.error().message.find("out of range") != std::string::npos);
  CHECK(!pipeline_stage_layers(12, 4, 4));
  CHECK(!pipeline_stage_layers(0, 1, 0));
}

TEST_CASE("upcycled biases: fc1 biases scale as the weights, fc2 biases by t; exact for ReLU") {
  // ReLU (not gated), F_d 12, H 5, E 4, G 2, k 2: the first virtual group (experts 0, 1) is one
  // whole dense FFN. With every router logit equal, softmax after top-k gives each 1/2 and
  // before top-k each 1/E; the experts' outputs (ETP shards summed, the fc2 bias once) weighted
  // so must equal the dense FFN's, biases included.
  const int H = 5, Fd = 12, E = 4, G = 2, k = 2;
  const dense m = make_dense(H, Fd);
  std::vector<double> b1(Fd), b2(H);
  for (int i = 0; i < Fd; ++i) b1[static_cast<std::size_t>(i)] = 0.3 * std::sin(1.0 + i);
  for (int h = 0; h < H; ++h) b2[static_cast<std::size_t>(h)] = 0.7 * std::cos(2.0 + h);
  const dense_ffn_shape d{.hidden = H, .ffn = Fd, .gated = false};
  std::vector<double> x(H);
  for (int h = 0; h < H; ++h) x[static_cast<std::size_t>(h)] = std::cos(0.4 * h) - 0.2;
  std::vector<double> want(b2);  // the dense FFN: down relu(up x + b1) + b2
  for (int n = 0; n < Fd; ++n) {
    double a = b1[static_cast<std::size_t>(n)];
    for (int h = 0; h < H; ++h)
      a += m.up[static_cast<std::size_t>(n * H + h)] * x[static_cast<std::size_t>(h)];
    for (int h = 0; h < H; ++h)
      want[static_cast<std::size_t>(h)] +=
          m.down[static_cast<std::size_t>(h * Fd + n)] * std::max(a, 0.0);
  }
  for (const bool pre : {false, true})
    for (const int etp : {1, 2, 3}) {
      CAPTURE(pre);
      CAPTURE(etp);
      const upcycle_options o{.num_experts = E,
                              .topk = k,
                              .granularity = G,
                              .act = activation::relu,
                              .pre_softmax = pre,
                              .init = router_init::uniform};
      const double s = upcycle_weight_scale(d, o).value();
      const double t = upcycle_fc2_bias_scale(d, o).value();
      CHECK(t == (pre ? 2.0 : 1.0));  // E / k before top-k, 1 after
      const double p = pre ? 1.0 / E : 1.0 / k;
      const int F = Fd / G, Fs = F / etp;
      std::vector<double> got(H, 0.0);
      for (int r = 0; r < etp; ++r) {
        const upcycle_rank rk{.ep = 1, .ep_rank = 0, .etp = etp, .etp_rank = r};
        const auto plan = upcycle_slices(d, o, rk).value();
        const auto data = cut(m, plan);
        std::vector<std::span<const double>> views(data.begin(), data.end());
        const mlp_param_sizes n = mlp_sizes(upcycled_shape(d, o, rk).value());
        std::vector<double> fc1(n.fc1), fc2(n.fc2), bias1(static_cast<std::size_t>(E * Fs)),
            bias2(static_cast<std::size_t>(E * H));
        REQUIRE(upcycle_experts<double, double>(d, o, rk, views, {fc1, fc2}).has_value());
        REQUIRE(upcycle_biases<double, double>(d, o, rk, {.up = b1, .down = b2}, {bias1, bias2})
                    .has_value());
        for (int e = 0; e < E; ++e)
          for (int c = 0; c < Fs; ++c)  // the shard's entries of the dense bias, times s
            CHECK(bias1[static_cast<std::size_t>(e * Fs + c)] ==
                  b1[static_cast<std::size_t>((e % G) * F + r * Fs + c)] * s);
        for (int e = 0; e < G; ++e) {  // the chosen experts: 0 .. G-1
          for (int c = 0; c < Fs; ++c) {
            double a = bias1[static_cast<std::size_t>(e * Fs + c)];
            for (int h = 0; h < H; ++h)
              a += fc1[static_cast<std::size_t>((e * Fs + c) * H + h)] *
                   x[static_cast<std::size_t>(h)];
            for (int h = 0; h < H; ++h)
              got[static_cast<std::size_t>(h)] +=
                  p * fc2[static_cast<std::size_t>((e * H + h) * Fs + c)] * std::max(a, 0.0);
          }
          if (r == 0)  // the fc2 bias once per expert, after the ETP reduction
            for (int h = 0; h < H; ++h)
              got[static_cast<std::size_t>(h)] += p * bias2[static_cast<std::size_t>(e * H + h)];
        }
      }
      for (int h = 0; h < H; ++h)
        CHECK(std::fabs(got[static_cast<std::size_t>(h)] - want[static_cast<std::size_t>(h)]) <=
              1e-12 * std::fabs(want[static_cast<std::size_t>(h)]) + 1e-14);
    }
  // Bias shapes are checked: a gate bias for an FFN without a gate is refused.
  const upcycle_options o{.num_experts = E, .topk = k, .granularity = G, .act = activation::relu};
  std::vector<double> bias1(static_cast<std::size_t>(E * Fd / G));
  const auto st = upcycle_biases<double, double>(d, o, {}, {.gate = b1, .up = b1}, {bias1, {}});
  REQUIRE(!st);
  CHECK(st.error().message.find("gate only when gated") != std::string::npos);
}
