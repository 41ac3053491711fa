// The MoE layer on the CPU executor with its GEMMs on the library backends (cutlass_sm90 for the
// dropless experts, cublas_strided in pad mode, cublas_dense for the router and the shared
// expert), whose descriptions (CUTLASS's argument arrays, cuBLAS's calls) host_blas executes and
// checks against the libraries' rules: every rank's output, input gradient and reduced router and
// expert gradients against the single-rank fp64 reference of layer_harness.hpp (normwise 1e-2 in
// bf16, 1e-5 in fp32), forward and backward, on one rank, EP 8, EP 4 x ETP 2, EP spanning TP and
// EP = ETP = 1 (row ranges on the context only); with empty experts, ranks whose experts are all
// empty, skewed routing, and pad mode.
//
// bf16 runs a strict policy: a backend that refuses a GEMM fails the run, so every expert GEMM is
// shown to have run on CUTLASS's arrays or cuBLAS's strided call (only the router's fp32 x bf16
// gradients, which no library backend takes, stay on simt_gemm). fp32 runs the default policy of
// cuda_exec, tensor_core_gemms: CUTLASS refuses fp32 and each GEMM falls back (cublas_dense where
// the row ranges are on the host, simt_gemm where they are on the context only).
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/gemm_policy.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "device_layer_rank.hpp"
#include "layer_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// The router's GEMMs that ran on cuBLAS's descriptions, over every rank's thread: the layer's
// gating runs on the router's policy (its logits: one per rank and forward).
std::atomic<int> router_cublas_runs{0};
template <class A, class B, class C>
struct counted_router_gemm : cublas_dense<A, B, C> {
  template <execution_context Exec>
  [[nodiscard]] status run(Exec& x) const {
    ++router_cublas_runs;
    return cublas_dense<A, B, C>::run(x);
  }
};

// Every GEMM on a library backend, no fallback: a refusal is an error of the layer.
struct strict_library_gemms {
  template <gemm_kind K, gemm_mode M, class A, class B, class C>
  using backend = std::conditional_t<
      !std::is_same_v<A, B>, simt_gemm<A, B, C>,  // the router's fp32 x bf16 gradients
      std::conditional_t<
          K == gemm_kind::router, counted_router_gemm<A, B, C>,
          std::conditional_t<K == gemm_kind::shared, cublas_dense<A, B, C>,
                             std::conditional_t<M == gemm_mode::pad, cublas_strided<A, B, C>,
                                                std::conditional_t<std::is_same_v<A, bfloat16>,
                                                                   cutlass_sm90<A, B, C>,
                                                                   cublas_dense<A, B, C>>>>>>;
};
static_assert(gemm_policy<strict_library_gemms, cpu_exec>);
static_assert(gemm_policy<tensor_core_gemms<>, cpu_exec>);

using dev_comm = thread_device_communicator;
using space = cpu_device_space;

