// The stream-order check over both dispatchers: each rank runs two micro-batches through one
// workspace, F1 B1 F2 B2 with nothing read back in between (the second with other values, other
// experts and, in pad mode, another capacity, so every host-written table changes; and a dropless
// step followed by a padded one), on
// stream_order_exec (tests/support/stream_order_exec.hpp): cuda_exec's code path, one
// stream, the host part of the workspace pinned. The stream-order fake must find no access that
// CUDA's order leaves unordered (above all: no host write into a pinned source a copy the stream
// has not yet run still reads), and the results must equal cpu_exec's bitwise. A dispatch copies
// nothing from the host part, so the caller may rewrite it at once; a write of the caller's into
// a pinned source while a copy from it is pending must be reported.
#include <doctest/doctest.h>
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>

#include <algorithm>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "../support/stream_order_exec.hpp"
#include "device_round_trip.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

using comm_t = thread_device_communicator;

// The second micro-batch: other values, and every routed pair moved to the next expert.
rank_inputs shifted(rank_inputs in, int experts) {
  for (double& v : in.x) v = 2 * v - 0.25;
  for (double& v : in.dout) v = -3 * v;
  for (int& e : in.expert)
    if (e >= 0) e = (e + 1) % experts;
  return in;
}

// What both micro-batches produced, read back after both.
struct two_steps_result {
  std::vector<float> out, dx, dprobs;  // [2 N, H], [2 N, H], [2 N, k]
};

// Pins the host part of a workspace on contexts that model pinned memory.
template <class Exec>
void pin(Exec& x, const dispatch_workspace& ws) {
  if constexpr (requires { x.pin(ws.host.data(), ws.host.size(), "the host part"); })
    x.pin(ws.host.data(), ws.host.size(), "the workspace's host part");
}

// F1 B1 F2 B2 on one workspace; the "experts" pass their rows through (y = x, dx_rows = x,
// dprob_rows = p, as copies on the context), so no step reads anything back before the end.
// The modes of the two micro-batches: both routed as they come, both padded, or a dropless one
// and then a padded one (a layer whose drop policy starts dropping), whose host tables must not
// touch what the first one's copies may still read.
enum class steps_mode { dropless, pad, dropless_then_pad };

