//! @file mpi_device_communicator.hpp
//! @brief The MPI backend with device buffers: collectives on buffers that may live in GPU
//! memory, over MPI processes.
//!
//! Where the MPI library is CUDA-aware (checked at run time, MPIX_Query_cuda_support), the
//! collectives that only move data (all_to_all_v, all_gather_v, all_gather, broadcast) hand the
//! device pointers to MPI. Otherwise, and always for the reductions (moefold reduces on the host,
//! in rank order), device buffers are staged through host memory: the inputs are copied to the
//! host after the stream's earlier work, the host collective runs (with its header check and
//! timeout, comm/mpi/mpi_communicator.hpp), and the outputs are copied back. The call returns when
//! the outputs are in place (it synchronizes the stream; MPI collectives block the host anyway).
//! Host and managed buffers go to MPI as they are.
//!
//! Its memory space is device_space: the row-view collectives take device row views and a
//! cuda_copy_exec, whose stream orders the copies (no pointer probing: the type says where the rows
//! are). The span forms probe each pointer (cudaPointerGetAttributes) and order on stream().
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/cuda/cuda_check.hpp"
#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "../../core/row_view.hpp"
#include "../../exec/cuda/cuda_copy_exec.hpp"
#include "../communicator.hpp"
#include "../mpi/mpi_communicator.hpp"
#include "../span_collectives.hpp"
#include "cuda_types.hpp"

namespace moefold {
inline namespace v0_1 {

//! True when this process's MPI moves device buffers itself (Open MPI's run-time query; false
//! for an MPI that does not say).
[[nodiscard]] inline bool mpi_is_cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

namespace detail {
//! True for memory the host cannot read (device memory); host, managed and unknown (no GPU)
//! pointers are false.
inline bool is_device_memory(const void* p) noexcept {
  if (!p) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" or "invalid value"
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}
}  // namespace detail

//! One rank's MPI communicator for device (or host) buffers. Move-only.
class mpi_device_communicator {
 public:
  using memory_space = device_space;

  //! Wraps `comm` as mpi_communicator::wrap does; device work is ordered on `stream`.
  [[nodiscard]] static expected<mpi_device_communicator> wrap(MPI_Comm comm, mpi_options opt = {},
                                                              cudaStream_t stream = nullptr) {
    auto host = mpi_communicator::wrap(comm, opt);
    if (!host) return unexpected<error>(host.error());
    return mpi_device_communicator(std::move(*host), stream);
  }
  mpi_device_communicator(mpi_communicator host, cudaStream_t stream)
      : host_(std::move(host)), stream_(stream), cuda_aware_(mpi_is_cuda_aware()) {}

  [[nodiscard]] int rank() const noexcept { return host_.rank(); }
  [[nodiscard]] int size() const noexcept { return host_.size(); }
  //! Whether device buffers go to MPI directly (else they are staged through host memory).
  [[nodiscard]] bool cuda_aware() const noexcept { return cuda_aware_; }
  [[nodiscard]] mpi_communicator& host() noexcept { return host_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    return staged<T>(buf, buf, false, stream_, false, [&](std::span<const T>, std::span<T> out) {
      return host_.all_reduce<T>(out, op);
    });
  }

  template <transferable T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send,
                                  std::span<T> recv) {
    return staged<T>(
        send, recv, true, stream_, false,
        [&](std::span<const T> in, std::span<T> out) { return host_.all_gather<T>(in, out); });
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts) {
    return staged<T>(send, recv, true, stream_, false,
                     [&](std::span<const T> in, std::span<T> out) {
                       return host_.all_gather_v<T>(in, out, counts);
                     });
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts) {
    return staged<T>(send, recv, true, stream_, false,
                     [&](std::span<const T> in, std::span<T> out) {
                       return host_.all_to_all_v<T>(in, send_counts, out, recv_counts);
                     });
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op) {
    return staged<T>(send, recv, false, stream_, false,
                     [&](std::span<const T> in, std::span<T> out) {
                       return host_.reduce_scatter_v<T>(in, counts, out, op);
                     });
  }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    return staged<T>(buf, buf, true, stream_, false, [&](std::span<const T>, std::span<T> out) {
      return host_.broadcast<T>(out, root);
    });
  }

  [[nodiscard]] status barrier() { return host_.barrier(); }

  // --- row views in device memory, ordered on the context's stream ----------------------------

  template <reducible T>
  [[nodiscard]] status all_reduce(cuda_copy_exec& x, row_view<T, device_space> buf, reduce_op op) {
    auto b = detail::flat(buf);
    return staged<T>(b, b, false, x.stream(), true, [&](std::span<const T>, std::span<T> out) {
      return host_.all_reduce<T>(out, op);
    });
  }

