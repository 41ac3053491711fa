//! @file exec_buffer.hpp
//! @brief exec_buffer<T, Exec>: rows x width elements owned in an execution context's memory
//! space (host memory for host_exec, the executor's memory for cpu_exec, stream-ordered device
//! memory for cuda_exec), freed through the same context. Move-only.
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

  //! rows x width elements (contiguous) in exec's space; exec must outlive the buffer.
  [[nodiscard]] static expected<exec_buffer> make(Exec& exec, std::int64_t rows,
                                                  std::int64_t width) {
    auto shape = row_view<T, space>::make(nullptr, rows, width);
    if (!shape) return unexpected<error>(shape.error());
    const auto bytes = static_cast<std::size_t>(shape->extent_bytes());
    auto p = exec.allocate_bytes(bytes);
    if (!p) return unexpected<error>(p.error());
    exec_buffer b;
    b.exec_ = &exec;
    b.bytes_ = bytes;
    b.view_ = row_view<T, space>(static_cast<T*>(*p), shape->rows(), shape->width());
    return b;
  }

  exec_buffer() = default;
  exec_buffer(exec_buffer&& o) noexcept
      : exec_(std::exchange(o.exec_, nullptr)),
        bytes_(o.bytes_),
        view_(std::exchange(o.view_, {})) {}
  exec_buffer& operator=(exec_buffer&& o) noexcept {
    if (this != &o) {
      release();
      exec_ = std::exchange(o.exec_, nullptr);
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
    if (exec_ && view_.data()) exec_->deallocate_bytes(view_.data(), bytes_);
    exec_ = nullptr;
  }

  Exec* exec_ = nullptr;
  std::size_t bytes_ = 0;
  row_view<T, space> view_{};
};

}  // namespace v0_1
}  // namespace moefold
