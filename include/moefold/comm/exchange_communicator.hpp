//! @file exchange_communicator.hpp
//! @brief A host communicator over a run-time backend of two byte collectives (exchange_backend:
//! an all-gather of equal parts and an all-to-all of variable parts), so that code instantiated
//! once against exchange_communicator (the layer, in a unit that includes no framework header)
//! runs over whatever group a program hands it at run time: a PyTorch ProcessGroup
//! (comm/torch/torch_communicator.hpp), or any transport a trainer already has.
//!
//! The backend moves bytes; everything moefold promises is done here, the same for every backend:
//! - every collective first all-gathers moefold's collective headers (what each rank sends to
//!   and expects from each peer; comm/schedule.hpp), and every rank checks every pair, so a rank
//!   calling another collective, counts that disagree, or a rank that rejected its own arguments
//!   become the same error on every rank before any data moves (transports such as gloo check no
//!   counts: too many rows abort the receiver, too few leave stale rows);
//! - reductions never use the transport's arithmetic: the parts travel by all-to-all into a
//!   staging area and are summed in rank order in the accumulator type (fp32 for 16-bit floats),
//!   so results equal the thread world's and MPI's bit for bit;
//! - all_gather_v pads every part to the largest (transports refuse unequal all-gathers);
//! - a backend error (a dead peer, a timeout) breaks the communicator: that call and every later
//!   one return an error (errc::comm_broken after the first), never a hang.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../exec/host_exec.hpp"
#include "communicator.hpp"
#include "schedule.hpp"
#include "span_collectives.hpp"

