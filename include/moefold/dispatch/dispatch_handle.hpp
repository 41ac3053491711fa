//! @file dispatch_handle.hpp
//! @brief The typed handle a dispatcher's dispatch() returns and only its combine() and backward
//! accept, and the byte accounting every dispatcher reports.
#pragma once

#include <cstdint>
#include <span>

#include "../core/expected.hpp"
#include "../core/memory_space.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "expert_batch.hpp"
#include "permute.hpp"

namespace moefold {
inline namespace v0_1 {

//! Rows and bytes one collective sent from this rank to other ranks.
struct comm_volume {
  long long rows = 0;
  long long bytes = 0;
};

//! Per-step byte accounting of one dispatch/combine round trip (forward). The dispatch's rows are
//! packed rows (the token row, its probabilities, zeros to a multiple of 16 bytes: the
//! dispatchers' packed_width()), counted at their packed size.
struct dispatch_volume {
  comm_volume count_gather;  //!< per-expert counts (or token counts), AllGather over tp-ep
  comm_volume dispatch_a2a;  //!< packed rows (token row and probability), All-to-All-V over EP
  comm_volume dispatch_agv;  //!< packed rows, AllGather-V over ETP (All-to-All path) or tp-ep
                             //!< (AllGather path, with the expert ids)
  comm_volume combine_rsv;   //!< ReduceScatter-V over ETP (All-to-All path) or tp-ep (AllGather)
  comm_volume combine_a2a;   //!< All-to-All-V back over EP
};

namespace detail {
//! Who last dispatched into a workspace: written at the start of its host part by every dispatch,
//! so a handle can tell whether its workspace still holds its dispatch.
struct dispatch_stamp {
  const void* owner = nullptr;
  std::uint64_t serial = 0;
};
}  // namespace detail

//! What dispatch() hands to combine() and the backward: views into the workspace of its dispatch
//! (the batch in the context's memory space, the bookkeeping in its host part), valid while that
//! workspace's saved and host parts are not given to another dispatch. Several handles of one
//! dispatcher may be in flight (pipeline schedules: F1 F2 B2 B1), each with its own saved and host
//! parts; they may share one scratch part (calls never overlap). The dispatcher that made a
//! handle checks it, and refuses, with an error before any collective runs, a handle of another
//! dispatcher or one whose workspace a later dispatch has reused (the stamp in its host part).
template <class Dispatcher>
class dispatch_handle {
 public:
  using value_type = typename Dispatcher::value_type;
  using prob_type = typename Dispatcher::prob_type;
  using space = typename Dispatcher::space;

  //! The rows this rank's local experts compute, grouped by local expert, in the context's
  //! memory space: what an expert functor takes (experts/expert_fn.hpp). The row ranges are the
  //! host counts, or the offsets on the context where the dispatch read none back.
  [[nodiscard]] expert_batch<value_type, prob_type, space> batch() const noexcept {
    return {.counts = per_expert_, .x = x_, .probs = p_, .offsets = offsets_};
  }
  //! The batch's rows [M, H] and probabilities [M, 1], in the context's memory space. In a
  //! context's device memory the rows start 16 bytes apart (stride: H padded up); in host memory
  //! they are contiguous (batch()).
  [[nodiscard]] row_view<const value_type, space> batch_rows() const noexcept { return x_; }
  [[nodiscard]] row_view<const prob_type, space> batch_probs() const noexcept { return p_; }
  //! Rows per local expert [L] (host memory; rows of local expert l follow those of l - 1).
  //! Empty when the dispatch left them on the context: see batch_offsets().
  [[nodiscard]] std::span<const int> batch_counts() const noexcept { return per_expert_; }
  //! The first row of each local expert [1, L + 1] in the context's memory, where the dispatch
  //! did not bring the counts to the host (batch_counts() empty: dispatch_input::
  //! every_pair_routed with EP = ETP = 1 on a context that runs kernels); empty otherwise. The
  //! last entry is the rows the record routes, M for a record that keeps its word.
  [[nodiscard]] row_view<const int, space> batch_offsets() const noexcept { return offsets_; }
  //! Rows of batch() (M).
  [[nodiscard]] int num_rows() const noexcept { return p_.rows(); }
  //! Tokens of this rank (N).
  [[nodiscard]] int num_tokens() const noexcept { return num_tokens_; }
  //! Rows and bytes each collective of the round trip sent (combine fills its part).
  [[nodiscard]] const dispatch_volume& volume() const noexcept { return volume_; }

 private:
  friend Dispatcher;
  const void* owner_ = nullptr;
  std::uint64_t serial_ = 0;
  const detail::dispatch_stamp* stamp_ = nullptr;
  int hidden_ = 0;
  int num_tokens_ = 0;
  basic_permute_plan<space> plan_{};
  bool plan_unchecked_ = false;  // its record's faults are still in plan_'s status row
  std::span<const int> per_expert_;
  row_view<const int, space> offsets_{};  // batch_offsets()
  bool routed_unchecked_ = false;  // every_pair_routed taken on trust: device_status() checks it
  row_view<value_type, space> x_{};
  row_view<prob_type, space> p_{};
  dispatch_volume volume_{};
  typename Dispatcher::state st_{};

  // Issued by `owner` as its dispatch number `serial`, stamped into its workspace's host part.
  void issue(const void* owner, std::uint64_t serial, detail::dispatch_stamp* stamp, int hidden,
             int num_tokens) noexcept {
    owner_ = owner;
    serial_ = serial;
    *stamp = {owner, serial};
    stamp_ = stamp;
    hidden_ = hidden;
    num_tokens_ = num_tokens;
  }
  // A handle of `owner` whose workspace still holds its dispatch, or an error (before any
  // collective runs).
  [[nodiscard]] status check_issued_by(const void* owner) const {
    if (owner_ != owner)
      return make_error(errc::invalid_argument,
                        "dispatcher: the handle comes from another dispatcher");
    if (stamp_ == nullptr || stamp_->owner != owner || stamp_->serial != serial_)
      return make_error(errc::invalid_argument,
                        "dispatcher: the handle's workspace has been reused by a later dispatch "
                        "(give each dispatch in flight its own saved and host parts)");
    return {};
  }
};

}  // namespace v0_1
}  // namespace moefold
