// Part of the GPU test program (test-simt-gpu, whose main is in
// tests/kernels/simt/simt_gpu_test.cu; two .cu files that include the kernel headers, linked
// together): both dispatchers on cuda_exec over the loopback world (8 ranks, one GPU,
// EP 4 x ETP 2, with and without pad mode) equal the same round trip on cpu_exec over the
// thread world bit for bit (the batch, the output, every gradient), with the same transfers:
// one device-to-host copy (the host's one wait) in a forward, none in All-to-All pad mode, none
// in combine and the backward; the kernels' error word stays clear. A bad routing record on one
// rank fails every rank in the forward, as on the CPU.
#include <doctest/doctest.h>
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/comm/thread_world.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>

#include <string>
#include <vector>

#include "device_round_trip.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

template <template <class, class, class, class> class Disp, class T, class P>
void gpu_equals_cpu(const problem& p, bool all_to_all) {
  const int W = p.fold.world;
  std::vector<trip<T, P>> cpu(static_cast<std::size_t>(W)), gpu(static_cast<std::size_t>(W));
  const auto cs = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    cpu_exec x;
    auto t = round_trip<Disp, T, P, cpu_exec>(p, dw, x);
    if (!t) return unexpected<error>(t.error());
    cpu[static_cast<std::size_t>(dw.rank())] = std::move(*t);
    return {};
  });
  const auto gs = run_loopback_world(W, [&](loopback_communicator& c) -> status {
    auto x = cuda_exec::make(c.stream());
    if (!x) return unexpected<error>(x.error());
    auto t = round_trip<Disp, T, P, cuda_exec>(p, c, *x);
    if (!t) return unexpected<error>(t.error());
    if (auto st = x->device_status(); !st) return st;  // no index out of range anywhere
    gpu[static_cast<std::size_t>(c.rank())] = std::move(*t);
    return {};
  });
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE_MESSAGE(cs[i].has_value(), cs[i].error().message);
    REQUIRE_MESSAGE(gs[i].has_value(), gs[i].error().message);
    const trip<T, P>&a = cpu[i], &b = gpu[i];
    check_same_results(a, b);
    CHECK(a.dispatch_copies == b.dispatch_copies);
    CHECK(b.dispatch_copies.to_host == (all_to_all && p.pad ? 0 : 1));
    CHECK(b.later_copies.to_host == 0);
    CHECK(b.later_copies.to_device == 0);
  }
}

}  // namespace

TEST_CASE(
    "[dispatch] both dispatchers on cuda_exec (loopback world, EP 4 x ETP 2) equal "
    "cpu_exec bitwise, one wait per forward") {
  for (bool pad : {false, true}) {
    CAPTURE(pad);
    const problem p = folded_problem(pad);
    gpu_equals_cpu<all_to_all_dispatcher, bfloat16, float>(p, true);
    gpu_equals_cpu<all_gather_dispatcher, bfloat16, float>(p, false);
    gpu_equals_cpu<all_to_all_dispatcher, float, float>(p, true);
  }
}

TEST_CASE("[dispatch] cuda_exec: a bad routing record on one rank fails every rank") {
  // 4 ranks, EP 4, E = 4, k = 2: rank 2's token 1 names expert 7. All-to-All, dropless: every
  // rank's forward fails in its one wait, rank 2 with the host builder's words.
  const auto st = run_loopback_world(4, [](loopback_communicator& c) -> status {
    const int r = c.rank();
    auto x = cuda_exec::make(c.stream());
    if (!x) return unexpected<error>(x.error());
    auto ep = c.split(0, r);
    auto etp = c.split(r, 0);
    auto tp_ep = c.split(0, r);
    if (!ep || !etp || !tp_ep) return make_error(errc::invalid_argument, "split");
    const dispatch_groups<loopback_communicator> g{*ep, *etp, *tp_ep};
    using D = all_to_all_dispatcher<float, loopback_communicator, cuda_exec, float>;
    auto d = D::make({.max_tokens = 2, .hidden = 3, .topk = 2, .num_experts = 4, .ep = 4});
    if (!d) return unexpected<error>(d.error());
    const std::vector<int> rec =
        r == 2 ? std::vector<int>{0, 1, 2, 7} : std::vector<int>{r, (r + 1) % 4, (r + 2) % 4, -1};
    TRY_ASSIGN(xs, upload(*x, std::vector<float>(6, 1.f), 2, 3));
    TRY_ASSIGN(es, upload(*x, rec, 2, 2));
    TRY_ASSIGN(ps, upload(*x, std::vector<float>(4, 0.5f), 2, 2));
    TRY_ASSIGN(wsb, make_exec_workspace(*x, d->workspace_sizes()));
    const dispatch_workspace ws = wsb->view();
    const dispatch_input<float, device_space> in{
        .num_tokens = 2, .x = xs->cview(), .expert = es->cview(), .probs = ps->cview()};
    auto h = d->dispatch(*x, in, g, ws);
    if (h) return make_error(errc::invalid_argument, "a bad record was accepted");
    const std::string want =
        r == 2 ? "token 1 slot 1 names expert 7" : "tp-ep rank 2's routing record";
    if (h.error().message.find(want) == std::string::npos) return unexpected<error>(h.error());
    return {};
  });
  for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? std::string() : s.error().message));
}
