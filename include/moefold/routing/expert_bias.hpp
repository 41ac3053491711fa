//! @file expert_bias.hpp
//! @brief Auxiliary-loss-free load balancing (arXiv 2408.15664; Megatron-Core
//! moe_router_enable_expert_bias) on an execution context: the per-expert fp32 bias that steers
//! the router's selection (topk_router reads it), the rows each expert received this global batch
//! (added once per training forward), and the update once per global batch from those counts
//! summed over TP x DP x CP: bias += rate * sign(mean(c) - c), the counts reset. One
//! implementation for every context (kernels/expert_bias.hpp); counts are whole numbers in fp32
//! (exact below 2^24 per expert and global batch).
#pragma once

#include <cmath>
#include <span>
#include <vector>

#include <moefold/kernels/expert_bias.hpp>

#include "../comm/communicator.hpp"
#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"
#include "../exec/exec_buffer.hpp"

namespace moefold {
inline namespace v0_1 {

template <class Exec>
class expert_bias {
 public:
  using space = typename Exec::memory_space;

  //! E experts, the update rate u; the bias, the counts and the update's scratch [1, E] each,
  //! zeroed, on `exec` (which must outlive the object: they are freed there).
  [[nodiscard]] static expected<expert_bias> make(Exec& exec, int num_experts, float rate) {
    if (num_experts < 1)
      return make_error(errc::invalid_size, "expert bias: num_experts must be >= 1");
    if (!(std::isfinite(rate) && rate >= 0))
      return make_error(errc::invalid_argument,
                        "expert bias: the update rate must be finite and >= 0");
    expert_bias b;
    b.experts_ = num_experts;
    b.rate_ = rate;
    exec_buffer<float, Exec>* parts[3] = {&b.bias_, &b.counts_, &b.summed_};
    for (exec_buffer<float, Exec>* buf : parts) {
      auto v = exec_buffer<float, Exec>::make(exec, 1, num_experts);
      if (!v) return unexpected<error>(v.error());
      *buf = std::move(*v);
      if (auto st = exec.template fill<float>(buf->view(), 0.0f); !st)
        return unexpected<error>(st.error());
    }
    return b;
  }

  [[nodiscard]] int num_experts() const noexcept { return experts_; }
  //! The bias [1, E] (the router's expert_bias view).
  [[nodiscard]] row_view<const float, space> bias() const noexcept { return bias_.cview(); }
  //! This global batch's rows per expert so far [1, E].
  [[nodiscard]] row_view<const float, space> counts() const noexcept { return counts_.cview(); }

  //! Adds one training forward's rows per expert: routed - dropped + padded (each [1, E] int on
  //! the context; dropped and padded empty when `routed` already counts the rows received).
  [[nodiscard]] status add_counts(Exec& exec, row_view<const int, space> routed,
                                  row_view<const int, space> dropped = {},
                                  row_view<const int, space> padded = {}) {
    const auto fits = [&](const row_view<const int, space>& v, bool may_be_empty) {
      return (may_be_empty && v.empty()) ||
             (v.rows() == 1 && v.width() == experts_ && v.contiguous());
    };
    if (!fits(routed, false) || !fits(dropped, true) || !fits(padded, true))
      return make_error(errc::shape_mismatch, "expert bias: the counts must be [1, E] with E = " +
                                                  detail::to_decimal(experts_) +
                                                  " (dropped and padded may be empty)");
    const kernels::expert_counts_accumulate_kernel k{
        .counts = routed.data(),
        .num_experts = experts_,
        .local = counts_.view().data(),
        .dropped = dropped.empty() ? nullptr : dropped.data(),
        .padded = padded.empty() ? nullptr : padded.data()};
    return launch(exec, launch_grid{.blocks = capped_blocks<Exec>(experts_, k.block_threads)}, k);
  }

  //! Once per global batch, after its last backward: the counts summed over tp_dp_cp, the
  //! update, the counts reset. Collective over tp_dp_cp. A failed reduction changes nothing.
  template <class Comm>
  [[nodiscard]] status update(Exec& exec, Comm& tp_dp_cp) {
    if (auto st = exec.copy(counts_.cview(), summed_.view()); !st) return st;
    if (tp_dp_cp.size() > 1)
      if (auto st = tp_dp_cp.all_reduce(exec, summed_.view(), reduce_op::sum); !st) return st;
    const kernels::expert_bias_update_kernel k{.summed = summed_.view().data(),
                                               .num_experts = experts_,
                                               .rate = rate_,
                                               .bias = bias_.view().data(),
                                               .local = counts_.view().data()};
    return launch(exec, launch_grid{.blocks = 1}, k);
  }

  //! The bias and the counts as host vectors (a checkpoint; synchronizes).
  [[nodiscard]] status save(Exec& exec, std::vector<float>& bias,
                            std::vector<float>& counts) const {
    bias.resize(detail::uz(experts_));
    counts.resize(detail::uz(experts_));
    if (auto st = exec.copy(bias_.cview(), row_view<float, host_space>(bias.data(), 1, experts_));
        !st)
      return st;
    if (auto st =
            exec.copy(counts_.cview(), row_view<float, host_space>(counts.data(), 1, experts_));
        !st)
      return st;
    return exec.synchronize();
  }
  //! A checkpoint's bias and counts (E finite values each, counts >= 0); checked first, so a
  //! refused state changes nothing.
  [[nodiscard]] status load(Exec& exec, std::span<const float> bias,
                            std::span<const float> counts) {
    if (bias.size() != detail::uz(experts_) || counts.size() != detail::uz(experts_))
      return make_error(errc::shape_mismatch,
                        "expert bias: load needs E = " + detail::to_decimal(experts_) +
                            " values of the bias and of the counts");
    for (std::size_t e = 0; e < bias.size(); ++e)
      if (!std::isfinite(bias[e]) || !std::isfinite(counts[e]) || counts[e] < 0)
        return make_error(errc::invalid_argument,
                          "expert bias: load needs finite values and counts >= 0");
    if (auto st =
            exec.copy(row_view<const float, host_space>(bias.data(), 1, experts_), bias_.view());
        !st)
      return st;
    return exec.copy(row_view<const float, host_space>(counts.data(), 1, experts_), counts_.view());
  }

 private:
  int experts_ = 0;
  float rate_ = 0.0f;
  exec_buffer<float, Exec> bias_{}, counts_{}, summed_{};  // [1, E] each
};

}  // namespace v0_1
}  // namespace moefold