namespace moefold {
inline namespace v0_1 {

//! What an exchange_communicator runs on: a fixed group of ranks and two collectives on host
//! bytes, called by every rank in the same order (the communicator has checked the counts of
//! every pair before it calls either). Both return an error instead of waiting forever: a dead
//! peer at once or at the transport's timeout (errc::comm_peer_failed, errc::comm_timeout), any
//! other failure as errc::backend_error; after an error the communicator calls neither again.
class exchange_backend {
 public:
  virtual ~exchange_backend() = default;
  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  //! What runs underneath, for messages ("gloo", "thread world").
  [[nodiscard]] virtual std::string name() const = 0;
  //! Every rank's `mine` (the same length on every rank) lands in `all` at rank * mine.size().
  [[nodiscard]] virtual status all_gather(std::span<const std::byte> mine,
                                          std::span<std::byte> all) = 0;
  //! send_bytes[p] bytes from `send` at send_offsets[p] go to rank p; recv_bytes[p] bytes from
  //! rank p land in `recv` at recv_offsets[p]. Send parts may overlap one another (the same part
  //! to every peer); receive parts do not, nor do they overlap the send parts.
  [[nodiscard]] virtual status all_to_all_v(const std::byte* send,
                                            std::span<const std::int64_t> send_bytes,
                                            std::span<const std::int64_t> send_offsets,
                                            std::byte* recv,
                                            std::span<const std::int64_t> recv_bytes,
                                            std::span<const std::int64_t> recv_offsets) = 0;
};

//! The backend of a group of one rank (a kind of group a mapping leaves at size 1, e.g. ETP = 1):
//! both collectives are copies.
class single_rank_exchange final : public exchange_backend {
 public:
  [[nodiscard]] int rank() const noexcept override { return 0; }
  [[nodiscard]] int size() const noexcept override { return 1; }
  [[nodiscard]] std::string name() const override { return "one rank"; }
  [[nodiscard]] status all_gather(std::span<const std::byte> mine,
                                  std::span<std::byte> all) override {
    if (all.size() < mine.size())
      return make_error(errc::workspace_too_small, "single_rank_exchange: all_gather's buffer");
    std::memmove(all.data(), mine.data(), mine.size());
    return {};
  }
  [[nodiscard]] status all_to_all_v(const std::byte* send, std::span<const std::int64_t> sb,
                                    std::span<const std::int64_t> so, std::byte* recv,
                                    std::span<const std::int64_t> rb,
                                    std::span<const std::int64_t> ro) override {
    if (sb.size() != 1 || rb.size() != 1 || sb[0] != rb[0])
      return make_error(errc::shape_mismatch,
                        "single_rank_exchange: all_to_all_v sends and receives one equal part");
    if (sb[0] > 0) std::memmove(recv + ro[0], send + so[0], detail::uz(sb[0]));
    return {};
  }
};

//! One rank's communicator over an exchange_backend (host buffers, host_exec). Move-only; owns
//! its backend.
class exchange_communicator : public span_collectives<exchange_communicator, host_space> {
  using spans = span_collectives<exchange_communicator, host_space>;

 public:
  using memory_space = host_space;

  //! Over `backend` (not null; its rank and size within the group it serves).
  [[nodiscard]] static expected<exchange_communicator> make(
      std::unique_ptr<exchange_backend> backend) {
    if (!backend)
      return make_error(errc::invalid_argument, "exchange_communicator: the backend is null");
    if (backend->size() < 1 || backend->rank() < 0 || backend->rank() >= backend->size())
      return make_error(errc::rank_out_of_range, "exchange_communicator: backend rank " +
                                                     detail::num(backend->rank()) + " of size " +
                                                     detail::num(backend->size()));
    exchange_communicator c;
    c.rank_ = backend->rank();
    c.size_ = backend->size();
    c.backend_ = std::move(backend);
    return c;
  }

  exchange_communicator(exchange_communicator&&) noexcept = default;
  exchange_communicator& operator=(exchange_communicator&&) noexcept = default;
  exchange_communicator(const exchange_communicator&) = delete;
  exchange_communicator& operator=(const exchange_communicator&) = delete;
  ~exchange_communicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! The backend (null once moved from).
  [[nodiscard]] exchange_backend* backend() const noexcept { return backend_.get(); }
  //! True after a backend error, a mismatch or fail(): every later call is errc::comm_broken.
  [[nodiscard]] bool broken() const noexcept { return broken_; }
  //! The context of the span forms.
  [[nodiscard]] host_exec default_exec() const noexcept { return {}; }

  using spans::all_gather;
  using spans::all_gather_v;
  using spans::all_to_all_v;
  using spans::reduce_scatter_v;

  // --- row views (counts in rows) -----------------------------------------------------------

  template <transferable T>
  [[nodiscard]] status all_to_all_v(host_exec&, row_view<const T> send,
                                    std::span<const int> send_counts, row_view<T> recv,
                                    std::span<const int> recv_counts) {
    auto s = detail::rows_schedule("all_to_all_v", send, recv, [&](int w) {
      return schedule_builder::all_to_all_v(rank_, size_, send_counts, recv_counts,
                                            detail::uz(send.rows()), detail::uz(recv.rows()), w);
    });
    return run(collective::all_to_all_v, s, call_info_of<T>(), [&]() -> status {
      return move_bytes(*s, sizeof(T), reinterpret_cast<const std::byte*>(send.data()),
                        reinterpret_cast<std::byte*>(recv.data()));
    });
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(host_exec&, row_view<const T> send, row_view<T> recv,
                                    std::span<const int> counts) {
    auto s = detail::rows_schedule("all_gather_v", send, recv, [&](int w) {
      return schedule_builder::all_gather_v(rank_, size_, counts, detail::uz(send.rows()),
                                            detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather_v, s, call_info_of<T>(), [&]() -> status {
      return gather_padded(*s, sizeof(T), reinterpret_cast<const std::byte*>(send.data()),
                           reinterpret_cast<std::byte*>(recv.data()));
    });
  }

  template <transferable T>
  [[nodiscard]] status all_gather(host_exec&, row_view<const T> send, row_view<T> recv) {
    auto s = detail::rows_schedule("all_gather", send, recv, [&](int w) {
      return schedule_builder::all_gather(rank_, size_, detail::uz(send.rows()),
                                          detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather, s, call_info_of<T>(), [&]() -> status {
      return gather_padded(*s, sizeof(T), reinterpret_cast<const std::byte*>(send.data()),
                           reinterpret_cast<std::byte*>(recv.data()));
    });
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(host_exec&, row_view<const T> send,
                                        std::span<const int> counts, row_view<T> recv,
                                        reduce_op op) {
    auto s = detail::rows_schedule("reduce_scatter_v", send, recv, [&](int w) {
      return schedule_builder::reduce_scatter_v(rank_, size_, counts, detail::uz(send.rows()),
                                                detail::uz(recv.rows()), w);
    });
    return run(
        collective::reduce_scatter_v, s, call_info_of<T>(static_cast<int>(op)), [&]() -> status {
          // Chunk p of every rank lands in staging slot p; then a rank-order reduction.
          T* stage = scratch<T>(detail::uz(s->recv_extent()));
          if (auto st = move_bytes(*s, sizeof(T), reinterpret_cast<const std::byte*>(send.data()),
                                   reinterpret_cast<std::byte*>(stage));
              !st)
            return st;
          reduce_slots(stage, s->recv_offsets(), s->result_count(), recv.data(), op);
          return {};
        });
  }

  template <reducible T>
  [[nodiscard]] status all_reduce(host_exec&, row_view<T> buf, reduce_op op) {
    return all_reduce(detail::flat(buf), op);
  }

  template <transferable T>
  [[nodiscard]] status broadcast(host_exec&, row_view<T> buf, int root) {
    return broadcast(detail::flat(buf), root);
  }

  [[nodiscard]] status barrier(host_exec&) { return barrier(); }

  // --- element forms -------------------------------------------------------------------------

  //! In place: element i is reduced by the rank owning its part (parts of n / size elements, the
  //! first n % size one longer), in rank order, then the parts are gathered back.
  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    auto s = schedule_builder::all_reduce(rank_, size_, buf.size());
    return run(collective::all_reduce, s, call_info_of<T>(static_cast<int>(op)), [&]() -> status {
      const auto n = static_cast<std::int64_t>(buf.size());
      const std::int64_t P = size_;
      std::vector<std::int64_t> part(detail::uz(size_)), at(detail::uz(size_));
      for (std::int64_t p = 0, o = 0; p < P; ++p) {
        part[detail::uz(p)] = n / P + (p < n % P ? 1 : 0);
        at[detail::uz(p)] = o;
        o += part[detail::uz(p)];
      }
      const std::int64_t mine = part[detail::uz(rank_)];
      // [size, mine]: every rank's copy of my part, then reduced into [mine] after it.
      T* stage = scratch<T>(detail::uz(mine * (P + 1)));
      std::vector<std::int64_t> sb(detail::uz(size_)), so(detail::uz(size_)), rb(detail::uz(size_)),
          ro(detail::uz(size_));
      for (std::int64_t p = 0; p < P; ++p) {
        const auto q = detail::uz(p);
        sb[q] = part[q] * static_cast<std::int64_t>(sizeof(T));
        so[q] = at[q] * static_cast<std::int64_t>(sizeof(T));
        rb[q] = mine * static_cast<std::int64_t>(sizeof(T));
        ro[q] = p * mine * static_cast<std::int64_t>(sizeof(T));
      }
      if (auto st = data_phase(reinterpret_cast<const std::byte*>(buf.data()), sb, so,
                               reinterpret_cast<std::byte*>(stage), rb, ro);
          !st)
        return st;
      std::vector<std::int64_t> slot(detail::uz(size_));
      for (std::int64_t p = 0; p < P; ++p) slot[detail::uz(p)] = p * mine;
      T* reduced = stage + P * mine;
      reduce_slots(stage, slot, mine, reduced, op);
      // Every rank's reduced part, padded to the longest (the first), back into buf.
      return gather_parts(reinterpret_cast<const std::byte*>(reduced), part, at, sizeof(T),
                          reinterpret_cast<std::byte*>(buf.data()));
    });
  }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    auto s = schedule_builder::broadcast(rank_, size_, buf.size(), root);
    return run(collective::broadcast, s, call_info_of<T>(), [&]() -> status {
      // The root sends from a copy: a transport's send and receive areas do not overlap.
      const std::byte* from = nullptr;
      if (rank_ == root) {
        T* copy = scratch<T>(buf.size());
        std::copy(buf.begin(), buf.end(), copy);
        from = reinterpret_cast<const std::byte*>(copy);
      }
      return move_bytes(*s, sizeof(T), from, reinterpret_cast<std::byte*>(buf.data()));
    });
  }

  //! The header exchange is itself a barrier: no rank completes it before all have entered.
  [[nodiscard]] status barrier() {
    return run(collective::barrier, schedule_builder::barrier(rank_, size_), call_info{},
               []() -> status { return {}; });
  }

  //! Takes part in the next collective as a failed rank (say, after an exception in its own
  //! code): every peer's collective returns errc::comm_peer_failed at once. Broken afterwards.
  [[nodiscard]] status fail(const std::string& why) {
    if (!backend_) return make_error(errc::comm_broken, "a moved-from exchange_communicator");
    const std::uint64_t call = seq_++;
    std::vector<collective_header> mine(
        detail::uz(size_), make_failure_header(collective::none, call, header_rank_failed));
    std::vector<collective_header> all(mine.size() * mine.size());
    static_cast<void>(gather_headers(mine, all));
    broken_ = true;
    why_ = "rank " + detail::num(rank_) + " failed: " + why;
    return make_error(errc::comm_peer_failed, why_);
  }

 private:
  exchange_communicator() = default;

  template <class T>
  T* scratch(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return reinterpret_cast<T*>(scratch_.data());
  }

  // Staged parts [slots] at `slot[p]` element offsets, reduced element-wise in rank order into
  // out[0, n).
  template <class T>
  static void reduce_slots(const T* stage, std::span<const std::int64_t> slot, std::int64_t n,
                           T* out, reduce_op op) {
    for (std::int64_t i = 0; i < n; ++i) {
      auto acc = detail::widen(stage[slot[0] + i]);
      for (std::size_t p = 1; p < slot.size(); ++p) {
        const auto x = detail::widen(stage[slot[p] + i]);
        acc = op == reduce_op::sum ? static_cast<decltype(acc)>(acc + x) : (acc < x ? x : acc);
      }
      out[i] = detail::narrow<T>(acc);
    }
  }

  // A checked backend call: a failure breaks the communicator.
  template <class F>
  status backend_call(F&& f) {
    status st = f();
    if (!st) {
      broken_ = true;
      why_ = st.error().message;
    }
    return st;
  }

  status data_phase(const std::byte* send, std::span<const std::int64_t> sb,
                    std::span<const std::int64_t> so, std::byte* recv,
                    std::span<const std::int64_t> rb, std::span<const std::int64_t> ro) {
    return backend_call([&] { return backend_->all_to_all_v(send, sb, so, recv, rb, ro); });
  }

  // The schedule's element counts and offsets in bytes, through the backend's all-to-all.
  status move_bytes(const collective_schedule& s, std::size_t elem, const std::byte* send,
                    std::byte* recv) {
    const auto e = static_cast<std::int64_t>(elem);
    std::vector<std::int64_t> sb(detail::uz(size_)), so(sb.size()), rb(sb.size()), ro(sb.size());
    for (int p = 0; p < size_; ++p) {
      const auto q = detail::uz(p);
      sb[q] = s.send_count(p) * e;
      so[q] = s.send_offset(p) * e;
      rb[q] = s.recv_count(p) * e;
      ro[q] = s.recv_offset(p) * e;
    }
    return data_phase(send, sb, so, recv, rb, ro);
  }

  // An all-gather of variable parts as the transport's all-gather of equal ones: every part
  // padded to the longest, then each copied to its place.
  status gather_padded(const collective_schedule& s, std::size_t elem, const std::byte* send,
                       std::byte* recv) {
    std::vector<std::int64_t> part(detail::uz(size_)), at(detail::uz(size_));
    for (int p = 0; p < size_; ++p) {
      part[detail::uz(p)] = s.recv_count(p);
      at[detail::uz(p)] = s.recv_offset(p);
    }
    return gather_parts(send, part, at, elem, recv);
  }

  // Rank p's part[p] elements (mine at `send`) into `recv` at at[p].
  status gather_parts(const std::byte* send, std::span<const std::int64_t> part,
                      std::span<const std::int64_t> at, std::size_t elem, std::byte* recv) {
    const auto e = static_cast<std::int64_t>(elem);
    const std::int64_t longest = *std::max_element(part.begin(), part.end()) * e;
    if (longest == 0) return {};
    // [1 + size, longest] bytes: my padded part, then everyone's.
    gather_.assign(detail::uz(longest * (size_ + 1)), std::byte{0});
    const std::int64_t mine = part[detail::uz(rank_)] * e;
    if (mine > 0) std::memcpy(gather_.data(), send, detail::uz(mine));
    const std::span<const std::byte> out(gather_.data(), detail::uz(longest));
    const std::span<std::byte> all(gather_.data() + longest, detail::uz(longest * size_));
    if (auto st = backend_call([&] { return backend_->all_gather(out, all); }); !st) return st;
    for (int p = 0; p < size_; ++p) {
      const std::int64_t n = part[detail::uz(p)] * e;
      if (n > 0)
        std::memcpy(recv + at[detail::uz(p)] * e,
                    all.data() + static_cast<std::int64_t>(p) * longest, detail::uz(n));
    }
    return {};
  }

  // Every rank's headers (one per peer) into all [size, size]: all[q * size + p] is what rank q
  // sends to rank p.
  status gather_headers(const std::vector<collective_header>& mine,
                        std::vector<collective_header>& all) {
    return backend_call([&] {
      return backend_->all_gather(std::as_bytes(std::span(mine)),
                                  std::as_writable_bytes(std::span(all)));
    });
  }

  // One collective: headers, every pair checked on every rank (so every rank reaches the same
  // verdict, naming the same first pair), then the data.
  template <class F>
  status run(collective op, const expected<collective_schedule>& s, const call_info& info,
             F&& data) {
    if (!backend_) return make_error(errc::comm_broken, "a moved-from exchange_communicator");
    if (broken_)
      return make_error(errc::comm_broken,
                        "the communicator is broken by an earlier failure (" + why_ + ")");
    const std::uint64_t call = seq_++;
    std::vector<collective_header> mine(detail::uz(size_));
    for (int p = 0; p < size_; ++p)
      mine[detail::uz(p)] = s ? make_header(*s, p, call, info)
                              : make_failure_header(op, call, header_rejected_arguments);
    std::vector<collective_header> all(mine.size() * mine.size());
    if (auto st = gather_headers(mine, all); !st) return st;
    if (!s) {  // my peers learn it from my header; I return my own reason
      broken_ = true;
      why_ = s.error().message;
      return unexpected<error>(s.error());
    }
    const auto header = [&](int from, int to) -> const collective_header& {
      return all[detail::uz(from) * detail::uz(size_) + detail::uz(to)];
    };
    const auto refuse = [&](status st) {
      // Not run anywhere; the ranks are still in step, but a mismatch is a program bug.
      broken_ = true;
      why_ = st.error().message;
      return st;
    };
    // A rank that rejected its arguments or failed, named first (the lowest); then every pair,
    // each once, in the same order on every rank.
    for (int q = 0; q < size_; ++q)
      if (header(q, rank_).failed != header_ok)
        return refuse(check_headers(header(rank_, q), header(q, rank_), rank_, q));
    for (int a = 0; a < size_; ++a)
      for (int b = a; b < size_; ++b)
        if (auto st = check_headers(header(a, b), header(b, a), a, b); !st) return refuse(st);
    return data();
  }

  std::unique_ptr<exchange_backend> backend_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t seq_ = 0;
  bool broken_ = false;
  std::string why_;
  std::vector<std::byte> scratch_;  // staging of the reductions, the broadcast root's copy
  std::vector<std::byte> gather_;   // the padded all-gather
};

static_assert(communicator<exchange_communicator>);
static_assert(communicator_for<exchange_communicator, host_exec>);

}  // namespace v0_1
}  // namespace moefold
