//! @file context_drop.hpp
//! @brief A library drop policy run on an execution context, its decision read back in
//! Megatron-Core's dense form (drop_result: final_map and final_probs [N, E], the report): what
//! the reference tests compare against Megatron-Core's own maps, so that they check the
//! production decision (dispatch/capacity_keep.hpp) and not the host reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <moefold/core/error.hpp>
#include <moefold/core/expected.hpp>
#include <moefold/core/row_view.hpp>
#include <moefold/dispatch/drop_args.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/routing/topk_routing.hpp>

#include "host_drop_policy.hpp"

namespace moefold {
inline namespace v0_1 {

//! Policy `p` decides on `x` over routing `r` (the tp-cp communicator `comm` and order keys for
//! full-sequence dropping); `out` gets the decision in dense form. Allocates (a test helper).
template <class P, class Exec, class Comm, class T>
[[nodiscard]] status context_dense(Exec& x, const P& p, Comm& comm,
                                   std::span<const std::int64_t> keys, const topk_routing<T>& r,
                                   drop_result<T>& out, int group = 1) {
  using S = typename Exec::memory_space;
  if (auto s = detail::check_routing_sizes(r); !s) return s;
  const int N = r.num_tokens, k = r.topk, E = r.num_experts;
  const auto NK = static_cast<std::size_t>(N) * static_cast<std::size_t>(k);
  const auto NE = static_cast<std::size_t>(N) * static_cast<std::size_t>(E);
  // Every buffer of the context's memory (a context may refuse an empty one: at least 1 x 1).
  auto buffer = [&x]<class U>(const U* src, int rows, int width) -> expected<exec_buffer<U, Exec>> {
    auto b = exec_buffer<U, Exec>::make(x, rows < 1 ? 1 : rows, width < 1 ? 1 : width);
    if (!b) return unexpected<error>(b.error());
    if (src != nullptr && rows > 0 && width > 0)
      if (auto st = x.copy(row_view<const U, host_space>(src, rows, width),
                           row_view<U, S>(b->view().data(), rows, width));
          !st)
        return unexpected<error>(st.error());
    return b;
  };
  auto ex = buffer(r.indices.data(), N, k);
  auto pr = buffer(r.probs.data(), N, k);
  auto ky = buffer(keys.data(), keys.empty() ? 0 : N, 1);
  auto keep = buffer(static_cast<const std::uint8_t*>(nullptr), N, k);
  auto kept = buffer(static_cast<const int*>(nullptr), N, k);
  auto routed = buffer(static_cast<const int*>(nullptr), 1, E);
  auto dropped = buffer(static_cast<const int*>(nullptr), 1, E);
  auto padded = buffer(static_cast<const int*>(nullptr), 1, E);
  auto totals = buffer(static_cast<const long long*>(nullptr), 1, 2);
  auto filler = buffer(static_cast<const std::uint8_t*>(nullptr), N, E);
  const std::size_t bytes =
      p.template workspace_bytes<T>({.max_tokens = N, .topk = k, .num_experts = E, .group = group});
  auto ws = buffer(static_cast<const std::byte*>(nullptr), 1, static_cast<int>(bytes));
  const auto made = [](const auto& b) -> status {
    if (b) return {};
    return unexpected<error>(b.error());
  };
  for (const status& s : {made(ex), made(pr), made(ky), made(keep), made(kept), made(routed),
                          made(dropped), made(padded), made(totals), made(filler), made(ws)})
    if (!s) return s;
  const auto view = [](auto& b, int rows, int width) {
    using U = std::remove_pointer_t<decltype(b->view().data())>;
    return row_view<U, S>(b->view().data(), rows, width);
  };
  auto dec =
      p.apply(x, comm,
              drop_input<T, S>{.experts = view(ex, N, k),
                               .probs = view(pr, N, k),
                               .order_keys = keys.empty()
                                                 ? row_view<const std::int64_t, S>{}
                                                 : row_view<const std::int64_t, S>(view(ky, N, 1))},
              drop_output<S>{.keep = view(keep, N, k),
                             .kept = view(kept, N, k),
                             .routed = view(routed, 1, E),
                             .dropped = view(dropped, 1, E),
                             .padded = view(padded, 1, E),
                             .totals = view(totals, 1, 2),
                             .filler_map = view(filler, N, E)},
              std::span<std::byte>(ws->view().data(), bytes));
  if (!dec) return unexpected<error>(dec.error());
  // Back to the host.
  std::vector<std::uint8_t> keep_h(NK), filler_h(NE);
  std::vector<int> routed_h(static_cast<std::size_t>(E)), dropped_h(routed_h.size()),
      padded_h(routed_h.size());
  long long totals_h[2] = {0, 0};
  const auto read = [&x](auto v, auto* dst) -> status {
    using U = std::remove_pointer_t<decltype(dst)>;
    if (v.rows() == 0 || v.width() == 0) return {};
    return x.copy(row_view<const U, S>(v), row_view<U, host_space>(dst, v.rows(), v.width()));
  };
  for (const status& s :
       {read(view(keep, N, k), keep_h.data()), read(view(filler, N, E), filler_h.data()),
        read(view(routed, 1, E), routed_h.data()), read(view(dropped, 1, E), dropped_h.data()),
        read(view(padded, 1, E), padded_h.data()), read(view(totals, 1, 2), totals_h),
        x.synchronize()})
    if (!s) return s;
  out.num_tokens = N;
  out.num_experts = E;
  out.topk = k;
  out.final_map = std::move(filler_h);
  out.final_probs.assign(NE, T(0));
  for (std::size_t t = 0; t < static_cast<std::size_t>(N); ++t)
    for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i)
      if (keep_h[t * static_cast<std::size_t>(k) + i]) {
        const auto e = static_cast<std::size_t>(r.indices[t * static_cast<std::size_t>(k) + i]);
        out.final_map[t * static_cast<std::size_t>(E) + e] = 1;
        out.final_probs[t * static_cast<std::size_t>(E) + e] =
            r.probs[t * static_cast<std::size_t>(k) + i];
      }
  out.kept = std::move(keep_h);
  out.pad_rows = dec->pad_rows;
  out.report = {.capacity = dec->capacity,
                .routed = std::move(routed_h),
                .dropped = std::move(dropped_h),
                .padded = std::move(padded_h),
                .dropped_pairs = totals_h[0],
                .fully_dropped_tokens = static_cast<int>(totals_h[1])};
  return {};
}

}  // namespace v0_1
}  // namespace moefold