template <template <class, class, class, class> class Disp, class Exec>
expected<two_steps_result> two_steps(const problem& p, steps_mode mode, comm_t& world, Exec& x) {
  TRY_ASSIGN(rg, groups_of(p, world));
  const dispatch_groups<comm_t> g = rg->dispatch();
  const int K = p.topk, H = p.hidden;
  auto disp = Disp<float, comm_t, Exec, float>::make({.max_tokens = p.tokens,
                                                      .hidden = H,
                                                      .topk = K,
                                                      .num_experts = p.experts,
                                                      .ep = rg->fold.ep(),
                                                      .etp = rg->fold.etp()});
  if (!disp) return unexpected<error>(disp.error());
  // Pad mode: capacity 3, then 2; the workspace sized for both steps.
  problem p2 = p;
  if (p.pad) p2.capacity = 2;
  const std::optional<int> cap1 =
      mode == steps_mode::pad ? std::optional<int>(p.capacity) : std::nullopt;
  const std::optional<int> cap2 =
      mode != steps_mode::dropless ? std::optional<int>(p2.capacity) : std::nullopt;
  const dispatch_workspace_bytes b1 = disp->workspace_sizes(cap1), b2 = disp->workspace_sizes(cap2);
  TRY_ASSIGN(wsb, make_exec_workspace(x, {.saved = std::max(b1.saved, b2.saved),
                                          .scratch = std::max(b1.scratch, b2.scratch),
                                          .host = std::max(b1.host, b2.host)}));
  const dispatch_workspace ws = wsb->view();
  pin(x, ws);
  const rank_inputs in1 = inputs_of(p, rg->groups, world.rank());
  const rank_inputs in2 = shifted(inputs_of(p2, rg->groups, world.rank()), p.experts);
  const int n = in1.n;
  TRY_ASSIGN(out, (exec_buffer<float, Exec>::make(x, 2 * n, H)));
  TRY_ASSIGN(dx, (exec_buffer<float, Exec>::make(x, 2 * n, H)));
  TRY_ASSIGN(dprobs, (exec_buffer<float, Exec>::make(x, 2 * n, K)));
  // Each step's buffers live to the end (a GPU frees memory only after its stream is done).
  std::vector<exec_buffer<float, Exec>> keep;
  std::vector<exec_buffer<int, Exec>> keep_records;
  for (int s = 0; s < 2; ++s) {
    const rank_inputs& in = s == 0 ? in1 : in2;
    const auto f = [](const std::vector<double>& v) {
      return std::vector<float>(v.begin(), v.end());
    };
    TRY_ASSIGN(xs, upload(x, f(in.x), n, H));
    TRY_ASSIGN(es, upload(x, in.expert, n, K));
    TRY_ASSIGN(ps, upload(x, f(in.probs), n, K));
    TRY_ASSIGN(douts, upload(x, f(in.dout), n, H));
    const dispatch_input<float, cpu_device_space, float> din{.num_tokens = n,
                                                             .x = xs->cview(),
                                                             .expert = es->cview(),
                                                             .probs = ps->cview(),
                                                             .capacity = s == 0 ? cap1 : cap2};
    TRY_ASSIGN(h, disp->dispatch(x, din, g, ws));
    const int M = h->num_rows();
    TRY_ASSIGN(y, (exec_buffer<float, Exec>::make(x, M, H)));
    TRY_ASSIGN(yp, (exec_buffer<float, Exec>::make(x, M, 1)));
    TRY_ASSIGN(dy, (exec_buffer<float, Exec>::make(x, M, H)));
    TRY(x.copy(h->batch_rows(), y->view()));
    TRY(x.copy(h->batch_probs(), yp->view()));
    const auto rows = [&](exec_buffer<float, Exec>& b, int w) {
      return row_view<float, cpu_device_space>(b.view().data() + static_cast<long long>(s) * n * w,
                                               n, w);
    };
    TRY(disp->combine(x, *h, y->cview(), g, rows(*out, H)));
    TRY(disp->combine_backward(x, *h, douts->cview(), g, dy->view()));
    TRY(disp->dispatch_backward(x, *h, y->cview(), yp->cview(), g, rows(*dx, H), rows(*dprobs, K)));
    for (auto* b : {&*xs, &*ps, &*douts, &*y, &*yp, &*dy}) keep.push_back(std::move(*b));
    keep_records.push_back(std::move(*es));
  }
  two_steps_result r;
  TRY_ASSIGN(o, (download<float>(x, out->cview())));
  TRY_ASSIGN(gx, (download<float>(x, dx->cview())));
  TRY_ASSIGN(gp, (download<float>(x, dprobs->cview())));
  r.out = *o;
  r.dx = *gx;
  r.dprobs = *gp;
  return r;
}

template <template <class, class, class, class> class Disp>
void check_stream_order(const problem& p, steps_mode mode, const std::string& name) {
  CAPTURE(name);
  CAPTURE(static_cast<int>(mode));
  const int W = p.fold.world;
  std::vector<two_steps_result> ref(static_cast<std::size_t>(W)), got(static_cast<std::size_t>(W));
  std::vector<std::vector<std::string>> violations(static_cast<std::size_t>(W));
  const auto rs = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    cpu_exec x(3);
    auto t = two_steps<Disp, cpu_exec>(p, mode, dw, x);
    if (!t) return unexpected<error>(t.error());
    ref[static_cast<std::size_t>(dw.rank())] = std::move(*t);
    return {};
  });
  const auto gs = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    stream_order_fake fake;  // one per rank: a rank is one process with one stream
    const auto r = static_cast<std::size_t>(dw.rank());
    {
      stream_order_exec x(fake, 3);
      auto t = two_steps<Disp, stream_order_exec>(p, mode, dw, x);
      if (!t) return unexpected<error>(t.error());
      x.check();
      got[r] = std::move(*t);
    }
    violations[r] = fake.violations();
    return {};
  });
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE_MESSAGE(rs[i].has_value(), rs[i].error().message);
    REQUIRE_MESSAGE(gs[i].has_value(), gs[i].error().message);
    for (const std::string& v : violations[i]) FAIL_CHECK(v);
    CHECK(!ref[i].out.empty());
    CHECK(same_bits(ref[i].out, got[i].out));
    CHECK(same_bits(ref[i].dx, got[i].dx));
    CHECK(same_bits(ref[i].dprobs, got[i].dprobs));
  }
}

}  // namespace

