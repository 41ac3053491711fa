// The wrapping the host tests repeat around the token dispatchers' one API (views on a context):
// host vectors as row views, a dispatch_input over them, and one host byte buffer carved into the
// three workspace parts.
#pragma once

#include <moefold/core/row_view.hpp>
#include <moefold/dispatch/dispatch_args.hpp>

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

namespace moefold::test {

//! A host vector (or span) as the contiguous rows [size / width, width] (host_rows).
template <class V>
[[nodiscard]] auto rows_of(V& v, int width) noexcept {
  return host_rows(std::span(v), width);
}

//! The views of one rank's dispatch input over host vectors: x [N, H], expert and probs [N, k],
//! with H and k from the dispatcher's shape.
template <class VX, class VP>
[[nodiscard]] auto host_input(const dispatch_shape& s, int num_tokens, const VX& x,
                              const std::vector<int>& expert, const VP& probs,
                              std::optional<int> capacity = {}) noexcept {
  using T = typename VX::value_type;
  using P = typename VP::value_type;
  return dispatch_input<T, host_space, P>{.num_tokens = num_tokens,
                                          .x = rows_of(x, s.hidden),
                                          .expert = rows_of(expert, s.topk),
                                          .probs = rows_of(probs, s.topk),
                                          .capacity = capacity};
}

//! One host buffer holding the three parts of a dispatcher's workspace (host contexts), every
//! byte set to `fill`; view() carves it as saved, scratch, host.
struct host_workspace {
  dispatch_workspace_bytes sizes{};
  std::vector<std::byte> bytes{};

  host_workspace() = default;
  explicit host_workspace(const dispatch_workspace_bytes& s, std::byte fill = std::byte{0})
      : sizes(s), bytes(s.total(), fill) {}

  [[nodiscard]] dispatch_workspace view() noexcept {
    const std::span<std::byte> w(bytes);
    return {.saved = w.first(sizes.saved),
            .scratch = w.subspan(sizes.saved, sizes.scratch),
            .host = w.subspan(sizes.saved + sizes.scratch)};
  }
};

}  // namespace moefold::test
