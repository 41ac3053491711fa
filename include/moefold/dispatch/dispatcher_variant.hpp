//! @file dispatcher_variant.hpp
//! @brief One of several token dispatchers, chosen at run time from dispatch_shape::kind. A
//! trainer picks the All-to-All or the AllGather dispatcher from its configuration (Megatron-Core's
//! moe_token_dispatcher_type); with this dispatcher one layer type serves both (one layer
//! instantiation to compile instead of two), and the choice costs a branch per call.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "dispatch_args.hpp"
#include "dispatch_handle.hpp"
#include "expert_batch.hpp"

namespace moefold {
inline namespace v0_1 {

//! Holds one of the dispatchers `D...` (each naming its `kind`, all of one token, probability and
//! context type) and forwards every call to it. make() makes the one whose kind the shape names
//! (the first when it names none); its handles hold the chosen dispatcher's handle, and a handle
//! of another alternative is refused by name before any collective runs.
template <class... D>
requires(sizeof...(D) >= 1) class dispatcher_variant {
  using first = std::tuple_element_t<0, std::tuple<D...>>;
  static_assert((std::same_as<typename D::value_type, typename first::value_type> && ...) &&
                    (std::same_as<typename D::prob_type, typename first::prob_type> && ...) &&
                    (std::same_as<typename D::exec_type, typename first::exec_type> && ...),
                "dispatcher_variant: every dispatcher must have the same value, probability and "
                "context types");

 public:
  using value_type = typename first::value_type;
  using prob_type = typename first::prob_type;
  using exec_type = typename first::exec_type;
  using space = typename exec_type::memory_space;
  using const_view = row_view<const value_type, space>;
  using view = row_view<value_type, space>;
  using const_prob_view = row_view<const prob_type, space>;
  using prob_view = row_view<prob_type, space>;

  //! The handle of the chosen dispatcher's dispatch, with the accessors every handle has.
  class handle_type {
   public:
    handle_type() = default;
    [[nodiscard]] expert_batch<value_type, prob_type, space> batch() const noexcept {
      return std::visit([](const auto& h) { return h.batch(); }, h_);
    }
    [[nodiscard]] const_view batch_rows() const noexcept {
      return std::visit([](const auto& h) { return h.batch_rows(); }, h_);
    }
    [[nodiscard]] const_prob_view batch_probs() const noexcept {
      return std::visit([](const auto& h) { return h.batch_probs(); }, h_);
    }
    [[nodiscard]] std::span<const int> batch_counts() const noexcept {
      return std::visit([](const auto& h) { return h.batch_counts(); }, h_);
    }
    [[nodiscard]] row_view<const int, space> batch_offsets() const noexcept {
      return std::visit([](const auto& h) { return h.batch_offsets(); }, h_);
    }
    [[nodiscard]] int num_rows() const noexcept {
      return std::visit([](const auto& h) { return h.num_rows(); }, h_);
    }
    [[nodiscard]] int num_tokens() const noexcept {
      return std::visit([](const auto& h) { return h.num_tokens(); }, h_);
    }
    [[nodiscard]] const dispatch_volume& volume() const noexcept {
      return std::visit([](const auto& h) -> const dispatch_volume& { return h.volume(); }, h_);
    }

   private:
    friend dispatcher_variant;
    template <class H>
    explicit handle_type(H&& h) : h_(std::forward<H>(h)) {}
    std::variant<typename D::handle_type...> h_{};
  };

  //! The dispatcher of the kind `s.kind` names (the first of D... when unset), checked as that
  //! dispatcher checks its shape; a kind none of D... is, is refused by name.
  [[nodiscard]] static expected<dispatcher_variant> make(const dispatch_shape& s) {
    const dispatcher_kind want = s.kind.value_or(first::kind);
    expected<dispatcher_variant> made = make_error(
        errc::invalid_argument, std::string("dispatcher_variant: no dispatcher of kind ") +
                                    to_string(want) + " among its alternatives");
    bool found = false;
    (
        [&] {
          if (found || D::kind != want) return;
          found = true;
          auto d = D::make(s);
          if (!d)
            made = unexpected<error>(d.error());
          else
            made = dispatcher_variant(std::move(*d));
        }(),
        ...);
    return made;
  }

  //! The kind chosen at make.
  [[nodiscard]] dispatcher_kind kind() const noexcept {
    return std::visit([](const auto& d) { return std::decay_t<decltype(d)>::kind; }, d_);
  }
  [[nodiscard]] const dispatch_shape& shape() const noexcept {
    return std::visit([](const auto& d) -> const dispatch_shape& { return d.shape(); }, d_);
  }
  [[nodiscard]] dispatch_workspace_bytes workspace_sizes(std::optional<int> capacity = {}) const {
    return std::visit([capacity](const auto& d) { return d.workspace_sizes(capacity); }, d_);
  }

  template <class Comm>
  [[nodiscard]] expected<handle_type> dispatch(
      exec_type& x, const dispatch_input<value_type, space, prob_type>& in,
      const dispatch_groups<Comm>& g, const dispatch_workspace& ws) {
    return std::visit(
        [&](auto& d) -> expected<handle_type> {
          auto h = d.dispatch(x, in, g, ws);
          if (!h) return unexpected<error>(h.error());
          return handle_type(std::move(*h));
        },
        d_);
  }
  template <class Comm>
  [[nodiscard]] status combine(exec_type& x, handle_type& h, const_view y,
                               const dispatch_groups<Comm>& g, view out) {
    return with_handle(h, [&](auto& d, auto& dh) { return d.combine(x, dh, y, g, out); });
  }
  template <class Comm>
  [[nodiscard]] status combine_backward(exec_type& x, const handle_type& h, const_view dout,
                                        const dispatch_groups<Comm>& g, view dy) {
    return with_handle(
        h, [&](auto& d, const auto& dh) { return d.combine_backward(x, dh, dout, g, dy); });
  }
  template <class Comm>
  [[nodiscard]] status dispatch_backward(exec_type& x, const handle_type& h, const_view dx_rows,
                                         const_prob_view dprob_rows, const dispatch_groups<Comm>& g,
                                         view dx, prob_view dprobs) {
    return with_handle(h, [&](auto& d, const auto& dh) {
      return d.dispatch_backward(x, dh, dx_rows, dprob_rows, g, dx, dprobs);
    });
  }
  [[nodiscard]] status device_status(exec_type& x, const handle_type& h) const {
    return with_handle(h, [&](const auto& d, const auto& dh) { return d.device_status(x, dh); });
  }

 private:
  template <class Di>
  explicit dispatcher_variant(Di&& d) : d_(std::forward<Di>(d)) {}

  // Calls f(dispatcher, its handle) when `h` holds the chosen dispatcher's kind of handle.
  template <class Self, class H, class F>
  static status with_handle_of(Self& self, H& h, F&& f) {
    if (h.h_.index() != self.d_.index())
      return make_error(errc::invalid_argument,
                        std::string("dispatcher_variant: the handle comes from another kind of "
                                    "dispatcher than this one's (") +
                            to_string(self.kind()) + ")");
    return std::visit(
        [&](auto& d) -> status {
          using Dd = std::remove_const_t<std::remove_reference_t<decltype(d)>>;
          return f(d, *std::get_if<typename Dd::handle_type>(&h.h_));
        },
        self.d_);
  }
  template <class H, class F>
  status with_handle(H& h, F&& f) {
    return with_handle_of(*this, h, std::forward<F>(f));
  }
  template <class H, class F>
  status with_handle(H& h, F&& f) const {
    return with_handle_of(*this, h, std::forward<F>(f));
  }

  std::variant<D...> d_;
};

}  // namespace v0_1
}  // namespace moefold
