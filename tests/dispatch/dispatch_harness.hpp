// Shared by the thread-world and MPI dispatcher tests: deterministic problem data keyed by
// (rank, token), a single-rank fp64 reference written here (a plain loop over tokens and their
// experts with its own SwiGLU math: no permutation, no dispatcher, no reference_mlp code), and the
// per-rank body that runs dispatch, experts, combine and the backward on any communicator.
#pragma once

#include <moefold/comm/group_communicator.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/dispatcher_variant.hpp>
#include <moefold/experts/reference_mlp.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "../support/host_dispatch.hpp"
#include "../support/mlp_layout.hpp"

namespace moefold::test {

struct problem {
  fold_config fold;
  int experts = 4, topk = 2, hidden = 3, ffn = 4, tokens = 5;
  double drop = 0.0;        // fraction of pairs dropped (-1) by the "policy"
  bool empty_rank = false;  // rank 0 of each stage holds no tokens
  int capacity = -1;        // >= 0: pairs beyond it per (rank, expert) in token order are dropped
  bool pad = false;         // dispatch in pad mode with that capacity
  std::optional<int> max_recv_rows{};  // the dispatcher's receive bound (unset: the worst case)
  bool bf16_values = false;  // every generated value rounded to bf16 (the reference is fed the
                             // same values as a bf16 implementation)
};

// v, or v rounded to the nearest bf16 when the problem asks for bf16 values.
inline double value_of(const problem& p, double v) {
  return p.bf16_values ? static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(v))))
                       : v;
}

// E 256, k 8 over EP 64 on 64 ranks (DeepSeek-V3's routing at small H and F): 256 tokens per
// rank, so each EP rank receives about 2,048 rows; the receive bound is twice that, far below the
// worst case of 131,072.
inline problem ep64_problem(int hidden) {
  problem p{.fold = {.world = 64, .ep = 64, .etp = 1}};
  p.experts = 256;
  p.topk = 8;
  p.hidden = hidden;
  p.ffn = hidden;
  p.tokens = 256;
  p.max_recv_rows = 4096;
  return p;
}

// Deterministic data keyed by (rank, token): every rank and the reference generate the same.
struct data {
  int H, F, E, K;
  std::vector<double> w1, w2;  // per expert: [H, 2F] columns [gate | up], [F, H]
  double weight1(int e, int h, int c) const {
    return w1[(static_cast<std::size_t>(e) * H + h) * 2 * F + c];
  }
  double weight2(int e, int c, int h) const {
    return w2[(static_cast<std::size_t>(e) * F + c) * H + h];
  }
};