TEST_CASE("stream order: both dispatchers, two micro-batches on one workspace, EP 4 x ETP 2") {
  for (steps_mode mode : {steps_mode::dropless, steps_mode::pad, steps_mode::dropless_then_pad}) {
    const problem p = folded_problem(mode != steps_mode::dropless);
    check_stream_order<all_to_all_dispatcher>(p, mode, "all_to_all");
    check_stream_order<all_gather_dispatcher>(p, mode, "all_gather");
  }
}

TEST_CASE(
    "stream order: the host part is the caller's again when dispatch returns (nothing copied from "
    "it); a write into a pinned source while its copy is pending is reported") {
  // All-to-All dropless waits once, for the status rows, and stores its chunk table on the
  // context with kernels carrying the values (store_host_values), not a copy from the host part:
  // the caller may rewrite the part at once, with no violation. The check itself still sees the
  // hazard: a copy from the pinned part, then a write into it before any wait, is reported once,
  // naming the part.
  const problem p = folded_problem(false);
  std::vector<std::vector<std::string>> after_dispatch(static_cast<std::size_t>(p.fold.world)),
      after_copy(after_dispatch.size());
  const auto st = run_thread_world(p.fold.world, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    stream_order_fake fake;
    stream_order_exec x(fake, 5);
    TRY_ASSIGN(rg, groups_of(p, dw));
    auto disp = all_to_all_dispatcher<float, comm_t, stream_order_exec, float>::make(
        {.max_tokens = p.tokens,
         .hidden = p.hidden,
         .topk = p.topk,
         .num_experts = p.experts,
         .ep = rg->fold.ep(),
         .etp = rg->fold.etp()});
    if (!disp) return unexpected<error>(disp.error());
    TRY_ASSIGN(wsb, make_exec_workspace(x, disp->workspace_sizes()));
    const dispatch_workspace ws = wsb->view();
    x.pin(ws.host.data(), ws.host.size(), "the workspace's host part");
    const rank_inputs in = inputs_of(p, rg->groups, dw.rank());
    const auto f = [](const std::vector<double>& v) {
      return std::vector<float>(v.begin(), v.end());
    };
    TRY_ASSIGN(xs, upload(x, f(in.x), in.n, p.hidden));
    TRY_ASSIGN(es, upload(x, in.expert, in.n, p.topk));
    TRY_ASSIGN(ps, upload(x, f(in.probs), in.n, p.topk));
    const dispatch_input<float, cpu_device_space, float> din{
        .num_tokens = in.n, .x = xs->cview(), .expert = es->cview(), .probs = ps->cview()};
    const long long copies_before = x.copies().to_device;
    TRY_ASSIGN(h, disp->dispatch(x, din, rg->dispatch(), ws));
    if (x.copies().to_device != copies_before)
      return make_error(errc::invalid_argument, "the dispatch copied to the context");
    for (std::byte& b : ws.host) b = ~b;  // the caller reuses the pinned part at once
    x.check();
    const auto r = static_cast<std::size_t>(dw.rank());
    after_dispatch[r] = fake.violations();
    // A copy from the pinned part, and a write into it while the copy is pending.
    const int n = static_cast<int>(ws.host.size() / sizeof(int));
    TRY_ASSIGN(dst, (exec_buffer<int, stream_order_exec>::make(x, 1, n)));
    TRY(x.copy(row_view<const int>(reinterpret_cast<const int*>(ws.host.data()), 1, n),
               dst->view()));
    for (std::byte& b : ws.host) b = ~b;
    x.check();
    after_copy[r] = fake.violations();
    return {};
  });
  for (int r = 0; r < p.fold.world; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE_MESSAGE(st[i].has_value(), st[i].error().message);
    CHECK(after_dispatch[i].empty());
    REQUIRE(after_copy[i].size() == 1);
    CHECK(after_copy[i][0].find("a write into the pinned source of copy to the device") !=
          std::string::npos);
    CHECK(after_copy[i][0].find("the workspace's host part") != std::string::npos);
  }
}
