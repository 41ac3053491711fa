// row_view: the checked constructor's rules, 64-bit offsets beyond 2^31 elements (arithmetic
// only, nothing allocated), sub-views, const conversion, and host element access for host views
// only.
#include <moefold/core/row_view.hpp>

#include <doctest/doctest.h>

#include <climits>
#include <cstdint>
#include <vector>

using namespace moefold;

template <class V>
concept host_readable = requires(V v) {
  v(0, 0);
  v.row(0);
  v.flat();
};
static_assert(host_readable<row_view<float>>);
static_assert(host_readable<row_view<const float>>);
static_assert(!host_readable<row_view<float, device_space>>);
static_assert(!host_readable<row_view<float, cpu_device_space>>);
static_assert(std::is_convertible_v<row_view<float>, row_view<const float>>);
static_assert(!std::is_convertible_v<row_view<const float>, row_view<float>>);
static_assert(!std::is_convertible_v<row_view<float, device_space>, row_view<float>>);
static_assert(!std::is_convertible_v<row_view<float>, row_view<float, cpu_device_space>>);

TEST_CASE("row_view: element access, sub-views and strides on the host") {
  std::vector<int> buf(4 * 6);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<int>(i);
  auto v = row_view<int>::make(buf.data(), 4, 5, 6);  // 4 rows of 5, 6 apart
  REQUIRE(v.has_value());
  CHECK(v->rows() == 4);
  CHECK(v->width() == 5);
  CHECK(v->stride() == 6);
  CHECK(!v->contiguous());
  CHECK(v->extent() == 3 * 6 + 5);
  CHECK(v->extent_bytes() == (3 * 6 + 5) * 4);
  CHECK((*v)(2, 3) == 15);
  CHECK(v->row(3)[4] == 22);
  CHECK(v->flat().empty());  // a strided view is not one span
  const row_view<const int> c = v->subrows(1, 2);
  CHECK(c.rows() == 2);
  CHECK(c(0, 0) == 6);
  CHECK(c(1, 4) == 16);
  CHECK(v->first(1).rows() == 1);
  auto h = host_rows(std::span<int>(buf), 8);
  CHECK(h.rows() == 3);
  CHECK(h.contiguous());
  CHECK(h.flat().size() == 24);
  CHECK(h(2, 7) == 23);
}

TEST_CASE("row_view::make refuses what it cannot address") {
  float* p = nullptr;
  CHECK(row_view<float>::make(p, -1, 4).error().code == errc::invalid_size);
  CHECK(row_view<float>::make(p, 4, 8, 4).error().code == errc::invalid_size);
  auto big = row_view<float>::make(p, std::int64_t{INT_MAX} + 1, 1);
  REQUIRE(!big);
  CHECK(big.error().code == errc::overflow);
  CHECK(row_view<float>::make(p, INT_MAX, 1).has_value());
  CHECK(row_view<double>::make(nullptr, INT_MAX, INT_MAX, INT64_MAX / 4).error().code ==
        errc::overflow);
}

TEST_CASE("row_view: more than 2^31 elements are addressed in 64-bit arithmetic") {
  // A DeepSeek-V3 receive buffer: 300,000 rows of H = 7168 bf16-sized elements, padded to 8192.
  // Offsets are computed, never dereferenced: the view points at no memory.
  using bf = std::uint16_t;
  auto v = row_view<bf, device_space>::make(nullptr, 300000, 7168, 8192);
  REQUIRE(v.has_value());
  CHECK(v->offset(299999) == std::int64_t{299999} * 8192);
  CHECK(v->offset(299999) > std::int64_t{INT_MAX});
  CHECK(v->offset(262144, 7167) == std::int64_t{262144} * 8192 + 7167);
  CHECK(v->extent() == std::int64_t{299999} * 8192 + 7168);
  CHECK(v->extent_bytes() == (std::int64_t{299999} * 8192 + 7168) * 2);
  // Sub-views of real memory keep the stride: their offsets count from their first row.
  std::vector<bf> small(3 * 8192);
  const auto tail = row_view<bf>(small.data(), 3, 7168, 8192).subrows(1, 2);
  CHECK(tail.data() == small.data() + 8192);
  CHECK(tail.offset(1) == 8192);
  // rows x width beyond 2^31 in a contiguous view too
  auto c = row_view<float, cpu_device_space>::make(nullptr, 1 << 20, 4096);
  REQUIRE(c.has_value());
  CHECK(c->extent() == std::int64_t{1} << 32);
  CHECK(c->offset(1 << 19, 0) == std::int64_t{1} << 31);
}
