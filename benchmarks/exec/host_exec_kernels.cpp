// The router, loss, capacity, histogram and scan kernel bodies on host_exec (a plain loop, team
// bodies with a team of one) against today's host loops doing the same work
// (routing/topk_router.hpp, routing/aux_loss.hpp, dispatch/drop_policy_local.hpp,
// dispatch/plan_builders.hpp and the prefix sum of dispatch/permute.hpp), and, at the README
// example's size, the same kernels on cpu_exec (the checker). docs/kernels.md records the table
// ("host_exec: kernel bodies on the host, measured").
//
// Sizes: the layer suites' smallest and largest (tests/layer, tests/dispatch: 4-64 tokens per
// rank, E 4-16, k 2), the README example (train_moe_cpu --world 8 --tp 2 --ep 4 --etp 1 --drop
// sub_sequence --capacity 1.25: 256 tokens over 8 ranks, 32 per rank, E 8, k 2, softmax after
// top-k, aux loss 0.01, z-loss off), and two larger ones (4,096 tokens, E 64 k 8, and E 512 k 8,
// which takes the block-per-token router). Logits N(0, 2) plus a linear per-expert skew from -1 to
// +1, so that the heavier experts overflow capacity 1.25 and the keep rank has work to do.
//
// Each group is timed as batches of calls (steady_clock over a batch long enough for
// sub-microsecond resolution); min and median over --reps batches, in microseconds per call.
// The host loops run in double (the example's type) and float; the kernels are fp32 (the
// router kernels are float). Each group stands alone: what it takes from the group before it
// (the selection, d loss / d scores, the logsumexp, the counts) comes from the float host loop.
// Before timing, each group's kernel result is checked against the float host loop's in what the
// kernels promise: indices, maps, keep decisions and counts exactly, float values within a bound
// in ulps of their condition (the worst is printed). A group that fails prints a FAIL line and is
// not timed on the contexts (its host loops still are), the others go on, and the program exits
// 1: nothing wrong is timed. "layer step" sums the groups one step of the README example runs.
//
//   bench-host-exec-kernels [--reps N] [--json] [--target-ms F] [--groups G,...] [--sizes S,...]
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <moefold/dispatch/drop_policy_local.hpp>
#include <moefold/dispatch/plan_builders.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/capacity.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_aux_loss.hpp>
#include <moefold/kernels/router_block.hpp>
#include <moefold/kernels/router_z_loss.hpp>
#include <moefold/kernels/scan.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#include "../../tests/support/host_aux_loss.hpp"
#include "../../tests/support/host_drop_policy.hpp"
#include "../../tests/support/host_topk_router.hpp"

using namespace moefold;
namespace k = moefold::kernels;

namespace {

constexpr double aux_coeff = 0.01, z_coeff = 1e-3, capacity_factor = 1.25;
constexpr std::uint64_t seed = 20261205;

struct size_case {
  const char* name;
  int N, E, K;
  bool with_cpu_exec;  // the checker's cost too (README size only: milliseconds per launch)
};

const size_case sizes[] = {
    {"suite-min", 4, 4, 2, false},        {"readme", 32, 8, 2, true},
    {"suite-max", 64, 16, 2, false},      {"large", 4096, 64, 8, false},
    {"large-block", 4096, 512, 8, false},
};

enum group : int {
  router_fwd,
  router_bwd,
  aux_fwd,
  aux_bwd,
  z_fwd,
  z_bwd,
  capacity,
  histogram,
  scan,
  groups
};
const char* const group_names[groups] = {"router fwd",   "router bwd", "aux loss fwd",
                                         "aux loss bwd", "z-loss fwd", "z-loss bwd",
                                         "capacity",     "histogram",  "scan"};
const char* const group_keys[groups] = {"router-fwd", "router-bwd", "aux-fwd",   "aux-bwd", "z-fwd",
                                        "z-bwd",      "capacity",   "histogram", "scan"};
// The groups one layer step (forward + backward) of the README example runs: the z-loss is off
// there (its coefficient defaults to 0), so its two rows are not in the step.
constexpr bool in_step[groups] = {true, true, true, true, false, false, true, true, true};

// ---------------------------------------------------------------------------------------------
// Inputs and the host loops' state, per size.

template <class T>
struct host_state {
  host_topk_router<T> router{};
  std::vector<T> logits{};  // [N, E]
  topk_routing<T> routing{};
  topk_router_scratch<T> router_ws{};
  std::vector<T> dprobs{}, dlogits{};  // [N, k], [N, E]
  aux_scores<T> aux{};
  aux_loss_term<T> term{};
  std::vector<T> scratch{};  // 3 E
  T z = 0;
  // capacity
  std::vector<std::uint8_t> keep{};
  drop_report report{};
  drop_scratch<T> drop_ws{};
  std::vector<int> kept_experts{};
  std::vector<T> kept_probs{};
  drop_counts counts{};
  // histogram, scan
  std::vector<int> hist{}, fault{}, offsets{};  // [E], [2], [E + 1]
};

struct kernel_state {
  std::vector<float> logits;  // [N, E]
  std::vector<int> indices;   // [N, k]
  std::vector<float> probs, dprobs, dlogits;
  std::vector<float> scores, sums, aux_loss, dscores;  // [N, E], [E], [1], [E]
  std::vector<std::uint8_t> map;                       // [N, E]
  std::vector<double> counts;                          // [E]
  std::vector<float> lse, z_loss;                      // [N], [1]
  std::vector<int> valid;                              // [1]
  // capacity (offsets: the histogram and scan groups' result, an input here)
  std::vector<int> cap_offsets, lists, routed, dropped, padded, kept, dispatched;
  std::vector<std::uint8_t> keep;
  std::vector<long long> totals;
  // histogram, scan
  std::vector<int> hist, fault, scan_out, scan_tiles, scan_total;
  // What a group takes from the one before it, from the float host loop's result, so that each
  // group is measured and checked on its own: the router backward's selection, the aux backward's
  // d loss / d scores, the z-loss backward's logsumexp and valid count, the scan's counts.
  std::vector<int> bwd_indices, bwd_valid, scan_in;
  std::vector<float> bwd_dscores, bwd_lse;
};

struct inputs {
  int N, E, K;
  std::vector<float> logits;
  std::vector<double> logits64;
  std::vector<float> dprobs;
  std::vector<int> route_ids;      // the float host router's selection: the capacity's input
  std::vector<float> route_probs;  // and its probabilities
};

inputs make_inputs(const size_case& s) {
  std::mt19937_64 rng(seed + static_cast<std::uint64_t>(s.N) * 1000 + s.E);
  std::normal_distribution<float> d(0.0f, 2.0f);
  inputs in{s.N, s.E, s.K, {}, {}, {}, {}, {}};
  in.logits.resize(static_cast<std::size_t>(s.N) * s.E);
  for (int t = 0; t < s.N; ++t)
    for (int e = 0; e < s.E; ++e)
      in.logits[static_cast<std::size_t>(t) * s.E + e] =
          d(rng) +
          (s.E > 1 ? 2.0f * static_cast<float>(e) / static_cast<float>(s.E - 1) - 1.0f : 0.0f);
  in.logits64.assign(in.logits.begin(), in.logits.end());
  std::normal_distribution<float> g(0.0f, 0.1f);
  in.dprobs.resize(static_cast<std::size_t>(s.N) * s.K);
  for (auto& v : in.dprobs) v = g(rng);
  return in;
}

// A group that failed (a call's error, or a result the check refused): thrown to main, which
// prints it, times nothing of that group, goes on with the others and exits 1 at the end.
struct bench_failure {
  std::string what;
};
[[noreturn]] void fail(const std::string& what) { throw bench_failure{what}; }
void must(const status& st, const std::string& what) {
  if (!st) fail(what + ": " + st.error().message);
}

template <class T>
host_state<T> make_host(const inputs& in) {
  auto r = host_topk_router<T>::make({.num_experts = in.E, .topk = in.K});
  if (!r) fail("topk_router::make: " + r.error().message);
  host_state<T> h{.router = *r};
  h.logits.assign(in.logits.begin(), in.logits.end());
  h.dprobs.assign(in.dprobs.begin(), in.dprobs.end());
  h.dlogits.assign(h.logits.size(), T(0));
  h.scratch.assign(3 * static_cast<std::size_t>(in.E), T(0));
  h.keep.assign(static_cast<std::size_t>(in.N) * in.K, 0);
  h.kept_experts.assign(h.keep.size(), 0);
  h.kept_probs.assign(h.keep.size(), T(0));
  h.hist.assign(static_cast<std::size_t>(in.E), 0);
  h.fault.assign(2, 0);
  h.offsets.assign(static_cast<std::size_t>(in.E) + 1, 0);
  h.term.counts.assign(static_cast<std::size_t>(in.E), 0.0);
  return h;
}

// ---------------------------------------------------------------------------------------------
// Today's host loops, one group per call.

template <class T>
struct host_loops {
  const inputs& in;
  host_state<T>& h;
  // The capacity's input: the float router's selection (the same record for both types).
  topk_routing<T> record;

