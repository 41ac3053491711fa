//! @file elementwise.hpp
//! @brief Element-by-element kernels over [rows, width] views: relabel (global expert ids to a
//! rank's local ones), add a converted source, convert, scale, fill. Each element is one thread's,
//! grid-strided, with the arithmetic of the host's row operations (exec/host_memory_ops.hpp):
//! sums in accumulator_t<T> (fp32 for 16-bit data), rounded to T once, never fused.
#pragma once

#include <moefold/core/config.hpp>
#include <moefold/core/dtype.hpp>

#include "simt/math.hpp"

namespace moefold::kernels {

//! A [rows, width] view for kernels: the element (r, c) is at p[r * stride + c].
template <class T>
struct rows_arg {
  T* p;
  long long stride;
  MOEFOLD_HOST_DEVICE T& operator()(long long r, long long c) const { return p[r * stride + c]; }
};

namespace detail_elementwise {
//! Calls f(r, c) for every element, grid-strided over the flattened [rows, width].
template <class Ctx, class F>
MOEFOLD_HOST_DEVICE void for_each_element(Ctx& c, int rows, int width, F&& f) {
  const long long n = static_cast<long long>(rows) * width;
  const long long step = static_cast<long long>(c.grid_blocks()) * Ctx::block_threads;
  for (long long i = static_cast<long long>(c.block()) * Ctx::block_threads + c.thread(); i < n;
       i += step)
    f(i / width, i % width);
}
}  // namespace detail_elementwise

//! dst = ids - first where first <= ids < first + count, else -1.   ids, dst [rows, width]
struct relabel_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "relabel";
  rows_arg<const int> ids;
  int first, count;
  rows_arg<int> dst;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    detail_elementwise::for_each_element(c, rows, width, [&](long long r, long long k) {
      const int s = ids(r, k);
      dst(r, k) = (s >= first && s - first < count) ? s - first : -1;
    });
  }
};

//! dst += src converted to T: the sum in accumulator_t<T>, rounded to T once.
template <class T, class U>
struct add_converted_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "add_converted";
  rows_arg<const U> src;
  rows_arg<T> dst;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    detail_elementwise::for_each_element(c, rows, width, [&](long long r, long long k) {
      T& d = dst(r, k);
      d = moefold::detail::narrow<T>(
          simt::add(moefold::detail::widen(d),
                    static_cast<accumulator_t<T>>(moefold::detail::widen(src(r, k)))));
    });
  }
};

//! dst = src converted to T (widened, or rounded to nearest once).
template <class T, class U>
struct convert_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "convert";
  rows_arg<const U> src;
  rows_arg<T> dst;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    detail_elementwise::for_each_element(c, rows, width, [&](long long r, long long k) {
      dst(r, k) = static_cast<T>(moefold::detail::widen(src(r, k)));
    });
  }
};

//! dst *= s (in accumulator_t<T>, rounded to T once).
template <class T>
struct scale_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "scale";
  rows_arg<T> dst;
  T s;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    detail_elementwise::for_each_element(c, rows, width, [&](long long r, long long k) {
      T& d = dst(r, k);
      d = moefold::detail::narrow<T>(
          simt::mul(moefold::detail::widen(d), moefold::detail::widen(s)));
    });
  }
};

//! Every element of dst = v.
template <class T>
struct fill_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "fill";
  rows_arg<T> dst;
  T v;
  int rows, width;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    detail_elementwise::for_each_element(c, rows, width,
                                         [&](long long r, long long k) { dst(r, k) = v; });
  }
};

}  // namespace moefold::kernels
