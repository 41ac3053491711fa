// Both dispatchers on the CPU executor (cpu_exec, the GPU code path on the CPU): the thread world
// over the executor's device memory, every buffer allocated by the executor (poisoned: a byte
// nothing wrote reads as NaN or -1), EP 4 x ETP 2 on 8 ranks. Each call must equal the same call
// on host_exec bitwise, and the host <-> device transfers of a step are counted: dispatch moves
// the small bookkeeping arrays only (the gathered counts to the host, the chunk table to the
// context), combine and the backward move none.
#include <doctest/doctest.h>
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/core/dtype.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>

#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "device_round_trip.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

template <template <class, class, class, class> class Disp, class T, class P = T>
void host_equals_device(const problem& p, bool all_to_all) {
  const int W = p.fold.world;
  std::vector<trip<T, P>> host(static_cast<std::size_t>(W)), dev(static_cast<std::size_t>(W));
  const auto hs = run_thread_world(W, [&](thread_communicator& world) -> status {
    host_exec x;
    auto t = round_trip<Disp, T, P, host_exec>(p, world, x);
    if (!t) return unexpected<error>(t.error());
    host[static_cast<std::size_t>(world.rank())] = std::move(*t);
    return {};
  });
  const auto ds = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    cpu_exec x;
    auto t = round_trip<Disp, T, P, cpu_exec>(p, dw, x);
    if (!t) return unexpected<error>(t.error());
    dev[static_cast<std::size_t>(dw.rank())] = std::move(*t);
    return {};
  });
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE_MESSAGE(hs[i].has_value(), hs[i].error().message);
    REQUIRE_MESSAGE(ds[i].has_value(), ds[i].error().message);
    const trip<T, P>&a = host[i], &b = dev[i];
    check_same_results(a, b);
    // Transfers: the All-to-All path brings the gathered status rows (counts, faults) to the
    // host, and in pad mode moves nothing (the chunk table is written in the context from the
    // fold, kernels/chunk_table.hpp); the AllGather path brings the group's header table back.
    // Nothing is copied to the context: the host's bookkeeping (the dropless chunk table, the
    // AllGather's header row and each source's first token) is stored by kernels carrying the
    // values (store_host_values). Everything else stays in the context's memory.
    const copy_counts& c = b.dispatch_copies;
    CHECK(c.to_host == (all_to_all && p.pad ? 0 : 1));
    CHECK(c.to_device == 0);
    CHECK(b.later_copies.to_host == 0);
    CHECK(b.later_copies.to_device == 0);
  }
}

}  // namespace

// fp64 (the packed backward, as fp32 takes), bf16 (16-bit T: the probability gradients keep
// their own reduction), and bf16 tokens with fp32 probabilities (H 5: a gap column before them,
// two columns each, their own reduction in fp32).
template <class Tokens, class Probs>
struct types {
  using T = Tokens;
  using P = Probs;
};
TEST_CASE_TEMPLATE("both dispatchers on cpu_exec equal host_exec bitwise, EP 4 x ETP 2", Ty,
                   types<double, double>, types<bfloat16, bfloat16>, types<bfloat16, float>) {
  using T = typename Ty::T;
  using P = typename Ty::P;
  for (bool pad : {false, true}) {
    CAPTURE(pad);
    const problem p = folded_problem(pad);
    host_equals_device<all_to_all_dispatcher, T, P>(p, true);
    host_equals_device<all_gather_dispatcher, T, P>(p, false);
  }
}

