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
#include <utility>

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
    host_workspace ws(d.workspace_sizes());
    std::vector<std::byte> small(16);
    auto ep = world.split(0, world.rank()).value();
    auto etp = world.split(world.rank(), 0).value();
    auto tpep = world.split(0, world.rank()).value();
    const dispatch_groups<thread_communicator> g{ep, etp, tpep};
    const std::vector<double> x = {1, 2}, probs = {1, 1};
    const std::vector<int> expert = {0, 1};
    host_exec hx;
    CHECK(d.dispatch(hx, host_input(d.shape(), 3, x, expert, probs), g, ws.view()).error().code ==
          errc::invalid_size);
    // 16 bytes in all (the saved part; the others empty).
    CHECK(d.dispatch(hx, host_input(d.shape(), 2, x, expert, probs), g, {.saved = small})
              .error()
              .code == errc::workspace_too_small);
    auto h = d.dispatch(hx, host_input(d.shape(), 2, x, expert, probs), g, ws.view());
    REQUIRE(h);
    std::vector<double> y(static_cast<std::size_t>(h->num_rows())), out(2);
    // A handle from another dispatcher is refused (no collective runs, so no rank waits).
    CHECK(d2.combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1))
              .error()
              .message.find("another dispatcher") != std::string::npos);
    return d.combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1));
  });
  for (const auto& s : st) CHECK(s.has_value());
}

// The run-time choice runs the chosen dispatcher's code: bitwise its results and its bytes, on
// folds with ETP > 1 and EP spanning attention groups, with dropped pairs and in pad mode.
TEST_CASE_TEMPLATE("a dispatcher chosen at run time equals the concrete one bitwise", Pair,
                   std::pair<variant_path<thread_communicator, dispatcher_kind::all_to_all>, a2a>,
                   std::pair<variant_path<thread_communicator, dispatcher_kind::all_gather>, ag>) {
  using chosen = typename Pair::first_type;
  using concrete = typename Pair::second_type;
  problem dropped{.fold = {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 2}, .drop = 0.25};
  problem padded{.fold = {.world = 4, .ep = 4, .etp = 1}, .experts = 8};
  padded.capacity = 2;
  padded.pad = true;
  for (const problem& p : {dropped, padded}) {
    CAPTURE(p.pad);
    const auto a = run<chosen>(p), b = run<concrete>(p);
    REQUIRE(a.size() == b.size());
    const auto same = [](const std::vector<double>& u, const std::vector<double>& v) {
      return u.size() == v.size() &&
             std::memcmp(u.data(), v.data(), u.size() * sizeof(double)) == 0;
    };
    for (std::size_t r = 0; r < a.size(); ++r) {
      CAPTURE(r);
      CHECK(same(a[r].out, b[r].out));
      CHECK(same(a[r].dx, b[r].dx));
      CHECK(same(a[r].dprob, b[r].dprob));
      CHECK(same(a[r].dw1, b[r].dw1));
      CHECK(same(a[r].dw2, b[r].dw2));
      CHECK(a[r].per_expert == b[r].per_expert);
      CHECK(a[r].a2a_rows == b[r].a2a_rows);
    }
  }
}

