// One rank of moe_layer on any execution context and communicator (cpu_exec over the
// device-space thread world in layer-moe-layer-cpu-exec; stream_order_exec there too; cuda_exec
// over the loopback world in the GPU check): the weights of layer_harness.hpp uploaded to the
// context, forward, backward (seed 1), gradients reduced, everything read back and widened; the
// drop counts checked against the records and the host waits counted (one device-to-host copy
// per forward where the collectives need the counts, none in pad mode, none with EP = ETP = 1
// dropless, none in the backward).
#pragma once

#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_variant.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/experts/mlp_experts.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "../dispatch/device_round_trip.hpp"
#include "layer_harness.hpp"

namespace moefold::test {

template <class T>
std::vector<double> widen_all(const std::vector<T>& v) {
  return widen(std::span<const T>(v));
}

// The options both layers run with (layer_harness.hpp's: softmax top-k, aux and z-loss).
inline moe_layer_options options_of(const problem& p, const dynamic_folded_mesh& fold) {
  return {.hidden = p.hidden,
          .max_tokens = p.tokens,
          .ep = fold.ep(),
          .etp = fold.etp(),
          .router = {.num_experts = p.experts, .topk = p.topk},
          .aux_loss_coeff = aux_coeff,
          .z_loss_coeff = z_coeff};
}

// Whether a policy's decision is the tp-cp group's (full sequence), and its capacity rule
// (capacity factor, pad mode, what decides) as sub_sequence holds it.
inline bool group_drop(const drop_policy_variant& d) {
  return std::holds_alternative<full_sequence>(d.policy);
}
inline sub_sequence capacity_rule(const drop_policy_variant& d) {
  if (const auto* s = std::get_if<sub_sequence>(&d.policy)) return *s;
  if (const auto* f = std::get_if<full_sequence>(&d.policy))
    return {
        .capacity_factor = f->capacity_factor, .pad_to_capacity = f->pad_to_capacity, .by = f->by};
  return {};
}

// Rank r's tokens' true sequence keys (sequence_order_keys of its attention tp and cp
// coordinates; one sequence per micro-batch, N tokens of it per rank).
inline std::vector<std::int64_t> sequence_keys(const problem& p, const dynamic_folded_mesh& fold,
                                               int r) {
  const auto a = fold.attention_coord_of(r);
  return sequence_order_keys({.tp_rank = a.tp,
                              .tp = fold.tp(),
                              .cp_rank = a.cp,
                              .cp = fold.cp(),
                              .local_seq = p.tokens,
                              .batch = 1})
      .value();
}

// The drop counts of a forward against what its records say, recomputed on the host: routed
// pairs per expert from the router's record, kept ones from the kept record, the totals; with
// this rank's decision (sub-sequence) none kept beyond C and in pad mode exactly C rows per expert
// (kept + fillers). A group's decision (full sequence) is checked over the group by the caller
// from res.capacity and res.rows_per_expert.
template <class Exec, class Layer, class Stats>
status check_drop_counts(Exec& x, const Layer& layer, const Stats& stats, const problem& p,
                         const drop_policy_variant& policy, layer_result& res) {
  const sub_sequence drop = capacity_rule(policy);
  const bool group = group_drop(policy);
  const int E = p.experts;
  if (!stats.capacity || stats.drop_totals.empty())
    return make_error(errc::invalid_argument, "a forward with a drop policy reports no capacity");
  const int C = *stats.capacity;
  TRY_ASSIGN(routed, (download<int>(x, stats.counts.subrows(0, 1))));
  TRY_ASSIGN(dropped, (download<int>(x, stats.counts.subrows(1, 1))));
  TRY_ASSIGN(padded, (download<int>(x, stats.counts.subrows(2, 1))));
  TRY_ASSIGN(totals, (download<long long>(x, stats.drop_totals)));
  std::vector<int> want_routed(static_cast<std::size_t>(E)), kept(static_cast<std::size_t>(E));
  for (int id : res.indices) ++want_routed[static_cast<std::size_t>(id)];
  long long lost = 0, dropped_pairs = 0;
  for (std::size_t t = 0; t * static_cast<std::size_t>(p.topk) < res.kept.size(); ++t) {
    bool any = false;
    for (int i = 0; i < p.topk; ++i) {
      const int id = res.kept[t * static_cast<std::size_t>(p.topk) + static_cast<std::size_t>(i)];
      if (id >= 0) ++kept[static_cast<std::size_t>(id)];
      any = any || id >= 0;
    }
    lost += any ? 0 : 1;
  }
  for (int e = 0; e < E; ++e) {
    const auto i = static_cast<std::size_t>(e);
    dropped_pairs += (*dropped)[i];
    const bool ok = (*routed)[i] == want_routed[i] && kept[i] == (*routed)[i] - (*dropped)[i] &&
                    (group ? kept[i] <= C && kept[i] + (*padded)[i] <= C
                           : kept[i] == std::min(want_routed[i], C) &&
                                 (!drop.pad_to_capacity || kept[i] + (*padded)[i] == C)) &&
                    (drop.pad_to_capacity || (*padded)[i] == 0);
    if (!ok)
      return make_error(errc::invalid_argument,
                        "expert " + std::to_string(e) + ": routed " + std::to_string((*routed)[i]) +
                            ", dropped " + std::to_string((*dropped)[i]) + ", padded " +
                            std::to_string((*padded)[i]) + ", kept " + std::to_string(kept[i]) +
                            " with capacity " + std::to_string(C));
  }
  if ((*totals)[0] != dropped_pairs || (*totals)[1] != lost)
    return make_error(errc::invalid_argument, "the drop totals do not match the counts");
  // Pad mode's static shape: C rows per expert from every rank of the tp-ep group.
  const auto fold = make_folded(p.fold).value();
  if (drop.pad_to_capacity && layer.last_dispatch().num_rows() != C * E * fold.etp())
    return make_error(errc::invalid_argument, "pad mode: the experts got " +
                                                  std::to_string(layer.last_dispatch().num_rows()) +
                                                  " rows, not C E etp");
  res.dropped = dropped_pairs;
  res.capacity = C;
  res.rows_per_expert.resize(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    res.rows_per_expert[static_cast<std::size_t>(e)] =
        kept[static_cast<std::size_t>(e)] + (*padded)[static_cast<std::size_t>(e)];
  return {};
}

// One rank's parameters on the context: the experts' weights of layer_harness.hpp in the
// library's layout (from the host reference expert's loader) and the router weight, with zeroed
// gradients.
template <class T, class Exec>
struct simt_rank_params {
  using G = main_grad_t<T>;
  exec_buffer<T, Exec> fc1, fc2, w;  // [L 2 F/etp, H], [L H, F/etp], [E, H]
  exec_buffer<G, Exec> g1, g2, dw;   // their gradients
};
template <class T, class Exec>
expected<simt_rank_params<T, Exec>> upload_rank_params(const problem& p,
                                                       const dynamic_folded_mesh& fold, int r,
                                                       Exec& x) {
  using G = main_grad_t<T>;
  const int H = p.hidden, E = p.experts, L = E / fold.ep(), fs = p.ffn / fold.etp();
  const data w = make_weights(p);
  TRY_ASSIGN(ref, (rank_experts<T, float>(p, fold, r, w.w1, w.w2)));
  const std::vector<T> fc1(ref->weights_fc1().begin(), ref->weights_fc1().end());
  const std::vector<T> fc2(ref->weights_fc2().begin(), ref->weights_fc2().end());
  const auto wr = router_weight(p);
  TRY_ASSIGN(d_fc1, upload(x, fc1, L * 2 * fs, H));
  TRY_ASSIGN(d_fc2, upload(x, fc2, L * H, fs));
  TRY_ASSIGN(d_w, upload(x, cast<T>(wr), E, H));
  TRY_ASSIGN(d_g1, upload(x, std::vector<G>(fc1.size(), G(0)), L * 2 * fs, H));
  TRY_ASSIGN(d_g2, upload(x, std::vector<G>(fc2.size(), G(0)), L * H, fs));
  TRY_ASSIGN(d_dw, upload(x, std::vector<G>(wr.size(), G(0)), E, H));
  return simt_rank_params<T, Exec>{std::move(*d_fc1), std::move(*d_fc2), std::move(*d_w),
                                   std::move(*d_g1),  std::move(*d_g2),  std::move(*d_dw)};
}
// The experts the layer runs on a context in these tests: mlp_experts on the context with the
// GEMM policy Gemms (simt_gemm by default: on cpu_exec and cuda_exec the same bits), fp32
// probabilities.
template <class T, class Exec, class Gemms = simt_gemms>
using simt_rank_experts = mlp_experts<T, Exec, Gemms, main_grad_t<T>, float>;

// The rank's experts (SwiGLU, its ETP shard) over those parameters; `o`: whether they save fc1's
// output (the default) or recompute it.
template <class T, class Gemms = simt_gemms, class Exec>
expected<simt_rank_experts<T, Exec, Gemms>> rank_mlp(const problem& p,
                                                     const dynamic_folded_mesh& fold, int r, Exec&,
                                                     simt_rank_params<T, Exec>& par,
                                                     mlp_experts_options o = {}) {
  return simt_rank_experts<T, Exec, Gemms>::make({.hidden = p.hidden,
                                                  .ffn = p.ffn,
                                                  .num_local_experts = p.experts / fold.ep(),
                                                  .etp = fold.etp(),
                                                  .etp_rank = fold.moe_coord_of(r).etp,
                                                  .act = activation::swiglu},
                                                 {par.fc1.cview(), par.fc2.cview()},
                                                 {par.g1.view(), par.g2.view()}, o);
}

// What a rank starts from: its communicators (split from the world), its parameters and
// experts on the context (the weights of layer_harness.hpp), its tokens on the host and uploaded,
// the output buffers, and (`keys`) its tokens' true sequence keys for full-sequence dropping.
template <class T, class Exec, class Comm, class Gemms = simt_gemms>
struct layer_rank_setup {
  using space = typename Exec::memory_space;
  dynamic_folded_mesh fold;
  moe_layer_communicators<Comm> comms;  // the layer holds it by reference: not moved after make
  simt_rank_params<T, Exec> par;
  std::optional<simt_rank_experts<T, Exec, Gemms>> mlp;  // moved into the layer
  std::vector<T> xs, douts;                              // [N, H] on the host
  exec_buffer<T, Exec> x, dout, out, dx;                 // [N, H]
  std::optional<exec_buffer<std::int64_t, Exec>> keys;   // [N, 1]; none: the group's rank order

  [[nodiscard]] row_view<const std::int64_t, space> key_view() const {
    return keys ? keys->cview() : row_view<const std::int64_t, space>{};
  }
};

template <class T, class Gemms = simt_gemms, class Exec, class Comm>
expected<layer_rank_setup<T, Exec, Comm, Gemms>> make_layer_rank_setup(
    const problem& p, Comm& world, Exec& x, bool keys, mlp_experts_options experts = {}) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int r = world.rank(), H = p.hidden;
  TRY_ASSIGN(comms, make_layer_communicators(world, groups));
  TRY_ASSIGN(par, (upload_rank_params<T>(p, fold, r, x)));
  TRY_ASSIGN(mlp, (rank_mlp<T, Gemms>(p, fold, r, x, *par, experts)));
  std::vector<T> xs, douts;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    for (double v : d.x) xs.push_back(static_cast<T>(v));
    for (double v : d.dout) douts.push_back(static_cast<T>(v));
  }
  TRY_ASSIGN(d_x, upload(x, xs, p.tokens, H));
  std::optional<exec_buffer<std::int64_t, Exec>> d_keys;
  if (keys) {
    TRY_ASSIGN(k, upload(x, sequence_keys(p, fold, r), p.tokens, 1));
    d_keys = std::move(*k);
  }
  TRY_ASSIGN(d_dout, upload(x, douts, p.tokens, H));
  TRY_ASSIGN(d_out, (exec_buffer<T, Exec>::make(x, p.tokens, H)));
  TRY_ASSIGN(d_dx, (exec_buffer<T, Exec>::make(x, p.tokens, H)));
  return layer_rank_setup<T, Exec, Comm, Gemms>{.fold = fold,
                                                .comms = std::move(*comms),
                                                .par = std::move(*par),
                                                .mlp = std::move(*mlp),
                                                .xs = std::move(xs),
                                                .douts = std::move(douts),
                                                .x = std::move(*d_x),
                                                .dout = std::move(*d_dout),
                                                .out = std::move(*d_out),
                                                .dx = std::move(*d_dx),
                                                .keys = std::move(d_keys)};
}

