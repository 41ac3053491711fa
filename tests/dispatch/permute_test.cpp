// Permutation primitives against references written here with other algorithms (a double loop
// over experts and tokens, per-token sums), plus finite differences for the backward.
#include <moefold/dispatch/dispatch_args.hpp>
#include <moefold/dispatch/permute.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace moefold;
using namespace moefold::dispatch;  // the permutation, chunk-sort and split building blocks

namespace {

struct routing {
  int n, k, e;
  std::vector<int> expert;  // [n*k], -1 = dropped
  std::vector<double> prob;
};

// Random top-k routing with distinct experts per token and some dropped pairs.
routing random_routing(std::mt19937& rng, int n, int k, int e, double drop) {
  routing r{n, k, e, std::vector<int>(static_cast<std::size_t>(n * k)),
            std::vector<double>(static_cast<std::size_t>(n * k))};
  std::vector<int> ids(static_cast<std::size_t>(e));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int t = 0; t < n; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < k; ++j) {
      const auto s = static_cast<std::size_t>(t * k + j);
      r.expert[s] = u(rng) < drop ? -1 : ids[static_cast<std::size_t>(j)];
      r.prob[s] = u(rng);
    }
  }
  return r;
}

struct planned {
  std::vector<std::byte> ws;
  permute_plan plan;
};

planned make_plan(const routing& r, std::optional<int> capacity = {}) {
  const permute_args a{
      .num_tokens = r.n, .topk = r.k, .num_experts = r.e, .expert = r.expert, .capacity = capacity};
  planned p{std::vector<std::byte>(permute_plan::workspace_bytes(a)), {}};
  p.plan = permute_plan::make(a, p.ws).value();
  return p;
}

std::vector<double> random_rows(std::mt19937& rng, int rows, int hidden) {
  std::vector<double> x(static_cast<std::size_t>(rows * hidden));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (auto& v : x) v = u(rng);
  return x;
}

}  // namespace

TEST_CASE("permute groups rows by expert ascending, tokens ascending inside an expert") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const int n = trial % 7 == 0 ? 0 : 1 + static_cast<int>(rng() % 40);
    const int e = 1 + static_cast<int>(rng() % 9);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(e));
    const auto r = random_routing(rng, n, k, e, trial % 3 == 0 ? 0.0 : 0.3);
    auto p = make_plan(r);
    // Reference: for each expert, for each token, the pair if routed.
    std::vector<int> want_slot;
    std::vector<int> want_counts(static_cast<std::size_t>(e), 0);
    for (int ex = 0; ex < e; ++ex)
      for (int t = 0; t < n; ++t)
        for (int j = 0; j < k; ++j)
          if (r.expert[static_cast<std::size_t>(t * k + j)] == ex) {
            want_slot.push_back(t * k + j);
            ++want_counts[static_cast<std::size_t>(ex)];
          }
    const auto& plan = p.plan;
    REQUIRE(plan.num_rows() == static_cast<int>(want_slot.size()));
    CHECK(std::equal(want_slot.begin(), want_slot.end(), plan.row_slot().begin()));
    CHECK(std::equal(want_counts.begin(), want_counts.end(), plan.counts().begin()));
    for (int ex = 0; ex <= e; ++ex)
      CHECK(plan.offsets()[static_cast<std::size_t>(ex)] ==
            std::accumulate(want_counts.begin(), want_counts.begin() + ex, 0));
    for (int s = 0; s < n * k; ++s) {
      const int row = plan.slot_row()[static_cast<std::size_t>(s)];
      if (r.expert[static_cast<std::size_t>(s)] < 0)
        CHECK(row == -1);
      else
        CHECK(plan.row_slot()[static_cast<std::size_t>(row)] == s);
    }
    // Rows and probabilities follow the plan.
    const int h = 3;
    const auto x = random_rows(rng, n, h);
    std::vector<double> xp(static_cast<std::size_t>(plan.num_rows() * h));
    std::vector<double> pp(static_cast<std::size_t>(plan.num_rows()));
    REQUIRE(permute<double>(plan, x, h, xp));
    REQUIRE(permute_probs<double>(plan, r.prob, pp));
    for (int row = 0; row < plan.num_rows(); ++row) {
      const int s = want_slot[static_cast<std::size_t>(row)];
      for (int c = 0; c < h; ++c)
        CHECK(xp[static_cast<std::size_t>(row * h + c)] ==
              x[static_cast<std::size_t>((s / k) * h + c)]);
      CHECK(pp[static_cast<std::size_t>(row)] == r.prob[static_cast<std::size_t>(s)]);
    }
  }
}

