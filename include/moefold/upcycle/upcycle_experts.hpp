//! @file upcycle_experts.hpp
//! @brief The experts one rank owns after upcycling, built from exactly the dense slices it needs
//! (docs/upcycling.md). Expert e (global id) is slice i = e mod G of the dense FFN, F = F_d / G
//! wide; its ETP shard r holds neurons [i F + r F / ETP, + F / ETP): those rows of gate_proj and
//! up_proj (gate and up kept paired) and those columns of down_proj. The output is the rank's
//! local experts in Megatron-Core's TEGroupedMLP layout (experts/mlp_params.hpp): fc1 [L, F1, H]
//! (this shard's gate rows, then its up rows), fc2 [L, H, F / ETP], each value the dense value
//! times the scale s (upcycle_scale.hpp) in fp64, rounded once to the output type.
//!
//! Lazy by construction: upcycle_slices() states the slices (tensor, rows, columns) a rank reads,
//! once per distinct slice index among its local experts; upcycle_experts() takes views of
//! exactly those, in that order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/expected.hpp"
#include "../experts/mlp_params.hpp"
#include "round_once.hpp"
#include "upcycle_options.hpp"
#include "upcycle_scale.hpp"

namespace moefold {
inline namespace v0_1 {

//! The dense FFN's projections (Hugging Face names: gate_proj [F_d, H], up_proj [F_d, H],
//! down_proj [H, F_d]).
enum class dense_tensor : std::uint8_t { gate, up, down };

//! A rectangle of a dense projection, row-major: rows [first_row, first_row + rows), columns
//! [first_col, first_col + cols). `part` is the slice index i it serves.
struct dense_slice {
  dense_tensor tensor = dense_tensor::up;
  int part = 0;
  int first_row = 0, rows = 0;
  int first_col = 0, cols = 0;
  bool operator==(const dense_slice&) const = default;
};

//! Where a rank sits in the expert mapping.
struct upcycle_rank {
  int ep = 1;        //!< EP
  int ep_rank = 0;   //!< this rank's EP index
  int etp = 1;       //!< ETP
  int etp_rank = 0;  //!< this rank's ETP index
};

//! Where upcycle_experts writes a rank's experts: fc1 [L, F1, H] and fc2 [L, H, F / ETP] in the
//! TEGroupedMLP layout (mlp_sizes(upcycled_shape(...)) elements each), e.g. the buffers a
//! trainer then binds with mlp_experts or moe_layer.
template <class T>
struct upcycled_weights {
  std::span<T> fc1{};
  std::span<T> fc2{};
};

namespace detail {
[[nodiscard]] inline status check_upcycle_rank(const dense_ffn_shape& d, const upcycle_options& o,
                                               const upcycle_rank& r) {
  if (auto st = check_upcycle(d, o); !st) return st;
  if (r.ep < 1 || r.etp < 1)
    return make_error(errc::invalid_size, "upcycle: ep and etp must be >= 1");
  if (o.num_experts % r.ep != 0)
    return make_error(errc::invalid_argument,
                      "upcycle: num_experts = " + to_decimal(o.num_experts) +
                          " is not divisible by ep = " + to_decimal(r.ep));
  const int F = d.ffn / o.granularity;
  if (F % r.etp != 0)
    return make_error(errc::invalid_argument,
                      "upcycle: the expert FFN width F_d / G = " + to_decimal(F) +
                          " is not divisible by etp = " + to_decimal(r.etp));
  if (r.ep_rank < 0 || r.ep_rank >= r.ep || r.etp_rank < 0 || r.etp_rank >= r.etp)
    return make_error(errc::rank_out_of_range, "upcycle: ep_rank or etp_rank out of range");
  return {};
}
}  // namespace detail

//! The expert shape of a rank after upcycling (for mlp_sizes and the layer).
[[nodiscard]] inline expected<mlp_shape> upcycled_shape(const dense_ffn_shape& d,
                                                        const upcycle_options& o,
                                                        const upcycle_rank& r) {
  if (auto st = detail::check_upcycle_rank(d, o, r); !st) return unexpected<error>(st.error());
  return mlp_shape{.hidden = d.hidden,
                   .ffn = d.ffn / o.granularity,
                   .num_local_experts = o.num_experts / r.ep,
                   .etp = r.etp,
                   .etp_rank = r.etp_rank,
                   .act = o.act};
}

//! The slices rank `r` reads: for each distinct slice index i among its local experts (in the
//! order of first use), gate rows (gated only), up rows, then down columns, each F / ETP wide.
[[nodiscard]] inline expected<std::vector<dense_slice>> upcycle_slices(const dense_ffn_shape& d,
                                                                       const upcycle_options& o,
                                                                       const upcycle_rank& r) {
  if (auto st = detail::check_upcycle_rank(d, o, r); !st) return unexpected<error>(st.error());
  const int G = o.granularity, F = d.ffn / G, Fs = F / r.etp, L = o.num_experts / r.ep;
  std::vector<dense_slice> out;
  std::vector<bool> seen(static_cast<std::size_t>(G), false);
  for (int l = 0; l < L; ++l) {
    const int i = (r.ep_rank * L + l) % G;
    if (seen[static_cast<std::size_t>(i)]) continue;
    seen[static_cast<std::size_t>(i)] = true;
    const int n0 = i * F + r.etp_rank * Fs;  // first dense neuron of this shard
    if (d.gated) out.push_back({dense_tensor::gate, i, n0, Fs, 0, d.hidden});
    out.push_back({dense_tensor::up, i, n0, Fs, 0, d.hidden});
    out.push_back({dense_tensor::down, i, 0, d.hidden, n0, Fs});
  }
  return out;
}

//! Writes rank `r`'s local experts into `w` (mlp_sizes(upcycled_shape) elements each) from
//! `slices`, the data of upcycle_slices(d, o, r) in its order, each [rows, cols] row-major of
//! source type S. Every value is round_once<T>(double(src) * s).
template <class S, class T>
[[nodiscard]] status upcycle_experts(const dense_ffn_shape& d, const upcycle_options& o,
                                     const upcycle_rank& r,
                                     std::span<const std::span<const S>> slices,
                                     upcycled_weights<T> w) {
  auto shape = upcycled_shape(d, o, r);
  if (!shape) return unexpected<error>(shape.error());
  auto plan = upcycle_slices(d, o, r);
  if (!plan) return unexpected<error>(plan.error());
  auto scale = upcycle_weight_scale(d, o);
  if (!scale) return unexpected<error>(scale.error());
  using detail::to_decimal;
  if (slices.size() != plan->size())
    return make_error(errc::shape_mismatch, "upcycle_experts: " + to_decimal(slices.size()) +
                                                " slices given, upcycle_slices states " +
                                                to_decimal(plan->size()));
  for (std::size_t j = 0; j < plan->size(); ++j) {
    const dense_slice& s = (*plan)[j];
    if (slices[j].size() != static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.cols))
      return make_error(errc::shape_mismatch, "upcycle_experts: slice " + to_decimal(j) +
                                                  " must hold [" + to_decimal(s.rows) + ", " +
                                                  to_decimal(s.cols) + "] elements, got " +
                                                  to_decimal(slices[j].size()));
  }
  const mlp_param_sizes n = mlp_sizes(*shape);
  if (w.fc1.size() != n.fc1 || w.fc2.size() != n.fc2)
    return make_error(
        errc::shape_mismatch,
        "upcycle_experts: the output must hold fc1 [L, F1, H] = " + to_decimal(n.fc1) +
            " and fc2 [L, H, F/ETP] = " + to_decimal(n.fc2) + " elements");
  const int G = o.granularity, H = d.hidden, Fs = shape->ffn / r.etp, L = shape->num_local_experts;
  const int F1 = (d.gated ? 2 : 1) * Fs;
  const double sc = *scale;
  // The index in `slices` of tensor t for slice index i.
  auto find = [&](dense_tensor t, int i) -> std::size_t {
    for (std::size_t j = 0; j < plan->size(); ++j)
      if ((*plan)[j].tensor == t && (*plan)[j].part == i) return j;
    return plan->size();  // not reached: the plan holds every tensor of every part it serves
  };
  auto put = [&](std::span<T> dst, std::size_t at, S v) {
    dst[at] = detail::round_once<T>(detail::to_double(v) * sc);
  };
  for (int l = 0; l < L; ++l) {
    const int i = (r.ep_rank * L + l) % G;
    const auto fc1 = w.fc1.subspan(static_cast<std::size_t>(l) * F1 * H,
                                   static_cast<std::size_t>(F1) * H);  // [F1, H]
    const auto fc2 = w.fc2.subspan(static_cast<std::size_t>(l) * H * Fs,
                                   static_cast<std::size_t>(H) * Fs);  // [H, Fs]
    int row = 0;
    for (dense_tensor t : {dense_tensor::gate, dense_tensor::up}) {
      if (t == dense_tensor::gate && !d.gated) continue;
      const auto src = slices[find(t, i)];  // [Fs, H]
      for (int c = 0; c < Fs; ++c, ++row)
        for (int h = 0; h < H; ++h)
          put(fc1, static_cast<std::size_t>(row) * H + h, src[static_cast<std::size_t>(c) * H + h]);
    }
    const auto down = slices[find(dense_tensor::down, i)];  // [H, Fs]
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < Fs; ++c)
        put(fc2, static_cast<std::size_t>(h) * Fs + c, down[static_cast<std::size_t>(h) * Fs + c]);
  }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