// The layer's output and input gradient, the router's and the experts' (reduced) gradients read
// back from the context, widened.
template <class T, class Exec, class Comm, class Gemms>
status read_back(Exec& x, const layer_rank_setup<T, Exec, Comm, Gemms>& in, layer_result& res) {
  using G = main_grad_t<T>;
  TRY_ASSIGN(out, (download<T>(x, in.out.cview())));
  TRY_ASSIGN(dx, (download<T>(x, in.dx.cview())));
  TRY_ASSIGN(dw, (download<G>(x, in.par.dw.cview())));
  TRY_ASSIGN(g1, (download<G>(x, in.par.g1.cview())));
  TRY_ASSIGN(g2, (download<G>(x, in.par.g2.cview())));
  res.out = widen_all(*out);
  res.dx = widen_all(*dx);
  res.dw_router = widen_all(*dw);
  res.dw1 = widen_all(*g1);
  res.dw2 = widen_all(*g2);
  return {};
}

// The layer these tests run on a context: the drop policies through one type, the dispatcher
// with fp32 probabilities, mlp_experts on the context, the router and the experts on the GEMM
// policy Gemms.
template <class T, template <class, class, class, class> class Disp, class Exec, class Comm,
          class Gemms = simt_gemms>
using device_layer_t =
    moe_layer<T, Exec, Comm, drop_policy_variant, Disp<T, Comm, Exec, float>,
              simt_rank_experts<T, Exec, Gemms>, topk_router<T, Exec, accumulator_t<T>, Gemms>>;

