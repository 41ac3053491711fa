#include <moefold/core/workspace.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using moefold::workspace_alignment;
using moefold::workspace_carver;

namespace {
// The same sequence of takes, measured and carved.
std::size_t layout(workspace_carver& c, std::span<int>* a, std::span<double>* b,
                   std::span<char>* d) {
  *a = c.take<int>(5);
  *b = c.take<double>(3);
  *d = c.take<char>(0);
  return c.required();
}
}  // namespace

TEST_CASE("measuring and carving follow one sequence; sub-buffers are aligned and disjoint") {
  workspace_carver measure;
  std::span<int> a;
  std::span<double> b;
  std::span<char> d;
  const std::size_t need = layout(measure, &a, &b, &d);
  CHECK(a.empty());
  CHECK_FALSE(measure.fits());
  CHECK(need >= 5 * sizeof(int) + 3 * sizeof(double));
  for (std::size_t shift : {0u, 1u, 7u, 100u}) {  // any start address works
    std::vector<std::byte> ws(need + shift);
    workspace_carver c(std::span<std::byte>(ws).subspan(shift));
    (void)layout(c, &a, &b, &d);
    REQUIRE(c.fits());
    CHECK(a.size() == 5);
    CHECK(b.size() == 3);
    CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % workspace_alignment == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % workspace_alignment == 0);
    CHECK(reinterpret_cast<const std::byte*>(b.data()) >=
          reinterpret_cast<const std::byte*>(a.data() + 5));
    CHECK(reinterpret_cast<const std::byte*>(b.data() + 3) <= ws.data() + ws.size());
  }
  std::vector<std::byte> small(need / 2);
  workspace_carver c(small);
  (void)layout(c, &a, &b, &d);
  CHECK_FALSE(c.fits());
  CHECK(c.required() == need);
}
