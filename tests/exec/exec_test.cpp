// The execution contexts: host_exec copies and fills; cpu_exec copies between host and its device
// memory and counts each direction; its memory comes poisoned; exec_buffer owns memory in a
// context's space; copies of mismatched shapes are errors naming both spaces.
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace moefold;

static_assert(execution_context<host_exec>);
static_assert(execution_context<cpu_exec>);
static_assert(std::is_same_v<cpu_exec::memory_space, cpu_device_space>);

TEST_CASE("host_exec: copy and fill, strided views included") {
  host_exec x;
  std::vector<float> a(12), b(12, -1.f);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  // Rows 0..2 of width 2 taken 4 apart, into a contiguous [3, 2].
  REQUIRE(x.copy(row_view<const float>(a.data(), 3, 2, 4), row_view<float>(b.data(), 3, 2)));
  CHECK(b[0] == 0.f);
  CHECK(b[1] == 1.f);
  CHECK(b[2] == 4.f);
  CHECK(b[5] == 9.f);
  CHECK(b[6] == -1.f);  // untouched
  REQUIRE(x.fill(row_view<float>(b.data(), 2, 3), 7.f));
  CHECK(b[5] == 7.f);
  auto bad = x.copy(row_view<const float>(a.data(), 3, 2), row_view<float>(b.data(), 2, 2));
  REQUIRE(!bad);
  CHECK(bad.error().code == errc::shape_mismatch);
  CHECK(bad.error().message.find("from host to host memory") != std::string::npos);
}

TEST_CASE("cpu_exec: host <-> device copies are counted by direction; memory is poisoned") {
  cpu_exec x(123);
  CHECK(x.seed() == 123);
  auto d = exec_buffer<float, cpu_exec>::make(x, 4, 3);
  REQUIRE(d.has_value());
  auto e = exec_buffer<float, cpu_exec>::make(x, 4, 3);
  REQUIRE(e.has_value());
  std::vector<float> h(12), back(12, 0.f);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(i) * 0.5f;
  // Nothing written yet: reading the buffer gives NaN, never a plausible zero.
  REQUIRE(x.copy(d->cview(), row_view<float>(back.data(), 4, 3)));
  for (float v : back) CHECK(std::isnan(v));
  REQUIRE(x.copy(row_view<const float>(h.data(), 4, 3), d->view()));
  REQUIRE(x.copy(d->cview(), e->view()));
  REQUIRE(x.fill(e->view().subrows(3, 1), 9.f));
  REQUIRE(x.copy(e->cview(), row_view<float>(back.data(), 4, 3)));
  for (std::size_t i = 0; i < 9; ++i) CHECK(back[i] == h[i]);
  CHECK(back[9] == 9.f);
  CHECK(back[11] == 9.f);
  const copy_counts c = x.copies();
  CHECK(c.to_device == 1);
  CHECK(c.to_host == 2);
  CHECK(c.on_device == 1);
  CHECK(c.bytes_to_device == 48);
  CHECK(c.bytes_to_host == 96);
  CHECK(c.bytes_on_device == 48);
  auto bad = x.copy(d->cview(), row_view<float>(back.data(), 3, 4));
  REQUIRE(!bad);
  CHECK(bad.error().message.find("from cpu_device to host memory") != std::string::npos);
  CHECK(x.copies().to_host == 2);  // a refused copy is not counted
  x.reset_copies();
  CHECK(x.copies() == copy_counts{});
  // An int buffer is poisoned to -1.
  auto ints = exec_buffer<int, cpu_exec>::make(x, 1, 2);
  REQUIRE(ints.has_value());
  std::vector<int> hi(2, 0);
  REQUIRE(x.copy(ints->cview(), row_view<int>(hi.data(), 1, 2)));
  CHECK(hi[0] == -1);
}

TEST_CASE("exec_buffer: moves own, shapes are checked") {
  host_exec x;
  auto a = exec_buffer<double, host_exec>::make(x, 3, 5);
  REQUIRE(a.has_value());
  CHECK(a->view().rows() == 3);
  CHECK(a->view().width() == 5);
  a->view()(2, 4) = 1.5;
  exec_buffer<double, host_exec> b = std::move(*a);
  CHECK(b.view()(2, 4) == 1.5);
  CHECK(a->view().data() == nullptr);
  CHECK(exec_buffer<double, host_exec>::make(x, -1, 2).error().code == errc::invalid_size);
  CHECK(exec_buffer<double, host_exec>::make(x, 2, std::int64_t{1} << 40).error().code ==
        errc::overflow);
}