TEST_CASE("a run-time dispatcher choice is checked: kinds, handles of the other kind") {
  using either = dispatcher_variant<all_to_all_dispatcher<double, thread_communicator>,
                                    all_gather_dispatcher<double, thread_communicator>>;
  const dispatch_shape shape{.max_tokens = 2, .hidden = 1, .topk = 1, .num_experts = 2};
  CHECK(either::make(shape).value().kind() == dispatcher_kind::all_to_all);  // the first
  dispatch_shape ag_shape = shape;
  ag_shape.kind = dispatcher_kind::all_gather;
  CHECK(either::make(ag_shape).value().kind() == dispatcher_kind::all_gather);
  // A concrete dispatcher refuses a shape asking for the other one, by name.
  const auto refused = all_to_all_dispatcher<double, thread_communicator>::make(ag_shape);
  REQUIRE(!refused);
  CHECK(refused.error().message.find("asks for the allgather dispatcher") != std::string::npos);
  // The variant checks the shape as its chosen dispatcher does.
  dispatch_shape bad = ag_shape;
  bad.topk = 3;
  CHECK(either::make(bad).error().code == errc::invalid_argument);
  // A kind none of the alternatives is.
  using only_a2a = dispatcher_variant<all_to_all_dispatcher<double, thread_communicator>>;
  CHECK(only_a2a::make(ag_shape).error().message.find("no dispatcher of kind allgather") !=
        std::string::npos);
  // A handle of the other kind (or of another dispatcher of the same kind) is refused before any
  // collective runs.
  auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
    auto a = either::make(shape).value(), b = either::make(ag_shape).value(), a2 = a;
    host_workspace ws(a.workspace_sizes());
    auto self = world.split(0, 0).value();
    const dispatch_groups<thread_communicator> g{self, self, self};
    const std::vector<double> x = {1, 2}, probs = {1, 1};
    const std::vector<int> expert = {0, 1};
    host_exec hx;
    auto h = a.dispatch(hx, host_input(a.shape(), 2, x, expert, probs), g, ws.view());
    if (!h) return unexpected<error>(h.error());
    CHECK(h->num_rows() == 2);
    CHECK(h->batch_counts().size() == 2);
    std::vector<double> y(2), out(2);
    CHECK(b.combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1))
              .error()
              .message.find("another kind of dispatcher than this one's (allgather)") !=
          std::string::npos);
    CHECK(a2.combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1))
              .error()
              .message.find("another dispatcher") != std::string::npos);
    return a.combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1));
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
  status forward(host_exec& x, const expert_batch<double>& b, row_view<double> y,
                 std::span<std::byte> ws) {
    if (throw_here) throw std::runtime_error("expert functor failed on this rank");
    if (wrong_shape_here) return inner.forward(x, b, y.first(y.rows() / 2), ws);  // half the rows
    return inner.forward(x, b, y, ws);
  }
  status backward(host_exec& x, const expert_batch<double>& b, row_view<const double> dy,
                  row_view<double> dx, row_view<double> dp, std::span<std::byte> ws) {
    return inner.backward(x, b, dy, dx, dp, ws);
  }
};
static_assert(expert_fn<faulty_experts, host_exec, double>);

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
        host_workspace ws(disp->workspace_sizes());
        const dispatch_groups<thread_communicator> g{*ep, *etp, *tp_ep};
        host_exec hx;
        auto h = disp->dispatch(hx, host_input(disp->shape(), 3, x, expert, probs), g, ws.view());
        if (!h) return unexpected<error>(h.error());
        std::vector<double> y(static_cast<std::size_t>(h->num_rows()) * 2);
        std::vector<std::byte> fws(fx.inner.workspace_bytes(h->num_rows()));
        if (auto s = fx.forward(hx, h->batch(), host_rows(std::span(y), 2), fws); !s)
          return s;  // a failing rank returns early
        return disp->combine(hx, *h, rows_of(y, 2), g, rows_of(out, 2));
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
        host_workspace ws(disp->workspace_sizes(cap));
        const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
        host_exec hx;
        auto h =
            disp->dispatch(hx, host_input(disp->shape(), 2, x, expert, probs, cap), g, ws.view());
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
  status forward(host_exec&, const expert_batch<double>& b, row_view<double> y,
                 std::span<std::byte>) const {
    for (int r = 0; r < b.rows(); ++r)
      for (int h = 0; h < H; ++h) y(r, h) = b.probs(r, 0) * (b.x(r, h) / etp);
    return {};
  }
  status backward(host_exec&, const expert_batch<double>& b, row_view<const double> dy,
                  row_view<double> dx, row_view<double> dp, std::span<std::byte>) const {
    for (int r = 0; r < b.rows(); ++r) {
      double dot = 0;
      for (int h = 0; h < H; ++h) {
        dx(r, h) = b.probs(r, 0) * (dy(r, h) / etp);
        dot += dy(r, h) * b.x(r, h);
      }
      dp(r, 0) = dot / etp;
    }
    return {};
  }
};
static_assert(expert_fn<identity_experts, host_exec, double>);

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
    host_workspace ws(disp->workspace_sizes());
    const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
    host_exec hx;
    auto h = disp->dispatch(hx, host_input(disp->shape(), n, x, expert, probs), g, ws.view());
    if (!h) return unexpected<error>(h.error());
    const identity_experts fx{p.experts / fold.ep(), p.hidden, fold.etp()};
    const auto M = static_cast<std::size_t>(h->num_rows()), H = static_cast<std::size_t>(p.hidden);
    std::vector<double> y(M * H), dy(M * H), dxr(M * H), dpr(M);
    auto& res = results[static_cast<std::size_t>(r)];
    res.out.resize(x.size());
    res.dx.resize(x.size());
    res.dprob.resize(probs.size());
    for (const status& s :
         {fx.forward(hx, h->batch(), rows_of(y, p.hidden), {}),
          disp->combine(hx, *h, rows_of(y, p.hidden), g, rows_of(res.out, p.hidden)),
          disp->combine_backward(hx, *h, rows_of(dout, p.hidden), g, rows_of(dy, p.hidden)),
          fx.backward(hx, h->batch(), rows_of(dy, p.hidden), rows_of(dxr, p.hidden),
                      rows_of(dpr, 1), {}),
          disp->dispatch_backward(hx, *h, rows_of(dxr, p.hidden), rows_of(dpr, 1), g,
                                  rows_of(res.dx, p.hidden), rows_of(res.dprob, p.topk))})
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
          const std::optional<int> cap = bad_expert >= 0 ? std::nullopt : std::optional<int>(1);
          host_workspace ws(disp->workspace_sizes(cap));
          const dispatch_groups<thread_communicator> g{ep, etp, tp_ep};
          host_exec hx;
          auto h =
              disp->dispatch(hx, host_input(disp->shape(), 2, x, expert, probs, cap), g, ws.view());
          if (!h) return unexpected<error>(h.error());
          std::vector<double> y(static_cast<std::size_t>(h->num_rows())), out(2);
          return disp->combine(hx, *h, rows_of(y, 1), g, rows_of(out, 1));
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
    // Rows in flight are packed: the token row, its probability, zeros to a multiple of 16 bytes.
    const std::uint64_t packed = static_cast<std::uint64_t>(dw->packed_width()) * sizeof(bfloat16);
    CHECK(packed == (row + sizeof(bfloat16) + 15) / 16 * 16);
    const std::uint64_t counts = std::uint64_t{1} << 20;  // the gathered counts, alignment
    const auto w = dw->workspace_sizes();
    CHECK(w.saved >= S * m.EP * row);                 // the experts' batch: every routed pair
    CHECK(w.scratch >= (2 * S * m.EP + S) * packed);  // two receive buffers, one send buffer
    CHECK(w.scratch <= (2 * S * m.EP + S) * packed + counts);
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
      CHECK(b.scratch >= (2 * std::uint64_t{static_cast<unsigned>(R)} + S) * packed);
      CHECK(b.scratch <= (2 * std::uint64_t{static_cast<unsigned>(R)} + S) * packed + counts);
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

