// Part of the GPU test program (test-simt-gpu, whose main is in
// tests/kernels/simt/simt_gpu_test.cu): the MoE layer on cuda_exec over the loopback world (8
// ranks on one GPU, EP 4 x ETP 2), dropless, with sub-sequence dropping in pad mode and with
// full-sequence dropping over TP 2 in true sequence order, against the same layer on cpu_exec
// over the thread world. The same routing and kept record (the router's bodies are bitwise on
// both), the same host waits (run_device_rank checks them: one device-to-host copy per dropless
// forward, none in pad mode, none in the backward), the kernels' error word clear, and outputs,
// gradients and losses within 1e-6 normwise (the same kernel bodies; the bound leaves room for the
// GPU's own rounding of a sum it might contract, which the CPU tests of each kernel pin where it
// matters). Then two forwards in flight on two streams equal one after the other.
#include <doctest/doctest.h>
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>

#include <algorithm>
#include <optional>
#include <vector>

#include "device_layer_rank.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

void gpu_layer_equals_cpu(const problem& p, std::optional<drop_policy_variant> drop,
                          bool keys = false) {
  const int W = p.fold.world;
  std::vector<layer_result> cpu(static_cast<std::size_t>(W)), gpu(static_cast<std::size_t>(W));
  const auto cs = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<cpu_device_space>();
    cpu_exec x;
    auto r = run_device_rank<float, all_to_all_dispatcher>(p, dw, x, drop, keys);
    if (!r) return unexpected<error>(r.error());
    cpu[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  const auto gs = run_loopback_world(W, [&](loopback_communicator& c) -> status {
    auto x = cuda_exec::make(c.stream());
    if (!x) return unexpected<error>(x.error());
    auto r = run_device_rank<float, all_to_all_dispatcher>(p, c, *x, drop, keys);
    if (!r) return unexpected<error>(r.error());
    if (auto st = x->device_status(); !st) return st;  // no index out of range anywhere
    gpu[static_cast<std::size_t>(c.rank())] = std::move(*r);
    return {};
  });
  double worst = 0;
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    REQUIRE_MESSAGE(cs[i].has_value(), cs[i].error().message);
    REQUIRE_MESSAGE(gs[i].has_value(), gs[i].error().message);
    const layer_result &a = cpu[i], &b = gpu[i];
    CHECK(a.indices == b.indices);
    CHECK(a.kept == b.kept);
    CHECK(a.dropped == b.dropped);
    using field = std::vector<double> layer_result::*;
    for (field v : {&layer_result::out, &layer_result::dx, &layer_result::dw_router,
                    &layer_result::dw1, &layer_result::dw2}) {
      const double e = rel_err(a.*v, b.*v);
      worst = std::max(worst, e);
      CHECK(e <= 1e-6);
    }
    CHECK(a.aux == doctest::Approx(b.aux).epsilon(1e-6));
    CHECK(a.z == doctest::Approx(b.z).epsilon(1e-6));
  }
  MESSAGE("moe_layer cuda_exec vs cpu_exec, worst normwise difference: ", worst);
}

}  // namespace

TEST_CASE(
    "[layer] moe_layer on cuda_exec (loopback world, EP 4 x ETP 2) equals the layer on cpu_exec: "
    "dropless, sub-sequence pad mode, full-sequence by position with order keys; EP = ETP = 1 "
    "without a wait") {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 4, .etp = 2}};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 12;
  p.ffn = 4;
  p.tokens = 6;
  gpu_layer_equals_cpu(p, std::nullopt);
  gpu_layer_equals_cpu(p, sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true});
  // The tp-cp group is TP's 2 ranks: the record gathered over it, the order from device keys.
  gpu_layer_equals_cpu(p, full_sequence{.capacity_factor = 1.0, .by = drop_by::position}, true);
  // EP = ETP = 1 (TP 2 over EDP 2) dropless: the All-to-All dispatcher's direct path, no host
  // wait in the forward (run_device_rank checks it), the experts' row ranges on the device.
  problem q{.fold = {.world = 2, .tp = 2, .ep = 1, .etp = 1}};
  q.experts = 6;
  q.topk = 2;
  q.hidden = 12;
  q.ffn = 2;
  q.tokens = 7;
  gpu_layer_equals_cpu(q, std::nullopt);
}

TEST_CASE("[layer] moe_layer: two forwards in flight on two streams equal one after the other") {
  // One rank (EP = ETP = 1), dropless and in pad mode: the first micro-batch's forward on the
  // loopback rank's stream, the second's on a stream of its own, backwards in reverse order, each
  // on its forward's stream; outputs, input gradients and accumulated gradients bit for bit as
  // the two micro-batches one after the other on one stream.
  problem q{.fold = {.world = 1}};
  q.experts = 4;
  q.topk = 2;
  q.hidden = 12;
  q.ffn = 2;
  q.tokens = 7;
  for (const std::optional<drop_policy_variant>& drop :
       {std::optional<drop_policy_variant>{},
        std::optional<drop_policy_variant>(
            sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = true})}) {
    CAPTURE(drop.has_value());
    two_batches runs[2];
    const auto gs = run_loopback_world(1, [&](loopback_communicator& c) -> status {
      cudaStream_t second = nullptr;
      if (auto st = detail::cuda_check(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking),
                                       "cudaStreamCreateWithFlags");
          !st)
        return st;
      // Both runs on the two streams; the second stream is destroyed whatever the outcome.
      const auto both = [&]() -> status {
        auto x0 = cuda_exec::make(c.stream());
        if (!x0) return unexpected<error>(x0.error());
        auto x1 = cuda_exec::make(second);
        if (!x1) return unexpected<error>(x1.error());
        for (const bool in_flight : {false, true}) {
          auto r = run_two_batches<float, all_to_all_dispatcher>(q, c, *x0, *x1, drop, in_flight);
          if (!r) return unexpected<error>(r.error());
          runs[in_flight ? 1 : 0] = std::move(*r);
        }
        for (cuda_exec* x : {&*x0, &*x1})
          if (auto st = x->device_status(); !st) return st;
        return first_error({x0->synchronize(), x1->synchronize()});
      };
      const status result = both();
      (void)cudaStreamDestroy(second);
      return result;
    });
    REQUIRE_MESSAGE(gs[0].has_value(), gs[0].error().message);
    const two_batches &a = runs[0], &b = runs[1];
    for (int m = 0; m < 2; ++m) {
      CAPTURE(m);
      CHECK(a.out[m] == b.out[m]);
      CHECK(a.dx[m] == b.dx[m]);
    }
    CHECK(a.out[0] != a.out[1]);  // the micro-batches differ: a mix-up would show
    CHECK(a.dw_router == b.dw_router);
    CHECK(a.dw1 == b.dw1);
    CHECK(a.dw2 == b.dw2);
  }
}