TEST_CASE("EP = ETP = 1, every pair routed: both dispatchers on cpu_exec read nothing back") {
  // Two ranks of TP 2 over EP 1 x ETP 1 (EDP 2), no pair dropped: the batch is the N k rows of
  // the plan, its rows per expert stay on the context (batch_offsets, the host's running sums of
  // its counts), and every step is host_exec's bit for bit with no copy in either direction. The
  // same dispatch without the word brings the counts back once (the All-to-All dispatcher its
  // status rows, the AllGather dispatcher its header); pad mode needs no word (the All-to-All
  // dispatcher then copies nothing, the AllGather dispatcher still reads its header).
  problem p{.fold = {.world = 2, .tp = 2, .ep = 1, .etp = 1}};
  p.experts = 6;
  p.topk = 2;
  p.hidden = 5;
  p.tokens = 7;
  // Variants: All-to-All with the word, without, AllGather with, pad mode All-to-All, AllGather
  // without the word, pad mode AllGather.
  for (int variant = 0; variant < 6; ++variant) {
    const bool routed = variant != 1 && variant != 4, gather = variant == 2 || variant >= 4;
    p.pad = variant == 3 || variant == 5;
    p.capacity = p.pad ? 4 : -1;
    CAPTURE(variant);
    const int W = p.fold.world;
    std::vector<trip<float>> host(2), dev(2);
    const auto run = [&](auto&& body) {
      const auto st = run_thread_world(W, body);
      for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
    };
    run([&](thread_communicator& world) -> status {
      host_exec x;
      auto t =
          gather ? round_trip<all_gather_dispatcher, float, float, host_exec>(p, world, x, routed)
                 : round_trip<all_to_all_dispatcher, float, float, host_exec>(p, world, x, routed);
      if (!t) return unexpected<error>(t.error());
      host[static_cast<std::size_t>(world.rank())] = std::move(*t);
      return {};
    });
    run([&](thread_communicator& world) -> status {
      auto dw = std::move(world).in_space<cpu_device_space>();
      cpu_exec x;
      auto t = gather ? round_trip<all_gather_dispatcher, float, float, cpu_exec>(p, dw, x, routed)
                      : round_trip<all_to_all_dispatcher, float, float, cpu_exec>(p, dw, x, routed);
      if (!t) return unexpected<error>(t.error());
      dev[static_cast<std::size_t>(dw.rank())] = std::move(*t);
      return {};
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      const auto &a = host[r], &b = dev[r];
      const bool trusted = routed && !p.pad;
      CHECK(a.offsets.empty());  // host_exec plans on the host: its counts are there
      if (trusted) {
        CHECK(b.counts.empty());
        std::vector<int> want{0};
        for (int c : a.counts) want.push_back(want.back() + c);
        CHECK(b.offsets == want);
        CHECK(b.dispatch_copies.to_host == 0);
        CHECK(b.dispatch_copies.to_device == 0);
      } else {
        CHECK(b.counts == a.counts);
        CHECK(b.offsets.empty());
        CHECK(b.dispatch_copies.to_host == (p.pad && !gather ? 0 : 1));
      }
      check_same_values(a, b);
      CHECK(b.later_copies.to_host == 0);
      CHECK(b.later_copies.to_device == 0);
    }
  }
}

TEST_CASE("a device dispatcher refuses host-shaped mistakes: a wrong view, a short workspace") {
  const problem p = folded_problem(false);
  const auto st = run_thread_world(8, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    auto rg = groups_of(p, dw);
    if (!rg) return unexpected<error>(rg.error());
    const dispatch_groups<thread_device_communicator> g = rg->dispatch();
    using D = all_to_all_dispatcher<float, thread_device_communicator, cpu_exec>;
    auto d =
        D::make({.max_tokens = 4, .hidden = 3, .topk = 2, .num_experts = 8, .ep = 4, .etp = 2});
    if (!d) return unexpected<error>(d.error());
    cpu_exec x;
    auto xs = exec_buffer<float, cpu_exec>::make(x, 4, 3).value();
    auto es = exec_buffer<int, cpu_exec>::make(x, 4, 2).value();
    auto ps = exec_buffer<float, cpu_exec>::make(x, 4, 2).value();
    auto wsb = test::make_exec_workspace(x, d->workspace_sizes()).value();
    const dispatch_workspace ws = wsb.view();
    // probs of the wrong width: refused before any collective, on every rank alike.
    const dispatch_input<float, cpu_device_space> bad{
        .num_tokens = 4, .x = xs.cview(), .expert = es.cview(), .probs = {ps.view().data(), 4, 1}};
    auto h = d->dispatch(x, bad, g, ws);
    if (h) return make_error(errc::invalid_argument, "a [4, 1] probs view was accepted");
    if (h.error().code != errc::shape_mismatch ||
        h.error().message.find("probs [4, 1]") == std::string::npos)
      return unexpected<error>(h.error());
    // A host part too small.
    const dispatch_workspace short_ws{
        .saved = ws.saved, .scratch = ws.scratch, .host = ws.host.first(ws.host.size() / 2)};
    const dispatch_input<float, cpu_device_space> ok{
        .num_tokens = 4, .x = xs.cview(), .expert = es.cview(), .probs = ps.cview()};
    auto h2 = d->dispatch(x, ok, g, short_ws);
    if (h2 || h2.error().code != errc::workspace_too_small ||
        h2.error().message.find("host bytes") == std::string::npos)
      return make_error(errc::invalid_argument, "a short host part was accepted");
    return {};
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? std::string() : s.error().message));
}