  host_loops(const inputs& i, host_state<T>& s) : in(i), h(s) {
    record.num_tokens = in.N;
    record.num_experts = in.E;
    record.topk = in.K;
    record.indices = in.route_ids;
    record.probs.assign(in.route_probs.begin(), in.route_probs.end());
    h.counts = counts_into(h.report, in.E);
  }

  status run(group g) {
    const std::span<const T> logits(h.logits);
    switch (g) {
      case router_fwd: return h.router.route(logits, h.routing, {}, h.router_ws);
      case router_bwd:
        return h.router.backward(logits, h.routing, std::span<const T>(h.dprobs),
                                 std::span<T>(h.dlogits), h.router_ws);
      case aux_fwd: {
        // load_balancing_loss (group_losses.hpp) on a one-rank group: the counts' all-reduce
        // is a no-op, so this is its work.
        if (auto st = compute_aux_scores<T>(score_function::softmax, in.K, in.E, logits, {}, h.aux);
            !st)
          return st;
        column_counts(std::span<const std::uint8_t>(h.aux.map), std::span<double>(h.term.counts));
        switch_load_balancing_into(std::span<const T>(h.aux.scores), static_cast<std::size_t>(in.E),
                                   static_cast<double>(in.N), in.K, in.E, aux_coeff, 1.0, h.term);
        return {};
      }
      case aux_bwd:
        return add_aux_loss_gradient<T>(score_function::softmax, logits, in.E, {}, h.term, T(1),
                                        std::span<T>(h.dlogits), std::span<T>(h.scratch));
      case z_fwd: {
        auto z = z_loss<T>(logits, in.E, z_coeff);
        if (!z) return unexpected<error>(z.error());
        h.z = *z;
        return {};
      }
      case z_bwd:
        return add_z_loss_gradient<T>(logits, in.E, z_coeff, {}, T(1), std::span<T>(h.dlogits),
                                      std::span<T>(h.scratch));
      case capacity: {
        // The host loops of the keep rule (the tests' reference), then the kept pairs.
        const routing_view<T> rv = view_of(record, std::span<std::uint8_t>(h.keep));
        const sub_sequence policy{.capacity_factor = capacity_factor};
        if (auto st = host_apply(policy, rv, h.counts, h.drop_ws); !st) return st;
        detail::write_kept_pairs(rv, std::span<int>(h.kept_experts), std::span<T>(h.kept_probs));
        return {};
      }
      case histogram: {
        host_exec x;
        return count_routed_pairs(
            x, row_view<const int, host_space>(record.indices.data(), in.N, in.K),
            row_view<int, host_space>(h.hist.data(), 1, in.E),
            row_view<int, host_space>(h.fault.data(), 1, 2));
      }
      case scan: {
        // The plan builder's prefix sum of the per-expert counts (dispatch/permute.hpp).
        int* o = h.offsets.data();
        o[0] = 0;
        for (int e = 0; e < in.E; ++e) o[e + 1] = o[e] + h.hist[static_cast<std::size_t>(e)];
        return {};
      }
      default: return {};
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The kernels on a context, one group per call: the launches and grids topk_router,
// the drop decision and simt_memory_ops use.

kernel_state make_kernel_state(const inputs& in) {
  const auto NE = static_cast<std::size_t>(in.N) * in.E, NK = static_cast<std::size_t>(in.N) * in.K,
             E = static_cast<std::size_t>(in.E);
  kernel_state s;
  s.logits = in.logits;
  s.indices.assign(NK, -9);
  s.probs.assign(NK, -9.0f);
  s.dprobs = in.dprobs;
  s.dlogits.assign(NE, 0.0f);
  s.scores.assign(NE, -9.0f);
  s.map.assign(NE, 9);
  s.sums.assign(E, -9.0f);
  s.counts.assign(E, -9.0);
  s.aux_loss.assign(1, -9.0f);
  s.dscores.assign(E, -9.0f);
  s.lse.assign(static_cast<std::size_t>(in.N), -9.0f);
  s.z_loss.assign(1, -9.0f);
  s.valid.assign(1, -9);
  s.cap_offsets.assign(E + 1, 0);
  for (int e : in.route_ids) ++s.cap_offsets[static_cast<std::size_t>(e) + 1];
  std::partial_sum(s.cap_offsets.begin(), s.cap_offsets.end(), s.cap_offsets.begin());
  s.lists.assign(NK + 1, -9);
  s.routed.assign(E, -9);
  s.dropped.assign(E, -9);
  s.padded.assign(E, -9);
  s.kept.assign(NK, -9);
  s.dispatched.assign(E, -9);
  s.keep.assign(NK, 0xEE);
  s.totals.assign(2, -9);
  s.hist.assign(E, -9);
  s.fault.assign(2, -9);
  s.scan_out.assign(E, -9);
  s.scan_tiles.assign(static_cast<std::size_t>((in.E + k::scan_tiles_kernel::tile - 1) /
                                               k::scan_tiles_kernel::tile) +
                          1,
                      -9);
  s.scan_total.assign(1, -9);
  return s;
}

template <class Exec>
struct kernel_groups {
  Exec x;
  const inputs& in;
  kernel_state& s;

  // Runs f.template operator()<Team>() with the team the router's E takes (topk_router's
  // by_team): a warp per token up to E = 256, a block per token above.
  template <class F>
  status by_team(F&& f) const {
    return in.E <= k::detail_router::warp_per_token::max_experts
               ? f.template operator()<k::detail_router::warp_per_token>()
               : f.template operator()<k::detail_router::block_per_token>();
  }
  template <class Team, class K>
  status per_token(const K& kernel) const {
    const int per_block = Team::width == 32 ? K::block_threads / 32 : 1;
    return launch(x, capped_grid<Exec, K>(in.N, per_block), kernel);
  }
  template <class U>
  row_view<U, typename Exec::memory_space> view(std::vector<U>& v, int n) const {
    return row_view<U, typename Exec::memory_space>(v.data(), 1, n);
  }

  status run(group g) {
    const int N = in.N, E = in.E, K = in.K;
    switch (g) {
      case router_fwd:
        return by_team([&]<class Team>() {
          return per_token<Team>(k::basic_router_topk_kernel<Team>{.logits = s.logits.data(),
                                                                   .num_tokens = N,
                                                                   .num_experts = E,
                                                                   .topk = K,
                                                                   .score = score_function::softmax,
                                                                   .pre_softmax = false,
                                                                   .num_groups = 0,
                                                                   .group_topk = 0,
                                                                   .expert_bias = nullptr,
                                                                   .scale = false,
                                                                   .scaling_factor = 1.0f,
                                                                   .indices = s.indices.data(),
                                                                   .probs = s.probs.data()});
        });
      case router_bwd:
        return by_team([&]<class Team>() {
          return per_token<Team>(
              k::basic_router_backward_kernel<Team>{.logits = s.logits.data(),
                                                    .indices = s.bwd_indices.data(),
                                                    .dprobs = s.dprobs.data(),
                                                    .num_tokens = N,
                                                    .num_experts = E,
                                                    .topk = K,
                                                    .score = score_function::softmax,
                                                    .pre_softmax = false,
                                                    .scale = false,
                                                    .scaling_factor = 1.0f,
                                                    .dlogits = s.dlogits.data()});
        });
      case aux_fwd: {
        if (auto st = by_team([&]<class Team>() {
              return per_token<Team>(
                  k::basic_aux_scores_kernel<Team>{.logits = s.logits.data(),
                                                   .padding = nullptr,
                                                   .num_tokens = N,
                                                   .num_experts = E,
                                                   .topk = K,
                                                   .score = score_function::softmax,
                                                   .scores = s.scores.data(),
                                                   .map = s.map.data()});
            });
            !st)
          return st;
        const k::aux_column_sums_kernel<> sums{.scores = s.scores.data(),
                                               .map = s.map.data(),
                                               .rows = N,
                                               .columns = E,
                                               .sums = s.sums.data(),
                                               .counts = s.counts.data()};
        if (auto st =
                launch(x, launch_grid{.blocks = capped_blocks<Exec>(E, sums.block_threads)}, sums);
            !st)
          return st;
        const k::switch_loss_kernel<> loss{.column_sums = s.sums.data(),
                                           .counts = s.counts.data(),
                                           .columns = E,
                                           .total_tokens = static_cast<double>(N),
                                           .per_token = static_cast<double>(K),
                                           .topk = K,
                                           .num_experts = E,
                                           .coeff = aux_coeff,
                                           .divide_by = 1.0,
                                           .running = nullptr,
                                           .used = nullptr,
                                           .loss = s.aux_loss.data(),
                                           .dscores = s.dscores.data()};
        return launch(x, launch_grid{.blocks = 1}, loss);
      }
      case aux_bwd:
        return by_team([&]<class Team>() {
          return per_token<Team>(
              k::basic_aux_loss_backward_kernel<Team>{.logits = s.logits.data(),
                                                      .padding = nullptr,
                                                      .num_tokens = N,
                                                      .num_experts = E,
                                                      .score = score_function::softmax,
                                                      .dscores = s.bwd_dscores.data(),
                                                      .columns = E,
                                                      .seed = 1.0f,
                                                      .dlogits = s.dlogits.data()});
        });
      case z_fwd: {
        if (auto st = by_team([&]<class Team>() {
              return per_token<Team>(k::basic_logsumexp_kernel<Team>{.logits = s.logits.data(),
                                                                     .padding = nullptr,
                                                                     .num_tokens = N,
                                                                     .num_experts = E,
                                                                     .lse = s.lse.data()});
            });
            !st)
          return st;
        const k::z_loss_total_kernel<> total{.lse = s.lse.data(),
                                             .padding = nullptr,
                                             .num_tokens = N,
                                             .coeff = static_cast<float>(z_coeff),
                                             .loss = s.z_loss.data(),
                                             .valid = s.valid.data()};
        return launch(x, launch_grid{.blocks = 1, .smem_bytes = total.smem_bytes}, total);
      }
      case z_bwd:
        return by_team([&]<class Team>() {
          return per_token<Team>(
              k::basic_z_loss_backward_kernel<Team>{.logits = s.logits.data(),
                                                    .padding = nullptr,
                                                    .lse = s.bwd_lse.data(),
                                                    .valid = s.bwd_valid.data(),
                                                    .num_tokens = N,
                                                    .num_experts = E,
                                                    .coeff = static_cast<float>(z_coeff),
                                                    .seed = 1.0f,
                                                    .dlogits = s.dlogits.data()});
        });
      case capacity: {
        // The drop decision (capacity_keep.hpp) after its histogram and scan: C, then four
        // launches.
        auto c = expert_capacity(static_cast<long long>(N) * K, E, capacity_factor);
        if (!c) return unexpected<error>(c.error());
        const k::keep_args<float> a{.expert = in.route_ids.data(),
                                    .probs = in.route_probs.data(),
                                    .order = nullptr,
                                    .by_order = nullptr,
                                    .offsets = s.cap_offsets.data(),
                                    .scratch = s.lists.data(),
                                    .num_tokens = N,
                                    .topk = K,
                                    .num_experts = E,
                                    .capacity = *c,
                                    .by = drop_by::probs,
                                    .pad = false,
                                    .first = 0,
                                    .count = N,
                                    .keep = s.keep.data(),
                                    .routed = s.routed.data(),
                                    .dropped = s.dropped.data(),
                                    .padded = s.padded.data(),
                                    .filler_map = nullptr};
        const long long pairs = static_cast<long long>(N) * K;
        const k::expert_lists_kernel<float> lists{a};
        const k::keep_rank_kernel<float> rank{a};
        const k::drop_totals_kernel totals{.keep = a.keep,
                                           .dropped = a.dropped,
                                           .topk = K,
                                           .num_experts = E,
                                           .first = 0,
                                           .count = N,
                                           .totals = s.totals.data()};
        const k::kept_record_kernel record{.expert = in.route_ids.data(),
                                           .keep = a.keep,
                                           .pairs = pairs,
                                           .kept = s.kept.data(),
                                           .routed = a.routed,
                                           .dropped = a.dropped,
                                           .padded = a.padded,
                                           .num_experts = E,
                                           .dispatched = s.dispatched.data()};
        if (auto st = launch(x, launch_grid{.blocks = capped_blocks<Exec>(E, lists.block_threads)},
                             lists);
            !st)
          return st;
        if (auto st = launch(
                x, launch_grid{.blocks = capped_blocks<Exec>(pairs, rank.block_threads)}, rank);
            !st)
          return st;
        if (auto st = launch(x, launch_grid{.blocks = 1, .smem_bytes = totals.smem_bytes}, totals);
            !st)
          return st;
        return launch(x,
                      launch_grid{.blocks = capped_blocks<Exec>(std::max<long long>(pairs, E),
                                                                record.block_threads)},
                      record);
      }
      case histogram: {
        // simt_memory_ops::expert_histogram: two fills, the histogram, the fault word.
        if (auto st = x.template fill<int>(view(s.hist, E), 0); !st) return st;
        if (auto st = x.template fill<int>(view(s.fault, 2), 2147483647); !st) return st;
        const long long n = static_cast<long long>(N) * K;
        if (auto st = launch(x,
                             launch_grid{.blocks = capped_blocks<Exec>(n, 256),
                                         .smem_bytes = k::expert_histogram_kernel::smem_bytes(E)},
                             k::expert_histogram_kernel{.ids = in.route_ids.data(),
                                                        .n = n,
                                                        .num_experts = E,
                                                        .counts = s.hist.data(),
                                                        .first_bad = s.fault.data(),
                                                        .topk = K});
            !st)
          return st;
        return launch(x, launch_grid{.blocks = 1},
                      k::record_fault_kernel{.ids = in.route_ids.data(), .fault = s.fault.data()});
      }
      case scan: {
        // simt_memory_ops::exclusive_scan over the E counts: three launches.
        const long long n = E,
                        tiles = (n + k::scan_tiles_kernel::tile - 1) / k::scan_tiles_kernel::tile;
        constexpr std::size_t smem = sizeof(int) * (256 / 32 + 1);
        if (auto st =
                launch(x, launch_grid{.blocks = capped_blocks<Exec>(tiles, 1), .smem_bytes = smem},
                       k::scan_tiles_kernel{.in = s.scan_in.data(),
                                            .out = s.scan_out.data(),
                                            .n = n,
                                            .tile_sums = s.scan_tiles.data()});
            !st)
          return st;
        if (auto st = launch(x, launch_grid{.blocks = 1, .smem_bytes = smem},
                             k::scan_tile_sums_kernel{.tile_sums = s.scan_tiles.data(),
                                                      .tiles = tiles,
                                                      .total = s.scan_total.data()});
            !st)
          return st;
        return launch(x, launch_grid{.blocks = capped_blocks<Exec>(n, 256)},
                      k::add_tile_offsets_kernel{
                          .out = s.scan_out.data(), .n = n, .tile_offsets = s.scan_tiles.data()});
      }
      default: return {};
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Checks: the kernels' results against the float host loop's.

constexpr double ulp1 = 0x1p-23;  // one fp32 ulp at 1

// The worst |got - want| seen, in fp32 ulps of a scale (the value's condition), per group.
struct checker {
  std::string where;
  double worst = 0;
  void close(double got, double want, double scale, double bound, const char* what, long i) {
    const double err = std::abs(got - want) / (ulp1 * (scale > 0 ? scale : 1e-300));
    if (!(got == want) && !(err <= bound))
      fail(where + ": " + what + "[" + std::to_string(i) + "] = " + std::to_string(got) +
           ", host " + std::to_string(want) + ": " + std::to_string(err) +
           " ulps of its scale (bound " + std::to_string(bound) + ")");
    if (got != want) worst = std::max(worst, err);
  }
  template <class A, class B>
  void equal(const std::vector<A>& got, const std::vector<B>& want, std::size_t n,
             const char* what) {
    for (std::size_t i = 0; i < n; ++i)
      if (static_cast<long long>(got[i]) != static_cast<long long>(want[i]))
        fail(where + ": " + what + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) +
             ", host " + std::to_string(want[i]));
  }
};

// Near-tie: the k-th and (k+1)-th largest of a row of fp64 values within 1e-6 of the largest
// (the order exp's last bits may give either way).
bool near_tie(const double* v, int E, int kk) {
  std::vector<double> r(v, v + E);
  std::sort(r.begin(), r.end(), std::greater<>());
  const double tol = 1e-6 * std::max(std::abs(r.front()), 1e-30);
  for (int i = 0; i + 1 < std::min(kk + 1, E); ++i)
    if (r[static_cast<std::size_t>(i)] - r[static_cast<std::size_t>(i) + 1] <= tol) return true;
  return false;
}

// The group g of the kernels (already run once on `s`) against the float host loop's (run once
// on `h`), and the fp64 host state `h64` for conditions. Returns the worst ulps seen.
double verify(group g, const inputs& in, const kernel_state& s, const host_state<float>& h,
              const host_state<double>& h64, const std::string& where) {
  checker c{where + " " + group_names[g]};
  const int N = in.N, E = in.E, K = in.K;
  const auto NE = static_cast<std::size_t>(N) * E, NK = static_cast<std::size_t>(N) * K;
  switch (g) {
    case router_fwd:
      c.equal(s.indices, h.routing.indices, NK, "indices");
      for (std::size_t i = 0; i < NK; ++i)
        c.close(s.probs[i], h.routing.probs[i], std::abs(h64.routing.probs[i]), 8, "probs",
                static_cast<long>(i));
      break;
    case router_bwd:
      for (int t = 0; t < N; ++t) {
        // softmax over the k selected: dx_i = p_i (g_i - <p, g>); condition p_i (|g_i| + sum |p
        // g|).
        double pg = 0;
        for (int i = 0; i < K; ++i)
          pg += std::abs(h64.routing.probs[static_cast<std::size_t>(t) * K + i] *
                         h64.dprobs[static_cast<std::size_t>(t) * K + i]);
        std::vector<double> cond(static_cast<std::size_t>(E), 0.0);
        for (int i = 0; i < K; ++i) {
          const auto p = static_cast<std::size_t>(t) * K + i;
          cond[static_cast<std::size_t>(h64.routing.indices[p])] =
              h64.routing.probs[p] * (std::abs(h64.dprobs[p]) + pg);
        }
        for (int e = 0; e < E; ++e) {
          const auto at = static_cast<std::size_t>(t) * E + e;
          c.close(s.dlogits[at], h.dlogits[at], cond[static_cast<std::size_t>(e)], 16, "dlogits",
                  static_cast<long>(at));
        }
      }
      break;
    case aux_fwd: {
      long ties = 0;
      for (int t = 0; t < N; ++t) {
        const auto row = static_cast<std::size_t>(t) * E;
        const bool tie = near_tie(h64.aux.scores.data() + row, E, K);
        ties += tie ? 1 : 0;
        for (int e = 0; e < E; ++e) {
          const auto at = row + static_cast<std::size_t>(e);
          if (!tie && s.map[at] != h.aux.map[at])
            fail(c.where + ": map[" + std::to_string(at) + "] differs (not a near-tie)");
          c.close(s.scores[at], h.aux.scores[at], h64.aux.scores[at], 16, "scores",
                  static_cast<long>(at));
        }
      }
      if (ties == 0) c.equal(s.counts, h.term.counts, static_cast<std::size_t>(E), "counts");
      // Column sums of positive scores: relative; the loss and its gradient from them.
      std::vector<double> sums64(static_cast<std::size_t>(E), 0.0);
      for (std::size_t i = 0; i < NE; ++i)
        sums64[i % static_cast<std::size_t>(E)] += h64.aux.scores[i];
      std::vector<float> sums32(static_cast<std::size_t>(E), 0.0f);
      for (std::size_t i = 0; i < NE; ++i)
        sums32[i % static_cast<std::size_t>(E)] += h.aux.scores[i];
      for (int e = 0; e < E; ++e)
        c.close(s.sums[static_cast<std::size_t>(e)], sums32[static_cast<std::size_t>(e)],
                sums64[static_cast<std::size_t>(e)], 16, "column sums", e);
      c.close(s.aux_loss[0], h.term.loss, h64.term.loss, 16, "aux loss", 0);
      for (int e = 0; e < E; ++e)
        c.close(s.dscores[static_cast<std::size_t>(e)], h.term.dscores[static_cast<std::size_t>(e)],
                std::abs(h64.term.dscores[static_cast<std::size_t>(e)]), 16, "dscores", e);
      break;
    }
    case aux_bwd:
      // dl_e = s_e (ds_e - <s, ds>); condition s_e (|ds_e| + sum s |ds|).
      for (int t = 0; t < N; ++t) {
        const auto row = static_cast<std::size_t>(t) * E;
        double sd = 0;
        for (int e = 0; e < E; ++e)
          sd += h64.aux.scores[row + e] * std::abs(h64.term.dscores[static_cast<std::size_t>(e)]);
        for (int e = 0; e < E; ++e) {
          const double cond = h64.aux.scores[row + e] *
                              (std::abs(h64.term.dscores[static_cast<std::size_t>(e)]) + sd);
          c.close(s.dlogits[row + e], h.dlogits[row + e], cond, 16, "dlogits",
                  static_cast<long>(row + e));
        }
      }
      break;
    case z_fwd: {
      // loss = coeff sum lse^2 / N, lse = m + log sum exp(x - m); condition with |m|.
      double cond = 0;
      for (int t = 0; t < N; ++t) {
        const double* r = in.logits64.data() + static_cast<std::size_t>(t) * E;
        const double m = *std::max_element(r, r + E);
        double sum = 0;
        for (int e = 0; e < E; ++e) sum += std::exp(r[e] - m);
        const double l = std::abs(m) + std::log(sum);
        cond += l * l;
      }
      cond *= z_coeff / N;
      c.equal(s.valid, std::vector<int>{N}, 1, "valid");
      c.close(s.z_loss[0], h.z, cond, 32, "z-loss", 0);
      break;
    }
    case z_bwd:
      // dl = seed coeff 2 lse / valid softmax_e; condition with |m| + log sum.
      for (int t = 0; t < N; ++t) {
        const double* r = in.logits64.data() + static_cast<std::size_t>(t) * E;
        const double m = *std::max_element(r, r + E);
        double sum = 0;
        for (int e = 0; e < E; ++e) sum += std::exp(r[e] - m);
        const double f = 2.0 * z_coeff * (std::abs(m) + std::log(sum)) / N;
        for (int e = 0; e < E; ++e) {
          const auto at = static_cast<std::size_t>(t) * E + e;
          c.close(s.dlogits[at], h.dlogits[at], f * std::exp(r[e] - m) / sum, 16, "dlogits",
                  static_cast<long>(at));
        }
      }
      break;
    case capacity: {
      c.equal(s.keep, h.keep, NK, "keep");
      c.equal(s.routed, h.report.routed, static_cast<std::size_t>(E), "routed");
      c.equal(s.dropped, h.report.dropped, static_cast<std::size_t>(E), "dropped");
      c.equal(s.padded, h.report.padded, static_cast<std::size_t>(E), "padded");
      c.equal(s.kept, h.kept_experts, NK, "kept record");
      std::vector<int> dispatched;
      for (std::size_t e = 0; e < static_cast<std::size_t>(E); ++e)
        dispatched.push_back(h.counts.dispatched(e));
      c.equal(s.dispatched, dispatched, static_cast<std::size_t>(E), "dispatched");
      c.equal(s.totals,
              std::vector<long long>{h.counts.dropped_pairs, h.counts.fully_dropped_tokens}, 2,
              "totals (dropped pairs, fully dropped tokens)");
      break;
    }
    case histogram:
      c.equal(s.hist, h.hist, static_cast<std::size_t>(E), "counts");
      c.equal(s.fault, h.fault, 2, "fault");
      break;
    case scan:
      c.equal(s.scan_out, h.offsets, static_cast<std::size_t>(E), "offsets");
      c.equal(s.scan_total, std::vector<int>{h.offsets[static_cast<std::size_t>(E)]}, 1, "total");
      break;
    default: break;
  }
  return c.worst;
}

// ---------------------------------------------------------------------------------------------
// Timing.

struct timing {
  double min_us = -1, med_us = -1;
  long calls = 0;  // per batch
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// f() as batches of calls long enough for sub-microsecond resolution (at least target_s each):
// min and median over reps batches, in microseconds per call.
template <class F>
timing time_calls(F&& f, int reps, double target_s, const std::string& what) {
  bool ok = true;
  ok = ok && static_cast<bool>(f());  // warm
  long n = 1;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) ok = ok && static_cast<bool>(f());
    const double t = seconds_since(t0);
    if (t >= target_s || n >= (1L << 26)) break;
    n = t <= 0 ? n * 16
               : std::max(n * 2, static_cast<long>(static_cast<double>(n) * 1.2 * target_s / t));
  }
  std::vector<double> per;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) ok = ok && static_cast<bool>(f());
    per.push_back(seconds_since(t0) * 1e6 / static_cast<double>(n));
  }
  if (!ok) fail(what + ": a call failed while timed");
  std::sort(per.begin(), per.end());
  return {per.front(), per[per.size() / 2], n};
}

struct row {
  std::string size;
  int N, E, K;
  std::string group;
  timing host64, host32, hexec, cexec;
  double worst_ulps = 0;
  bool failed = false;   // the kernels' result was refused (or a call failed): not timed
  bool in_step = false;  // one of the layer step's groups
  bool cpu = false;      // cpu_exec timed too (the README size)
};

std::string fmt(double us) {
  char b[32];
  if (us < 0) return "-";
  if (us < 10)
    std::snprintf(b, sizeof b, "%.3f", us);
  else if (us < 1000)
    std::snprintf(b, sizeof b, "%.1f", us);
  else
    std::snprintf(b, sizeof b, "%.0f", us);
  return b;
}
std::string ratio(double a, double b) {
  if (a < 0 || b <= 0) return "-";
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", a / b);
  return s;
}
std::string json_num(double v) {
  if (v < 0) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}

}  // namespace

int run(int argc, char** argv) {
  int reps = 7;
  bool json = false;
  double target_ms = 2.0;
  std::string group_list, size_list;
  const char* const usage =
      "usage: bench-host-exec-kernels [--reps N] [--json] [--target-ms F] [--groups G,...] "
      "[--sizes S,...]\n"
      "  groups: router-fwd router-bwd aux-fwd aux-bwd z-fwd z-bwd capacity histogram scan\n"
      "  sizes: suite-min readme suite-max large large-block\n";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--json")
      json = true;
    else if (a == "--target-ms" && i + 1 < argc)
      target_ms = std::max(0.01, std::atof(argv[++i]));
    else if (a == "--groups" && i + 1 < argc)
      group_list = argv[++i];
    else if (a == "--sizes" && i + 1 < argc)
      size_list = argv[++i];
    else {
      std::fprintf(stderr, "%s", usage);
      return 2;
    }
  }
  // --groups / --sizes: comma-separated keys (group_keys, the size names); all by default.
  const auto listed = [](const std::string& list, const std::string& key) {
    if (list.empty()) return true;
    const std::string l = "," + list + ",";
    return l.find("," + key + ",") != std::string::npos;
  };
  bool wanted_group[groups];
  for (int g = 0; g < groups; ++g) wanted_group[g] = listed(group_list, group_keys[g]);
  int failures = 0;
  const double target_s = target_ms * 1e-3;
  // What a launch itself costs: an independent body (record_fault_kernel: a block of 32 threads,
  // one of which works) and a team body with nothing to do (z_loss_total_kernel over 0 tokens).
  std::array<timing, 4> launches{};
  {
    std::vector<int> ids{3}, fault{2147483647, 0}, valid{0};
    std::vector<float> loss{0.0f};
    const k::record_fault_kernel rf{.ids = ids.data(), .fault = fault.data()};
    const k::z_loss_total_kernel<> zt{.lse = nullptr,
                                      .padding = nullptr,
                                      .num_tokens = 0,
                                      .coeff = 1.0f,
                                      .loss = loss.data(),
                                      .valid = valid.data()};
    const launch_grid one{.blocks = 1}, one_smem{.blocks = 1, .smem_bytes = zt.smem_bytes};
    launches[0] = time_calls([&] { return launch(host_exec{}, one, rf); }, reps, target_s,
                             "record_fault on host_exec");
    launches[1] = time_calls([&] { return launch(host_exec{}, one_smem, zt); }, reps, target_s,
                             "z_loss_total on host_exec");
    launches[2] = time_calls([&] { return launch(cpu_exec{seed}, one, rf); }, reps, target_s,
                             "record_fault on cpu_exec");
    launches[3] = time_calls([&] { return launch(cpu_exec{seed}, one_smem, zt); }, reps, target_s,
                             "z_loss_total on cpu_exec");
  }
  std::vector<row> rows;
  for (const auto& sz : sizes) {
    if (!listed(size_list, sz.name)) continue;
    inputs in = make_inputs(sz);
    // The capacity's and the histogram's record: the float host router's selection.
    {
      auto r = host_topk_router<float>::make({.num_experts = in.E, .topk = in.K});
      topk_routing<float> rt;
      must(r->route(std::span<const float>(in.logits), rt), "route");
      in.route_ids = rt.indices;
      in.route_probs = rt.probs;
    }
    host_state<double> h64 = make_host<double>(in);
    host_state<float> h32 = make_host<float>(in);
    host_loops<double> host64(in, h64);
    host_loops<float> host32(in, h32);
    kernel_state ks = make_kernel_state(in);
    kernel_groups<host_exec> hx{host_exec{}, in, ks};
    kernel_state cs = make_kernel_state(in);
    kernel_groups<cpu_exec> cx{cpu_exec{seed}, in, cs};

    const std::string where = std::string(sz.name) + " (N " + std::to_string(in.N) + ", E " +
                              std::to_string(in.E) + ", k " + std::to_string(in.K) + ")";
    // The host loops once, in a step's order (what each group takes from the one before), then
    // the kernels' inputs from the float host loop's results: each group stands alone.
    for (int gi = 0; gi < groups; ++gi) {
      const auto g = static_cast<group>(gi);
      must(host64.run(g), where + " " + group_names[g] + " (host f64)");
      must(host32.run(g), where + " " + group_names[g] + " (host f32)");
    }
    for (kernel_state* st : {&ks, &cs}) {
      st->bwd_indices = h32.routing.indices;
      st->bwd_dscores = h32.term.dscores;
      st->bwd_lse.resize(static_cast<std::size_t>(in.N));
      for (int t = 0; t < in.N; ++t)
        st->bwd_lse[static_cast<std::size_t>(t)] =
            detail::logsumexp(std::span<const float>(in.logits).subspan(
                static_cast<std::size_t>(t) * in.E, static_cast<std::size_t>(in.E)));
      st->bwd_valid.assign(1, in.N);
      st->scan_in = h32.hist;
    }
    bool step_complete = true, step_failed = false;
    const std::size_t first_row = rows.size();
    for (int gi = 0; gi < groups; ++gi) {
      const auto g = static_cast<group>(gi);
      if (!wanted_group[gi]) {
        step_complete = step_complete && !in_step[gi];
        continue;
      }
      row r{sz.name, in.N, in.E,  in.K,        group_names[g],  {}, {}, {},
            {},      0,    false, in_step[gi], sz.with_cpu_exec};
      const std::string what = where + " " + group_names[g];
      try {
        // Once on fresh gradients, then checked (a backward adds to dlogits; the router
        // backward writes all of it).
        std::fill(h64.dlogits.begin(), h64.dlogits.end(), 0.0);
        std::fill(h32.dlogits.begin(), h32.dlogits.end(), 0.0f);
        std::fill(ks.dlogits.begin(), ks.dlogits.end(), 0.0f);
        std::fill(cs.dlogits.begin(), cs.dlogits.end(), 0.0f);
        must(host64.run(g), what + " (host f64)");
        must(host32.run(g), what + " (host f32)");
        must(hx.run(g), what + " (host_exec)");
        r.worst_ulps = verify(g, in, ks, h32, h64, where + " host_exec");
        if (sz.with_cpu_exec) {
          must(cx.run(g), what + " (cpu_exec)");
          r.worst_ulps = std::max(r.worst_ulps, verify(g, in, cs, h32, h64, where + " cpu_exec"));
        }
      } catch (const bench_failure& f) {
        std::printf("FAIL: %s\n", f.what.c_str());
        std::fflush(stdout);
        r.failed = true;
        step_failed = step_failed || in_step[gi];
        ++failures;
      }
      // The host loops are timed either way; the kernels only when their result was right.
      r.host64 = time_calls([&] { return host64.run(g); }, reps, target_s, what + " host f64");
      r.host32 = time_calls([&] { return host32.run(g); }, reps, target_s, what + " host f32");
      if (!r.failed) {
        r.hexec = time_calls([&] { return hx.run(g); }, reps, target_s, what + " host_exec");
        if (sz.with_cpu_exec)
          r.cexec = time_calls([&] { return cx.run(g); }, reps, target_s, what + " cpu_exec");
      }
      rows.push_back(r);
    }
    // The layer step: the groups the README example runs per forward + backward (only when
    // every one of them was measured here; a failed one leaves the kernels' sum out).
    if (!step_complete) continue;
    row step{sz.name, in.N, in.E,        in.K,  "layer step",    {}, {}, {},
             {},      0,    step_failed, false, sz.with_cpu_exec};
    auto add = [](timing& a, const timing& b) {
      if (b.min_us < 0) return;
      a.min_us = (a.min_us < 0 ? 0 : a.min_us) + b.min_us;
      a.med_us = (a.med_us < 0 ? 0 : a.med_us) + b.med_us;
    };
    for (std::size_t i = first_row; i < rows.size(); ++i) {
      if (!rows[i].in_step) continue;
      add(step.host64, rows[i].host64);
      add(step.host32, rows[i].host32);
      if (!step_failed) {
        add(step.hexec, rows[i].hexec);
        add(step.cexec, rows[i].cexec);
      }
      step.worst_ulps = std::max(step.worst_ulps, rows[i].worst_ulps);
    }
    rows.push_back(step);
  }