// One rank's layer on the context: the weights of layer_harness.hpp uploaded (the router weight
// bound from the caller's buffers), forward, backward (seed 1), gradients reduced; everything
// read back and widened. `drop`: none (dropless), or a policy; `keys`: full-sequence dropping in
// true sequence order (sequence_keys), not the group's rank order; `experts`: the experts save
// fc1's output (the default) or recompute it. Checked on the way: the layer's buffers are those
// it sized at make, and what it reports saving per received row.
template <class T, template <class, class, class, class> class Disp, class Gemms = simt_gemms,
          class Exec, class Comm>
expected<layer_result> run_device_rank(const problem& p, Comm& world, Exec& x,
                                       const std::optional<drop_policy_variant>& drop,
                                       bool keys = false, mlp_experts_options experts = {}) {
  using layer_t = device_layer_t<T, Disp, Exec, Comm, Gemms>;
  const auto copies = [&x] {
    if constexpr (counts_copies<Exec>)
      return x.copies();
    else
      return copy_counts{};
  };
  TRY_ASSIGN(in, (make_layer_rank_setup<T, Gemms>(p, world, x, keys, experts)));
  const auto& fold = in->fold;
  const auto& xs = in->xs;
  const int H = p.hidden;
  TRY_ASSIGN(layer, (layer_t::make(x, options_of(p, fold), in->comms, drop.value_or(dropless{}),
                                   std::move(*in->mlp))));
  TRY(layer->bind_parameters(
      {.router_weight = in->par.w.view(), .router_grad = in->par.dw.view()}));
  // Per received row the experts save their pre-activation, F1 = 2 F / ETP values of T (SwiGLU),
  // unless they recompute fc1; the dispatcher its copy of the row and its probability (a row of
  // H values padded to 16 bytes, a float).
  TRY_ASSIGN(rates, layer->saved_bytes_per_row());
  const std::size_t f1_bytes = 2 * detail::uz(p.ffn / fold.etp()) * sizeof(T),
                    row_bytes = detail::uz(H) * sizeof(T) + sizeof(float);
  if (rates->experts_per_row != (experts.recompute_fc1 ? 0 : f1_bytes) ||
      rates->per_received_row < rates->experts_per_row + row_bytes ||
      rates->per_received_row > rates->experts_per_row + row_bytes + 16 ||
      rates->per_token < detail::uz(H) * sizeof(T) + detail::uz(p.experts) * sizeof(float))
    return make_error(errc::invalid_argument,
                      "saved bytes per received row " + std::to_string(rates->per_received_row) +
                          " (experts " + std::to_string(rates->experts_per_row) + "), per token " +
                          std::to_string(rates->per_token) + ": not the parts' sizes");
  const dispatch_workspace_bytes made = layer->workspace_sizes();
  const copy_counts before = copies();
  TRY_ASSIGN(stats, layer->forward(x, in->x.cview(), in->key_view(), in->out.view()));
  const copy_counts after_forward = copies();
  // The one-in-flight form's storage was sized at make for every forward (pad mode's largest
  // capacity included): the forward grew nothing.
  if (const dispatch_workspace_bytes now = layer->workspace_sizes();
      now.saved != made.saved || now.scratch != made.scratch || now.host != made.host)
    return make_error(errc::invalid_argument, "the forward grew the layer's storage");
  // Dropless with EP = ETP = 1 on a context that runs kernels (either dispatcher): the batch is
  // the N k rows and its row ranges stay on the context (no count comes back).
  const bool unsharded = runs_kernels_v<Exec> && !drop && fold.ep() * fold.etp() == 1;
  if (const auto& hd = layer->last_dispatch();
      unsharded && (!hd.batch_counts().empty() || hd.batch_offsets().empty() ||
                    hd.num_rows() != p.tokens * p.topk))
    return make_error(errc::invalid_argument,
                      "EP = ETP = 1 dropless: the batch is not N k rows with its row ranges on "
                      "the context");
  // Nothing was left to the device: the keys were good, the record whole (a wait of its own,
  // outside the forward's and the backward's counts).
  TRY(layer->device_status(x));
  layer_result res;
  // The stats are values on the context: one copy when the test reads them.
  TRY_ASSIGN(values, read_forward_stats(x, *stats));
  TRY_ASSIGN(losses, (download<float>(x, stats->losses)));
  if (losses->size() != moe_loss_count)
    return make_error(errc::invalid_argument, "the training forward gave no loss values");
  res.aux = values->aux_loss;
  res.z = values->z_loss;
  TRY_ASSIGN(idx, (download<int>(x, layer->last_context().indices())));
  res.indices = *idx;
  TRY_ASSIGN(kept, (download<int>(x, layer->last_kept_experts())));
  res.kept = *kept;
  if (drop && !std::holds_alternative<dropless>(drop->policy)) {
    TRY(check_drop_counts(x, *layer, *stats, p, *drop, res));
  } else if (res.kept != res.indices || stats->capacity || values->dropped.dropped_pairs != 0) {
    return make_error(errc::invalid_argument, "the dropless layer reports a drop");
  }
  // The saved input starts every row 16 bytes apart (H padded up) and is the forward's, bit for
  // bit (read before the backward, which releases it).
  const auto kept_x = layer->last_context().input();
  if (kept_x.rows() != p.tokens || kept_x.width() != H ||
      (kept_x.stride() * static_cast<std::int64_t>(sizeof(T))) % 16 != 0 ||
      kept_x.stride() >= kept_x.width() + static_cast<std::int64_t>(16 / sizeof(T)))
    return make_error(errc::invalid_argument,
                      "the kept input is not [N, H] with a row stride of H padded to 16 bytes "
                      "(stride " +
                          std::to_string(kept_x.stride()) + ")");
  TRY_ASSIGN(kept_host, (download<T>(x, kept_x)));
  if (!std::equal(kept_host->begin(), kept_host->end(), xs.begin(), xs.end(),
                  [](T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }))
    return make_error(errc::invalid_argument, "the kept input differs from the forward's");
  const copy_counts before_backward = copies();
  TRY(layer->backward(x, in->dout.cview(), 1.0f, in->dx.view()));
  // The host waits: one copy of the counts per forward where the collectives need them, none in
  // pad mode, none in the backward; none at all in the unsharded case above.
  const long long forward_waits = after_forward.to_host - before.to_host,
                  backward_waits = copies().to_host - before_backward.to_host;
  const long long want_forward =
      (drop && capacity_rule(*drop).pad_to_capacity) || unsharded ? 0 : 1;
  if (forward_waits != want_forward || backward_waits != 0)
    return make_error(errc::invalid_argument, "device-to-host copies: forward " +
                                                  std::to_string(forward_waits) + " (want " +
                                                  std::to_string(want_forward) + "), backward " +
                                                  std::to_string(backward_waits) + " (want 0)");
  TRY(layer->reduce_gradients(x));  // the experts' own gradient views
  TRY(read_back(x, *in, res));
  return res;
}