template <class T, template <class, class, class, class> class Disp, class Gemms>
std::vector<layer_result> run_library(const problem& p,
                                      const std::optional<drop_policy_variant>& drop = {}) {
  std::vector<layer_result> res(static_cast<std::size_t>(p.fold.world));
  const auto st = run_thread_world(p.fold.world, [&](thread_communicator& world) -> status {
    auto dw = std::move(world).in_space<space>();
    cpu_exec x(11 + static_cast<std::uint64_t>(dw.rank()));
    auto r = run_device_rank<T, Disp, Gemms>(p, dw, x, drop);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(dw.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// Routed pairs per expert over every rank's tokens (a tp group's ranks repeat theirs: the zeros
// and the skew are what counts).
std::vector<int> pairs_per_expert(const problem& p, const std::vector<layer_result>& res) {
  std::vector<int> n(static_cast<std::size_t>(p.experts), 0);
  for (const auto& r : res)
    for (int e : r.indices) ++n[static_cast<std::size_t>(e)];
  return n;
}

struct scenario {
  std::string name;
  fold_config fold;
  int experts, topk, tokens;
};
// H 16 and F / ETP 8: rows of 32 and 16 bytes, as TMA needs them.
const scenario scenarios[] = {
    {"one rank", {.world = 1}, 4, 2, 9},
    {"EP 8, one expert per rank", {.world = 8, .ep = 8, .etp = 1}, 8, 2, 12},
    {"EP 4 x ETP 2, empty experts", {.world = 8, .tp = 2, .ep = 4, .etp = 2}, 16, 2, 2},
    {"EP spanning TP", {.world = 4, .tp = 2, .ep = 4, .etp = 1}, 8, 2, 6},
    {"EP = ETP = 1: row ranges on the context", {.world = 2, .tp = 2, .ep = 1, .etp = 1}, 4, 2, 7},
};

template <class T, template <class, class, class, class> class Disp, class Gemms>
void check_scenarios(int& with_empty, int& skewed) {
  for (const auto& s : scenarios) {
    CAPTURE(s.name);
    problem p{.fold = s.fold};
    p.experts = s.experts;
    p.topk = s.topk;
    p.hidden = 16;
    p.ffn = 8 * make_folded(s.fold).value().etp();
    p.tokens = s.tokens;
    p.bf16_values = std::is_same_v<T, bfloat16>;
    const auto res = run_library<T, Disp, Gemms>(p);
    layer_check judge;
    CHECK(check_layer_results<T>(p, res, drop_mode::none, &judge) == 0);
    CHECK(judge.worst > 0);
    const auto n = pairs_per_expert(p, res);
    const int most = *std::max_element(n.begin(), n.end());
    long long all = 0;
    for (int v : n) all += v;
    with_empty += std::count(n.begin(), n.end(), 0) > 0 ? 1 : 0;
    skewed += most * p.experts >= 2 * all ? 1 : 0;  // one expert at twice the mean or more
  }
}

}  // namespace

TEST_CASE("the layer on cuBLAS's and CUTLASS's descriptions in bf16: the fp64 reference") {
  int with_empty = 0, skewed = 0;
  router_cublas_runs = 0;
  check_scenarios<bfloat16, all_to_all_dispatcher, strict_library_gemms>(with_empty, skewed);
  check_scenarios<bfloat16, all_gather_dispatcher, strict_library_gemms>(with_empty, skewed);
  // The gating linear ran on the router's policy (cuBLAS), not the context's default (SIMT): one
  // logits GEMM per rank and forward, two dispatchers.
  int ranks = 0;
  for (const auto& s : scenarios) ranks += s.fold.world;
  CHECK(router_cublas_runs == 2 * ranks);
  // The routing gave what the runs are for: empty experts and a skewed expert (checked, not
  // assumed: the router weights decide).
  CHECK(with_empty > 0);
  CHECK(skewed > 0);
}

TEST_CASE("the layer in bf16, pad mode on one strided cuBLAS batch: the fp64 reference") {
  for (const auto& f : {fold_config{.world = 8, .tp = 2, .ep = 4, .etp = 2},
                        fold_config{.world = 2, .tp = 2, .ep = 1, .etp = 1}}) {
    problem p{.fold = f};
    p.experts = 8;
    p.topk = 2;
    p.hidden = 16;
    p.ffn = 8 * make_folded(f).value().etp();
    p.tokens = 6;
    p.bf16_values = true;
    const sub_sequence pad{.capacity_factor = 1.0, .pad_to_capacity = true};
    const auto res = run_library<bfloat16, all_to_all_dispatcher, strict_library_gemms>(p, pad);
    layer_check judge;
    check_layer_results<bfloat16>(p, res, drop_mode::per_rank, &judge);
    CHECK(judge.worst > 0);
    for (const auto& r : res)
      for (int rows : r.rows_per_expert) CHECK(rows == r.capacity);
  }
}

TEST_CASE("the layer in fp32 on cuda_exec's default policy (every fallback taken): fp64") {
  int with_empty = 0, skewed = 0;
  check_scenarios<float, all_to_all_dispatcher, tensor_core_gemms<>>(with_empty, skewed);
  CHECK(with_empty > 0);
  CHECK(skewed > 0);
}
