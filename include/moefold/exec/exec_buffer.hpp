//! @file exec_buffer.hpp
//! @brief exec_buffer<T, Exec>: rows x width elements owned in an execution context's memory
//! space (host memory for host_exec, the executor's memory for cpu_exec, stream-ordered device
//! memory for cuda_exec), freed by the context's deallocator (a copy of it is kept, never the
//! context: the buffer may outlive the context object it was made on; for cuda_exec the stream
//! must outlive it). Move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "exec.hpp"

namespace moefold {
inline namespace v0_1 {

template <class T, copy_context Exec>
class exec_buffer {
 public:
  using space = typename Exec::memory_space;

  //! rows x width elements (contiguous) in exec's space.
  [[nodiscard]] static expected<exec_buffer> make(Exec& exec, std::int64_t rows,
                                                  std::int64_t width) {
    auto shape = row_view<T, space>::make(nullptr, rows, width);
    if (!shape) return unexpected<error>(shape.error());
    const auto bytes = static_cast<std::size_t>(shape->extent_bytes());
    auto p = exec.allocate_bytes(bytes);
    if (!p) return unexpected<error>(p.error());
    exec_buffer b;
    b.free_ = exec.deallocator();
    b.owns_ = true;
    b.bytes_ = bytes;
    b.view_ = row_view<T, space>(static_cast<T*>(*p), shape->rows(), shape->width());
    return b;
  }

  exec_buffer() = default;
  exec_buffer(exec_buffer&& o) noexcept
      : free_(o.free_),
        owns_(std::exchange(o.owns_, false)),
        bytes_(o.bytes_),
        view_(std::exchange(o.view_, {})) {}
  exec_buffer& operator=(exec_buffer&& o) noexcept {
    if (this != &o) {
      release();
      free_ = o.free_;
      owns_ = std::exchange(o.owns_, false);
      bytes_ = o.bytes_;
      view_ = std::exchange(o.view_, {});
    }
    return *this;
  }
  exec_buffer(const exec_buffer&) = delete;
  exec_buffer& operator=(const exec_buffer&) = delete;
  ~exec_buffer() { release(); }

  [[nodiscard]] row_view<T, space> view() const noexcept { return view_; }
  [[nodiscard]] row_view<const T, space> cview() const noexcept { return view_; }

 private:
  void release() noexcept {
    if (owns_ && view_.data()) free_(view_.data(), bytes_);
    owns_ = false;
  }

  using deallocator_type = decltype(std::declval<const Exec&>().deallocator());
  deallocator_type free_{};
  bool owns_ = false;
  std::size_t bytes_ = 0;
  row_view<T, space> view_{};
};

}  // namespace v0_1
}  // namespace moefold
