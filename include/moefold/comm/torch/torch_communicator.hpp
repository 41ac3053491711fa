//! @file torch_communicator.hpp
//! @brief moefold's collectives over a PyTorch process group (c10d::ProcessGroup; gloo for CPU
//! tensors): the group a trainer already has, taken from Python (moefold_torch) or from libtorch.
//!
//! torch_communicator is an exchange_communicator (comm/exchange_communicator.hpp) whose backend
//! moves host bytes with the group's all_gather_single and all_to_all_single on uint8 tensors
//! over the caller's memory (no copy, except that send parts which are not laid out in peer order,
//! a broadcast's, are packed first). So every moefold rule holds over torch as over MPI: the
//! collective headers are all-gathered and every rank checks every pair before data moves (gloo
//! checks no counts), sums never use the group's arithmetic (rank order, fp32 for 16-bit: the
//! thread world's bits), and all_gather_v pads to the largest part (gloo refuses unequal parts).
//!
//! Errors: c10d raises from Work::wait. A peer that died raises at once (a plain std::exception or
//! a c10::DistNetworkError: errc::comm_peer_failed); a stalled peer raises at the group's timeout
//! (the one given to init_process_group or new_group: errc::comm_timeout); anything else is
//! errc::backend_error. Each breaks the communicator (gloo's state is unknown after it): later
//! calls return errc::comm_broken. Nothing here throws.
//!
//! Needs torch's C++ headers and libraries (built with torch.utils.cpp_extension, or against
//! libtorch), as comm/mpi/ needs MPI's. Only the units that wrap a group include it: code
//! instantiated against exchange_communicator (the layer) includes no torch header.
#pragma once

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../core/expected.hpp"
#include "../exchange_communicator.hpp"