// One forward's storage on a context (a forward in flight keeps it until its backward), sized by
// the layer's saved_sizes for the capacity pad mode will report (its rows grow with it; `group`:
// the ranks whose tokens a full-sequence decision sees).
template <class Exec>
struct forward_storage {
  exec_buffer<std::byte, Exec> saved;
  std::size_t saved_bytes = 0;
  std::vector<std::byte> host;
  [[nodiscard]] moe_saved_storage view() { return {{saved.view().data(), saved_bytes}, host}; }
};
template <class Layer, class Exec>
expected<forward_storage<Exec>> make_forward_storage(const Layer& layer, Exec& x, const problem& p,
                                                     const std::optional<drop_policy_variant>& drop,
                                                     int group) {
  std::optional<int> cap;
  if (drop && capacity_rule(*drop).pad_to_capacity) {
    TRY_ASSIGN(c, expert_capacity(
                      static_cast<long long>(group_drop(*drop) ? group : 1) * p.tokens * p.topk,
                      p.experts, capacity_rule(*drop).capacity_factor));
    cap = *c;
  }
  const moe_saved_bytes sb = layer.saved_sizes(cap);
  TRY_ASSIGN(b, (exec_buffer<std::byte, Exec>::make(
                    x, 1, static_cast<std::int64_t>(std::max<std::size_t>(sb.saved, 1)))));
  return forward_storage<Exec>{std::move(*b), sb.saved, std::vector<std::byte>(sb.host)};
}