// --- Probabilities travel with their rows (packed rows) ------------------------------------------

namespace {

// What one collective of a round trip did, as a recording communicator saw it.
struct call_record {
  std::string kind;           // "a2a", "agv", "ag", "rsv", "all_reduce", "broadcast", "barrier"
  std::size_t elem = 0;       // sizeof the element type
  bool is_int = false;        // counts, headers, expert ids
  int width = 0;              // row width (elements)
  long long remote = 0;       // rows sent to other ranks
  long long pad_bytes = 0;    // bytes checked in the padding columns of packed rows (sent and got)
  long long pad_nonzero = 0;  // of those, the nonzero ones
};

// A communicator that forwards to a thread_communicator and records each collective: its kind,
// element type, width, the rows it sent to other ranks, and, for packed rows (width `packed`),
// the bytes of the padding columns [used, packed) and of the gap [gap_from, gap_to) before the
// probabilities of what it sent and received. The thread world copies bytes, so a padding
// element left unwritten would show here.
struct recording_comm {
  using memory_space = host_space;
  thread_communicator* c = nullptr;
  std::vector<call_record>* log = nullptr;
  int packed = 0, used = 0;
  int gap_from = 0, gap_to = 0;

  int rank() const { return c->rank(); }
  int size() const { return c->size(); }