  template <transferable T>
  [[nodiscard]] status all_gather(cuda_copy_exec& x, row_view<const T, device_space> send,
                                  row_view<T, device_space> recv) {
    const int w = detail::row_width(send, recv);
    return staged<T>(detail::flat(send), detail::flat(recv), true, x.stream(), true,
                     [&](std::span<const T> in, std::span<T> out) {
                       host_exec h;
                       return host_.all_gather(h, rows_of(in, send.rows(), w),
                                               rows_of(out, recv.rows(), w));
                     });
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    row_view<T, device_space> recv, std::span<const int> counts) {
    const int w = detail::row_width(send, recv);
    return staged<T>(detail::flat(send), detail::flat(recv), true, x.stream(), true,
                     [&](std::span<const T> in, std::span<T> out) {
                       host_exec h;
                       return host_.all_gather_v(h, rows_of(in, send.rows(), w),
                                                 rows_of(out, recv.rows(), w), counts);
                     });
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    std::span<const int> send_counts,
                                    row_view<T, device_space> recv,
                                    std::span<const int> recv_counts) {
    const int w = detail::row_width(send, recv);
    return staged<T>(detail::flat(send), detail::flat(recv), true, x.stream(), true,
                     [&](std::span<const T> in, std::span<T> out) {
                       host_exec h;
                       return host_.all_to_all_v(h, rows_of(in, send.rows(), w), send_counts,
                                                 rows_of(out, recv.rows(), w), recv_counts);
                     });
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                        std::span<const int> counts, row_view<T, device_space> recv,
                                        reduce_op op) {
    const int w = detail::row_width(send, recv);
    return staged<T>(detail::flat(send), detail::flat(recv), false, x.stream(), true,
                     [&](std::span<const T> in, std::span<T> out) {
                       host_exec h;
                       return host_.reduce_scatter_v(h, rows_of(in, send.rows(), w), counts,
                                                     rows_of(out, recv.rows(), w), op);
                     });
  }

  template <transferable T>
  [[nodiscard]] status broadcast(cuda_copy_exec& x, row_view<T, device_space> buf, int root) {
    auto b = detail::flat(buf);
    return staged<T>(b, b, true, x.stream(), true, [&](std::span<const T>, std::span<T> out) {
      return host_.broadcast<T>(out, root);
    });
  }

  [[nodiscard]] status barrier(cuda_copy_exec&) { return host_.barrier(); }

  [[nodiscard]] expected<mpi_device_communicator> split(int color, int key) {
    auto sub = host_.split(color, key);
    if (!sub) return unexpected<error>(sub.error());
    return mpi_device_communicator(std::move(*sub), stream_);
  }

 private:
  // Host rows over a staged (or CUDA-aware device) span; the row count is the view's.
  template <class T>
  static row_view<T> rows_of(std::span<T> s, int rows, int width) noexcept {
    return row_view<T>(s.data(), width > 0 ? rows : 0, width);
  }

  // Runs f on buffers MPI can use: the caller's when they are host memory (or device memory and
  // `movable` on a CUDA-aware MPI), host copies otherwise; device work ordered on `stream` (the
  // call's context's stream, or the communicator's own for the span forms).
  // `out` may alias `in` (in place). `device`: the buffers are known to be device memory (row
  // views in device_space); otherwise each pointer is probed.
  template <class T, class F>
  status staged(std::span<const T> in, std::span<T> out, bool movable, cudaStream_t stream,
                bool device, F&& f) {
    const bool dev_in = device || detail::is_device_memory(in.data());
    const bool dev_out = device || detail::is_device_memory(out.data());
    if ((!dev_in && !dev_out) || (movable && cuda_aware_)) {
      if (dev_in || dev_out)  // MPI reads device memory now: the stream's producers first
        if (auto ok = detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
            !ok)
          return ok;
      return f(in, out);
    }
    const bool in_place =
        static_cast<const void*>(in.data()) == static_cast<const void*>(out.data());
    std::vector<T> h_in, h_out(out.size());
    if (dev_out && in_place) {
      if (auto ok = to_host(h_out.data(), out.data(), out.size(), stream); !ok) return ok;
    } else if (dev_in) {
      h_in.resize(in.size());
      if (auto ok = to_host(h_in.data(), in.data(), in.size(), stream); !ok) return ok;
    }
    if (auto ok = detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); !ok)
      return ok;
    const std::span<const T> hin = in_place ? std::span<const T>(h_out)
                                   : dev_in ? std::span<const T>(h_in)
                                            : in;
    if (!dev_out) return f(hin, out);  // only the input was staged
    if (auto ok = f(hin, std::span<T>(h_out)); !ok) return ok;
    if (auto ok =
            detail::cuda_check(cudaMemcpyAsync(out.data(), h_out.data(), out.size() * sizeof(T),
                                               cudaMemcpyHostToDevice, stream),
                               "cudaMemcpyAsync");
        !ok)
      return ok;
    // h_out dies here: wait for the copy.
    return detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  template <class T>
  static status to_host(T* dst, const T* src, std::size_t n, cudaStream_t s) {
    return detail::cuda_check(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, s),
                              "cudaMemcpyAsync");
  }

  mpi_communicator host_;
  cudaStream_t stream_ = nullptr;
  bool cuda_aware_ = false;
};

static_assert(splittable_communicator<mpi_device_communicator>);
static_assert(communicator_for<mpi_device_communicator, cuda_copy_exec>);

}  // namespace v0_1
}  // namespace moefold