// Two micro-batches through one rank's layer: one after the other on `x0`, or in flight on two
// execution contexts used alternately (the first forward on x0, the second on x1, then the
// second's backward on x1 and the first's on x0; two streams on a GPU), each forward with its own
// forward context and storage. The outputs, input gradients and accumulated gradients of a run.
struct two_batches {
  std::vector<double> out[2], dx[2], dw_router, dw1, dw2;
};
template <class T, template <class, class, class, class> class Disp, class Exec, class Comm>
expected<two_batches> run_two_batches(const problem& p, Comm& world, Exec& x0, Exec& x1,
                                      const std::optional<drop_policy_variant>& drop,
                                      bool in_flight) {
  using layer_t = device_layer_t<T, Disp, Exec, Comm>;
  const int H = p.hidden;
  TRY_ASSIGN(in, (make_layer_rank_setup<T>(p, world, x0, false)));
  TRY_ASSIGN(layer, (layer_t::make(x0, options_of(p, in->fold), in->comms,
                                   drop.value_or(dropless{}), std::move(*in->mlp))));
  TRY(layer->bind_parameters(
      {.router_weight = in->par.w.view(), .router_grad = in->par.dw.view()}));
  // The second micro-batch: the first's tokens reversed (other routing, the same sizes).
  std::vector<T> xs2(in->xs.rbegin(), in->xs.rend()), d2(in->douts.rbegin(), in->douts.rend());
  TRY_ASSIGN(x2, upload(x0, xs2, p.tokens, H));
  TRY_ASSIGN(dout2, upload(x0, d2, p.tokens, H));
  TRY_ASSIGN(out2, (exec_buffer<T, Exec>::make(x0, p.tokens, H)));
  TRY_ASSIGN(dx2, (exec_buffer<T, Exec>::make(x0, p.tokens, H)));
  TRY(x0.synchronize());  // the uploads are there before x1 reads them
  const row_view<const T, typename Exec::memory_space> xin[2] = {in->x.cview(), x2->cview()},
                                                       dout[2] = {in->dout.cview(), dout2->cview()};
  const row_view<T, typename Exec::memory_space> out[2] = {in->out.view(), out2->view()},
                                                 dx[2] = {in->dx.view(), dx2->view()};
  Exec* ex[2] = {&x0, in_flight ? &x1 : &x0};
  if (in_flight) {
    std::vector<forward_storage<Exec>> storage;
    for (int m = 0; m < 2; ++m) {
      TRY_ASSIGN(st, make_forward_storage(*layer, *ex[m], p, drop, in->comms.tp_cp.size()));
      storage.push_back(std::move(*st));
    }
    typename layer_t::context_type c[2];
    for (int m = 0; m < 2; ++m)
      TRY(layer->forward(*ex[m], xin[m], {}, out[m], c[m], storage[m].view()));
    // The backwards accumulate into the same gradient buffers: the second's (on x1) is finished
    // before the first's (on x0) starts, as a trainer orders its streams with an event.
    TRY(layer->backward(*ex[1], c[1], dout[1], {}, dx[1]));
    TRY(ex[1]->synchronize());
    TRY(layer->backward(*ex[0], c[0], dout[0], {}, dx[0]));
  } else {
    for (int m = 0; m < 2; ++m) {
      TRY(layer->forward(x0, xin[m], {}, out[m]));
      TRY(layer->backward(x0, dout[m], 1.0f, dx[m]));
    }
  }
  two_batches res;
  for (int m = 0; m < 2; ++m) {
    TRY_ASSIGN(o, (download<T>(x0, row_view<const T, typename Exec::memory_space>(out[m]))));
    TRY_ASSIGN(d, (download<T>(x0, row_view<const T, typename Exec::memory_space>(dx[m]))));
    res.out[m] = widen_all(*o);
    res.dx[m] = widen_all(*d);
  }
  layer_result g;
  TRY(read_back(x0, *in, g));
  res.dw_router = g.dw_router;
  res.dw1 = g.dw1;
  res.dw2 = g.dw2;
  return res;
}

