//! @file router_z_loss.hpp
//! @brief The router z-loss (ST-MoE; Megatron-Core `z_loss_func`, moe_z_loss_coeff) on an
//! execution context: coeff / |tp-cp| x the mean over this rank's valid tokens of
//! logsumexp(logits[t])^2 (the group's parts sum to the mean over the whole sequence), a device
//! value with a host read for logging, and its gradient added to dlogits. One implementation for
//! every context (kernels/router_z_loss.hpp).
//!
//! Memory: `saved_bytes()` per forward in flight, in the context's memory (the tokens'
//! logsumexp, the valid count, the loss value), until its backward.
//!
//! Shapes: logits, dlogits [N, E] contiguous; padding [1, N] (1 = padding token) or empty.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include <moefold/kernels/router_z_loss.hpp>

#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../core/workspace.hpp"
#include "../exec/exec.hpp"
#include "router_args.hpp"
#include "router_launch.hpp"

namespace moefold {
inline namespace v0_1 {

//! What one forward ran, for its backward (a host value).
template <class R>
struct z_loss_record {
  bool on = false;
  int num_tokens = 0;
  R coeff = R(0);  //!< coeff / |tp-cp|
};

template <class R, class Exec>
class router_z_loss {
  static_assert(router_dtype_check<R, Exec>::ok);

 public:
  using space = typename Exec::memory_space;

  //! E experts, at most max_tokens tokens a forward; coeff 0 turns the loss off.
  [[nodiscard]] static expected<router_z_loss> make(int num_experts, int max_tokens, double coeff) {
    if (!(std::isfinite(coeff) && coeff >= 0))
      return make_error(errc::invalid_argument,
                        "z-loss: the coefficient must be finite and >= 0 (0 turns it off)");
    if (num_experts < 1 || num_experts > kernels::logsumexp_block_kernel::max_experts ||
        max_tokens < 0)
      return make_error(errc::invalid_size,
                        "z-loss: need 1 <= num_experts <= " +
                            detail::to_decimal(kernels::logsumexp_block_kernel::max_experts) +
                            " and max_tokens >= 0");
    router_z_loss z;
    z.experts_ = num_experts;
    z.max_tokens_ = max_tokens;
    z.coeff_ = coeff;
    return z;
  }

  [[nodiscard]] bool on() const noexcept { return coeff_ > 0; }
  //! Bytes one forward keeps until its backward.
  [[nodiscard]] std::size_t saved_bytes() const {
    workspace_carver c;
    (void)carve(c);
    return c.required();
  }

  //! The z-loss of logits [N, E] over a tp-cp group of `group_size` ranks (its value in `saved`:
  //! loss()).
  [[nodiscard]] expected<z_loss_record<R>> forward(Exec& exec, row_view<const R, space> logits,
                                                   row_view<const std::uint8_t, space> padding,
                                                   int group_size, std::span<std::byte> saved) {
    const int n = logits.rows();
    if (auto st = check(logits, padding); !st) return unexpected<error>(st.error());
    z_loss_record<R> rec{.on = on(), .num_tokens = n};
    if (!rec.on) return rec;
    if (group_size < 1) return make_error(errc::invalid_size, "z-loss: group_size must be >= 1");
    rec.coeff = static_cast<R>(coeff_ / group_size);
    workspace_carver c(saved);
    const views v = carve(c);
    if (!c.fits())
      return make_error(errc::workspace_too_small,
                        "z-loss: the saved bytes are fewer than saved_bytes() = " +
                            detail::to_decimal(saved_bytes()));
    if (auto st = detail::by_router_team(experts_,
                                         [&]<class Team>() {
                                           const kernels::basic_logsumexp_kernel<Team, R> k{
                                               .logits = logits.data(),
                                               .padding = pad(padding),
                                               .num_tokens = n,
                                               .num_experts = experts_,
                                               .lse = v.lse.data()};
                                           return detail::launch_per_token<Team>(exec, k, n);
                                         });
        !st)
      return unexpected<error>(st.error());
    const kernels::z_loss_total_kernel<R> total{.lse = v.lse.data(),
                                                .padding = pad(padding),
                                                .num_tokens = n,
                                                .coeff = rec.coeff,
                                                .loss = v.loss.data(),
                                                .valid = v.valid.data()};
    if (auto st = launch(exec, launch_grid{.blocks = 1, .smem_bytes = total.smem_bytes}, total);
        !st)
      return unexpected<error>(st.error());
    return rec;
  }

  //! The loss value [1, 1] of the forward whose saved bytes these are (this rank's part).
  [[nodiscard]] row_view<const R, space> loss(std::span<std::byte> saved) const {
    workspace_carver c(saved);
    return carve(c).loss;
  }

  //! Adds seed * d z-loss / d logits to dlogits [N, E].
  [[nodiscard]] status backward(Exec& exec, row_view<const R, space> logits,
                                row_view<const std::uint8_t, space> padding,
                                const z_loss_record<R>& rec, std::span<std::byte> saved, R seed,
                                row_view<R, space> dlogits) const {
    if (!rec.on) return {};
    const int n = logits.rows();
    if (auto st = check(logits, padding); !st) return st;
    if (n != rec.num_tokens || dlogits.rows() != n || dlogits.width() != experts_ ||
        !dlogits.contiguous())
      return make_error(errc::shape_mismatch,
                        "z-loss: backward needs the forward's logits and dlogits [N, E] with N = " +
                            detail::to_decimal(rec.num_tokens));
    workspace_carver c(saved);
    const views v = carve(c);
    if (!c.fits())
      return make_error(errc::workspace_too_small,
                        "z-loss: the saved bytes are fewer than saved_bytes()");
    return detail::by_router_team(experts_, [&]<class Team>() {
      const kernels::basic_z_loss_backward_kernel<Team, R> k{.logits = logits.data(),
                                                             .padding = pad(padding),
                                                             .lse = v.lse.data(),
                                                             .valid = v.valid.data(),
                                                             .num_tokens = n,
                                                             .num_experts = experts_,
                                                             .coeff = rec.coeff,
                                                             .seed = seed,
                                                             .dlogits = dlogits.data()};
      return detail::launch_per_token<Team>(exec, k, n);
    });
  }

 private:
  struct views {
    row_view<R, space> lse;      // [1, N]
    row_view<int, space> valid;  // [1, 1]
    row_view<R, space> loss;     // [1, 1]
  };
  views carve(workspace_carver& c) const {
    views v;
    v.lse = row_view<R, space>(c.take<R>(detail::uz(max_tokens_)).data(), 1, max_tokens_);
    v.valid = row_view<int, space>(c.take<int>(1).data(), 1, 1);
    v.loss = row_view<R, space>(c.take<R>(1).data(), 1, 1);
    return v;
  }
  static const std::uint8_t* pad(row_view<const std::uint8_t, space> p) noexcept {
    return p.empty() ? nullptr : p.data();
  }
  status check(row_view<const R, space> logits, row_view<const std::uint8_t, space> padding) const {
    const int n = logits.rows();
    if (logits.width() != experts_ || !logits.contiguous() || n > max_tokens_)
      return make_error(
          errc::shape_mismatch,
          "z-loss: logits must be contiguous [N, E] with E = " + detail::to_decimal(experts_) +
              " and N <= max_tokens = " + detail::to_decimal(max_tokens_));
    if (!padding.empty() && (padding.rows() != 1 || padding.width() != n || !padding.contiguous()))
      return make_error(errc::shape_mismatch, "z-loss: the padding mask must be [1, N] or empty");
    return {};
  }

  int experts_ = 0, max_tokens_ = 0;
  double coeff_ = 0.0;
};

}  // namespace v0_1
}  // namespace moefold
