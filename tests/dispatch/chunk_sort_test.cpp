#include <moefold/dispatch/chunk_sort.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

using namespace moefold;

TEST_CASE("the expert-major order turns (t, j, l) into (l, t, j)") {
  const int etp = 2, ep = 3, L = 4;
  std::vector<int> order(static_cast<std::size_t>(etp * ep * L));
  expert_major_chunk_order(etp, ep, L, order);
  int pos = 0;
  for (int l = 0; l < L; ++l)
    for (int t = 0; t < etp; ++t)
      for (int j = 0; j < ep; ++j) {
        const int c = order[static_cast<std::size_t>(pos++)];
        CHECK(c / (ep * L) == t);
        CHECK((c / L) % ep == j);
        CHECK(c % L == l);
      }
  CHECK(check_chunk_order(std::vector<int>(order.size(), 1), order));
}

TEST_CASE("sort_chunks moves whole chunks into the given order; unsort is its inverse") {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 50; ++trial) {
    const int m = 1 + static_cast<int>(rng() % 12), width = 1 + static_cast<int>(rng() % 3);
    std::vector<int> sizes(static_cast<std::size_t>(m));
    for (auto& s : sizes) s = static_cast<int>(rng() % 4);  // zeros included
    std::vector<int> order(static_cast<std::size_t>(m));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int rows = std::accumulate(sizes.begin(), sizes.end(), 0);
    // Each element records its chunk and position, so the reference is a direct construction.
    std::vector<int> x;
    for (int c = 0; c < m; ++c)
      for (int r = 0; r < sizes[static_cast<std::size_t>(c)]; ++r)
        for (int w = 0; w < width; ++w) x.push_back(c * 1000 + r * 10 + w);
    std::vector<int> want;
    for (int c : order)
      for (int r = 0; r < sizes[static_cast<std::size_t>(c)]; ++r)
        for (int w = 0; w < width; ++w) want.push_back(c * 1000 + r * 10 + w);
    std::vector<int> sorted(static_cast<std::size_t>(rows * width)), back(sorted.size());
    REQUIRE(sort_chunks<int>(sizes, order, x, width, sorted));
    CHECK(sorted == want);
    REQUIRE(unsort_chunks<int>(sizes, order, sorted, width, back));
    CHECK(back == x);
    std::vector<int> sorted_sizes(sizes.size());
    sorted_chunk_sizes(sizes, order, sorted_sizes);
    CHECK(std::accumulate(sorted_sizes.begin(), sorted_sizes.end(), 0) == rows);
  }
}

TEST_CASE("bad chunk orders are rejected") {
  const std::vector<int> sizes = {1, 2, 3};
  CHECK(check_chunk_order(sizes, std::vector<int>{0, 1}).error().code == errc::shape_mismatch);
  CHECK(check_chunk_order(sizes, std::vector<int>{0, 1, 1}).error().code == errc::invalid_argument);
  CHECK(check_chunk_order(sizes, std::vector<int>{0, 1, 3}).error().code == errc::invalid_argument);
  CHECK(check_chunk_order(std::vector<int>{1, -1, 0}, std::vector<int>{0, 1, 2}).error().code ==
        errc::invalid_size);
  std::vector<int> x(5), out(6);
  CHECK(sort_chunks<int>(sizes, std::vector<int>{2, 1, 0}, x, 1, out).error().code ==
        errc::shape_mismatch);
}
