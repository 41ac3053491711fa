//! @file upcycle_biases.hpp
//! @brief The experts' biases after upcycling, for dense FFNs that have them (Hugging Face's
//! mlp_bias, Megatron-Core's add_bias_linear). moefold's own experts have no biases; this serves
//! trainers whose experts do (Megatron-Core's TEGroupedMLP with biases).
//!
//! Expert e (slice i = e mod G) on ETP shard r: its fc1 bias [F1] is this shard's gate bias
//! entries [i F + r F / ETP, + F / ETP), then the same up bias entries (not gated: the up bias
//! entries only), times the weight scale s: act(s (W x + b)) = s^p act(W x + b) for the ReLU
//! family, exactly as the weights scale. Its fc2 bias [H] is the dense one times t:
//!   - softmax after top-k: t = 1 (the k chosen probabilities sum to 1, so the biases add up to
//!     the dense bias exactly);
//!   - softmax before top-k: t = E / k (with a near-uniform router each chosen probability is
//!     about 1 / E, k of them; exact for the uniform router).
//! The fc2 bias is not sharded over ETP: every shard holds all of it, and it is added once after
//! the ETP reduction (as Megatron-Core's RowParallelLinear adds its bias after the reduce).
//! Values are computed in fp64 and rounded once to the output type, as the weights are.
#pragma once

#include <cstddef>
#include <span>

#include "../core/expected.hpp"
#include "round_once.hpp"
#include "upcycle_experts.hpp"
#include "upcycle_options.hpp"
#include "upcycle_scale.hpp"

namespace moefold {
inline namespace v0_1 {

//! A dense FFN's biases, whole (they are small): gate [F_d] (gated only; empty otherwise), up
//! [F_d] (empty: fc1 has no bias), down [H] (empty: fc2 has no bias).
template <class S>
struct dense_biases {
  std::span<const S> gate{};
  std::span<const S> up{};
  std::span<const S> down{};
};

//! Where upcycle_biases writes a rank's expert biases: fc1 [L, F1] (empty when the dense FFN has
//! no fc1 bias), fc2 [L, H] (empty when it has no fc2 bias).
template <class T>
struct upcycled_biases {
  std::span<T> fc1{};
  std::span<T> fc2{};
};

//! The factor t of the fc2 bias (see the file comment).
[[nodiscard]] inline expected<double> upcycle_fc2_bias_scale(const dense_ffn_shape& d,
                                                             const upcycle_options& o) {
  if (auto st = detail::check_upcycle(d, o); !st) return unexpected<error>(st.error());
  return o.pre_softmax ? static_cast<double>(o.num_experts) / o.topk : 1.0;
}

//! Writes rank `r`'s expert biases into `w` from the dense biases `b`.
template <class S, class T>
[[nodiscard]] status upcycle_biases(const dense_ffn_shape& d, const upcycle_options& o,
                                    const upcycle_rank& r, const dense_biases<S>& b,
                                    upcycled_biases<T> w) {
  auto shape = upcycled_shape(d, o, r);
  if (!shape) return unexpected<error>(shape.error());
  auto s = upcycle_weight_scale(d, o);
  if (!s) return unexpected<error>(s.error());
  auto t = upcycle_fc2_bias_scale(d, o);
  if (!t) return unexpected<error>(t.error());
  using detail::to_decimal;
  const auto Fd = static_cast<std::size_t>(d.ffn), H = static_cast<std::size_t>(d.hidden);
  const int G = o.granularity, F = shape->ffn, Fs = F / r.etp, L = shape->num_local_experts;
  const bool fc1 = !b.up.empty();
  if ((fc1 && b.up.size() != Fd) || (d.gated && fc1 && b.gate.size() != Fd) ||
      (!d.gated && !b.gate.empty()) || (!fc1 && !b.gate.empty()) ||
      (!b.down.empty() && b.down.size() != H))
    return make_error(
        errc::shape_mismatch,
        "upcycle_biases: the dense biases must be gate and up [F_d] = " + to_decimal(d.ffn) +
            " (gate only when gated, both or neither) and down [H] = " + to_decimal(d.hidden) +
            ", or empty");
  const std::size_t F1 = static_cast<std::size_t>((d.gated ? 2 : 1) * Fs);
  const auto uL = static_cast<std::size_t>(L);
  if (w.fc1.size() != (fc1 ? uL * F1 : 0) || w.fc2.size() != (b.down.empty() ? 0 : uL * H))
    return make_error(
        errc::shape_mismatch,
        "upcycle_biases: the output must hold fc1 [L, F1] = " + to_decimal(fc1 ? uL * F1 : 0) +
            " and fc2 [L, H] = " + to_decimal(b.down.empty() ? 0 : uL * H) + " elements");
  for (int l = 0; l < L; ++l) {
    const int i = (r.ep_rank * L + l) % G;
    const auto n0 = static_cast<std::size_t>(i * F + r.etp_rank * Fs);
    const auto lz = static_cast<std::size_t>(l);
    if (fc1) {
      std::size_t at = lz * F1;
      if (d.gated)
        for (std::size_t c = 0; c < static_cast<std::size_t>(Fs); ++c)
          w.fc1[at++] = detail::round_once<T>(detail::to_double(b.gate[n0 + c]) * *s);
      for (std::size_t c = 0; c < static_cast<std::size_t>(Fs); ++c)
        w.fc1[at++] = detail::round_once<T>(detail::to_double(b.up[n0 + c]) * *s);
    }
    for (std::size_t h = 0; h < (b.down.empty() ? 0 : H); ++h)
      w.fc2[lz * H + h] = detail::round_once<T>(detail::to_double(b.down[h]) * *t);
  }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
