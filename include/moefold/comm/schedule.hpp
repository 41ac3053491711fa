//! @file schedule.hpp
//! @brief The collective schedule: for one rank of one collective, how many elements it sends to
//! and receives from each peer and at which offsets, with the counts validated. This is the one
//! place that computes offsets; every backend executes these schedules (the thread world and the
//! device loopback step by step, MPI and NCCL by handing the counts and offsets to the engine).
//!
//! Also here: the header two ranks exchange before the data of a collective moves, and the check
//! of a pair of headers, so that a rank calling a different collective than its peer, or counts
//! that disagree between a sender and its receiver, are reported as errors by every backend in the
//! same words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "communicator.hpp"

namespace moefold {
inline namespace v0_1 {

//! The collectives, as they are named in headers and messages.
enum class collective : std::uint8_t {
  none = 0,
  all_to_all_v,
  all_gather_v,
  reduce_scatter_v,
  all_gather,
  all_reduce,
  broadcast,
  barrier,
  split,
};

[[nodiscard]] constexpr const char* to_string(collective c) noexcept {
  switch (c) {
    case collective::none: return "none";
    case collective::all_to_all_v: return "all_to_all_v";
    case collective::all_gather_v: return "all_gather_v";
    case collective::reduce_scatter_v: return "reduce_scatter_v";
    case collective::all_gather: return "all_gather";
    case collective::all_reduce: return "all_reduce";
    case collective::broadcast: return "broadcast";
    case collective::barrier: return "barrier";
    case collective::split: return "split";
  }
  return "?";
}

//! One step of a schedule: this rank sends send_count elements from send_offset of its send buffer
//! to send_peer, and receives recv_count elements from recv_peer into recv_offset of its receive
//! area. Step i pairs peer (rank + i) % size with (rank - i) mod size, so that executing the steps
//! in order with blocking exchanges never deadlocks (step 0 is the copy to itself).
struct schedule_step {
  int send_peer = 0;
  std::int64_t send_offset = 0;
  std::int64_t send_count = 0;
  int recv_peer = 0;
  std::int64_t recv_offset = 0;
  std::int64_t recv_count = 0;
};

//! The schedule of one collective on one rank. Counts and offsets are in elements.
//!
//! The receive area is the output buffer for every collective except reduce_scatter_v, whose
//! receive area is a staging area of size() chunks (chunk p = what rank p sent, at p * result)
//! that the backend reduces in rank order into the result_count() elements of the output.
class collective_schedule {
 public:
  [[nodiscard]] collective op() const noexcept { return op_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! The broadcast root (-1 for the other collectives).
  [[nodiscard]] int root() const noexcept { return root_; }

  [[nodiscard]] std::int64_t send_count(int peer) const noexcept { return at(send_count_, peer); }
  [[nodiscard]] std::int64_t send_offset(int peer) const noexcept { return at(send_offset_, peer); }
  [[nodiscard]] std::int64_t recv_count(int peer) const noexcept { return at(recv_count_, peer); }
  [[nodiscard]] std::int64_t recv_offset(int peer) const noexcept { return at(recv_offset_, peer); }
  //! Per-peer arrays, for engines that take them whole (MPI_Ialltoallv).
  [[nodiscard]] std::span<const std::int64_t> send_counts() const noexcept { return send_count_; }
  [[nodiscard]] std::span<const std::int64_t> send_offsets() const noexcept { return send_offset_; }
  [[nodiscard]] std::span<const std::int64_t> recv_counts() const noexcept { return recv_count_; }
  [[nodiscard]] std::span<const std::int64_t> recv_offsets() const noexcept { return recv_offset_; }

  //! Elements read from the send buffer (one past the last one read).
  [[nodiscard]] std::int64_t send_extent() const noexcept { return send_extent_; }
  //! Elements of the receive area (the output, or reduce_scatter_v's staging area).
  [[nodiscard]] std::int64_t recv_extent() const noexcept { return recv_extent_; }
  //! Elements written to the output buffer.
  [[nodiscard]] std::int64_t result_count() const noexcept { return result_; }
  //! Elements per row: the builders take counts and buffer sizes in rows of this width (1 for
  //! the element-count collectives); counts and offsets here are in elements, 64-bit.
  [[nodiscard]] int width() const noexcept { return width_; }

  [[nodiscard]] int num_steps() const noexcept { return size_; }
  [[nodiscard]] schedule_step step(int i) const noexcept {
    const int to = (rank_ + i) % size_;
    const int from = ((rank_ - i) % size_ + size_) % size_;
    return {to, send_offset(to), send_count(to), from, recv_offset(from), recv_count(from)};
  }

 private:
  friend struct schedule_builder;
  static std::int64_t at(const std::vector<std::int64_t>& v, int i) noexcept {
    return v[static_cast<std::size_t>(i)];
  }

  collective op_ = collective::none;
  int rank_ = 0;
  int size_ = 1;
  int root_ = -1;
  int width_ = 1;
  std::vector<std::int64_t> send_count_, send_offset_, recv_count_, recv_offset_;
  std::int64_t send_extent_ = 0, recv_extent_ = 0, result_ = 0;
};

namespace detail {
inline std::string num(long long v) { return to_decimal(v); }
}  // namespace detail

//! Builds schedules. Each function checks its arguments (rank in range, one count per peer,
//! counts >= 0, totals that fit, buffers large enough) and computes the offsets as exclusive
//! prefix sums of the counts.
//!
//! Counts and buffer sizes are in rows of `width` elements (width 1: elements). A row count, or a
//! total of row counts, of 2^31 or more is errc::overflow; element offsets are 64-bit, so rows of
//! any width are addressed correctly.
struct schedule_builder {
  //! all_to_all_v: send_counts[j] elements to rank j, recv_counts[j] from rank j, both stored in
  //! peer order. send_size / recv_size: the buffers' sizes in elements.
  [[nodiscard]] static expected<collective_schedule> all_to_all_v(
      int rank, int size, std::span<const int> send_counts, std::span<const int> recv_counts,
      std::size_t send_size, std::size_t recv_size, int width = 1, collective_schedule reuse = {}) {
    auto s = start(collective::all_to_all_v, rank, size, width, std::move(reuse));
    if (!s) return s;
    if (auto ok = prefix(*s, send_counts, "send_counts", s->send_count_, s->send_offset_,
                         s->send_extent_);
        !ok)
      return unexpected<error>(ok.error());
    if (auto ok = prefix(*s, recv_counts, "recv_counts", s->recv_count_, s->recv_offset_,
                         s->recv_extent_);
        !ok)
      return unexpected<error>(ok.error());
    s->result_ = s->recv_extent_;
    return fits(std::move(*s), send_size, recv_size);
  }

  //! all_gather_v: rank i contributes counts[i] elements (the first counts[rank] of the send
  //! buffer); everyone receives all of them in rank order.
  [[nodiscard]] static expected<collective_schedule> all_gather_v(
      int rank, int size, std::span<const int> counts, std::size_t send_size, std::size_t recv_size,
      int width = 1, collective_schedule reuse = {}) {
    auto s = start(collective::all_gather_v, rank, size, width, std::move(reuse));
    if (!s) return s;
    if (auto ok = prefix(*s, counts, "counts", s->recv_count_, s->recv_offset_, s->recv_extent_);
        !ok)
      return unexpected<error>(ok.error());
    const std::int64_t mine = s->recv_count_[static_cast<std::size_t>(rank)];
    s->send_count_.assign(static_cast<std::size_t>(size), mine);
    s->send_offset_.assign(static_cast<std::size_t>(size), 0);
    s->send_extent_ = mine;
    s->result_ = s->recv_extent_;
    return fits(std::move(*s), send_size, recv_size);
  }

  //! reduce_scatter_v: the send buffer holds sum(counts) elements, chunk i (counts[i] elements at
  //! the prefix sum) going to rank i; rank i's result is the reduction of the chunks i of all
  //! ranks. The receive area is a staging area of size * counts[rank] elements.
  [[nodiscard]] static expected<collective_schedule> reduce_scatter_v(
      int rank, int size, std::span<const int> counts, std::size_t send_size, std::size_t recv_size,
      int width = 1, collective_schedule reuse = {}) {
    auto s = start(collective::reduce_scatter_v, rank, size, width, std::move(reuse));
    if (!s) return s;
    if (auto ok = prefix(*s, counts, "counts", s->send_count_, s->send_offset_, s->send_extent_);
        !ok)
      return unexpected<error>(ok.error());
    const std::int64_t mine = s->send_count_[static_cast<std::size_t>(rank)];
    s->recv_count_.assign(static_cast<std::size_t>(size), mine);
    s->recv_offset_.resize(static_cast<std::size_t>(size));
    for (int p = 0; p < size; ++p) s->recv_offset_[static_cast<std::size_t>(p)] = p * mine;
    s->recv_extent_ = static_cast<std::int64_t>(size) * mine;
    s->result_ = mine;
    return fits(std::move(*s), send_size, recv_size);
  }

  //! all_gather: count rows from every rank; recv_size >= size * count rows.
  [[nodiscard]] static expected<collective_schedule> all_gather(int rank, int size,
                                                                std::size_t count,
                                                                std::size_t recv_size,
                                                                int width = 1,
                                                                collective_schedule reuse = {}) {
    if (width < 0) return make_error(errc::invalid_size, "all_gather: row width must be >= 0");
    if (size > 0 && count > static_cast<std::size_t>(max_rows) / static_cast<std::size_t>(size))
      return make_error(errc::overflow, "all_gather: " + std::to_string(count) + " rows times " +
                                            detail::num(size) + " ranks reach 2^31 rows");
    const auto w = static_cast<std::size_t>(width);
    auto s = uniform(collective::all_gather, rank, size, count * w, std::move(reuse));
    if (!s) return s;
    s->width_ = width;
    const auto n = static_cast<std::int64_t>(count * w);
    for (int p = 0; p < size; ++p) s->recv_offset_[static_cast<std::size_t>(p)] = p * n;
    s->send_extent_ = n;
    s->recv_extent_ = s->result_ = n * size;
    return fits(std::move(*s), count, recv_size);
  }

  //! all_reduce of count elements in place: every rank exchanges its count elements with every
  //! rank (what the engine really does is its business; the counts are what peers check).
  [[nodiscard]] static expected<collective_schedule> all_reduce(int rank, int size,
                                                                std::size_t count,
                                                                collective_schedule reuse = {}) {
    auto s = uniform(collective::all_reduce, rank, size, count, std::move(reuse));
    if (!s) return s;
    s->send_extent_ = s->recv_extent_ = s->result_ = static_cast<std::int64_t>(count);
    return s;
  }

  //! broadcast of count elements from root.
  [[nodiscard]] static expected<collective_schedule> broadcast(int rank, int size,
                                                               std::size_t count, int root,
                                                               collective_schedule reuse = {}) {
    auto s = uniform(collective::broadcast, rank, size, 0, std::move(reuse));
    if (!s) return s;
    if (root < 0 || root >= size)
      return make_error(errc::rank_out_of_range, "broadcast root " + detail::num(root) +
                                                     " is not a rank of a communicator of size " +
                                                     detail::num(size));
    const auto n = static_cast<std::int64_t>(count);
    if (n < 0) return make_error(errc::overflow, "broadcast count does not fit in int64");
    s->root_ = root;
    if (rank == root) s->send_count_.assign(static_cast<std::size_t>(size), n);
    s->recv_count_[static_cast<std::size_t>(root)] = n;
    s->send_extent_ = rank == root ? n : 0;
    s->recv_extent_ = s->result_ = n;
    return s;
  }

  //! barrier: no data.
  [[nodiscard]] static expected<collective_schedule> barrier(int rank, int size,
                                                             collective_schedule reuse = {}) {
    return uniform(collective::barrier, rank, size, 0, std::move(reuse));
  }

  //! split: no data (color and key travel in the header's root and count fields).
  [[nodiscard]] static expected<collective_schedule> split(int rank, int size) {
    return uniform(collective::split, rank, size, 0, {});
  }

 private:
  // `reuse`: a schedule whose arrays are recycled (a communicator passes back its last one, so
  // that a steady stream of collectives allocates nothing once the arrays have grown).
  static expected<collective_schedule> start(collective op, int rank, int size, int width,
                                             collective_schedule&& reuse) {
    if (width < 0)
      return make_error(
          errc::invalid_size,
          std::string(to_string(op)) + ": row width must be >= 0 (got " + detail::num(width) + ")");
    if (size < 1)
      return make_error(errc::invalid_size, std::string(to_string(op)) +
                                                ": communicator size must be >= 1 (got " +
                                                detail::num(size) + ")");
    if (rank < 0 || rank >= size)
      return make_error(errc::rank_out_of_range,
                        std::string(to_string(op)) + ": rank " + detail::num(rank) +
                            " is outside a communicator of size " + detail::num(size));
    collective_schedule s = std::move(reuse);
    s.op_ = op;
    s.root_ = -1;
    s.send_extent_ = s.recv_extent_ = s.result_ = 0;
    s.rank_ = rank;
    s.size_ = size;
    s.width_ = width;
    return s;
  }

  static expected<collective_schedule> uniform(collective op, int rank, int size, std::size_t count,
                                               collective_schedule&& reuse) {
    auto s = start(op, rank, size, 1, std::move(reuse));
    if (!s) return s;
    const auto n = static_cast<std::int64_t>(count);
    if (n < 0 || (size > 1 && n > INT64_MAX / size))
      return make_error(errc::overflow, std::string(to_string(op)) + ": " + std::to_string(count) +
                                            " elements times " + detail::num(size) +
                                            " ranks do not fit in int64");
    const auto z = static_cast<std::size_t>(size);
    s->send_count_.assign(z, n);
    s->recv_count_.assign(z, n);
    s->send_offset_.assign(z, 0);
    s->recv_offset_.assign(z, 0);
    if (op == collective::barrier || op == collective::split || op == collective::broadcast) {
      s->send_count_.assign(z, 0);
      s->recv_count_.assign(z, 0);
    }
    return s;
  }

  // Exclusive prefix sums of `counts` into (count, offset); the total into `total`.
  static status prefix(const collective_schedule& s, std::span<const int> counts, const char* what,
                       std::vector<std::int64_t>& count, std::vector<std::int64_t>& offset,
                       std::int64_t& total) {
    const char* op = to_string(s.op_);  // messages are formatted only on an error
    if (counts.size() != static_cast<std::size_t>(s.size_))
      return make_error(errc::shape_mismatch,
                        std::string(op) + ": " + what + " has " + std::to_string(counts.size()) +
                            " entries; it needs one per rank (" + detail::num(s.size_) + ")");
    count.resize(counts.size());
    offset.resize(counts.size());
    const std::int64_t w = s.width_;
    std::int64_t run = 0;  // rows
    for (std::size_t p = 0; p < counts.size(); ++p) {
      if (counts[p] < 0)
        return make_error(errc::invalid_size, std::string(op) + ": " + what + "[" +
                                                  std::to_string(p) +
                                                  "] = " + detail::num(counts[p]) + " is negative");
      count[p] = counts[p] * w;
      offset[p] = run * w;
      run += counts[p];  // at most 2^31 * 2^31: cannot overflow int64
    }
    // Elements are 64-bit, but rows stay below 2^31 (views, and MPI's row datatypes, count rows
    // in int).
    if (run > max_rows)
      return make_error(errc::overflow, std::string(op) + ": " + what + " add up to " +
                                            detail::num(run) + " rows, 2^31 or more");
    total = run * w;
    return {};
  }

  // Buffer sizes in rows against the extents (elements / width).
  static expected<collective_schedule> fits(collective_schedule s, std::size_t send_size,
                                            std::size_t recv_size) {
    const std::int64_t w = s.width_ > 0 ? s.width_ : 1;
    const std::int64_t need = s.op_ == collective::reduce_scatter_v ? s.result_ : s.recv_extent_;
    const bool send_ok = static_cast<std::uint64_t>(s.send_extent_ / w) <= send_size;
    const bool recv_ok = static_cast<std::uint64_t>(need / w) <= recv_size;
    if (!send_ok || !recv_ok) {  // messages are formatted only on an error
      const std::string op = to_string(s.op_);
      const std::string unit =
          s.width_ == 1 ? " elements" : " rows (of " + detail::num(s.width_) + " elements)";
      if (!send_ok)
        return make_error(errc::shape_mismatch,
                          op + ": the send buffer holds " + std::to_string(send_size) + unit +
                              " but the counts need " + detail::num(s.send_extent_ / w));
      return make_error(errc::shape_mismatch, op + ": the receive buffer holds " +
                                                  std::to_string(recv_size) + unit +
                                                  " but the counts need " + detail::num(need / w));
    }
    return s;
  }
};

//! What rank a tells rank b before the data of a collective moves. Fixed layout (it travels as
//! bytes over MPI); every field is checked against b's own view by check_headers.
struct collective_header {
  std::uint64_t seq = 0;         //!< collectives called on this communicator before this one
  std::int64_t send_count = 0;   //!< elements a sends to b
  std::int64_t recv_count = 0;   //!< elements a expects from b
  std::int32_t root = -1;        //!< broadcast root (split: the color)
  std::uint32_t elem_bytes = 0;  //!< sizeof the element type
  std::uint8_t op = 0;           //!< collective
  std::uint8_t type = 0;         //!< dtype
  std::uint8_t reduce = 0;       //!< reduce_op + 1, or 0 when the collective does not reduce
  std::uint8_t failed = 0;       //!< 1: a rejected its own arguments; 2: a failed (see error)
  std::uint32_t reserved = 0;
};
static_assert(sizeof(collective_header) == 40);

//! Header flags.
inline constexpr std::uint8_t header_ok = 0;
inline constexpr std::uint8_t header_rejected_arguments = 1;
inline constexpr std::uint8_t header_rank_failed = 2;

//! What a collective call is besides its schedule: element type, reduction.
struct call_info {
  dtype type = dtype::other;
  std::uint32_t elem_bytes = 0;
  int reduce = -1;  //!< static_cast<int>(reduce_op), or -1
};

template <class T>
[[nodiscard]] constexpr call_info call_info_of(int reduce = -1) noexcept {
  return {dtype_of<T>, static_cast<std::uint32_t>(sizeof(T)), reduce};
}

//! The header this rank sends to `peer` for schedule s (call number seq).
[[nodiscard]] inline collective_header make_header(const collective_schedule& s, int peer,
                                                   std::uint64_t seq, const call_info& c) {
  collective_header h;
  h.seq = seq;
  h.send_count = s.send_count(peer);
  h.recv_count = s.recv_count(peer);
  h.root = s.root();
  h.elem_bytes = c.elem_bytes;
  h.op = static_cast<std::uint8_t>(s.op());
  h.type = static_cast<std::uint8_t>(c.type);
  h.reduce = static_cast<std::uint8_t>(c.reduce + 1);
  return h;
}

//! The header of a rank whose arguments were rejected (flag 1) or that failed (flag 2): it still
//! takes part in the exchange so that its peers learn of it at once instead of waiting.
[[nodiscard]] inline collective_header make_failure_header(collective op, std::uint64_t seq,
                                                           std::uint8_t flag) {
  collective_header h;
  h.seq = seq;
  h.op = static_cast<std::uint8_t>(op);
  h.failed = flag;
  return h;
}

//! Checks a pair of headers: `mine` is what rank `me` sends to `peer`, `theirs` what `peer` sends
//! to `me`. The message names both ranks, the collective and the values that disagree.
[[nodiscard]] inline status check_headers(const collective_header& mine,
                                          const collective_header& theirs, int me, int peer) {
  using detail::num;
  const auto op_name = [](std::uint8_t op) {
    return std::string(to_string(static_cast<collective>(op)));
  };
  // Agreement is the common case, on every collective of every step: nothing is formatted (or
  // allocated) unless a field disagrees.
  const bool agree =
      theirs.failed == header_ok && theirs.op == mine.op && theirs.seq == mine.seq &&
      theirs.type == mine.type && theirs.elem_bytes == mine.elem_bytes &&
      theirs.reduce == mine.reduce &&
      (mine.op == static_cast<std::uint8_t>(collective::split) || theirs.root == mine.root) &&
      theirs.send_count == mine.recv_count && mine.send_count == theirs.recv_count;
  if (agree) return {};
  const std::string a = "rank " + num(me), b = "rank " + num(peer);
  const std::string where = op_name(mine.op) + " (call #" + std::to_string(mine.seq) + ")";
  if (theirs.failed == header_rejected_arguments)
    return make_error(errc::comm_peer_failed,
                      b + " rejected its arguments to " + op_name(theirs.op) + " (call #" +
                          std::to_string(theirs.seq) + "), so the collective was not run");
  if (theirs.failed != header_ok)
    return make_error(errc::comm_peer_failed, b + " failed (it threw or gave up) at call #" +
                                                  std::to_string(theirs.seq) + " while " + a +
                                                  " called " + where);
  if (theirs.op != mine.op || theirs.seq != mine.seq)
    return make_error(errc::comm_mismatch, "collective mismatch: " + a + " called " + where +
                                               " but " + b + " called " + op_name(theirs.op) +
                                               " (call #" + std::to_string(theirs.seq) + ")");
  if (theirs.type != mine.type || theirs.elem_bytes != mine.elem_bytes)
    return make_error(errc::comm_mismatch,
                      "element type mismatch in " + where + ": " + a + " uses " +
                          detail::describe(static_cast<dtype>(mine.type), mine.elem_bytes) + ", " +
                          b + " uses " +
                          detail::describe(static_cast<dtype>(theirs.type), theirs.elem_bytes));
  if (theirs.reduce != mine.reduce)
    return make_error(errc::comm_mismatch,
                      "reduction mismatch in " + where + ": " + a + " reduces with " +
                          to_string(static_cast<reduce_op>(mine.reduce - 1)) + ", " + b + " with " +
                          to_string(static_cast<reduce_op>(theirs.reduce - 1)));
  if (mine.op != static_cast<std::uint8_t>(collective::split) && theirs.root != mine.root)
    return make_error(errc::comm_mismatch, "root mismatch in " + where + ": " + a +
                                               " broadcasts from rank " + num(mine.root) + ", " +
                                               b + " from rank " + num(theirs.root));
  if (theirs.send_count != mine.recv_count)
    return make_error(errc::comm_mismatch, "count mismatch in " + where + ": " + b + " sends " +
                                               num(theirs.send_count) + " elements to " + a +
                                               ", which expects " + num(mine.recv_count));
  if (mine.send_count != theirs.recv_count)
    return make_error(errc::comm_mismatch, "count mismatch in " + where + ": " + a + " sends " +
                                               num(mine.send_count) + " elements to " + b +
                                               ", which expects " + num(theirs.recv_count));
  return {};
}

}  // namespace v0_1
}  // namespace moefold