namespace {

// One micro-batch of a rank: its inputs and what the round trip produced.
struct micro_batch {
  rank_inputs in;
  std::vector<double> out{}, dy{}, dx{}, dprobs{};
};

// The second micro-batch: other values, and every routed pair moved to the next expert.
rank_inputs shifted(rank_inputs in, int experts) {
  for (double& v : in.x) v = 2 * v - 0.25;
  for (double& v : in.dout) v = -3 * v;
  for (int& e : in.expert)
    if (e >= 0) e = (e + 1) % experts;
  return in;
}

template <class D>
using handle_of = typename D::handle_type;

// Forward: dispatch, "experts" y = x / 2 + p on the batch, combine.
template <class D, class Comm>
expected<handle_of<D>> forward(D& d, const dispatch_groups<Comm>& g, micro_batch& mb, int hidden,
                               const dispatch_workspace& ws) {
  host_exec x;
  auto h = d.dispatch(x, host_input(d.shape(), mb.in.n, mb.in.x, mb.in.expert, mb.in.probs), g, ws);
  if (!h) return h;
  const auto b = h->batch();
  const auto bx = b.x.flat(), bp = b.probs.flat();
  std::vector<double> y(bx.size());
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = bx[i] / 2 + bp[i / static_cast<std::size_t>(hidden)];
  mb.out.assign(static_cast<std::size_t>(mb.in.n) * static_cast<std::size_t>(hidden), 0.0);
  if (auto st = d.combine(x, *h, rows_of(y, hidden), g, rows_of(mb.out, hidden)); !st)
    return unexpected<error>(st.error());
  return h;
}

// Backward: combine_backward, "experts" dx_rows = dy * x, dprob_rows = sum(x), dispatch_backward.
// It reads the batch again, so the saved part must still hold this micro-batch's.
template <class D, class Comm>
status backward(D& d, const dispatch_groups<Comm>& g, micro_batch& mb, int hidden,
                const handle_of<D>& h) {
  const auto bx = h.batch().x.flat();
  mb.dy.assign(bx.size(), 0.0);
  host_exec x;
  if (auto st = d.combine_backward(x, h, rows_of(mb.in.dout, hidden), g, rows_of(mb.dy, hidden));
      !st)
    return st;
  std::vector<double> dxr(bx.size()), dpr(static_cast<std::size_t>(h.num_rows()), 0.0);
  for (std::size_t i = 0; i < dxr.size(); ++i) {
    dxr[i] = mb.dy[i] * bx[i];
    dpr[i / static_cast<std::size_t>(hidden)] += bx[i];
  }
  mb.dx.assign(mb.out.size(), 0.0);
  mb.dprobs.assign(mb.in.probs.size(), 0.0);
  return d.dispatch_backward(x, h, rows_of(dxr, hidden), rows_of(dpr, 1), g, rows_of(mb.dx, hidden),
                             rows_of(mb.dprobs, d.shape().topk));
}

template <template <class, class, class> class Disp>
void in_flight_equals_sequential() {
  const problem p = folded_problem(false);
  const auto st = run_thread_world(8, [&](thread_communicator& world) -> status {
    auto rg = groups_of(p, world);
    if (!rg) return unexpected<error>(rg.error());
    const auto& fold = rg->fold;
    const dispatch_groups<thread_communicator> g = rg->dispatch();
    using D = Disp<double, thread_communicator, host_exec>;
    auto d = D::make({.max_tokens = p.tokens,
                      .hidden = p.hidden,
                      .topk = p.topk,
                      .num_experts = p.experts,
                      .ep = fold.ep(),
                      .etp = fold.etp()})
                 .value();
    const auto sz = d.workspace_sizes();
    // Two saved and host parts, one scratch shared by both micro-batches.
    std::vector<std::byte> saved1(sz.saved), saved2(sz.saved), host1(sz.host), host2(sz.host),
        scratch(sz.scratch);
    const dispatch_workspace ws1{.saved = saved1, .scratch = scratch, .host = host1};
    const dispatch_workspace ws2{.saved = saved2, .scratch = scratch, .host = host2};
    const rank_inputs a = inputs_of(p, rg->groups, world.rank());
    const rank_inputs b = shifted(a, p.experts);
    // Sequential: F1 B1 F2 B2, one workspace.
    micro_batch s1{a}, s2{b};
    for (micro_batch* mb : {&s1, &s2}) {
      auto h = forward(d, g, *mb, p.hidden, ws1);
      if (!h) return unexpected<error>(h.error());
      if (auto s = backward(d, g, *mb, p.hidden, *h); !s) return s;
    }
    // In flight: F1 F2 B2 B1.
    micro_batch f1{a}, f2{b};
    auto h1 = forward(d, g, f1, p.hidden, ws1);
    if (!h1) return unexpected<error>(h1.error());
    auto h2 = forward(d, g, f2, p.hidden, ws2);
    if (!h2) return unexpected<error>(h2.error());
    if (auto s = backward(d, g, f2, p.hidden, *h2); !s) return s;
    if (auto s = backward(d, g, f1, p.hidden, *h1); !s) return s;
    for (auto [x, y] : {std::pair{&s1, &f1}, std::pair{&s2, &f2}})
      if (!same_bits(x->out, y->out) || !same_bits(x->dy, y->dy) || !same_bits(x->dx, y->dx) ||
          !same_bits(x->dprobs, y->dprobs))
        return make_error(errc::invalid_argument, "in flight differs from sequential");
    // The two micro-batches differ (so the comparison above could tell them apart).
    if (same_bits(f1.out, f2.out) && !f1.out.empty())
      return make_error(errc::invalid_argument, "the micro-batches are the same");
    // A later dispatch into the same saved and host parts makes the earlier handle stale: refused
    // before any collective (every rank refuses alike).
    auto h3 = forward(d, g, f1, p.hidden, ws1);
    if (!h3) return unexpected<error>(h3.error());
    auto h4 = forward(d, g, f2, p.hidden, ws1);
    if (!h4) return unexpected<error>(h4.error());
    const status stale = backward(d, g, f1, p.hidden, *h3);
    if (stale || stale.error().message.find("reused by a later dispatch") == std::string::npos)
      return make_error(errc::invalid_argument, "a stale handle was accepted");
    return backward(d, g, f2, p.hidden, *h4);
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? std::string() : s.error().message));
}

}  // namespace

