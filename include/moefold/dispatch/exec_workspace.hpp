//! @file exec_workspace.hpp
//! @brief A dispatcher's workspace allocated on an execution context: the saved and scratch parts
//! in the context's memory (exec_buffer), the host part on the host, sized by the dispatcher's
//! workspace_sizes(). What a caller without its own allocator (tests, benchmarks) holds; a
//! trainer with a caching allocator passes its own spans in dispatch_workspace instead.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "../core/expected.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"
#include "dispatch_args.hpp"

namespace moefold {
inline namespace v0_1 {

template <execution_context Exec>
struct exec_workspace {
  exec_buffer<std::byte, Exec> saved, scratch;  //!< in the context's memory
  std::vector<std::byte> host;                  //!< on the host (pinned is the caller's choice)
  dispatch_workspace_bytes sizes{};
  //! The three parts as dispatch() takes them.
  [[nodiscard]] dispatch_workspace view() {
    return {.saved = {saved.view().data(), sizes.saved},
            .scratch = {scratch.view().data(), sizes.scratch},
            .host = host};
  }
};

//! Allocates `sizes` on `x` (each device part at least one byte, so that every view has an
//! address).
template <execution_context Exec>
[[nodiscard]] expected<exec_workspace<Exec>> make_exec_workspace(
    Exec& x, const dispatch_workspace_bytes& sizes) {
  const auto bytes = [](std::size_t n) { return static_cast<long long>(n > 0 ? n : 1); };
  auto saved = exec_buffer<std::byte, Exec>::make(x, 1, bytes(sizes.saved));
  if (!saved) return unexpected<error>(saved.error());
  auto scratch = exec_buffer<std::byte, Exec>::make(x, 1, bytes(sizes.scratch));
  if (!scratch) return unexpected<error>(scratch.error());
  return exec_workspace<Exec>{.saved = std::move(*saved),
                              .scratch = std::move(*scratch),
                              .host = std::vector<std::byte>(sizes.host),
                              .sizes = sizes};
}

}  // namespace v0_1
}  // namespace moefold