inline double unit(std::uint64_t a, std::uint64_t b, std::uint64_t c) {  // a hash to [-1, 1)
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull ^
                    (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
                    (c + 17) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  z *= 0xD6E8FEB86659FD93ull;
  z ^= z >> 29;
  return static_cast<double>(z >> 11) / 4503599627370496.0 - 1.0;
}

struct token_data {
  std::vector<double> x;     // [H]
  std::vector<int> expert;   // [K]
  std::vector<double> prob;  // [K]
  std::vector<double> dout;  // [H]
};

inline token_data make_token(const problem& p, int rank, int t) {
  token_data d;
  for (int h = 0; h < p.hidden; ++h) {
    d.x.push_back(value_of(p, unit(1, rank * 1000 + t, h)));
    d.dout.push_back(value_of(p, unit(2, rank * 1000 + t, h)));
  }
  // Distinct experts: a rotation of a hashed start.
  const int start =
      static_cast<int>((unit(3, rank * 1000 + t, 0) + 1) * 0.5 * p.experts) % p.experts;
  const int step = 1 + static_cast<int>((unit(4, rank * 1000 + t, 0) + 1) * 0.5 * (p.experts - 1)) %
                           (p.experts - 1 > 0 ? p.experts - 1 : 1);
  std::vector<int> used;
  int e = start;
  for (int j = 0; j < p.topk; ++j) {
    while (std::find(used.begin(), used.end(), e) != used.end()) e = (e + 1) % p.experts;
    used.push_back(e);
    const bool dropped = (unit(5, rank * 1000 + t, j) + 1) * 0.5 < p.drop;
    d.expert.push_back(dropped ? -1 : e);
    d.prob.push_back(0.1 + 0.9 * (unit(6, rank * 1000 + t, j) + 1) * 0.5);
    e = (e + step) % p.experts;
  }
  return d;
}

inline data make_weights(const problem& p) {
  data w{p.hidden, p.ffn, p.experts, p.topk, {}, {}};
  for (int e = 0; e < p.experts; ++e) {
    for (int i = 0; i < p.hidden * 2 * p.ffn; ++i) w.w1.push_back(value_of(p, 0.5 * unit(7, e, i)));
    for (int i = 0; i < p.ffn * p.hidden; ++i) w.w2.push_back(value_of(p, 0.5 * unit(8, e, i)));
  }
  return w;
}

inline double silu(double v) { return v / (1 + std::exp(-v)); }
inline double silu_grad(double v) {
  const double s = 1 / (1 + std::exp(-v));
  return s * (1 + v * (1 - s));
}

// The reference: what one token's output and gradients are, and what its pairs add to the
// weight gradients of their experts.
struct reference_grads {
  std::map<int, std::vector<double>> dw1, dw2;  // per global expert, full layouts
};
inline void reference_token(const data& w, const token_data& d, std::vector<double>& out,
                            std::vector<double>& dx, std::vector<double>& dprob,
                            reference_grads& g) {
  const int H = w.H, F = w.F;
  out.assign(static_cast<std::size_t>(H), 0.0);
  dx.assign(static_cast<std::size_t>(H), 0.0);
  dprob.assign(d.expert.size(), 0.0);
  for (std::size_t j = 0; j < d.expert.size(); ++j) {
    const int e = d.expert[j];
    if (e < 0) continue;  // a dropped pair contributes nothing
    auto& dw1 = g.dw1[e];
    auto& dw2 = g.dw2[e];
    dw1.resize(static_cast<std::size_t>(H * 2 * F), 0.0);
    dw2.resize(static_cast<std::size_t>(F * H), 0.0);
    const double p = d.prob[j];
    for (int c = 0; c < F; ++c) {
      double gate = 0, up = 0;
      for (int h = 0; h < H; ++h) {
        gate += d.x[h] * w.weight1(e, h, c);
        up += d.x[h] * w.weight1(e, h, F + c);
      }
      const double a = silu(gate) * up;
      double dh = 0;
      for (int o = 0; o < H; ++o) {
        out[o] += a * p * w.weight2(e, c, o);
        dh += d.dout[o] * w.weight2(e, c, o);
        dw2[c * H + o] += a * p * d.dout[o];
      }
      dprob[j] += a * dh;
      const double dgate = p * dh * up * silu_grad(gate), dup = p * dh * silu(gate);
      for (int h = 0; h < H; ++h) {
        dx[h] += dgate * w.weight1(e, h, c) + dup * w.weight1(e, h, F + c);
        dw1[(h * 2 * F) + c] += d.x[h] * dgate;
        dw1[(h * 2 * F) + F + c] += d.x[h] * dup;
      }
    }
  }
}

inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct rank_result {
  std::vector<double> out, dx, dprob;
  // After the EDP reduction, this rank's shards of all local experts, in the library's layout
  // ([L, 2Fs, H] and [L, H, Fs]).
  std::vector<double> dw1, dw2;
  long long a2a_rows = 0, count_gather_rows = 0;
  int rows = 0;                 // M, the rows of the experts' batch
  std::vector<int> per_expert;  // [L] rows per local expert
};

template <class Comm>
struct all_to_all_path {
  using type = all_to_all_dispatcher<double, Comm>;
  static constexpr bool exact_bytes = true;  // one row per remote pair
  static constexpr std::optional<dispatcher_kind> kind{};
};
template <class Comm>
struct all_gather_path {
  using type = all_gather_dispatcher<double, Comm>;
  static constexpr bool exact_bytes = false;
  static constexpr std::optional<dispatcher_kind> kind{};
};
//! Either dispatcher through dispatcher_variant, the kind chosen at run time (make's shape).
template <class Comm, dispatcher_kind K>
struct variant_path {
  using type =
      dispatcher_variant<all_to_all_dispatcher<double, Comm>, all_gather_dispatcher<double, Comm>>;
  static constexpr bool exact_bytes = K == dispatcher_kind::all_to_all;
  static constexpr std::optional<dispatcher_kind> kind = K;
};

//! Rank r's shard of the routed experts in T: its E / EP local experts, ETP-sharded, loaded from
//! the full weights w1 (per expert [H, 2F], columns [gate | up]) and w2 (per expert [F, H]), the
//! reference's layout, converted to load_full's (support/mlp_layout.hpp). P: the probabilities'
//! type the experts take.
template <class T, class P = T>
expected<reference_mlp<T, main_grad_t<T>, P>> rank_experts(const problem& p,
                                                           const dynamic_folded_mesh& fold, int r,
                                                           const std::vector<double>& w1,
                                                           const std::vector<double>& w2) {
  const int L = p.experts / fold.ep();
  const auto mc = fold.moe_coord_of(r);
  auto mlp = reference_mlp<T, main_grad_t<T>, P>::make({.hidden = p.hidden,
                                                        .ffn = p.ffn,
                                                        .num_local_experts = L,
                                                        .etp = fold.etp(),
                                                        .etp_rank = mc.etp,
                                                        .act = activation::swiglu});
  if (!mlp) return mlp;
  const auto n1 = static_cast<std::size_t>(p.hidden * 2 * p.ffn),
             n2 = static_cast<std::size_t>(p.ffn * p.hidden);
  const std::vector<T> t1(w1.begin(), w1.end()), t2(w2.begin(), w2.end());
  for (int l = 0; l < L; ++l) {
    const auto e = static_cast<std::size_t>(mc.ep * L + l);
    const auto f1 =
        megatron_fc1_from_columns(std::span<const T>(t1).subspan(e * n1, n1), p.hidden, 2, p.ffn);
    const auto f2 =
        megatron_fc2_from_rows(std::span<const T>(t2).subspan(e * n2, n2), p.ffn, p.hidden);
    if (auto st = mlp->load_full(l, f1, f2); !st) return unexpected<error>(st.error());
  }
  return mlp;
}

//! The 12 folds of 8 ranks the MPI tests (mpirun -np 8) run.
inline const fold_config mpi_folds[] = {
    {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1},
    {.world = 8, .tp = 2, .cp = 2, .ep = 8, .etp = 1},
    {.world = 8, .cp = 2, .pp = 2, .ep = 2, .etp = 2},
    {.world = 8, .tp = 4, .ep = 2, .etp = 2},
    {.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-cp-ep-pp-dp"},
    {.world = 8, .ep = 8, .etp = 1},
    {.world = 8, .tp = 2, .ep = 4, .etp = 2},
    {.world = 8, .tp = 8, .ep = 8, .etp = 1},
    {.world = 8, .pp = 2, .ep = 4, .etp = 1},
    {.world = 8, .tp = 2, .cp = 2, .pp = 2, .ep = 2, .etp = 2},
    {.world = 8, .tp = 4, .ep = 2, .etp = 4},
    {.world = 8, .ep = 1, .etp = 1},
};

inline int tokens_of(const problem& p, const megatron_groups& groups, int r) {
  return (p.empty_rank && groups(group_kind::tp_dp_cp).find(r).position == 0) ? 0 : p.tokens;
}

// Rank r's tokens; with a capacity, each expert keeps the first `capacity` pairs of the rank in
// token order (a position drop written here, independent of the drop policies).
inline std::vector<token_data> rank_tokens(const problem& p, const megatron_groups& groups, int r) {
  std::vector<token_data> toks;
  std::map<int, int> taken;
  for (int t = 0; t < tokens_of(p, groups, r); ++t) {
    toks.push_back(make_token(p, r, t));
    for (int& e : toks.back().expert)
      if (e >= 0 && p.capacity >= 0 && taken[e]++ >= p.capacity) e = -1;
  }
  return toks;
}

//! Rank r's dispatcher inputs, flattened: x [N, H], expert and probs [N*k], dout [N, H].
struct rank_inputs {
  int n = 0;
  std::vector<double> x;
  std::vector<int> expert;
  std::vector<double> probs, dout;
};
inline rank_inputs inputs_of(const problem& p, const megatron_groups& groups, int r) {
  rank_inputs in;
  for (const auto& d : rank_tokens(p, groups, r)) {
    ++in.n;
    in.x.insert(in.x.end(), d.x.begin(), d.x.end());
    in.expert.insert(in.expert.end(), d.expert.begin(), d.expert.end());
    in.probs.insert(in.probs.end(), d.prob.begin(), d.prob.end());
    in.dout.insert(in.dout.end(), d.dout.begin(), d.dout.end());
  }
  return in;
}

//! The dispatcher of `Path` sized for the problem and the fold.
template <class Path>
auto make_dispatcher(const problem& p, const dynamic_folded_mesh& fold) {
  return Path::type::make({.max_tokens = p.tokens,
                           .hidden = p.hidden,
                           .topk = p.topk,
                           .num_experts = p.experts,
                           .ep = fold.ep(),
                           .etp = fold.etp(),
                           .max_recv_rows = p.max_recv_rows,
                           .kind = Path::kind});
}

//! One rank's part of the layer: dispatch, experts, combine, backward, EDP gradient reduction.
template <class Path, class Comm>
expected<rank_result> run_rank(const problem& p, Comm& world) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const int r = world.rank();
  auto ep = group_communicator(world, groups, {group_kind::ep});
  auto etp = group_communicator(world, groups, {group_kind::etp});
  auto tp_ep = group_communicator(world, groups, {group_kind::tp_ep});
  auto edp = group_communicator(world, groups, {group_kind::edp});
  if (!ep || !etp || !tp_ep || !edp) return make_error(errc::invalid_argument, "groups");
  auto [n, x, expert, probs, dout] = inputs_of(p, groups, r);
  auto disp = make_dispatcher<Path>(p, fold);
  if (!disp) return unexpected<error>(disp.error());
  const std::optional<int> cap = p.pad ? std::optional<int>(p.capacity) : std::nullopt;
  host_workspace ws(disp->workspace_sizes(cap));
  const dispatch_groups<Comm> g{*ep, *etp, *tp_ep};
  host_exec hx;
  auto h = disp->dispatch(hx, host_input(disp->shape(), n, x, expert, probs, cap), g, ws.view());
  if (!h) return unexpected<error>(h.error());
  auto mlp = rank_experts<double>(p, fold, r, w.w1, w.w2);
  if (!mlp) return unexpected<error>(mlp.error());
  const auto M = static_cast<std::size_t>(h->num_rows());
  const auto H = static_cast<std::size_t>(p.hidden);
  rank_result res;
  std::vector<double> y(M * H), dy(M * H), dx_rows(M * H), dp_rows(M);
  res.out.resize(static_cast<std::size_t>(n) * H);
  res.dx.resize(res.out.size());
  res.dprob.resize(probs.size());
  auto ok = [](const status& st) { return st.has_value(); };
  for (const status& st :
       {mlp->forward(h->batch(), y),
        disp->combine(hx, *h, rows_of(y, p.hidden), g, rows_of(res.out, p.hidden)),
        disp->combine_backward(hx, *h, rows_of(dout, p.hidden), g, rows_of(dy, p.hidden)),
        mlp->backward(h->batch(), dy, dx_rows, dp_rows),
        disp->dispatch_backward(hx, *h, rows_of(dx_rows, p.hidden), rows_of(dp_rows, 1), g,
                                rows_of(res.dx, p.hidden), rows_of(res.dprob, p.topk)),
        // Expert weights are replicated over EDP: their gradients are summed over it.
        edp->template all_reduce<double>(mlp->grads_fc1(), reduce_op::sum),
        edp->template all_reduce<double>(mlp->grads_fc2(), reduce_op::sum)})
    if (!ok(st)) return unexpected<error>(st.error());
  res.dw1.assign(mlp->grads_fc1().begin(), mlp->grads_fc1().end());
  res.dw2.assign(mlp->grads_fc2().begin(), mlp->grads_fc2().end());
  res.a2a_rows = h->volume().dispatch_a2a.rows;
  res.count_gather_rows = h->volume().count_gather.rows;
  res.rows = h->num_rows();
  res.per_expert.assign(h->batch().counts.begin(), h->batch().counts.end());
  return res;
}

//! What rank r must get: its tokens' outputs and gradients, the EDP-reduced gradients of its
//! expert shards (the reference sums over all tokens of its pipeline stage), and the number of
//! its routed pairs whose expert lives on another EP rank.
inline rank_result expected_for_rank(const problem& p, int r) {
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  const int L = p.experts / fold.ep();
  rank_result want;
  reference_grads g;
  const auto stage = groups(group_kind::tp_dp_cp)[groups(group_kind::tp_dp_cp).find(r).group];
  for (int q : stage)
    for (const auto& d : rank_tokens(p, groups, q)) {
      std::vector<double> o, dx, dp;
      reference_token(w, d, o, dx, dp, g);
      if (q != r) continue;
      want.out.insert(want.out.end(), o.begin(), o.end());
      want.dx.insert(want.dx.end(), dx.begin(), dx.end());
      want.dprob.insert(want.dprob.end(), dp.begin(), dp.end());
      for (int e : d.expert) want.a2a_rows += (e >= 0 && e / L != fold.moe_coord_of(r).ep) ? 1 : 0;
    }
  const auto mc = fold.moe_coord_of(r);
  for (int l = 0; l < L; ++l) {
    auto d1 = g.dw1[mc.ep * L + l], d2 = g.dw2[mc.ep * L + l];
    d1.resize(static_cast<std::size_t>(p.hidden * 2 * p.ffn), 0.0);
    d2.resize(static_cast<std::size_t>(p.ffn * p.hidden), 0.0);
    // This shard of the reference's full gradients, in the library's layout: fc1 [2Fs, H] (the
    // shard's gate rows, then its up rows), fc2 [H, Fs].
    append_fc1_shard<double>(d1, p.hidden, 2, p.ffn, fold.etp(), mc.etp, want.dw1);
    append_fc2_shard<double>(d2, p.ffn, p.hidden, fold.etp(), mc.etp, want.dw2);
  }
  return want;
}

}  // namespace moefold::test