namespace moefold {
inline namespace v0_1 {

namespace detail {

//! The group's byte collectives as an exchange_backend.
class process_group_exchange final : public exchange_backend {
 public:
  explicit process_group_exchange(c10::intrusive_ptr<c10d::ProcessGroup> pg) : pg_(std::move(pg)) {}

  [[nodiscard]] int rank() const noexcept override { return pg_->getRank(); }
  [[nodiscard]] int size() const noexcept override { return pg_->getSize(); }
  [[nodiscard]] std::string name() const override {
    return "torch process group (" + pg_->getBackendName() + ")";
  }
  [[nodiscard]] const c10::intrusive_ptr<c10d::ProcessGroup>& group() const noexcept { return pg_; }

  [[nodiscard]] status all_gather(std::span<const std::byte> mine,
                                  std::span<std::byte> all) override {
    return guarded("all_gather_single", [&] {
      at::Tensor in = bytes(const_cast<std::byte*>(mine.data()), mine.size());
      at::Tensor out = bytes(all.data(), all.size());
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
      return pg_->all_gather_single(out, in);
#else
      return pg_->_allgather_base(out, in);
#endif
    });
  }

  [[nodiscard]] status all_to_all_v(const std::byte* send, std::span<const std::int64_t> send_bytes,
                                    std::span<const std::int64_t> send_offsets, std::byte* recv,
                                    std::span<const std::int64_t> recv_bytes,
                                    std::span<const std::int64_t> recv_offsets) override {
    // all_to_all_single takes split sizes: parts in peer order, each right after the last.
    std::vector<std::int64_t> in_splits(send_bytes.begin(), send_bytes.end()),
        out_splits(recv_bytes.begin(), recv_bytes.end());
    std::int64_t send_total = 0, recv_total = 0;
    bool send_packed = true;
    for (std::size_t p = 0; p < send_bytes.size(); ++p) {
      send_packed = send_packed && (send_bytes[p] == 0 || send_offsets[p] == send_total);
      send_total += send_bytes[p];
    }
    for (std::size_t p = 0; p < recv_bytes.size(); ++p) {
      if (recv_bytes[p] != 0 && recv_offsets[p] != recv_total)
        return make_error(errc::invalid_argument,
                          "torch_communicator: receive parts must lie in peer order");
      recv_total += recv_bytes[p];
    }
    const std::byte* from = send;
    if (!send_packed) {  // the same part to several peers (a broadcast's root): packed
      staging_.resize(static_cast<std::size_t>(send_total));
      std::int64_t at = 0;
      for (std::size_t p = 0; p < send_bytes.size(); ++p) {
        if (send_bytes[p] > 0)
          std::memcpy(staging_.data() + at, send + send_offsets[p],
                      static_cast<std::size_t>(send_bytes[p]));
        at += send_bytes[p];
      }
      from = staging_.data();
    }
    return guarded("all_to_all_single", [&] {
      at::Tensor in = bytes(const_cast<std::byte*>(from), static_cast<std::size_t>(send_total));
      at::Tensor out = bytes(recv, static_cast<std::size_t>(recv_total));
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
      return pg_->all_to_all_single(out, in, out_splits, in_splits);
#else
      return pg_->alltoall_base(out, in, out_splits, in_splits);
#endif
    });
  }

 private:
  // n bytes at p as a uint8 CPU tensor over that memory (a 1-byte dummy for none).
  at::Tensor bytes(std::byte* p, std::size_t n) {
    if (n == 0) p = &dummy_;
    return at::from_blob(p, {static_cast<std::int64_t>(n)},
                         at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  }

  // Starts a collective (`start` returns its Work) and waits for it; c10d's exceptions become
  // moefold errors.
  template <class Start>
  status guarded(const char* what, Start&& start) noexcept {
    const std::string where = name() + " " + what;
    try {
      c10::intrusive_ptr<c10d::Work> w = start();
      if (!w->wait()) return make_error(errc::comm_peer_failed, where + " was aborted");
      return {};
    } catch (const c10::DistNetworkError& e) {
      return classify(where, e.what_without_backtrace(), errc::comm_peer_failed);
    } catch (const c10::Error& e) {
      return classify(where, e.what_without_backtrace(), errc::backend_error);
    } catch (const std::exception& e) {  // gloo's own, when a peer's connection closes
      return classify(where, e.what(), errc::comm_peer_failed);
    } catch (...) {
      return make_error(errc::backend_error, where + " failed with an unknown exception");
    }
  }
  static status classify(const std::string& where, const std::string& what, errc otherwise) {
    const bool timed_out = what.find("timed out") != std::string::npos ||
                           what.find("Timed out") != std::string::npos ||
                           what.find("Timeout") != std::string::npos;
    if (timed_out)
      return make_error(errc::comm_timeout,
                        where +
                            " did not complete within the group's timeout (a peer is stuck "
                            "or not calling it): " +
                            what);
    return make_error(otherwise, where + " failed (" +
                                     (otherwise == errc::comm_peer_failed
                                          ? std::string("a peer died or closed its connection")
                                          : std::string("the process group's error")) +
                                     "): " + what);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::vector<std::byte> staging_;
  std::byte dummy_{};
};

}  // namespace detail

//! One rank's communicator over a torch process group. Move-only; holds a reference to the group
//! (which must not be destroyed by the trainer while moefold uses it: torch keeps it alive while
//! this reference lives).
class torch_communicator : public exchange_communicator {
 public:
  //! Over `group` (not null). Collective over nothing: every rank wraps its own handle.
  [[nodiscard]] static expected<torch_communicator> wrap(
      c10::intrusive_ptr<c10d::ProcessGroup> group) {
    if (!group)
      return make_error(errc::invalid_argument, "torch_communicator::wrap: the group is null");
    auto c = exchange_communicator::make(
        std::make_unique<detail::process_group_exchange>(std::move(group)));
    if (!c) return unexpected<error>(c.error());
    return torch_communicator(std::move(*c));
  }

  //! The process group (null once moved from).
  [[nodiscard]] c10::intrusive_ptr<c10d::ProcessGroup> group() const {
    const auto* b = dynamic_cast<const detail::process_group_exchange*>(backend());
    return b ? b->group() : c10::intrusive_ptr<c10d::ProcessGroup>();
  }

 private:
  explicit torch_communicator(exchange_communicator&& c) : exchange_communicator(std::move(c)) {}
};

static_assert(communicator<torch_communicator>);
static_assert(communicator_for<torch_communicator, host_exec>);

}  // namespace v0_1
}  // namespace moefold
