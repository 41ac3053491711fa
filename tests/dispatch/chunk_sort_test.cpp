// This test counts allocations: support/count_new.hpp replaces the program's operator new.
#include <moefold/dispatch/chunk_sort.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/count_new.hpp"

using namespace moefold;
using namespace moefold::dispatch;  // the permutation, chunk-sort and split building blocks

namespace {

std::size_t at(int i) { return static_cast<std::size_t>(i); }

// The naive reference, written without prefix sums: chunk c starts at the sum of the sizes before
// it, recomputed for every chunk (O(C^2)); rows of `width` elements.
int naive_start(const std::vector<int>& sizes, int c) {
  int start = 0;
  for (int d = 0; d < c; ++d) start += sizes[at(d)];
  return start;
}
std::vector<int> naive_sort(const std::vector<int>& sizes, const std::vector<int>& order,
                            const std::vector<int>& x, int width) {
  std::vector<int> out;
  for (int c : order)
    for (int r = 0; r < sizes[at(c)]; ++r)
      for (int w = 0; w < width; ++w) out.push_back(x[at((naive_start(sizes, c) + r) * width + w)]);
  return out;
}
std::vector<int> naive_unsort(const std::vector<int>& sizes, const std::vector<int>& order,
                              const std::vector<int>& sorted, int width) {
  std::vector<int> out(sorted.size(), -7);
  int pos = 0;  // rows of the sorted buffer consumed so far
  for (int c : order)
    for (int r = 0; r < sizes[at(c)]; ++r, ++pos)
      for (int w = 0; w < width; ++w)
        out[at((naive_start(sizes, c) + r) * width + w)] = sorted[at(pos * width + w)];
  return out;
}

// x whose every element is distinct: row i, column w holds i * width + w + 1.
std::vector<int> distinct_rows(const std::vector<int>& sizes, int width) {
  std::vector<int> x(at(std::accumulate(sizes.begin(), sizes.end(), 0) * width));
  std::iota(x.begin(), x.end(), 1);
  return x;
}

}  // namespace

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

TEST_CASE("4096 and 5000 chunks: sort and unsort equal the naive reference") {
  std::mt19937 rng(4096);
  for (const int m : {4096, 5000}) {  // 5000: beyond the stack bitmap and the stack offsets
    const int width = 2;
    std::vector<int> sizes(at(m));
    for (auto& v : sizes) v = static_cast<int>(rng() % 4);  // a quarter of the chunks empty
    std::vector<int> order(at(m));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int> x = distinct_rows(sizes, width);
    const std::vector<int> want = naive_sort(sizes, order, x, width);
    CHECK(check_chunk_order(sizes, order));

    std::vector<int> sorted(x.size(), -1), back(x.size(), -1);
    REQUIRE(sort_chunks<int>(sizes, order, x, width, sorted));
    CHECK(sorted == want);
    REQUIRE(unsort_chunks<int>(sizes, order, sorted, width, back));
    CHECK(back == x);
    CHECK(naive_unsort(sizes, order, want, width) == x);  // the two references agree

    // The caller-storage forms give the same rows, and the offsets are the naive chunk starts.
    std::vector<int> src(at(m)), dst(at(m)), sorted2(x.size(), -1), back2(x.size(), -1);
    REQUIRE(sort_chunks<int>(sizes, order, x, width, sorted2, src, dst));
    CHECK(sorted2 == want);
    REQUIRE(unsort_chunks<int>(sizes, order, sorted2, width, back2, src, dst));
    CHECK(back2 == x);
    for (const int c : {0, 1, m / 2, m - 1}) CHECK(src[at(c)] == naive_start(sizes, c));
    std::vector<int> sorted_sizes(at(m));
    for (int p = 0; p < m; ++p) sorted_sizes[at(p)] = sizes[at(order[at(p)])];
    for (const int p : {0, 1, m / 2, m - 1})
      CHECK(dst[at(order[at(p)])] == naive_start(sorted_sizes, p));
  }
}

