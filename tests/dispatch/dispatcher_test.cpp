// Both dispatcher paths (All-to-All and AllGather) on the thread world, over a sweep of folded
// mappings, against the single-rank fp64 reference of dispatch_harness.hpp.
#include <moefold/comm/thread_world.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <type_traits>

#include "dispatch_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using a2a = all_to_all_path<thread_communicator>;
using ag = all_gather_path<thread_communicator>;

template <class Path>
std::vector<rank_result> run(const problem& p) {
  const int world = make_folded(p.fold).value().world_size();
  std::vector<rank_result> results(static_cast<std::size_t>(world));
  const auto st = run_thread_world(world, [&](thread_communicator& comm) -> status {
    auto r = run_rank<Path>(p, comm);
    if (!r) return unexpected<error>(r.error());
    results[static_cast<std::size_t>(comm.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

struct coverage {
  int etp_gt_1 = 0, several_local = 0, ep_spans_attention = 0, dropped_pairs = 0, empty = 0,
      configs = 0, idle_experts = 0;
};

template <class Path>
void check_problem(const problem& p, coverage& cov) {
  CAPTURE(p.fold.world);
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.pp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  CAPTURE(std::string(p.fold.order));
  CAPTURE(p.drop);
  const auto res = run<Path>(p);
  for (std::size_t r = 0; r < res.size(); ++r) {
    CAPTURE(r);
    const auto want = expected_for_rank(p, static_cast<int>(r));
    CHECK(rel_err(res[r].out, want.out) <= 1e-12);
    CHECK(rel_err(res[r].dx, want.dx) <= 1e-12);
    CHECK(rel_err(res[r].dprob, want.dprob) <= 1e-12);
    CHECK(rel_err(res[r].dw1, want.dw1) <= 1e-12);
    CHECK(rel_err(res[r].dw2, want.dw2) <= 1e-12);
    // Bytes: one row per routed pair whose expert lives on another EP rank, nothing more.
    if (Path::exact_bytes) CHECK(res[r].a2a_rows == want.a2a_rows);
    // Experts that received no row (invariant 10): finite gradients (their values are checked
    // against the reference above, zero where no replica saw a token).
    for (int c : res[r].per_expert) cov.idle_experts += c == 0;
    for (const auto* v : {&res[r].dw1, &res[r].dw2, &res[r].dx, &res[r].dprob})
      for (double g : *v) REQUIRE(std::isfinite(g));
  }
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  for (int r = 0; r < fold.world_size(); ++r)
    for (int t = 0; t < tokens_of(p, groups, r); ++t) {
      const auto d = make_token(p, r, t);
      cov.dropped_pairs += static_cast<int>(std::count(d.expert.begin(), d.expert.end(), -1));
    }
  ++cov.configs;
  if (fold.etp() > 1) ++cov.etp_gt_1;
  if (p.experts / fold.ep() > 1) ++cov.several_local;
  if (fold.ep() > 1 && fold.ep() * fold.etp() > fold.tp() * fold.cp()) ++cov.ep_spans_attention;
  if (p.empty_rank) ++cov.empty;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "each dispatcher path equals the fp64 single-rank reference over a sweep of folds", Path, a2a,
    ag) {
  const fold_config folds[] = {
      {.world = 1},
      {.world = 2, .ep = 2, .etp = 1},
      {.world = 4, .ep = 4, .etp = 1},
      {.world = 4, .tp = 2, .ep = 2, .etp = 2},
      {.world = 4, .tp = 2, .ep = 4, .etp = 1},
      {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1},
      {.world = 8, .tp = 2, .cp = 2, .ep = 8, .etp = 1},
      {.world = 8, .cp = 2, .pp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 4, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-cp-ep-pp-dp"},
      {.world = 12, .tp = 2, .pp = 3, .ep = 2, .etp = 1},
      {.world = 12, .tp = 3, .ep = 4, .etp = 3},
      {.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1},
      {.world = 16, .tp = 4, .ep = 16, .etp = 1},
      {.world = 16, .tp = 2, .pp = 2, .ep = 2, .etp = 2},
      {.world = 6, .tp = 3, .ep = 2, .etp = 1},
  };
  coverage cov;
  int i = 0;
  for (const auto& f : folds) {
    for (double drop : {0.0, 0.3}) {
      const auto fold = make_folded(f).value();
      problem p{.fold = f};
      p.experts = fold.ep() * (1 + i % 3);  // 1..3 local experts
      p.topk = std::min(2 + i % 2, p.experts);
      p.ffn = 2 * fold.etp() * (1 + i % 2);
      p.drop = drop;
      p.empty_rank = i % 4 == 3;
      check_problem<Path>(p, cov);
      ++i;
    }
  }
  CHECK(cov.configs == 32);
  CHECK(cov.etp_gt_1 >= 6);
  CHECK(cov.several_local >= 10);
  CHECK(cov.ep_spans_attention >= 8);
  CHECK(cov.dropped_pairs >= 50);
  CHECK(cov.empty >= 6);
  CHECK(cov.idle_experts >= 3);  // local experts that computed zero rows
  MESSAGE(cov.idle_experts << " (rank, local expert) pairs with zero rows");
}

TEST_CASE_TEMPLATE("each dispatcher path is bitwise repeatable run to run", Path, a2a, ag) {
  problem p{.fold = {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 2}, .experts = 4, .ffn = 4};
  const auto r1 = run<Path>(p), r2 = run<Path>(p);
  for (std::size_t r = 0; r < r1.size(); ++r) {
    REQUIRE(r1[r].out.size() == r2[r].out.size());
    CHECK(std::memcmp(r1[r].out.data(), r2[r].out.data(), r1[r].out.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(r1[r].dx.data(), r2[r].dx.data(), r1[r].dx.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(r1[r].dw1.data(), r2[r].dw1.data(), r1[r].dw1.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("dispatcher misuse gives clear errors") {
  CHECK(all_to_all_dispatcher<double, thread_communicator>::make(
            {.max_tokens = 4, .hidden = 2, .topk = 2, .num_experts = 6, .ep = 4})
            .error()
            .message.find("not divisible by ep = 4") != std::string::npos);
  CHECK(all_to_all_dispatcher<double, thread_communicator>::make(
            {.max_tokens = 4, .hidden = 2, .topk = 5, .num_experts = 4})
            .error()
            .code == errc::invalid_argument);
  auto st = run_thread_world(2, [](thread_communicator& world) -> status {
    auto d = all_to_all_dispatcher<double, thread_communicator>::make(
                 {.max_tokens = 2, .hidden = 1, .topk = 1, .num_experts = 2, .ep = 2})
                 .value();
    auto d2 = d;
    std::vector<std::byte> ws(d.workspace_bytes()), small(16);
    auto ep = world.split(0, world.rank()).value();
    auto etp = world.split(world.rank(), 0).value();
    auto tpep = world.split(0, world.rank()).value();
    const dispatch_groups<thread_communicator> g{ep, etp, tpep};
    const std::vector<double> x = {1, 2}, probs = {1, 1};
    const std::vector<int> expert = {0, 1};
    CHECK(d.dispatch({.num_tokens = 3, .x = x, .expert = expert, .probs = probs}, g, ws)
              .error()
              .code == errc::invalid_size);
    CHECK(d.dispatch({.num_tokens = 2, .x = x, .expert = expert, .probs = probs}, g, small)
              .error()
              .code == errc::workspace_too_small);
    auto h = d.dispatch({.num_tokens = 2, .x = x, .expert = expert, .probs = probs}, g, ws);
    REQUIRE(h);
    std::vector<double> y(static_cast<std::size_t>(h->num_rows())), out(2);
    // A handle from another dispatcher is refused (no collective runs, so no rank waits).
    CHECK(d2.combine(*h, y, g, out).error().message.find("another dispatcher") !=
          std::string::npos);
    return d.combine(*h, y, g, out);
  });
  for (const auto& s : st) CHECK(s.has_value());
}

TEST_CASE("both dispatcher paths agree on identical routing and weights") {
  problem p{.fold = {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 2},
            .experts = 8,
            .ffn = 4,
            .drop = 0.2};
  const auto r1 = run<a2a>(p), r2 = run<ag>(p);
  for (std::size_t r = 0; r < r1.size(); ++r) {
    CHECK(rel_err(r2[r].out, r1[r].out) <= 1e-13);
    CHECK(rel_err(r2[r].dx, r1[r].dx) <= 1e-13);
    CHECK(rel_err(r2[r].dprob, r1[r].dprob) <= 1e-13);
    CHECK(rel_err(r2[r].dw1, r1[r].dw1) <= 1e-13);
    CHECK(rel_err(r2[r].dw2, r1[r].dw2) <= 1e-13);
  }
}

namespace {

// An expert functor that misbehaves on one rank: throws, or reports a wrong shape.
struct faulty_experts {
  reference_mlp<double> inner;
  bool throw_here = false, wrong_shape_here = false;
  int num_local_experts() const { return inner.num_local_experts(); }
  int hidden() const { return inner.hidden(); }
  status forward(const expert_batch<double>& b, std::span<double> y) {
    if (throw_here) throw std::runtime_error("expert functor failed on this rank");
    if (wrong_shape_here) return inner.forward(b, y.first(y.size() / 2));  // half the rows
    return inner.forward(b, y);
  }
  status backward(const expert_batch<double>& b, std::span<const double> dy, std::span<double> dx,
                  std::span<double> dp) {
    return inner.backward(b, dy, dx, dp);
  }
};
static_assert(expert_fn<faulty_experts, double>);

// Runs dispatch -> experts -> combine on a world of 4 (EP 4), rank 2's functor misbehaving.
std::vector<status> run_faulty(bool throws, bool wrong_shape, int experts_on_rank_2 = 4) {
  return run_thread_world(
      4,
      [&](thread_communicator& world) -> status {
        const int r = world.rank();
        const int E = r == 2 ? experts_on_rank_2 : 4;
        auto disp = all_to_all_dispatcher<double, thread_communicator>::make(
            {.max_tokens = 3, .hidden = 2, .topk = 1, .num_experts = E, .ep = 4});
        if (!disp) return unexpected<error>(disp.error());
        auto ep = world.split(0, r);
        auto etp = world.split(r, 0);
        auto tp_ep = world.split(0, r);
        if (!ep || !etp || !tp_ep) return make_error(errc::invalid_argument, "split");
        faulty_experts fx{
            reference_mlp<double>::make({.hidden = 2, .ffn = 2, .num_local_experts = E / 4})
                .value(),
            r == 2 && throws, r == 2 && wrong_shape};
        std::vector<double> x(6, 1.0), probs(3, 1.0), out(6);
        std::vector<int> expert = {1, 2, 3};  // rank 2 owns expert 2: it gets rows
        std::vector<std::byte> ws(disp->workspace_bytes());
        const dispatch_groups<thread_communicator> g{*ep, *etp, *tp_ep};
        auto h = disp->dispatch({.num_tokens = 3, .x = x, .expert = expert, .probs = probs}, g, ws);
        if (!h) return unexpected<error>(h.error());
        std::vector<double> y(static_cast<std::size_t>(h->num_rows()) * 2);
        if (auto s = fx.forward(h->batch(), y); !s) return s;  // a failing rank returns early
        return disp->combine(*h, y, g, out);
      },
      {.timeout = std::chrono::milliseconds(2000)});
}

}  // namespace

TEST_CASE(
    "a misbehaving expert functor or inconsistent expert counts: errors on every rank, no hang") {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto [throws, wrong] : {std::pair{true, false}, std::pair{false, true}}) {
    CAPTURE(throws);
    const auto st = run_faulty(throws, wrong);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      REQUIRE_FALSE(st[static_cast<std::size_t>(r)].has_value());
      const auto& e = st[static_cast<std::size_t>(r)].error();
      if (r == 2) {
        CHECK((throws ? e.code == errc::comm_peer_failed : e.code == errc::shape_mismatch));
        if (throws) CHECK(e.message.find("expert functor failed") != std::string::npos);
      } else {
        // The others learn it in their next collective, within the timeout.
        CHECK((e.code == errc::comm_peer_failed || e.code == errc::comm_timeout));
      }
    }
  }
  // Rank 2 believes in 8 experts, the others in 4: the count exchange does not match.
  const auto st = run_faulty(false, false, 8);
  for (const auto& s : st) {
    REQUIRE_FALSE(s.has_value());
    CHECK((s.error().code == errc::comm_mismatch || s.error().code == errc::comm_peer_failed));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE_TEMPLATE(
    "pad mode: every expert gets exactly C rows per source, results equal no padding", Path, a2a,
    ag) {
  // Invariants 4 and 6 of docs/dispatch-semantics.md 11 at the dispatcher: with the same kept
  // pairs, padding to the capacity changes the row counts (C per source and expert, C*ETP*EP per
  // local expert, static: no counts exchanged on the All-to-All path) and nothing else.
  const fold_config folds[] = {
      {.world = 1},
      {.world = 4, .ep = 4, .etp = 1},
      {.world = 4, .tp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .cp = 2, .ep = 4, .etp = 2},
      {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-cp-ep-pp-dp"},
      {.world = 12, .tp = 3, .ep = 4, .etp = 3},
  };
  int i = 0, dropped_by_capacity = 0;
  for (const auto& f : folds)
    for (int cap : {1, 2, 5}) {
      const auto fold = make_folded(f).value();
      problem p{.fold = f};
      p.experts = fold.ep() * (1 + i % 2);
      p.topk = std::min(2, p.experts);
      p.ffn = 2 * fold.etp();
      p.drop = i % 3 == 0 ? 0.2 : 0.0;
      p.empty_rank = i % 4 == 1;
      p.capacity = cap;
      CAPTURE(f.world);
      CAPTURE(f.ep);
      CAPTURE(cap);
      const auto plain = run<Path>(p);
      p.pad = true;
      const auto padded = run<Path>(p);
      const int L = p.experts / fold.ep(), P = fold.ep() * fold.etp();
      for (std::size_t r = 0; r < plain.size(); ++r) {
        CAPTURE(r);
        const auto want = expected_for_rank(p, static_cast<int>(r));
        CHECK(rel_err(padded[r].out, want.out) <= 1e-12);
        CHECK(rel_err(padded[r].dw1, want.dw1) <= 1e-12);
        // Equal to the unpadded run: zero rows add exact zeros in the same order.
        CHECK(padded[r].out == plain[r].out);
        CHECK(padded[r].dx == plain[r].dx);
        CHECK(padded[r].dprob == plain[r].dprob);
        CHECK(padded[r].dw1 == plain[r].dw1);
        CHECK(padded[r].dw2 == plain[r].dw2);
        // Invariant 4: counts bounded without padding, exact with it.
        REQUIRE(padded[r].per_expert.size() == static_cast<std::size_t>(L));
        for (int l = 0; l < L; ++l) {
          CHECK(plain[r].per_expert[static_cast<std::size_t>(l)] <= cap * P);
          CHECK(padded[r].per_expert[static_cast<std::size_t>(l)] == cap * P);
        }
        CHECK(padded[r].rows == cap * L * P);
        if (Path::exact_bytes) {  // the padding travels: C*L rows to each other EP rank
          CHECK(padded[r].a2a_rows == static_cast<long long>(cap) * L * (fold.ep() - 1));
          CHECK(padded[r].count_gather_rows == 0);
        }
      }
      const megatron_groups groups(fold);
      for (int r = 0; r < fold.world_size(); ++r) {
        const auto kept = rank_tokens(p, groups, r);
        for (std::size_t t = 0; t < kept.size(); ++t)
          dropped_by_capacity += make_token(p, r, static_cast<int>(t)).expert != kept[t].expert;
      }
      ++i;
    }
  CHECK(dropped_by_capacity >= 20);  // the capacity actually bound in many runs
}

TEST_CASE_TEMPLATE("pad mode: ranks padding to different capacities fail together, no hang", Path,
                   a2a, ag) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = run_thread_world(
      4,
      [](thread_communicator& world) -> status {
        const int r = world.rank();
        auto disp =
            Path::type::make({.max_tokens = 2, .hidden = 1, .topk = 1, .num_experts = 4, .ep = 4});
        if (!disp) return unexpected<error>(disp.error());
        auto ep = world.split(0, r).value();
        auto etp = world.split(r, 0).value();
        auto tp_ep = world.split(0, r).value();
        const int cap = r == 1 ? 2 : 1;
        std::vector<double> x = {1, 2}, probs = {1, 1};
        std::vector<int> expert = {0, 3};
        std::vector<std::byte> ws(disp->workspace_bytes(cap));
        const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
        auto h = disp->dispatch(
            {.num_tokens = 2, .x = x, .expert = expert, .probs = probs, .capacity = cap}, g, ws);
        if (!h) return unexpected<error>(h.error());
        return {};
      },
      {.timeout = std::chrono::milliseconds(2000)});
  for (const auto& s : st) {
    REQUIRE_FALSE(s.has_value());
    CHECK((s.error().code == errc::comm_mismatch || s.error().code == errc::comm_peer_failed));
  }
  if (std::is_same_v<Path, ag>)  // the AllGather path names the rule
    CHECK(st[0].error().message.find("every rank must pad to the same capacity") !=
          std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

namespace {

// Identity experts (invariant 1): each ETP shard returns p * x / ETP, so the ReduceScatter over
// ETP gives p * x; the backward gives dx = p * dy / ETP and dp = <dy, x> / ETP per shard.
struct identity_experts {
  int L = 1, H = 1, etp = 1;
  int num_local_experts() const { return L; }
  int hidden() const { return H; }
  status forward(const expert_batch<double>& b, std::span<double> y) const {
    for (std::size_t r = 0; r < b.probs.size(); ++r)
      for (std::size_t h = 0; h < static_cast<std::size_t>(H); ++h)
        y[r * H + h] = b.probs[r] * (b.x[r * H + h] / etp);
    return {};
  }
  status backward(const expert_batch<double>& b, std::span<const double> dy, std::span<double> dx,
                  std::span<double> dp) const {
    for (std::size_t r = 0; r < b.probs.size(); ++r) {
      double dot = 0;
      for (std::size_t h = 0; h < static_cast<std::size_t>(H); ++h) {
        dx[r * H + h] = b.probs[r] * (dy[r * H + h] / etp);
        dot += dy[r * H + h] * b.x[r * H + h];
      }
      dp[r] = dot / etp;
    }
    return {};
  }
};
static_assert(expert_fn<identity_experts, double>);

struct identity_result {
  std::vector<double> out, dx, dprob;
};

// Every rank of a world-8 fold runs the identity round trip on its tokens.
template <class Path>
std::vector<identity_result> run_identity(const problem& p) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  std::vector<identity_result> results(static_cast<std::size_t>(fold.world_size()));
  const auto st = run_thread_world(fold.world_size(), [&](thread_communicator& world) -> status {
    const int r = world.rank();
    auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
    auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep);
    auto disp = make_dispatcher<Path>(p, fold);
    if (!disp) return unexpected<error>(disp.error());
    const auto [n, x, expert, probs, dout] = inputs_of(p, groups, r);
    std::vector<std::byte> ws(disp->workspace_bytes());
    const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
    auto h = disp->dispatch({.num_tokens = n, .x = x, .expert = expert, .probs = probs}, g, ws);
    if (!h) return unexpected<error>(h.error());
    const identity_experts fx{p.experts / fold.ep(), p.hidden, fold.etp()};
    const auto M = static_cast<std::size_t>(h->num_rows()), H = static_cast<std::size_t>(p.hidden);
    std::vector<double> y(M * H), dy(M * H), dxr(M * H), dpr(M);
    auto& res = results[static_cast<std::size_t>(r)];
    res.out.resize(x.size());
    res.dx.resize(x.size());
    res.dprob.resize(probs.size());
    for (const status& s :
         {fx.forward(h->batch(), y), disp->combine(*h, y, g, res.out),
          disp->combine_backward(*h, dout, g, dy), fx.backward(h->batch(), dy, dxr, dpr),
          disp->dispatch_backward(*h, dxr, dpr, g, res.dx, res.dprob)})
      if (!s) return s;
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "identity experts: out = x * sum p, dx = g * sum p, dp = <g, x>, bitwise equal across maps",
    Path, a2a, ag) {
  // Invariants 1 and 2 of docs/dispatch-semantics.md 11. The expected values are formed here in
  // slot order, the All-to-All path's fixed summation order. With ETP a power of two, dividing by
  // ETP and summing ETP equal parts is exact, so its results are bitwise equal to them and
  // therefore across mappings: world 8, every fold below computes the same 8 x N tokens. The
  // AllGather path sums per owning EP rank first and then over the group (its ReduceScatter), a
  // fixed order that depends on EP: equal to rounding there (and bitwise run to run, tested above).
  constexpr bool slot_order = std::is_same_v<Path, a2a>;
  const fold_config folds[] = {
      {.world = 8, .ep = 1, .etp = 1},
      {.world = 8, .ep = 8, .etp = 1},
      {.world = 8, .tp = 2, .ep = 4, .etp = 2},
      {.world = 8, .tp = 2, .cp = 2, .ep = 2, .etp = 4},
      {.world = 8, .tp = 4, .ep = 2, .etp = 1},
      {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 2},
      {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-cp-ep-pp-dp"},
  };
  for (double drop : {0.0, 0.25}) {
    std::vector<identity_result> first;
    for (const auto& f : folds) {
      CAPTURE(f.tp);
      CAPTURE(f.ep);
      CAPTURE(f.etp.value_or(f.tp));
      CAPTURE(drop);
      problem p{.fold = f, .experts = 8, .topk = 3, .hidden = 4, .tokens = 6, .drop = drop};
      const auto res = run_identity<Path>(p);
      const auto fold = make_folded(f).value();
      const megatron_groups groups(fold);
      for (int r = 0; r < 8; ++r) {
        CAPTURE(r);
        const auto toks = rank_tokens(p, groups, r);
        std::vector<double> out, dx, dp;
        for (const auto& d : toks) {
          for (int h = 0; h < p.hidden; ++h) {
            double o = 0, g = 0;
            for (int j = 0; j < p.topk; ++j)
              if (d.expert[j] >= 0) {
                o += d.prob[j] * d.x[h];
                g += d.prob[j] * d.dout[h];
              }
            out.push_back(o);
            dx.push_back(g);
          }
          for (int j = 0; j < p.topk; ++j) {
            double dot = 0;
            for (int h = 0; h < p.hidden; ++h) dot += d.dout[h] * d.x[h];
            dp.push_back(d.expert[j] >= 0 ? dot : 0.0);
          }
        }
        const auto& got = res[static_cast<std::size_t>(r)];
        if (slot_order) {
          CHECK(got.out == out);
          CHECK(got.dx == dx);
        } else {
          CHECK(rel_err(got.out, out) <= 1e-15);
          CHECK(rel_err(got.dx, dx) <= 1e-15);
        }
        CHECK(got.dprob == dp);
      }
      if (!slot_order) continue;
      if (first.empty()) {
        first = res;
      } else {
        for (std::size_t r = 0; r < res.size(); ++r) {
          CHECK(std::memcmp(res[r].out.data(), first[r].out.data(),
                            res[r].out.size() * sizeof(double)) == 0);
          CHECK(std::memcmp(res[r].dx.data(), first[r].dx.data(),
                            res[r].dx.size() * sizeof(double)) == 0);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("pad mode: a rank over capacity, or naming a bad expert, fails every rank", Path,
                   a2a, ag) {
  for (int bad_expert : {-1, 7}) {  // -1: rank 2 routes 2 pairs to expert 0 with capacity 1
    CAPTURE(bad_expert);
    const auto st = run_thread_world(
        4,
        [&](thread_communicator& world) -> status {
          const int r = world.rank();
          auto disp = Path::type::make(
              {.max_tokens = 2, .hidden = 1, .topk = 1, .num_experts = 4, .ep = 4});
          if (!disp) return unexpected<error>(disp.error());
          auto ep = world.split(0, r).value();
          auto etp = world.split(r, 0).value();
          auto tp_ep = world.split(0, r).value();
          std::vector<double> x = {1, 2}, probs = {1, 1};
          std::vector<int> expert = {r, (r + 1) % 4};
          if (r == 2) expert = {0, bad_expert >= 0 ? bad_expert : 0};
          const int cap = bad_expert >= 0 ? -1 : 1;
          std::vector<std::byte> ws(disp->workspace_bytes(cap));
          const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
          auto h = disp->dispatch(
              {.num_tokens = 2, .x = x, .expert = expert, .probs = probs, .capacity = cap}, g, ws);
          if (!h) return unexpected<error>(h.error());
          std::vector<double> y(static_cast<std::size_t>(h->num_rows())), out(2);
          return disp->combine(*h, y, g, out);
        },
        {.timeout = std::chrono::milliseconds(2000)});
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      REQUIRE_FALSE(st[static_cast<std::size_t>(r)].has_value());
      const auto& e = st[static_cast<std::size_t>(r)].error();
      if (std::is_same_v<Path, ag> || r == 2) {  // the AllGather path: everyone sees the record
        CHECK(e.code == errc::invalid_argument);
        CHECK(e.message.find(bad_expert >= 0 ? "names expert 7" : "drop before padding") !=
              std::string::npos);
      } else {  // the All-to-All path: the others learn it from their next collective
        CHECK((e.code == errc::comm_peer_failed || e.code == errc::comm_timeout));
      }
    }
  }
}

TEST_CASE(
    "DeepSeek-V3 and Qwen3-235B shapes: workspace queried without allocating, rows grow "
    "with the receive bound, not with EP") {
  struct model {
    const char* name;
    int E, k, H, N, EP;
  };
  using a2a_bf16 = all_to_all_dispatcher<bfloat16, thread_communicator>;
  for (const model m : {model{"DeepSeek-V3", 256, 8, 7168, 4096, 64},
                        model{"Qwen3-235B-A22B", 128, 8, 4096, 4096, 32}}) {
    CAPTURE(m.name);
    const std::uint64_t row = static_cast<std::uint64_t>(m.H) * sizeof(bfloat16);
    const std::uint64_t S = static_cast<std::uint64_t>(m.N) * m.k;  // rows a rank sends
    const std::uint64_t overhead = std::uint64_t{1} << 22;          // counts, plan, probabilities
    // Unbounded: constructible (64-bit elements), and the worst case grows with EP.
    const dispatch_shape worst{
        .max_tokens = m.N, .hidden = m.H, .topk = m.k, .num_experts = m.E, .ep = m.EP};
    auto dw = a2a_bf16::make(worst);
    REQUIRE(dw.has_value());
    const auto w = dw->workspace_sizes();
    CHECK(w.saved >= S * m.EP * row);              // the experts' batch: every routed pair
    CHECK(w.scratch >= (2 * S * m.EP + S) * row);  // two receive buffers, one send buffer
    // A trainer's bound of twice the mean load: the rows follow it, whatever EP is.
    const int R = static_cast<int>(2 * S);
    std::vector<dispatch_workspace_bytes> sizes;
    for (int ep : {8, m.EP}) {
      dispatch_shape s = worst;
      s.ep = ep;
      s.max_recv_rows = R;
      auto d = a2a_bf16::make(s);
      REQUIRE(d.has_value());
      const auto b = d->workspace_sizes();
      CHECK(b.saved >= R * row);
      CHECK(b.saved <= R * row + overhead);
      CHECK(b.scratch >= (2 * std::uint64_t{static_cast<unsigned>(R)} + S) * row);
      CHECK(b.scratch <= (2 * std::uint64_t{static_cast<unsigned>(R)} + S) * row + overhead);
      CHECK(d->workspace_bytes() == b.total());
      sizes.push_back(b);
    }
    const auto diff = [](std::size_t a, std::size_t b) { return a > b ? a - b : b - a; };
    CHECK(diff(sizes[0].total(), sizes[1].total()) < overhead);  // EP 8 vs EP 64: counts only
  }
  // Without a bound, a worst case of 2^31 rows or more is refused, naming the fix.
  auto huge = all_to_all_dispatcher<float, thread_communicator>::make(
      {.max_tokens = 1 << 16, .hidden = 1, .topk = 8, .num_experts = 4096, .ep = 4096});
  REQUIRE(!huge);
  CHECK(huge.error().code == errc::overflow);
  CHECK(huge.error().message.find("max_recv_rows") != std::string::npos);
}

TEST_CASE(
    "a step that would exceed the receive bound fails on every rank alike, before any row "
    "moves") {
  for (bool pad : {false, true})
    for (int path = 0; path < 2; ++path) {
      CAPTURE(pad);
      CAPTURE(path);
      problem p{.fold = {.world = 4, .tp = 2, .ep = 4, .etp = 1}};
      p.experts = 4;
      p.topk = 2;
      p.tokens = 8;
      p.capacity = pad ? 2 : -1;
      p.pad = pad;
      p.max_recv_rows = 3;  // each EP rank receives about 16 rows (pad: C * E * ETP = 8)
      std::vector<std::string> why(4);
      std::vector<int> code(4, 0), world_ok(4, 0);
      const auto st = run_thread_world(4, [&](thread_communicator& comm) -> status {
        auto r = path == 0 ? run_rank<a2a>(p, comm) : run_rank<ag>(p, comm);
        const auto me = static_cast<std::size_t>(comm.rank());
        if (!r) {
          why[me] = r.error().message;
          code[me] = static_cast<int>(r.error().code);
        }
        world_ok[me] = comm.barrier().has_value();  // every rank still in step
        return {};
      });
      for (const auto& s : st) CHECK(s.has_value());
      for (std::size_t r = 0; r < 4; ++r) {
        CAPTURE(r);
        CHECK(code[r] == static_cast<int>(errc::receive_bound_exceeded));
        CHECK(why[r] == why[0]);  // the same words on every rank
        CHECK(world_ok[r] == 1);
      }
      CHECK(why[0].find("max_recv_rows") != std::string::npos);
      // With a bound that holds, the same step runs and equals the reference.
      p.max_recv_rows = pad ? 8 : 4 * 8 * 2;
      const auto res = path == 0 ? run<a2a>(p) : run<ag>(p);
      for (std::size_t r = 0; r < res.size(); ++r) {
        const auto want = expected_for_rank(p, static_cast<int>(r));
        CHECK(rel_err(res[r].out, want.out) <= 1e-12);
        CHECK(rel_err(res[r].dx, want.dx) <= 1e-12);
        CHECK(rel_err(res[r].dw1, want.dw1) <= 1e-12);
      }
    }
}

TEST_CASE("E 256, k 8 over EP 64 on a 64-rank world with a receive bound equals the reference") {
  const problem p = ep64_problem(8);
  coverage cov;
  check_problem<a2a>(p, cov);
  CHECK(cov.configs == 1);
}