// The host layer, the same problem (moe_layer on host_exec, reference_mlp experts, the policy;
// `keys`: full-sequence dropping in true sequence order).
template <class T, template <class, class, class, class> class Disp, class Policy = dropless>
std::vector<layer_result> run_host(const problem& p, const Policy& policy = {}, bool keys = false) {
  using D = Disp<T, thread_communicator, host_exec, float>;
  const int W = p.fold.world;
  const auto fold = make_folded(p.fold).value();
  std::vector<layer_result> res(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    const auto k = keys ? sequence_keys(p, fold, world.rank()) : std::vector<std::int64_t>{};
    auto r = run_layer_rank<T, Policy, D>(p, policy, world, k);
    if (!r) return unexpected<error>(r.error());
    res[static_cast<std::size_t>(world.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return res;
}

// Each rank of the two layers: the same routing, values within `tol` normwise.
inline void check_same_layer(const std::vector<layer_result>& dev,
                             const std::vector<layer_result>& host, double tol) {
  REQUIRE(dev.size() == host.size());
  for (std::size_t r = 0; r < dev.size(); ++r) {
    CAPTURE(r);
    const layer_result &a = dev[r], &b = host[r];
    CHECK(a.indices == b.indices);
    CHECK(a.kept == b.kept);
    CHECK(a.dropped == b.dropped);
    CHECK(rel_err(a.out, b.out) <= tol);
    CHECK(rel_err(a.dx, b.dx) <= tol);
    CHECK(rel_err(a.dw_router, b.dw_router) <= tol);
    CHECK(rel_err(a.dw1, b.dw1) <= tol);
    CHECK(rel_err(a.dw2, b.dw2) <= tol);
    CHECK(a.aux == doctest::Approx(b.aux).epsilon(tol));
    CHECK(a.z == doctest::Approx(b.z).epsilon(tol));
  }
}

}  // namespace moefold::test