TEST_CASE("orders that are not permutations are refused naming the rule, and nothing is written") {
  struct bad {
    int m;
    std::vector<int> order;
    std::string message;
  };
  std::vector<bad> cases = {
      {3, {0, 1, 1}, "chunk sort: chunk 1 appears twice in the order"},
      {3, {2, 0, 2}, "chunk sort: chunk 2 appears twice in the order"},
      {3, {0, 1, 3}, "chunk sort: order names chunk 3 of 3"},
      {3, {-1, 1, 2}, "chunk sort: order names chunk -1 of 3"},
      {3, {0, INT_MAX, 2}, "chunk sort: order names chunk 2147483647 of 3"},
  };
  // Large orders (5000: beyond the stack bitmap): chunk 0 named again last, far from its first
  // place; chunk 100, in another word of the bitmap; the last chunk named first and last; and a
  // chunk out of range last.
  for (const int m : {300, 5000}) {
    std::vector<int> o(at(m));
    std::iota(o.begin(), o.end(), 0);
    auto dup_first = o;
    dup_first[at(m - 1)] = 0;
    auto dup_100 = o;
    dup_100[at(m - 2)] = 100;
    auto dup_last = o;
    dup_last[0] = m - 1;
    auto out_of_range = o;
    out_of_range[at(m - 1)] = m;
    cases.push_back({m, dup_first, "chunk sort: chunk 0 appears twice in the order"});
    cases.push_back({m, dup_100, "chunk sort: chunk 100 appears twice in the order"});
    cases.push_back({m, dup_last,
                     "chunk sort: chunk " + std::to_string(m - 1) + " appears twice in the order"});
    cases.push_back(
        {m, out_of_range,
         "chunk sort: order names chunk " + std::to_string(m) + " of " + std::to_string(m)});
  }
  for (const auto& b : cases) {
    CAPTURE(b.message);
    const std::vector<int> sizes(at(b.m), 2);
    const std::vector<int> x = distinct_rows(sizes, 1);
    const auto refused = [&](const status& st) {
      REQUIRE_FALSE(st);
      CHECK(st.error().code == errc::invalid_argument);
      CHECK(st.error().message == b.message);
    };
    refused(check_chunk_order(sizes, b.order));
    std::vector<int> src(at(b.m)), dst(at(b.m));
    refused(plan_chunk_offsets(sizes, b.order, src, dst));
    std::vector<int> out(x.size(), -5);
    refused(sort_chunks<int>(sizes, b.order, x, 1, out));
    refused(unsort_chunks<int>(sizes, b.order, x, 1, out));
    refused(sort_chunks<int>(sizes, b.order, x, 1, out, src, dst));
    refused(unsort_chunks<int>(sizes, b.order, x, 1, out, src, dst));
    CHECK(std::all_of(out.begin(), out.end(), [](int v) { return v == -5; }));
  }
}

TEST_CASE("zero-size chunks: leading, trailing, consecutive, all of them, and no chunks") {
  const int width = 3;
  const std::vector<std::vector<int>> all_sizes = {
      {0, 0, 3, 0, 2, 0}, {0, 1, 0, 0, 0, 4}, {5, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0}};
  const std::vector<int> order = {5, 2, 0, 4, 1, 3};
  for (const auto& sizes : all_sizes) {
    const std::vector<int> x = distinct_rows(sizes, width);
    std::vector<int> sorted(x.size(), -1), back(x.size(), -1);
    REQUIRE(sort_chunks<int>(sizes, order, x, width, sorted));
    CHECK(sorted == naive_sort(sizes, order, x, width));
    REQUIRE(unsort_chunks<int>(sizes, order, sorted, width, back));
    CHECK(back == x);
    std::vector<int> src(sizes.size()), dst(sizes.size());
    REQUIRE(plan_chunk_offsets(sizes, order, src, dst));
    for (int c = 0; c < 6; ++c) CHECK(src[at(c)] == naive_start(sizes, c));
  }
  const std::vector<int> none;
  std::vector<int> empty;
  CHECK(check_chunk_order(none, none));
  CHECK(sort_chunks<int>(none, none, none, width, empty));
  CHECK(unsort_chunks<int>(none, none, none, width, empty));
}

TEST_CASE("plan_chunk_offsets refuses offset arrays of the wrong length and more than max_rows") {
  const std::vector<int> sizes = {1, 2, 3}, order = {2, 0, 1};
  std::vector<int> two(2), three(3);
  auto st = plan_chunk_offsets(sizes, order, two, three);
  REQUIRE_FALSE(st);
  CHECK(st.error().code == errc::shape_mismatch);
  CHECK(st.error().message == "chunk sort: 3 chunks but offset arrays of 2 and 3 entries");
  // sum(sizes) = 2^31: the int offsets would overflow.
  const std::vector<int> huge = {INT_MAX, 1, 0};
  std::vector<int> dst(3);
  st = plan_chunk_offsets(huge, order, three, dst);
  REQUIRE_FALSE(st);
  CHECK(st.error().code == errc::overflow);
  CHECK(st.error().message.find("2147483648 rows") != std::string::npos);
  std::vector<int> x(1), out(1, -5);
  CHECK(sort_chunks<int>(huge, order, x, 0, out).error().code == errc::overflow);
  CHECK(out[0] == -5);
}

TEST_CASE(
    "no heap allocation: the caller-storage forms, and the convenient ones up to 256 chunks") {
  std::mt19937 rng(256);
  for (const int m : {1, 7, 256, 2000}) {
    std::vector<int> sizes(at(m)), order(at(m)), src(at(m)), dst(at(m));
    for (auto& v : sizes) v = static_cast<int>(rng() % 3);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int> x = distinct_rows(sizes, 2);
    std::vector<int> sorted(x.size()), back(x.size());
    moefold::test::counting.store(true);
    const long long before = moefold::test::news.load();
    REQUIRE(sort_chunks<int>(sizes, order, x, 2, sorted, src, dst));
    REQUIRE(unsort_chunks<int>(sizes, order, sorted, 2, back, src, dst));
    REQUIRE(check_chunk_order(sizes, order));  // a bitmap on the stack up to 4096 chunks
    const long long with_storage = moefold::test::news.load() - before;
    REQUIRE(sort_chunks<int>(sizes, order, x, 2, sorted));
    REQUIRE(unsort_chunks<int>(sizes, order, sorted, 2, back));
    const long long convenient = moefold::test::news.load() - before - with_storage;
    moefold::test::counting.store(false);
    CAPTURE(m);
    CHECK(with_storage == 0);
    CHECK(convenient == (m <= 256 ? 0 : 2));  // beyond 256 chunks: one array per call
    CHECK(back == x);
  }
}