TEST_CASE(
    "handles in flight: F1 F2 B2 B1 equals F1 B1 F2 B2 bitwise; a reused workspace is refused") {
  in_flight_equals_sequential<all_to_all_dispatcher>();
  in_flight_equals_sequential<all_gather_dispatcher>();
}

namespace {

// What a rank saw of a step with a bad record on rank 2: dispatch's status, the transfers it
// made, and (when it succeeded) device_status's.
struct bad_step {
  status dispatch{}, device{};
  copy_counts copies{};
};

// 4 ranks, EP 4, E = 4, k = 2, two tokens per rank; rank 2's record is `bad`, the others valid.
template <template <class, class, class, class> class Disp>
std::vector<bad_step> bad_record_step(const std::vector<int>& bad, std::optional<int> cap) {
  std::vector<bad_step> seen(4);
  const auto st = run_thread_world(
      4,
      [&](thread_communicator& world) -> status {
        const int r = world.rank();
        auto dw = std::move(world).in_space<cpu_device_space>();
        auto ep = dw.split(0, r);
        auto etp = dw.split(r, 0);
        auto tp_ep = dw.split(0, r);
        if (!ep || !etp || !tp_ep) return make_error(errc::invalid_argument, "split");
        const dispatch_groups<thread_device_communicator> g{*ep, *etp, *tp_ep};
        using D = Disp<float, thread_device_communicator, cpu_exec, float>;
        auto d = D::make({.max_tokens = 2, .hidden = 3, .topk = 2, .num_experts = 4, .ep = 4});
        if (!d) return unexpected<error>(d.error());
        cpu_exec x(static_cast<std::uint64_t>(r) + 1);
        const std::vector<int> good = {r, (r + 1) % 4, (r + 2) % 4, -1};
        TRY_ASSIGN(xs, upload(x, std::vector<float>(6, 1.f), 2, 3));
        TRY_ASSIGN(es, upload(x, r == 2 ? bad : good, 2, 2));
        TRY_ASSIGN(ps, upload(x, std::vector<float>(4, 0.5f), 2, 2));
        TRY_ASSIGN(wsb, test::make_exec_workspace(x, d->workspace_sizes(cap)));
        const dispatch_workspace ws = wsb->view();
        const dispatch_input<float, cpu_device_space> in{.num_tokens = 2,
                                                         .x = xs->cview(),
                                                         .expert = es->cview(),
                                                         .probs = ps->cview(),
                                                         .capacity = cap};
        bad_step& mine = seen[static_cast<std::size_t>(r)];
        x.reset_copies();
        auto h = d->dispatch(x, in, g, ws);
        mine.copies = x.copies();
        if (!h) {
          mine.dispatch = unexpected<error>(h.error());
          return {};
        }
        // The step goes on (the rows of a faulty record are zeros), then the record's check.
        TRY_ASSIGN(y, (exec_buffer<float, cpu_exec>::make(x, h->num_rows(), 3)));
        TRY(x.fill<float>(y->view(), 1.f));
        TRY_ASSIGN(out, (exec_buffer<float, cpu_exec>::make(x, 2, 3)));
        TRY(d->combine(x, *h, y->cview(), g, out->view()));
        x.reset_copies();
        mine.device = d->device_status(x, *h);
        mine.copies = x.copies();
        return {};
      },
      {.timeout = std::chrono::milliseconds(5000)});
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), (s ? std::string() : s.error().message));
  return seen;
}

