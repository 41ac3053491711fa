//! @file drop_result.hpp
//! @brief The dense form of a drop decision, as Megatron-Core builds it: `final_map` and
//! `final_probs` [N, E]. For tests and logging only: the layer and the dispatcher take the
//! routing record with its keep mask (routing_view.hpp) and never build [N, E] maps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../routing/routing_view.hpp"
#include "../routing/topk_routing.hpp"
#include "drop_policy.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {
//! The communicator argument of a local policy's dense form (ignored).
struct no_comm {};
}  // namespace detail

//! The routing after a drop policy: Megatron-Core's `final_map` and `final_probs` [N, E] (dropped
//! pairs are 0, the survivors keep their probabilities, filler rows have probability 0), which of
//! the k selected pairs of each token survived, and the report.
template <class T>
struct drop_result {
  int num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  std::vector<std::uint8_t> final_map{};  // [N, E]
  std::vector<T> final_probs{};           // [N, E]
  std::vector<std::uint8_t> kept{};       // [N, k]: pair (t, indices[t, i]) survived
  std::optional<int> pad_rows{};          //!< drop_counts::pad_rows
  drop_report report;

  //! The surviving routing in top-k record form, as the dispatcher takes it: expert [N*k] with
  //! -1 for a dropped pair (pad-mode fillers are not pairs; the dispatcher pads to pad_rows), and
  //! probs [N*k] with 0 for a dropped pair.
  [[nodiscard]] std::vector<int> kept_experts(const topk_routing<T>& r) const {
    std::vector<int> out(r.indices);
    for (std::size_t p = 0; p < out.size() && p < kept.size(); ++p)
      if (!kept[p]) out[p] = -1;
    return out;
  }
  [[nodiscard]] std::vector<T> kept_probs(const topk_routing<T>& r) const {
    std::vector<T> out(r.probs);
    for (std::size_t p = 0; p < out.size() && p < kept.size(); ++p)
      if (!kept[p]) out[p] = T(0);
    return out;
  }

  //! Backward of final_probs = probs_sparse * final_map: the gradient with respect to the router's
  //! k probabilities, dprobs [N, k], from the gradient dfinal [N, E]; dropped pairs get 0.
  [[nodiscard]] status mask_gradient(const topk_routing<T>& r, std::span<const T> dfinal,
                                     std::span<T> dprobs) const {
    const auto N = static_cast<std::size_t>(num_tokens), E = static_cast<std::size_t>(num_experts),
               K = static_cast<std::size_t>(topk);
    if (r.num_tokens != num_tokens || r.num_experts != num_experts || r.topk != topk ||
        dfinal.size() != N * E || dprobs.size() != N * K)
      return make_error(errc::shape_mismatch,
                        "drop mask_gradient: need the same routing, dfinal [N*E], dprobs [N*k]");
    for (std::size_t t = 0; t < N; ++t)
      for (std::size_t i = 0; i < K; ++i)
        dprobs[t * K + i] =
            kept[t * K + i] ? dfinal[t * E + static_cast<std::size_t>(r.indices[t * K + i])] : T(0);
    return {};
  }
};

//! Runs policy `p` on a host top-k routing and builds the dense result (allocates: a test and
//! logging helper). Collective when the policy is: a rank whose routing has the wrong sizes still
//! takes part (with an empty record), so the group fails together.
template <class P, class C, class T>
[[nodiscard]] status apply_dense(const P& p, C& comm, std::span<const std::int64_t> keys,
                                 const topk_routing<T>& r, drop_result<T>& out) {
  const status sizes = detail::check_routing_sizes(r);
  drop_scratch<T> ws;
  std::vector<std::uint8_t> keep(sizes ? r.indices.size() : 0);
  if (!sizes) {
    // pairs() > 0 with null pointers: the policy reports bad input (to its whole group).
    const routing_view<T> none{
        .num_tokens = r.num_tokens < 1 ? 1 : r.num_tokens, .topk = 1, .num_experts = 1};
    drop_counts c = counts_into(out.report, 1);
    (void)p.apply(comm, keys, none, c, ws);
    return sizes;
  }
  const auto N = static_cast<std::size_t>(r.num_tokens),
             E = static_cast<std::size_t>(r.num_experts), K = static_cast<std::size_t>(r.topk);
  std::vector<std::uint8_t> filler(N * E);
  drop_counts c = counts_into(out.report, r.num_experts, filler);
  const routing_view<T> v = view_of(r, std::span<std::uint8_t>(keep));
  if (auto s = p.apply(comm, keys, v, c, ws); !s) return s;
  out.num_tokens = r.num_tokens;
  out.num_experts = r.num_experts;
  out.topk = r.topk;
  out.final_map = std::move(filler);
  out.final_probs.assign(N * E, T(0));
  for (std::size_t t = 0; t < N; ++t)
    for (std::size_t i = 0; i < K; ++i)
      if (keep[t * K + i]) {
        const auto e = static_cast<std::size_t>(r.indices[t * K + i]);
        out.final_map[t * E + e] = 1;
        out.final_probs[t * E + e] = r.probs[t * K + i];
      }
  out.kept = std::move(keep);
  out.pad_rows = c.pad_rows;
  out.report.capacity = c.capacity;
  out.report.dropped_pairs = c.dropped_pairs;
  out.report.fully_dropped_tokens = c.fully_dropped_tokens;
  return {};
}

}  // namespace v0_1
}  // namespace moefold
