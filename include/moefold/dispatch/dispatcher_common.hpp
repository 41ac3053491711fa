//! @file dispatcher_common.hpp
//! @brief What both token dispatchers share around their own four steps: the calls on a
//! default-constructed context (host_exec carries nothing), one workspace buffer split into its
//! two parts, and views of workspace spans in the dispatcher's memory space.
//!
//! A dispatcher D derives from dispatcher_common<D, T, Comm, Exec>, implements dispatch(x, in, g,
//! dispatch_workspace), combine(x, ...), combine_backward(x, ...), dispatch_backward(x, ...) and
//! workspace_sizes(capacity), and brings these overloads in with using-declarations.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "dispatch_args.hpp"
#include "dispatch_handle.hpp"

namespace moefold {
inline namespace v0_1 {

template <class D, class T, class Comm, class Exec>
class dispatcher_common {
 public:
  using handle_type = dispatch_handle<D>;

  //! Bytes of one buffer holding both workspace parts (see workspace_sizes).
  [[nodiscard]] std::size_t workspace_bytes(int capacity = -1) const {
    return self().workspace_sizes(capacity).total();
  }

  //! Dispatch with one buffer of workspace_bytes(capacity) bytes holding both parts.
  [[nodiscard]] expected<handle_type> dispatch(Exec& x, const dispatch_input<T>& in,
                                               const dispatch_groups<Comm>& g,
                                               std::span<std::byte> workspace) {
    return self().dispatch(x, in, g,
                           detail::split_workspace(workspace, self().workspace_sizes(in.capacity)));
  }

  // The calls on a default-constructed context.
  [[nodiscard]] expected<handle_type> dispatch(
      const dispatch_input<T>& in, const dispatch_groups<Comm>& g,
      std::span<std::byte> workspace) requires std::default_initializable<Exec> {
    Exec x{};
    return self().dispatch(x, in, g, workspace);
  }
  [[nodiscard]] expected<handle_type> dispatch(
      const dispatch_input<T>& in, const dispatch_groups<Comm>& g,
      const dispatch_workspace& ws) requires std::default_initializable<Exec> {
    Exec x{};
    return self().dispatch(x, in, g, ws);
  }
  [[nodiscard]] status combine(handle_type& h, std::span<const T> y, const dispatch_groups<Comm>& g,
                               std::span<T> out) requires std::default_initializable<Exec> {
    Exec x{};
    return self().combine(x, h, y, g, out);
  }
  [[nodiscard]] status combine_backward(const handle_type& h, std::span<const T> dout,
                                        const dispatch_groups<Comm>& g,
                                        std::span<T> dy) requires std::default_initializable<Exec> {
    Exec x{};
    return self().combine_backward(x, h, dout, g, dy);
  }
  [[nodiscard]] status dispatch_backward(
      const handle_type& h, std::span<const T> dx_rows, std::span<const T> dprob_rows,
      const dispatch_groups<Comm>& g, std::span<T> dx,
      std::span<T> dprobs) requires std::default_initializable<Exec> {
    Exec x{};
    return self().dispatch_backward(x, h, dx_rows, dprob_rows, g, dx, dprobs);
  }

 protected:
  //! [v.size() / width, width] in the dispatcher's memory space.
  template <class U>
  static row_view<U, typename Exec::memory_space> rows_of(std::span<U> v, int width) noexcept {
    return row_view<U, typename Exec::memory_space>(
        v.data(), width > 0 ? static_cast<int>(v.size() / detail::uz(width)) : 0, width);
  }

 private:
  D& self() noexcept { return static_cast<D&>(*this); }
  const D& self() const noexcept { return static_cast<const D&>(*this); }
};

}  // namespace v0_1
}  // namespace moefold