bool says(const status& s, const std::string& words) {
  return !s && s.error().code == errc::invalid_argument &&
         s.error().message.find(words) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "cpu_exec, a bad routing record on one rank: the All-to-All forward's one wait fails every "
    "rank; in pad mode nothing waits and device_status reports it") {
  // Rank 2's token 1 names expert 7 (outside [-1, 4)), or expert 0 twice.
  const std::vector<int> out_of_range = {0, 1, 2, 7}, twice = {0, 1, 0, 0};
  for (const auto& [bad, words] :
       {std::pair{out_of_range, std::string("token 1 slot 1 names expert 7")},
        std::pair{twice, std::string("token 1 names expert 0 twice")}}) {
    CAPTURE(words);
    // Dropless: every rank fails in dispatch; rank 2 with the host builder's words, the others
    // naming rank 2. One device-to-host copy each (rank 2 also reads its record for the words).
    const auto seen = bad_record_step<all_to_all_dispatcher>(bad, std::nullopt);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& s = seen[static_cast<std::size_t>(r)];
      CHECK(says(s.dispatch, r == 2 ? words : "tp-ep rank 2's routing record"));
      CHECK(s.copies.to_host == (r == 2 ? 2 : 1));
    }
    // Pad mode (capacity 2): every dispatch succeeds without a wait; device_status finds rank
    // 2's fault (one copy), the others' records are fine.
    const auto padded = bad_record_step<all_to_all_dispatcher>(bad, 2);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& s = padded[static_cast<std::size_t>(r)];
      REQUIRE(s.dispatch);
      CHECK(s.copies.to_host == 1);
      if (r == 2)
        CHECK(says(s.device, "token 1 slot 1 of the routing record names an expert outside"));
      else
        CHECK(s.device);
    }
  }
  // Pad mode, over capacity: rank 2 routes two pairs to expert 0 (slots 0 and 2) with capacity
  // 1; the second, token 1 slot 0, is beyond it.
  const auto over = bad_record_step<all_to_all_dispatcher>({0, 1, 0, 2}, 1);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto& s = over[static_cast<std::size_t>(r)];
    REQUIRE(s.dispatch);
    if (r == 2)
      CHECK(
          says(s.device, "token 1 slot 0 of the routing record is beyond its expert's capacity 1"));
    else
      CHECK(s.device);
  }
}

