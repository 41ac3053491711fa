//! @file context_buffers.hpp
//! @brief Test helpers over a context's memory (doctest assertions): a buffer holding a host
//! vector, and a context view read back to the host.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include <moefold/core/memory_space.hpp>
#include <moefold/core/row_view.hpp>
#include <moefold/exec/exec_buffer.hpp>

namespace moefold::test {

//! A buffer on `x` holding v ([rows, width]; v may be empty when rows x width is 0).
template <class Exec, class T>
exec_buffer<T, Exec> on(Exec& x, const std::vector<T>& v, int rows, int width) {
  auto b = exec_buffer<T, Exec>::make(x, rows, width);
  REQUIRE(b);
  if (rows * width > 0)
    REQUIRE(x.copy(row_view<const T, host_space>(v.data(), rows, width), b->view()));
  return std::move(*b);
}

//! The view's elements on the host (waits for the context).
template <class Exec, class V>
auto back(Exec& x, V v) {
  using T = std::remove_const_t<typename V::value_type>;
  std::vector<T> h(static_cast<std::size_t>(v.rows()) * static_cast<std::size_t>(v.width()));
  if (!h.empty()) REQUIRE(x.copy(v, row_view<T, host_space>(h.data(), v.rows(), v.width())));
  REQUIRE(x.synchronize());
  return h;
}

}  // namespace moefold::test