TEST_CASE("unpermute(permute(x)) = x * routed pairs; with probs = x * sum of kept probs") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int n = static_cast<int>(rng() % 30), e = 2 + static_cast<int>(rng() % 6);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(e)), h = 4;
    const auto r = random_routing(rng, n, k, e, 0.25);
    auto p = make_plan(r);
    const auto x = random_rows(rng, n, h);
    std::vector<double> xp(static_cast<std::size_t>(p.plan.num_rows() * h)),
        plain(static_cast<std::size_t>(n * h)), weighted(static_cast<std::size_t>(n * h));
    REQUIRE(permute<double>(p.plan, x, h, xp));
    REQUIRE(unpermute<double>(p.plan, xp, h, {}, plain));
    REQUIRE(unpermute<double>(p.plan, xp, h, r.prob, weighted));
    for (int t = 0; t < n; ++t) {
      int routed = 0;
      double psum = 0;
      for (int j = 0; j < k; ++j)
        if (r.expert[static_cast<std::size_t>(t * k + j)] >= 0) {
          ++routed;
          psum += r.prob[static_cast<std::size_t>(t * k + j)];
        }
      for (int c = 0; c < h; ++c) {
        const double xv = x[static_cast<std::size_t>(t * h + c)];
        CHECK(plain[static_cast<std::size_t>(t * h + c)] ==
              doctest::Approx(xv * routed).epsilon(1e-14));
        CHECK(weighted[static_cast<std::size_t>(t * h + c)] ==
              doctest::Approx(xv * psum).epsilon(1e-14));
      }
    }
  }
}