TEST_CASE(
    "cpu_exec, a bad routing record on one rank: the AllGather forward fails every rank alike, in "
    "both modes") {
  struct bad_case {
    std::vector<int> record;
    std::optional<int> cap;
    std::string words;
  };
  for (const auto& c :
       {bad_case{{0, 1, 2, 7}, std::nullopt, "tp-ep rank 2 names expert 7, outside [0, 4)"},
        bad_case{{0, 1, 0, 0}, std::nullopt, "tp-ep rank 2: token 1 names expert 0 twice"},
        bad_case{{0, 1, 0, 0}, 2, "tp-ep rank 2: token 1 names expert 0 twice"},
        bad_case{
            {0, 1, 0, 2}, 1, "tp-ep rank 2 routes more than the capacity 1 pairs to expert 0"}}) {
    CAPTURE(c.words);
    const auto seen = bad_record_step<all_gather_dispatcher>(c.record, c.cap);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& s = seen[static_cast<std::size_t>(r)];
      CHECK(says(s.dispatch, c.words));
      CHECK(s.copies.to_host == 1);  // the header table, nothing else
    }
  }
}

TEST_CASE(
    "EP = ETP = 1, every pair vouched for: a record that breaks the word gets no wait in dispatch "
    "and device_status names it, on both dispatchers") {
  // One rank, E = 4, k = 2, three tokens. A -1 (token 1's second slot): the pairs it names get
  // their rows, the missing one none, and token 1's output is its first pair's alone. An id
  // outside [-1, E) or a repeated expert: the record gets no rows (every output 0).
  struct bad_case {
    std::vector<int> record;
    std::string words;
  };
  const bad_case cases[] = {
      {{0, 1, 2, -1, 3, 0}, "routes 5 of its N k = 6 pairs (a slot holds -1)"},
      {{0, 1, 2, 9, 3, 0}, "token 1 slot 1 of the routing record names an expert outside [-1, 4)"},
      {{0, 1, 2, 2, 3, 0},
       "token 1 slot 1 of the routing record names an expert outside [-1, 4) "
       "or one its token named before"}};
  const auto run_case = [&]<template <class, class, class, class> class Disp>(const bad_case& c) {
    const auto st = run_thread_world(1, [&](thread_communicator& world) -> status {
      auto dw = std::move(world).in_space<cpu_device_space>();
      cpu_exec x;
      const int N = 3, K = 2, H = 4, E = 4;
      TRY_ASSIGN(d, (Disp<float, decltype(dw), cpu_exec, float>::make(
                        {.max_tokens = N, .hidden = H, .topk = K, .num_experts = E})));
      TRY_ASSIGN(wsb, make_exec_workspace(x, d->workspace_sizes()));
      std::vector<float> xs(N * H), ps(N * K, 0.5f);
      for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(i % 7) - 2.5f;
      TRY_ASSIGN(dx, upload(x, xs, N, H));
      TRY_ASSIGN(de, upload(x, c.record, N, K));
      TRY_ASSIGN(dp, upload(x, ps, N, K));
      const dispatch_input<float, cpu_device_space> in{.num_tokens = N,
                                                       .x = dx->cview(),
                                                       .expert = de->cview(),
                                                       .probs = dp->cview(),
                                                       .every_pair_routed = true};
      const dispatch_groups<decltype(dw)> g{dw, dw, dw};
      x.reset_copies();
      TRY_ASSIGN(h, d->dispatch(x, in, g, wsb->view()));
      CHECK(x.copies().to_host == 0);
      CHECK(h->num_rows() == N * K);
      // The "experts": y = the batch rows as they are; combine sums each token's pairs.
      TRY_ASSIGN(out, (exec_buffer<float, cpu_exec>::make(x, N, H)));
      TRY(d->combine(x, *h, h->batch_rows(), g, out->view()));
      TRY_ASSIGN(o, (download<float>(x, out->cview())));
      const bool faulty = c.record[3] != -1;
      for (int t = 0; t < N; ++t)
        for (int j = 0; j < H; ++j) {
          const float v = xs[static_cast<std::size_t>(t * H + j)];
          // Every routed pair of token t carries its row once: k rows, or 1 for token 1 with -1.
          const float want = faulty ? 0.0f : (t == 1 ? v : 2 * v);
          CHECK((*o)[static_cast<std::size_t>(t * H + j)] == want);
        }
      const status ds = d->device_status(x, *h);
      REQUIRE_FALSE(ds.has_value());
      CHECK_MESSAGE(ds.error().message.find(c.words) != std::string::npos, ds.error().message);
      return {};
    });
    for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? std::string() : s.error().message));
  };
  for (const auto& c : cases) {
    CAPTURE(c.words);
    run_case.template operator()<all_to_all_dispatcher>(c);
    run_case.template operator()<all_gather_dispatcher>(c);
  }
}
