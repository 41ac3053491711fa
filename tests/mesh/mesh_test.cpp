// mesh<Axes...>: typed tests over static/dynamic mixes; every mix must behave the same.
#include <moefold/mesh/mesh.hpp>

#include <doctest/doctest.h>

#include <set>
#include <type_traits>

using namespace moefold;

namespace {
template <int A, int B, int C>
using mesh3 = mesh<axis::tp<A>, axis::dp<B>, axis::pp<C>>;
constexpr int D = dynamic;

// Makes a mesh of sizes (2, 3, 4) whatever is static in it.
template <class M>
M make234() {
  if constexpr (M::num_dynamic_axes() == 0)
    return M{};
  else
    return M::make(2, 3, 4).value();  // all sizes form: static positions are checked
}
}  // namespace

TEST_CASE_TEMPLATE("mesh behaves the same whatever is static", M, mesh3<2, 3, 4>, mesh3<D, 3, 4>,
                   mesh3<2, D, 4>, mesh3<2, 3, D>, mesh3<D, D, 4>, mesh3<D, D, D>) {
  const M m = make234<M>();
  CHECK(M::num_axes() == 3);
  CHECK(m.size(axis_id::tp) == 2);
  CHECK(m.size(axis_id::dp) == 3);
  CHECK(m.size(axis_id::pp) == 4);
  CHECK(m.size(axis_id::ep) == 1);  // an absent axis has size 1
  CHECK(static_cast<int>(m.world_size()) == 24);
  // First axis fastest: rank = tp + 2 * (dp + 3 * pp).
  for (int r = 0; r < 24; ++r) {
    const auto c = m.coord_of(r);
    CHECK(c[0] == r % 2);
    CHECK(c[1] == (r / 2) % 3);
    CHECK(c[2] == r / 6);
    CHECK(m.rank_of(c) == r);
  }
  CHECK(m.template coord<axis::dp>(11) == 2);
  // tp groups are consecutive pairs; dp groups stride 2; pp groups stride 6.
  const auto tp = m.template groups<axis::tp>();
  CHECK(tp.count() == 12);
  CHECK(tp[5].to_vector() == std::vector<int>{10, 11});
  const auto dp = m.template groups<axis::dp>();
  CHECK(dp.to_vectors() == std::vector<std::vector<int>>{{0, 2, 4},
                                                         {1, 3, 5},
                                                         {6, 8, 10},
                                                         {7, 9, 11},
                                                         {12, 14, 16},
                                                         {13, 15, 17},
                                                         {18, 20, 22},
                                                         {19, 21, 23}});
  const auto tp_pp = m.template groups<axis::pp, axis::tp>();  // query order does not matter
  CHECK(tp_pp[1].to_vector() == std::vector<int>{2, 3, 8, 9, 14, 15, 20, 21});
  CHECK(m.groups({axis_id::tp, axis_id::pp}).value() == tp_pp);
  CHECK(m.groups({axis_id::ep}).error().code == errc::invalid_argument);
  CHECK(m.checked_coord_of(24).error().code == errc::rank_out_of_range);
  CHECK(m.checked_rank_of({0, 3, 0}).error().code == errc::rank_out_of_range);
  CHECK(m.checked_rank_of({1, 2, 3}).value() == 23);
}

TEST_CASE("static sizes stay compile-time values and cost no storage") {
  using S = mesh<axis::tp<2>, axis::pp<4>>;
  static_assert(std::is_empty_v<S>);
  static_assert(std::is_same_v<decltype(S{}.size<axis::tp>()), std::integral_constant<int, 2>>);
  static_assert(std::is_same_v<decltype(S{}.world_size()), std::integral_constant<int, 8>>);
  static_assert(std::is_same_v<decltype(S{}.size<axis::ep>()), std::integral_constant<int, 1>>);
  using M = mesh<axis::tp<2>, axis::dp<>, axis::pp<4>>;
  static_assert(sizeof(M) == sizeof(int));
  static_assert(std::is_same_v<decltype(M::make(3).value().size<axis::dp>()), int>);
  static_assert(M::static_size<axis::tp>() == 2 && M::static_size<axis::dp>() == dynamic);
  static_assert(sizeof(mesh<axis::tp<>, axis::dp<>, axis::pp<>>) == 3 * sizeof(int));
  // Usable in constant expressions, including the checked factory.
  static_assert(M::make(3).value().rank_of({1, 2, 3}) == 1 + 2 * (2 + 3 * 3));
  static_assert(M::make(3).value().groups<axis::pp>()(1, 2) ==
                1 + 2 * 6);  // group 1 = {tp 1, dp 0}, stride 6
}

TEST_CASE("make rejects sizes below 1, contradicted static sizes and overflow") {
  using M = mesh<axis::tp<2>, axis::dp<>, axis::pp<>>;
  CHECK(M::make(0, 1).error().code == errc::invalid_size);
  CHECK(M::make(-3, 1).error().message.find("dp must be >= 1 (got -3)") != std::string::npos);
  CHECK(M::make(2, 4, 0).error().code == errc::invalid_size);
  auto wrong = M::make(4, 2, 2);
  CHECK(wrong.error().code == errc::invalid_size);
  CHECK(wrong.error().message.find("tp is static 2 but 4") != std::string::npos);
  CHECK(M::make(1 << 20, 1 << 20).error().code == errc::overflow);
  CHECK(M::make(2147483647, 1).error().code == errc::overflow);  // 2 * (2^31-1)
  CHECK(M::make(1073741823, 1).value().world_size() == 2147483646);
}

TEST_CASE("conversions: static to dynamic always, dynamic to static checked") {
  using S = mesh<axis::tp<2>, axis::pp<4>>;
  using D2 = mesh<axis::tp<>, axis::pp<>>;
  auto d = D2::from(S{});
  REQUIRE(d);
  CHECK(d->size(axis_id::pp) == 4);
  CHECK(S::from(*d).has_value());
  CHECK(S::from(D2::make(2, 8).value()).error().code == errc::invalid_size);
}

TEST_CASE("every group list of a mesh partitions its ranks") {
  using M = mesh<axis::tp<>, axis::cp<>, axis::dp<>, axis::pp<>>;
  const auto m = M::make(3, 2, 5, 2).value();
  for (unsigned mask = 0; mask < 16; ++mask) {
    axis_set s;
    for (unsigned i = 0; i < 4; ++i)
      if (mask & (1u << i)) s.insert(M::axis(i));
    const auto l = m.groups(s).value();
    CHECK(l.count() * l.group_size() == 60);
    std::set<int> seen;
    for (auto g : l)
      for (int r : g) seen.insert(r);
    CHECK(seen.size() == 60u);
    CHECK(*seen.begin() == 0);
    CHECK(*seen.rbegin() == 59);
  }
}