TEST_CASE("pad mode: exactly capacity rows per expert, zero padding, same result as no padding") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 30; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 25), e = 2 + static_cast<int>(rng() % 5), k = 2;
    auto r = random_routing(rng, n, k, e, 0.1);
    // Drop the pairs over capacity first (position policy), as a drop policy would.
    const int cap = 1 + static_cast<int>(rng() % 6);
    std::vector<int> seen(static_cast<std::size_t>(e), 0);
    for (auto& ex : r.expert)
      if (ex >= 0 && seen[static_cast<std::size_t>(ex)]++ >= cap) ex = -1;
    auto padded = make_plan(r, cap);
    auto plain = make_plan(r);
    CHECK(padded.plan.num_rows() == cap * e);
    for (int ex = 0; ex < e; ++ex) {
      CHECK(padded.plan.offsets()[static_cast<std::size_t>(ex)] == ex * cap);
      CHECK(padded.plan.counts()[static_cast<std::size_t>(ex)] <= cap);
    }
    const int h = 3;
    const auto x = random_rows(rng, n, h);
    std::vector<double> xp(static_cast<std::size_t>(cap * e * h)),
        pp(static_cast<std::size_t>(cap * e));
    REQUIRE(permute<double>(padded.plan, x, h, xp));
    REQUIRE(permute_probs<double>(padded.plan, r.prob, pp));
    for (int row = 0; row < cap * e; ++row)
      if (padded.plan.row_slot()[static_cast<std::size_t>(row)] < 0) {
        CHECK(pp[static_cast<std::size_t>(row)] == 0.0);
        for (int c = 0; c < h; ++c) CHECK(xp[static_cast<std::size_t>(row * h + c)] == 0.0);
      }
    // The expert: y = 2x + expert id on real rows. Pad and plain runs must agree bitwise.
    auto expert_fn = [&](const permute_plan& pl, std::vector<double> v) {
      for (int ex = 0; ex < e; ++ex)
        for (int row = pl.offsets()[static_cast<std::size_t>(ex)];
             row < pl.offsets()[static_cast<std::size_t>(ex) + 1]; ++row)
          for (int c = 0; c < h; ++c) {
            auto& y = v[static_cast<std::size_t>(row * h + c)];
            y = 2 * y + ex;
          }
      return v;
    };
    std::vector<double> xq(static_cast<std::size_t>(plain.plan.num_rows() * h));
    REQUIRE(permute<double>(plain.plan, x, h, xq));
    std::vector<double> out_pad(static_cast<std::size_t>(n * h)), out_plain(out_pad.size());
    REQUIRE(unpermute<double>(padded.plan, expert_fn(padded.plan, xp), h, r.prob, out_pad));
    REQUIRE(unpermute<double>(plain.plan, expert_fn(plain.plan, xq), h, r.prob, out_plain));
    CHECK(std::memcmp(out_pad.data(), out_plain.data(), out_pad.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("unpermute_backward equals finite differences of <g, unpermute(y, p)>") {
  std::mt19937 rng(3);
  const int n = 9, e = 5, k = 3, h = 4;
  const auto r = random_routing(rng, n, k, e, 0.2);
  auto p = make_plan(r);
  const int m = p.plan.num_rows();
  auto y = random_rows(rng, m, h);
  auto probs = r.prob;
  const auto g = random_rows(rng, n, h);
  auto loss = [&](const std::vector<double>& yy, const std::vector<double>& pr) {
    std::vector<double> out(static_cast<std::size_t>(n * h));
    REQUIRE(unpermute<double>(p.plan, yy, h, pr, out));
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += g[i] * out[i];
    return l;
  };
  std::vector<double> dy(static_cast<std::size_t>(m * h)), dp(static_cast<std::size_t>(n * k));
  REQUIRE(unpermute_backward<double>(p.plan, g, y, h, probs, dy, dp));
  const double eps = 1e-6;
  for (std::size_t i = 0; i < y.size(); ++i) {
    auto yp = y, ym = y;
    yp[i] += eps;
    ym[i] -= eps;
    CHECK(dy[i] == doctest::Approx((loss(yp, probs) - loss(ym, probs)) / (2 * eps)).epsilon(1e-7));
  }
  for (std::size_t s = 0; s < probs.size(); ++s) {
    auto pp = probs, pm = probs;
    pp[s] += eps;
    pm[s] -= eps;
    const double fd = (loss(y, pp) - loss(y, pm)) / (2 * eps);
    CHECK(dp[s] == doctest::Approx(fd).epsilon(1e-7));
    if (r.expert[s] < 0) CHECK(dp[s] == 0.0);  // a dropped pair has no gradient
  }
}

TEST_CASE("permuting the input tokens permutes the output the same way") {
  std::mt19937 rng(13);
  const int n = 20, e = 6, k = 2, h = 2;
  const auto r = random_routing(rng, n, k, e, 0.0);
  std::vector<int> pi(n);
  std::iota(pi.begin(), pi.end(), 0);
  std::shuffle(pi.begin(), pi.end(), rng);
  routing rp = r;
  const auto x = random_rows(rng, n, h);
  std::vector<double> xpi(x.size());
  for (int t = 0; t < n; ++t) {
    const int src = pi[static_cast<std::size_t>(t)];
    for (int j = 0; j < k; ++j) {
      rp.expert[static_cast<std::size_t>(t * k + j)] =
          r.expert[static_cast<std::size_t>(src * k + j)];
      rp.prob[static_cast<std::size_t>(t * k + j)] = r.prob[static_cast<std::size_t>(src * k + j)];
    }
    for (int c = 0; c < h; ++c)
      xpi[static_cast<std::size_t>(t * h + c)] = x[static_cast<std::size_t>(src * h + c)];
  }
  auto run = [&](const routing& rr, const std::vector<double>& xx) {
    auto p = make_plan(rr);
    std::vector<double> xp(static_cast<std::size_t>(p.plan.num_rows() * h));
    REQUIRE(permute<double>(p.plan, xx, h, xp));
    for (int ex = 0; ex < e; ++ex)  // an expert that scales its rows by (1 + expert id)
      for (int row = p.plan.offsets()[static_cast<std::size_t>(ex)];
           row < p.plan.offsets()[static_cast<std::size_t>(ex) + 1]; ++row)
        for (int c = 0; c < h; ++c) xp[static_cast<std::size_t>(row * h + c)] *= 1 + ex;
    std::vector<double> out(xx.size());
    REQUIRE(unpermute<double>(p.plan, xp, h, rr.prob, out));
    return out;
  };
  const auto out = run(r, x), out_pi = run(rp, xpi);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < h; ++c)
      CHECK(out_pi[static_cast<std::size_t>(t * h + c)] ==
            out[static_cast<std::size_t>(pi[static_cast<std::size_t>(t)] * h + c)]);
}

TEST_CASE("bad routing records and buffers give clear errors") {
  std::vector<int> bad_expert = {0, 5};
  std::vector<std::byte> ws(4096);
  auto a =
      permute_plan::make({.num_tokens = 1, .topk = 2, .num_experts = 4, .expert = bad_expert}, ws);
  CHECK(a.error().code == errc::invalid_argument);
  CHECK(a.error().message.find("expert 5, outside [0, 4)") != std::string::npos);
  std::vector<int> twice = {1, 1};
  CHECK(permute_plan::make({.num_tokens = 1, .topk = 2, .num_experts = 4, .expert = twice}, ws)
            .error()
            .message.find("twice") != std::string::npos);
  std::vector<int> ok = {1, 2, 3, 0};
  CHECK(permute_plan::make({.num_tokens = 3, .topk = 2, .num_experts = 4, .expert = ok}, ws)
            .error()
            .code == errc::shape_mismatch);
  std::vector<std::byte> tiny(8);
  CHECK(permute_plan::make({.num_tokens = 2, .topk = 2, .num_experts = 4, .expert = ok}, tiny)
            .error()
            .code == errc::workspace_too_small);
  std::vector<int> crowded = {1, -1, 1, -1, 1, -1};
  CHECK(permute_plan::make(
            {.num_tokens = 3, .topk = 2, .num_experts = 4, .expert = crowded, .capacity = 2}, ws)
            .error()
            .message.find("more than the capacity 2") != std::string::npos);
  CHECK(permute_plan::make({.num_tokens = -1, .topk = 2, .num_experts = 4, .expert = {}}, ws)
            .error()
            .code == errc::invalid_size);
  auto plan =
      permute_plan::make({.num_tokens = 2, .topk = 2, .num_experts = 4, .expert = ok}, ws).value();
  std::vector<double> x(2 * 3), out(4 * 2);  // out has the wrong hidden size
  CHECK(permute<double>(plan, x, 3, out).error().code == errc::shape_mismatch);
}

TEST_CASE("no tokens, or no routed pair: empty buffers work and the output is zero") {
  std::vector<std::byte> ws(4096);
  auto empty = permute_plan::make({.num_tokens = 0, .topk = 2, .num_experts = 3, .expert = {}}, ws);
  REQUIRE(empty);
  CHECK(empty->num_rows() == 0);
  std::vector<int> dropped = {-1, -1};
  auto none =
      permute_plan::make({.num_tokens = 1, .topk = 2, .num_experts = 3, .expert = dropped}, ws)
          .value();
  std::vector<double> y, out = {5, 5}, probs = {0.5, 0.5};
  REQUIRE(unpermute<double>(none, y, 2, probs, out));
  CHECK(out == std::vector<double>{0, 0});
}

TEST_CASE("pad mode over several sources: C rows per (expert, source), blocks in source order") {
  // The layout is checked against a direct construction: for expert e and source s, block
  // [e*S*C + s*C, e*S*C + (s+1)*C) holds the source's kept pairs of e in token order, then padding.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int sources = 1 + static_cast<int>(rng() % 5), e = 1 + static_cast<int>(rng() % 4);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(e));
    std::vector<int> per_source(static_cast<std::size_t>(sources));
    int n = 0;
    for (auto& v : per_source) n += v = trial % 5 == 0 ? 0 : static_cast<int>(rng() % 6);
    auto r = random_routing(rng, n, k, e, 0.2);
    const int cap = static_cast<int>(rng() % 4);
    // Drop over capacity per (source, expert), first come first kept.
    std::vector<int> owner;
    for (int s = 0; s < sources; ++s)
      for (int t = 0; t < per_source[static_cast<std::size_t>(s)]; ++t) owner.push_back(s);
    std::vector<int> seen(static_cast<std::size_t>(sources * e), 0);
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < k; ++j) {
        int& ex = r.expert[static_cast<std::size_t>(t * k + j)];
        if (ex >= 0 &&
            seen[static_cast<std::size_t>(owner[static_cast<std::size_t>(t)] * e + ex)]++ >= cap)
          ex = -1;
      }
    const permute_args a{.num_tokens = n,
                         .topk = k,
                         .num_experts = e,
                         .expert = r.expert,
                         .capacity = cap,
                         .num_sources = sources,
                         .source_tokens = per_source};
    std::vector<std::byte> ws(permute_plan::workspace_bytes(a));
    const auto plan = permute_plan::make(a, ws).value();
    REQUIRE(plan.num_rows() == cap * e * sources);
    std::vector<int> want(static_cast<std::size_t>(cap * e * sources), -1);
    for (int ex = 0; ex < e; ++ex)
      for (int s = 0; s < sources; ++s) {
        int row = (ex * sources + s) * cap;
        for (int t = 0; t < n; ++t)
          for (int j = 0; j < k; ++j)
            if (owner[static_cast<std::size_t>(t)] == s &&
                r.expert[static_cast<std::size_t>(t * k + j)] == ex)
              want[static_cast<std::size_t>(row++)] = t * k + j;
      }
    CHECK(std::vector<int>(plan.row_slot().begin(), plan.row_slot().end()) == want);
    for (int s = 0; s < n * k; ++s) {
      const int row = plan.slot_row()[static_cast<std::size_t>(s)];
      if (row >= 0) CHECK(plan.row_slot()[static_cast<std::size_t>(row)] == s);
      CHECK((row >= 0) == (r.expert[static_cast<std::size_t>(s)] >= 0));
    }
  }
  // Bad input: source counts that do not add up, several sources without pad mode, a source over
  // capacity (named in the message).
  const std::vector<int> ex = {0, 0, 0}, two = {1, 2}, wrong = {1, 1};
  std::vector<std::byte> ws(4096);
  CHECK(permute_plan::make({.num_tokens = 3,
                            .topk = 1,
                            .num_experts = 1,
                            .expert = ex,
                            .capacity = 2,
                            .num_sources = 2,
                            .source_tokens = wrong},
                           ws)
            .error()
            .code == errc::shape_mismatch);
  CHECK(permute_plan::make({.num_tokens = 3,
                            .topk = 1,
                            .num_experts = 1,
                            .expert = ex,
                            .num_sources = 2,
                            .source_tokens = two},
                           ws)
            .error()
            .code == errc::invalid_argument);
  const auto over = permute_plan::make({.num_tokens = 3,
                                        .topk = 1,
                                        .num_experts = 1,
                                        .expert = ex,
                                        .capacity = 1,
                                        .num_sources = 2,
                                        .source_tokens = two},
                                       ws);
  REQUIRE_FALSE(over);
  CHECK(over.error().message.find("expert 0 has 2 routed pairs from source 1") !=
        std::string::npos);
}