  template <class T>
  void note(const char* kind, row_view<const T> s, row_view<const T> r, long long remote) {
    call_record rec{kind, sizeof(T), std::is_same_v<T, int>, s.width(), remote, 0, 0};
    auto check_columns = [&](int from, int to) {
      for (const row_view<const T>* v : {&s, &r})
        for (int i = 0; i < v->rows(); ++i) {
          const auto* b = reinterpret_cast<const unsigned char*>(v->row_data(i) + from);
          for (std::size_t q = 0; q < sizeof(T) * static_cast<std::size_t>(to - from); ++q) {
            ++rec.pad_bytes;
            rec.pad_nonzero += b[q] != 0;
          }
        }
    };
    if (!rec.is_int && s.width() == packed && packed > used) check_columns(used, packed);
    if (!rec.is_int && s.width() == packed && gap_to > gap_from) check_columns(gap_from, gap_to);
    log->push_back(rec);
  }
  template <class T>
  status all_to_all_v(host_exec& x, row_view<const T> s, std::span<const int> sn, row_view<T> r,
                      std::span<const int> rn) {
    auto st = c->all_to_all_v(x, s, sn, r, rn);
    note<T>("a2a", s, r, s.rows() - sn[static_cast<std::size_t>(rank())]);
    return st;
  }
  template <class T>
  status all_gather_v(host_exec& x, row_view<const T> s, row_view<T> r, std::span<const int> n) {
    auto st = c->all_gather_v(x, s, r, n);
    note<T>("agv", s, r, static_cast<long long>(s.rows()) * (size() - 1));
    return st;
  }
  template <class T>
  status all_gather(host_exec& x, row_view<const T> s, row_view<T> r) {
    auto st = c->all_gather(x, s, r);
    note<T>("ag", s, r, static_cast<long long>(s.rows()) * (size() - 1));
    return st;
  }
  template <class T>
  status reduce_scatter_v(host_exec& x, row_view<const T> s, std::span<const int> n, row_view<T> r,
                          reduce_op op) {
    auto st = c->reduce_scatter_v(x, s, n, r, op);
    note<T>("rsv", s, r, s.rows() - n[static_cast<std::size_t>(rank())]);
    return st;
  }
  template <class T>
  status all_reduce(host_exec& x, row_view<T> b, reduce_op op) {
    log->push_back({"all_reduce", sizeof(T), std::is_same_v<T, int>, b.width(), 0, 0, 0});
    return c->all_reduce(x, b, op);
  }
  template <class T>
  status broadcast(host_exec& x, row_view<T> b, int root) {
    log->push_back({"broadcast", sizeof(T), std::is_same_v<T, int>, b.width(), 0, 0, 0});
    return c->broadcast(x, b, root);
  }
  status barrier(host_exec& x) {
    log->push_back({"barrier", 0, false, 0, 0, 0, 0});
    return c->barrier(x);
  }
};
static_assert(communicator_for<recording_comm, host_exec, double> &&
              communicator_for<recording_comm, host_exec, int>);

// The collectives of one phase, by kind: rows of T and rows of int.
struct phase_calls {
  int a2a = 0, agv = 0, ag = 0, rsv = 0, ints = 0;
  long long remote_t = 0, remote_int = 0;  // rows of T / int sent to other ranks
  long long remote_bytes = 0;              // bytes, from the calls' own views
  long long pad_bytes = 0, pad_nonzero = 0;
  int t_calls() const { return a2a + agv + ag + rsv; }
  friend bool operator==(const phase_calls&, const phase_calls&) = default;
};
phase_calls summarize(std::vector<call_record>& log) {
  phase_calls p;
  for (const auto& c : log) {
    p.remote_bytes += c.remote * c.width * static_cast<long long>(c.elem);
    p.pad_bytes += c.pad_bytes;
    p.pad_nonzero += c.pad_nonzero;
    if (c.is_int) {
      ++p.ints;
      p.remote_int += c.remote;
      continue;
    }
    p.remote_t += c.remote;
    p.a2a += c.kind == "a2a";
    p.agv += c.kind == "agv";
    p.ag += c.kind == "ag";
    p.rsv += c.kind == "rsv";
  }
  log.clear();
  return p;
}

// One rank's round trip (dispatch, experts, combine, both backwards) through recording
// communicators, the workspace filled with 0xA5 bytes first (a pad element left unwritten would
// travel as 0xA5). Returns the results and the collectives of each phase.
struct recorded {
  rank_result res;
  phase_calls dispatch, combine, combine_backward, dispatch_backward;
  dispatch_volume volume;
  int packed_width = 0;
};
template <bool AllToAll, class T = double, class P = T>
using recorded_dispatcher =
    std::conditional_t<AllToAll, all_to_all_dispatcher<T, recording_comm, host_exec, P>,
                       all_gather_dispatcher<T, recording_comm, host_exec, P>>;

// Groups of recording communicators over one fold; `packed`, `used` set once the dispatcher is
// known.
struct recording_groups {
  expected<thread_communicator> ep, etp, tp_ep;
  std::vector<call_record> log;
  recording_comm rep, retp, rtp_ep;
  recording_groups(thread_communicator& world, const megatron_groups& groups)
      : ep(group_communicator(world, groups, {group_kind::ep})),
        etp(group_communicator(world, groups, {group_kind::etp})),
        tp_ep(group_communicator(world, groups, {group_kind::tp_ep})) {}
  bool ok() const { return ep && etp && tp_ep; }
  dispatch_groups<recording_comm> make(int packed, int used, int gap_from = 0, int gap_to = 0) {
    rep = {&*ep, &log, packed, used, gap_from, gap_to};
    retp = {&*etp, &log, packed, used, gap_from, gap_to};
    rtp_ep = {&*tp_ep, &log, packed, used, gap_from, gap_to};
    return {rep, retp, rtp_ep};
  }
};

template <bool AllToAll>
expected<recorded> run_recorded(const problem& p, thread_communicator& world) {
  using D = recorded_dispatcher<AllToAll>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const int r = world.rank();
  recording_groups rg(world, groups);
  if (!rg.ok()) return make_error(errc::invalid_argument, "groups");
  auto disp = D::make({.max_tokens = p.tokens,
                       .hidden = p.hidden,
                       .topk = p.topk,
                       .num_experts = p.experts,
                       .ep = fold.ep(),
                       .etp = fold.etp()});
  if (!disp) return unexpected<error>(disp.error());
  const int W = disp->packed_width();
  const dispatch_groups<recording_comm> g = rg.make(W, AllToAll ? p.hidden + 1 : p.hidden + p.topk);
  auto& log = rg.log;
  auto [n, x, expert, probs, dout] = inputs_of(p, groups, r);
  const std::optional<int> cap = p.pad ? std::optional<int>(p.capacity) : std::nullopt;
  host_workspace ws(disp->workspace_sizes(cap), std::byte{0xA5});
  recorded out;
  out.packed_width = W;
  host_exec hx;
  auto h = disp->dispatch(hx, host_input(disp->shape(), n, x, expert, probs, cap), g, ws.view());
  if (!h) return unexpected<error>(h.error());
  out.dispatch = summarize(log);
  auto mlp = rank_experts<double>(p, fold, r, w.w1, w.w2);
  if (!mlp) return unexpected<error>(mlp.error());
  const auto M = static_cast<std::size_t>(h->num_rows()), H = static_cast<std::size_t>(p.hidden);
  std::vector<double> y(M * H), dy(M * H), dx_rows(M * H), dp_rows(M);
  auto& res = out.res;
  res.out.resize(static_cast<std::size_t>(n) * H);
  res.dx.resize(res.out.size());
  res.dprob.resize(probs.size());
  if (auto st = mlp->forward(h->batch(), y); !st) return unexpected<error>(st.error());
  const int Hi = p.hidden;
  if (auto st = disp->combine(hx, *h, rows_of(y, Hi), g, rows_of(res.out, Hi)); !st)
    return unexpected<error>(st.error());
  out.combine = summarize(log);
  if (auto st = disp->combine_backward(hx, *h, rows_of(dout, Hi), g, rows_of(dy, Hi)); !st)
    return unexpected<error>(st.error());
  out.combine_backward = summarize(log);
  if (auto st = mlp->backward(h->batch(), dy, dx_rows, dp_rows); !st)
    return unexpected<error>(st.error());
  if (auto st = disp->dispatch_backward(hx, *h, rows_of(dx_rows, Hi), rows_of(dp_rows, 1), g,
                                        rows_of(res.dx, Hi), rows_of(res.dprob, p.topk));
      !st)
    return unexpected<error>(st.error());
  out.dispatch_backward = summarize(log);
  out.volume = h->volume();
  return out;
}

template <bool AllToAll>
std::vector<recorded> run_all_recorded(const problem& p) {
  const int world = make_folded(p.fold).value().world_size();
  std::vector<recorded> results(static_cast<std::size_t>(world));
  const auto st = run_thread_world(world, [&](thread_communicator& comm) -> status {
    auto r = run_recorded<AllToAll>(p, comm);
    if (!r) return unexpected<error>(r.error());
    results[static_cast<std::size_t>(comm.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  // (memcmp may not be given the null data() of an empty vector, even with size 0.)
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

}  // namespace

static_assert(detail::packed_width<float>(4) == 4 && detail::packed_width<float>(5) == 8 &&
              detail::packed_width<double>(4) == 4 && detail::packed_width<double>(7) == 8 &&
              detail::packed_width<bfloat16>(7169) == 7176 &&
              detail::packed_width<bfloat16>(4097) == 4104);
static_assert(all_to_all_dispatcher<float, thread_communicator>::pack_reductions &&
              all_to_all_dispatcher<double, thread_communicator>::pack_reductions &&
              all_gather_dispatcher<double, thread_communicator>::pack_reductions &&
              !all_to_all_dispatcher<bfloat16, thread_communicator>::pack_reductions &&
              !all_gather_dispatcher<float16, thread_communicator>::pack_reductions);

TEST_CASE(
    "All-to-All path: probabilities travel with their rows, one collective per pair, packed "
    "bytes, zero padding, the same bits") {
  // H 6, k 3 in fp64: packed rows of W = round_up(7 * 8, 16) / 8 = 8 elements, one pad element.
  for (const fold_config f : {fold_config{.world = 8, .tp = 2, .ep = 8, .etp = 1},
                              fold_config{.world = 8, .tp = 2, .ep = 4, .etp = 2},
                              fold_config{.world = 4, .tp = 2, .ep = 2, .etp = 2}})
    for (bool pad : {false, true}) {
      CAPTURE(f.ep);
      CAPTURE(f.etp.value_or(f.tp));
      CAPTURE(pad);
      problem p{.fold = f, .experts = 8, .topk = 3, .hidden = 6, .ffn = 4, .tokens = 6};
      p.drop = pad ? 0.0 : 0.2;
      p.capacity = pad ? 3 : -1;
      p.pad = pad;
      const int etp = make_folded(f).value().etp();
      const auto rec = run_all_recorded<true>(p);
      const auto plain = run<a2a>(p);
      for (std::size_t r = 0; r < rec.size(); ++r) {
        CAPTURE(r);
        const auto& c = rec[r];
        REQUIRE(c.packed_width == 8);
        // The same bits as the plain communicator (which the fp64 sweeps check).
        CHECK(same_bits(c.res.out, plain[r].out));
        CHECK(same_bits(c.res.dx, plain[r].dx));
        CHECK(same_bits(c.res.dprob, plain[r].dprob));
        // One collective per pair: dispatch A2A (+ AGV over ETP), combine (RSV +) A2A, and the
        // backward's mirror images. Before packing: 6 row collectives at ETP 1, 12 at ETP 2.
        CHECK(c.dispatch.a2a == 1);
        CHECK(c.dispatch.agv == (etp > 1 ? 1 : 0));
        CHECK(c.dispatch.ints == (pad ? 0 : 1));  // the counts (none in pad mode)
        CHECK(c.combine.rsv == (etp > 1 ? 1 : 0));
        CHECK(c.combine.a2a == 1);
        CHECK(c.combine_backward.a2a == 1);
        CHECK(c.combine_backward.agv == (etp > 1 ? 1 : 0));
        CHECK(c.dispatch_backward.rsv == (etp > 1 ? 1 : 0));
        CHECK(c.dispatch_backward.a2a == 1);
        const int round_trip = c.dispatch.t_calls() + c.combine.t_calls() +
                               c.combine_backward.t_calls() + c.dispatch_backward.t_calls();
        CHECK(round_trip == (etp > 1 ? 8 : 4));
        // The volume reports the packed bytes: rows * W * sizeof(T), as the collectives sent.
        const auto& v = c.volume;
        CHECK(v.dispatch_a2a.rows == plain[r].a2a_rows);
        CHECK(v.dispatch_a2a.bytes == v.dispatch_a2a.rows * 8 * 8);
        CHECK(v.dispatch_agv.bytes == v.dispatch_agv.rows * 8 * 8);
        CHECK(v.dispatch_a2a.rows + v.dispatch_agv.rows == c.dispatch.remote_t);
        CHECK(v.dispatch_a2a.bytes + v.dispatch_agv.bytes + v.count_gather.bytes ==
              c.dispatch.remote_bytes);
        CHECK(v.combine_a2a.bytes == v.combine_a2a.rows * 6 * 8);  // combine rows are not packed
        // Padding: written as zeros in every packed row sent and received, forward and backward.
        CHECK(c.dispatch.pad_bytes > 0);
        CHECK(c.dispatch_backward.pad_bytes > 0);
        CHECK(c.dispatch.pad_nonzero == 0);
        CHECK(c.dispatch_backward.pad_nonzero == 0);
      }
    }
}

TEST_CASE(
    "AllGather path: tokens and probabilities gathered in one collective, gradients returned in "
    "one, packed bytes, zero padding, the same bits") {
  // H 6, k 3 in fp64: packed rows of W = round_up(9 * 8, 16) / 8 = 10 elements, one pad element.
  for (const fold_config f : {fold_config{.world = 8, .tp = 2, .ep = 8, .etp = 1},
                              fold_config{.world = 8, .tp = 2, .ep = 4, .etp = 2}})
    for (bool pad : {false, true}) {
      CAPTURE(f.ep);
      CAPTURE(pad);
      problem p{.fold = f, .experts = 8, .topk = 3, .hidden = 6, .ffn = 4, .tokens = 6};
      p.empty_rank = !pad;
      p.capacity = pad ? 3 : -1;
      p.pad = pad;
      const auto rec = run_all_recorded<false>(p);
      const auto plain = run<ag>(p);
      for (std::size_t r = 0; r < rec.size(); ++r) {
        CAPTURE(r);
        const auto& c = rec[r];
        REQUIRE(c.packed_width == 10);
        CHECK(same_bits(c.res.out, plain[r].out));
        CHECK(same_bits(c.res.dx, plain[r].dx));
        CHECK(same_bits(c.res.dprob, plain[r].dprob));
        // Dispatch: the header and the expert ids (int) and one AllGather-V of packed rows (was
        // two: tokens, probabilities); the backward one ReduceScatter-V (was two). 6 collectives
        // per round trip, 8 before, whatever ETP is.
        CHECK(c.dispatch.agv == 1);
        CHECK(c.dispatch.ints == 2);
        CHECK(c.combine.rsv == 1);
        CHECK(c.combine_backward.agv == 1);
        CHECK(c.dispatch_backward.rsv == 1);
        const int round_trip = c.dispatch.t_calls() + c.dispatch.ints + c.combine.t_calls() +
                               c.combine_backward.t_calls() + c.dispatch_backward.t_calls();
        CHECK(round_trip == 6);
        const auto& v = c.volume;
        CHECK(v.dispatch_agv.rows == c.dispatch.remote_t);
        CHECK(v.dispatch_agv.bytes == v.dispatch_agv.rows * (10 * 8 + 3 * 4));
        CHECK(v.dispatch_agv.bytes + v.count_gather.bytes == c.dispatch.remote_bytes);
        CHECK(c.dispatch.pad_bytes + c.dispatch_backward.pad_bytes > 0);
        CHECK(c.dispatch.pad_nonzero == 0);
        CHECK(c.dispatch_backward.pad_nonzero == 0);
      }
    }
}

namespace {

// A round trip in T with data every 16-bit type holds exactly (small integers, eighths) and
// sums that stay exact: identity "experts" (y = the batch's rows, dx_rows = dy, dprob_rows = the
// batch's probabilities). Results as floats, and the collectives of the backward. Probabilities
// in P; `fine_probs` adds (1 + i % 5) / 4096 to each, which needs more than bf16's 8 bits of
// mantissa (an fp32 P carries it exactly, a bf16 one cannot).
struct exact_result {
  std::vector<float> out, dx, dprob, batch_x, batch_p;
  phase_calls dispatch, dispatch_backward;
};
template <class T, bool AllToAll, class P = T>
expected<exact_result> run_exact(const problem& p, thread_communicator& world,
                                 bool fine_probs = false) {
  using D = recorded_dispatcher<AllToAll, T, P>;
  using layout = detail::packed_layout<T, P>;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank();
  recording_groups rg(world, groups);
  if (!rg.ok()) return make_error(errc::invalid_argument, "groups");
  auto disp = D::make({.max_tokens = p.tokens,
                       .hidden = p.hidden,
                       .topk = p.topk,
                       .num_experts = p.experts,
                       .ep = fold.ep(),
                       .etp = fold.etp()});
  if (!disp) return unexpected<error>(disp.error());
  // Used columns: the token row, the gap up to the probabilities, the probabilities.
  const int Hp = static_cast<int>(layout::probs_first(p.hidden));
  const auto g =
      rg.make(disp->packed_width(),
              Hp + static_cast<int>(layout::prob_cols) * (AllToAll ? 1 : p.topk), p.hidden, Hp);
  const auto in = inputs_of(p, groups, r);
  const auto N = static_cast<std::size_t>(in.n), H = static_cast<std::size_t>(p.hidden),
             K = static_cast<std::size_t>(p.topk);
  std::vector<T> x(N * H), dout(N * H);
  std::vector<P> probs(N * K);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] =
        T(static_cast<float>(static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 3) % 9) - 4));
    dout[i] =
        T(static_cast<float>(static_cast<int>((static_cast<std::size_t>(r) * 5 + i) % 7) - 3));
  }
  for (std::size_t i = 0; i < probs.size(); ++i)
    probs[i] = P(static_cast<float>(1 + (static_cast<std::size_t>(r) + i) % 8) / 8.f +
                 (fine_probs ? static_cast<float>(1 + i % 5) / 4096.f : 0.f));
  host_workspace ws(disp->workspace_sizes(), std::byte{0xA5});
  host_exec hx;
  auto h = disp->dispatch(hx, host_input(disp->shape(), in.n, x, in.expert, probs), g, ws.view());
  if (!h) return unexpected<error>(h.error());
  exact_result res;
  res.dispatch = summarize(rg.log);
  const auto b = h->batch();
  const auto M = static_cast<std::size_t>(h->num_rows());
  std::vector<T> y(b.x.flat().begin(), b.x.flat().end()), out(N * H), dy(M * H), dx(N * H);
  std::vector<P> dprob(N * K);
  const int Hi = p.hidden;
  if (auto st = disp->combine(hx, *h, rows_of(y, Hi), g, rows_of(out, Hi)); !st)
    return unexpected<error>(st.error());
  if (auto st = disp->combine_backward(hx, *h, rows_of(dout, Hi), g, rows_of(dy, Hi)); !st)
    return unexpected<error>(st.error());
  rg.log.clear();
  const std::vector<P> dp_rows(b.probs.flat().begin(), b.probs.flat().end());
  if (auto st = disp->dispatch_backward(hx, *h, rows_of(dy, Hi), rows_of(dp_rows, 1), g,
                                        rows_of(dx, Hi), rows_of(dprob, p.topk));
      !st)
    return unexpected<error>(st.error());
  res.dispatch_backward = summarize(rg.log);
  auto to_float = [](const auto& v) {
    std::vector<float> f;
    for (const auto& e : v) f.push_back(static_cast<float>(e));
    return f;
  };
  res.out = to_float(out);
  res.dx = to_float(dx);
  res.dprob = to_float(dprob);
  res.batch_x = to_float(b.x.flat());
  res.batch_p = to_float(b.probs.flat());
  return res;
}

template <class T, bool AllToAll, class P = T>
std::vector<exact_result> run_all_exact(const problem& p, bool fine_probs = false) {
  const int world = make_folded(p.fold).value().world_size();
  std::vector<exact_result> results(static_cast<std::size_t>(world));
  const auto st = run_thread_world(world, [&](thread_communicator& comm) -> status {
    auto r = run_exact<T, AllToAll, P>(p, comm, fine_probs);
    if (!r) return unexpected<error>(r.error());
    results[static_cast<std::size_t>(comm.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return results;
}

template <bool AllToAll>
void check_16_bit_backward(const fold_config& f) {
  problem p{.fold = f, .experts = 8, .topk = 3, .hidden = 6, .ffn = 4, .tokens = 6};
  const int etp = make_folded(f).value().etp();
  const auto want = run_all_exact<float, AllToAll>(p);
  const auto bf = run_all_exact<bfloat16, AllToAll>(p);
  const auto hf = run_all_exact<float16, AllToAll>(p);
  for (std::size_t r = 0; r < want.size(); ++r) {
    CAPTURE(r);
    for (const auto* got : {&bf[r], &hf[r]}) {
      // Exact data: the 16-bit runs equal the fp32 run, value for value.
      CHECK(got->out == want[r].out);
      CHECK(got->dx == want[r].dx);
      CHECK(got->dprob == want[r].dprob);
      CHECK(got->batch_x == want[r].batch_x);
      CHECK(got->batch_p == want[r].batch_p);
      // The dispatch is packed for every T (copies only), with zero padding.
      CHECK(got->dispatch.pad_bytes > 0);
      CHECK(got->dispatch.pad_nonzero == 0);
      CHECK(got->dispatch.t_calls() == (AllToAll && etp > 1 ? 2 : 1));
      // The backward's reduction keeps the probability gradients apart in 16 bits.
      const auto& b = got->dispatch_backward;
      if (AllToAll) {
        CHECK(b.rsv == (etp > 1 ? 2 : 0));
        CHECK(b.a2a == (etp > 1 ? 2 : 1));  // ETP 1 has no reduction: packed
      } else {
        CHECK(b.rsv == 2);
      }
    }
    const auto& b = want[r].dispatch_backward;  // fp32: one packed reduction
    CHECK(b.rsv == (AllToAll && etp == 1 ? 0 : 1));
    CHECK(b.a2a == (AllToAll ? 1 : 0));
  }
}

}  // namespace

TEST_CASE(
    "16-bit T: the dispatch travels packed, the backward reduces the probability gradients "
    "apart, and both equal fp32 on exact data") {
  for (const fold_config f : {fold_config{.world = 8, .tp = 2, .ep = 4, .etp = 2},
                              fold_config{.world = 8, .tp = 2, .ep = 8, .etp = 1}}) {
    CAPTURE(f.ep);
    check_16_bit_backward<true>(f);
    check_16_bit_backward<false>(f);
  }
}

namespace {

// bf16 tokens with fp32 probabilities (an fp32 router's, kept in fp32 to the experts as
// Megatron-Core does with moe_router_dtype='fp32'): H 5, so the probabilities start at the
// 4-byte boundary Hp = 6 after a one-column gap, and take two bf16 columns each.
template <bool AllToAll>
void check_fp32_probs_with_bf16_tokens(const fold_config& f) {
  problem p{.fold = f, .experts = 8, .topk = 3, .hidden = 5, .ffn = 4, .tokens = 6};
  const int etp = make_folded(f).value().etp();
  using layout = detail::packed_layout<bfloat16, float>;
  static_assert(layout::prob_cols == 2 && layout::probs_first(5) == 6 && layout::width(5, 1) == 8 &&
                layout::width(5, 3) == 16);
  const auto want = run_all_exact<float, AllToAll>(p, true);  // fp32 throughout
  const auto got = run_all_exact<bfloat16, AllToAll, float>(p, true);
  const auto rounded = run_all_exact<bfloat16, AllToAll>(p, true);  // probabilities in bf16
  bool rounding_seen = false;
  for (std::size_t r = 0; r < want.size(); ++r) {
    CAPTURE(r);
    // The probabilities arrive and their gradients return at fp32 precision, bit for bit; the
    // rows are bf16 (exact data).
    CHECK(got[r].batch_p == want[r].batch_p);
    CHECK(got[r].dprob == want[r].dprob);
    CHECK(got[r].batch_x == want[r].batch_x);
    CHECK(got[r].out == want[r].out);
    CHECK(got[r].dx == want[r].dx);
    // The same data with bf16 probabilities loses those bits (so the checks above can fail).
    rounding_seen =
        rounding_seen || (!want[r].batch_p.empty() && rounded[r].batch_p != want[r].batch_p);
    // Still one collective per step in the dispatch, the gap and the padding zero.
    CHECK(got[r].dispatch.t_calls() == (AllToAll && etp > 1 ? 2 : 1));
    CHECK(got[r].dispatch.pad_bytes > 0);
    CHECK(got[r].dispatch.pad_nonzero == 0);
    CHECK(got[r].dispatch_backward.pad_nonzero == 0);
    // The backward's reductions keep the fp32 probability gradients apart (never summed as
    // bf16); without a reduction (All-to-All, ETP 1) the backward stays packed.
    const auto& b = got[r].dispatch_backward;
    if (AllToAll) {
      CHECK(b.rsv == (etp > 1 ? 2 : 0));
      CHECK(b.a2a == (etp > 1 ? 2 : 1));
    } else {
      CHECK(b.rsv == 2);
    }
  }
  CHECK(rounding_seen);
}

}  // namespace

static_assert(
    !all_to_all_dispatcher<bfloat16, thread_communicator, host_exec, float>::pack_reductions &&
    !all_to_all_dispatcher<float, thread_communicator, host_exec, double>::pack_reductions &&
    std::same_as<all_gather_dispatcher<bfloat16, thread_communicator, host_exec,
                                       float>::handle_type::prob_type,
                 float>);

TEST_CASE(
    "bf16 tokens with fp32 probabilities: packed at a 4-byte column, never rounded to bf16, "
    "gradients reduced in fp32") {
  for (const fold_config f : {fold_config{.world = 8, .tp = 2, .ep = 4, .etp = 2},
                              fold_config{.world = 8, .tp = 2, .ep = 8, .etp = 1}}) {
    CAPTURE(f.ep);
    check_fp32_probs_with_bf16_tokens<true>(f);
    check_fp32_probs_with_bf16_tokens<false>(f);
  }
}

TEST_CASE_TEMPLATE(
    "a rank may send more rows than the receive bound: its send rows have their own buffer", Path,
    a2a, ag) {
  // EP 2, rank 0 holds no tokens: rank 1 sends its 16 pairs, EP rank 0 receives 10 of them and
  // EP rank 1 6, so a bound of 10 holds while rank 1 sends 16 rows (before packing, the send rows
  // were carved from a receive buffer of 10 rows).
  problem p{
      .fold = {.world = 2, .ep = 2, .etp = 1}, .experts = 4, .topk = 2, .ffn = 4, .tokens = 8};
  p.empty_rank = true;
  p.max_recv_rows = 10;
  coverage cov;
  check_problem<Path>(p, cov);
  const auto res = run<Path>(p);
  CHECK(res[0].rows + res[1].rows == 16);
  CHECK(std::max(res[0].rows, res[1].rows) == 10);
}