  // The table: min (median) in microseconds per call; ratios of the minima.
  std::printf(
      "host_exec kernel bodies vs today's host loops: us per call, min (median) of %d "
      "batches; kernels fp32\n",
      reps);
  std::printf(
      "one launch, us: independent body (record_fault_kernel, 1 block of 32) host_exec "
      "%s (%s), cpu_exec %s (%s); team body (z_loss_total_kernel, 0 tokens) host_exec %s "
      "(%s), cpu_exec %s (%s)\n",
      fmt(launches[0].min_us).c_str(), fmt(launches[0].med_us).c_str(),
      fmt(launches[2].min_us).c_str(), fmt(launches[2].med_us).c_str(),
      fmt(launches[1].min_us).c_str(), fmt(launches[1].med_us).c_str(),
      fmt(launches[3].min_us).c_str(), fmt(launches[3].med_us).c_str());
  std::printf("%-12s %5s %4s %2s  %-12s %17s %17s %17s %7s %7s %17s %8s %6s\n", "size", "N", "E",
              "k", "group", "host f64", "host f32", "host_exec", "hx/f64", "hx/f32", "cpu_exec",
              "cx/hx", "ulps");
  std::string last;
  for (const auto& r : rows) {
    if (r.size != last && !last.empty()) std::printf("\n");
    last = r.size;
    auto cell = [&r](const timing& t, bool timed = true) {
      if (t.min_us < 0) return std::string(r.failed && timed ? "FAILED" : "-");
      return fmt(t.min_us) + " (" + fmt(t.med_us) + ")";
    };
    std::printf("%-12s %5d %4d %2d  %-12s %17s %17s %17s %7s %7s %17s %8s %6.2f\n", r.size.c_str(),
                r.N, r.E, r.K, r.group.c_str(), cell(r.host64).c_str(), cell(r.host32).c_str(),
                cell(r.hexec).c_str(), ratio(r.hexec.min_us, r.host64.min_us).c_str(),
                ratio(r.hexec.min_us, r.host32.min_us).c_str(), cell(r.cexec, r.cpu).c_str(),
                ratio(r.cexec.min_us, r.hexec.min_us).c_str(), r.worst_ulps);
  }
  std::printf(
      "\nlayer step: router fwd + bwd, aux loss fwd + bwd, capacity, histogram, scan (the "
      "README example's groups; its z-loss is off)\n");
  std::printf(
      "ulps: the worst kernel-vs-host-f32 difference seen, in fp32 ulps of the value's "
      "condition (indices, maps, keep decisions and counts checked exactly)\n");
  if (json) {
    const char* const launch_names[4] = {"record_fault host_exec", "z_loss_total host_exec",
                                         "record_fault cpu_exec", "z_loss_total cpu_exec"};
    for (int i = 0; i < 4; ++i)
      std::printf("{\"launch\":\"%s\",\"min_us\":%s,\"med_us\":%s}\n", launch_names[i],
                  json_num(launches[static_cast<std::size_t>(i)].min_us).c_str(),
                  json_num(launches[static_cast<std::size_t>(i)].med_us).c_str());
  }
  if (json)
    for (const auto& r : rows)
      std::printf(
          "{\"size\":\"%s\",\"N\":%d,\"E\":%d,\"k\":%d,\"group\":\"%s\","
          "\"host_f64_min_us\":%s,\"host_f64_med_us\":%s,"
          "\"host_f32_min_us\":%s,\"host_f32_med_us\":%s,"
          "\"host_exec_min_us\":%s,\"host_exec_med_us\":%s,"
          "\"cpu_exec_min_us\":%s,\"cpu_exec_med_us\":%s,\"worst_ulps\":%.3f,"
          "\"failed\":%s}\n",
          r.size.c_str(), r.N, r.E, r.K, r.group.c_str(), json_num(r.host64.min_us).c_str(),
          json_num(r.host64.med_us).c_str(), json_num(r.host32.min_us).c_str(),
          json_num(r.host32.med_us).c_str(), json_num(r.hexec.min_us).c_str(),
          json_num(r.hexec.med_us).c_str(), json_num(r.cexec.min_us).c_str(),
          json_num(r.cexec.med_us).c_str(), r.worst_ulps, r.failed ? "true" : "false");
  if (failures > 0) {
    std::printf("%d group(s) failed their check: their kernels were not timed\n", failures);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const bench_failure& f) {  // outside a group: the host loops or a launch's timing
    std::printf("FAIL: %s\n", f.what.c_str());
    return 1;
  }
}