TEST_CASE("pad mode is an optional capacity: unset pads nothing, a negative one is refused") {
  const std::vector<int> expert = {0, 1, 1, 2};  // N = 2, k = 2, E = 4
  std::vector<std::byte> ws(1 << 12);
  const permute_args plain{.num_tokens = 2, .topk = 2, .num_experts = 4, .expert = expert};
  CHECK(!plain.capacity);
  const auto p = permute_plan::make(plain, ws);
  REQUIRE(p);
  CHECK(p->num_rows() == 4);  // rows as routed
  permute_args pad = plain;
  pad.capacity = 2;
  CHECK(permute_plan::make(pad, ws)->num_rows() == 8);  // C * E
  pad.capacity = 0;
  CHECK(permute_plan::make(pad, ws).error().code == errc::invalid_argument);  // over capacity 0
  pad.capacity = -1;  // the old "off" value is now a bad capacity, named as such
  const auto bad = permute_plan::make(pad, ws);
  REQUIRE(!bad);
  CHECK(bad.error().code == errc::invalid_argument);
  CHECK(bad.error().message.find("leave it unset for no padding") != std::string::npos);
  const std::vector<double> x(2 * 3), probs(4);
  const dispatch_shape s{.max_tokens = 2, .hidden = 3, .topk = 2, .num_experts = 4};
  dispatch_input<double> in{.num_tokens = 2,
                            .x = host_rows(std::span(x), s.hidden),
                            .expert = host_rows(std::span(expert), s.topk),
                            .probs = host_rows(std::span(probs), s.topk)};
  CHECK(detail::check_dispatch_input(s, in));
  in.capacity = -1;
  const auto st = detail::check_dispatch_input(s, in);
  REQUIRE(!st);
  CHECK(st.error().code == errc::invalid_argument);
  CHECK(st.error().message.find("capacity = -1") != std::string::npos);
}
