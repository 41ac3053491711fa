// folded_mesh: the worked examples of the reference as exact expectations, validation, and
// static/dynamic mixes that must behave alike.
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <doctest/doctest.h>

#include <map>
#include <string>

#include "group_text.hpp"

using namespace moefold;
using moefold::test::groups_from_text;
using moefold::test::singletons;

namespace {

using expectation = std::map<std::string, std::vector<std::vector<int>>>;

void check_groups(const megatron_groups& g, const expectation& want) {
  std::vector<std::string> listed;
  for (int i = 0; i < g.num_kinds(); ++i) listed.push_back(to_string(g.kind_at(i)));
  for (const auto& [name, groups] : want) {
    CAPTURE(name);
    bool found = false;
    for (int i = 0; i < g.num_kinds(); ++i)
      if (to_string(g.kind_at(i)) == name) {
        found = true;
        CHECK(g(g.kind_at(i)).to_vectors() == groups);
      }
    CHECK(found);
  }
}

megatron_groups groups_of(const fold_config& c, const group_options& o = {}) {
  return megatron_groups::make(make_folded(c).value(), o).value();
}

}  // namespace

TEST_CASE("worked example v0000: world 8, tp2 dp2 pp2 / etp2 ep1 edp2") {
  const auto g = groups_of({.world = 8, .tp = 2, .pp = 2, .ep = 1, .etp = 2});
  check_groups(g, {
                      {"dp-cp", groups_from_text("[0,2] [1,3] [4,6] [5,7]")},
                      {"dp", groups_from_text("[0,2] [1,3] [4,6] [5,7]")},
                      {"cp", singletons(8)},
                      {"tp-pp", groups_from_text("[0,1,4,5] [2,3,6,7]")},
                      {"tp", groups_from_text("[0,1] [2,3] [4,5] [6,7]")},
                      {"pp", groups_from_text("[0,4] [1,5] [2,6] [3,7]")},
                      {"embd", groups_from_text("[0,4] [1,5] [2,6] [3,7]")},
                      {"pos_embd", singletons(4)},
                      {"tp-dp-cp", groups_from_text("[0,1,2,3] [4,5,6,7]")},
                      {"tp-dp", groups_from_text("[0,1,2,3] [4,5,6,7]")},
                      {"tp-cp", groups_from_text("[0,1] [2,3] [4,5] [6,7]")},
                      {"ep", singletons(8)},
                      {"etp", groups_from_text("[0,1] [2,3] [4,5] [6,7]")},
                      {"tp-ep", groups_from_text("[0,1] [2,3] [4,5] [6,7]")},
                      {"tp-ep-pp", groups_from_text("[0,1,4,5] [2,3,6,7]")},
                      {"edp", groups_from_text("[0,2] [1,3] [4,6] [5,7]")},
                      {"intra_dist_opt_instance", groups_from_text("[0,1,4,5,2,3,6,7]")},
                  });
  CHECK(g.num_kinds() == 17);
}

TEST_CASE("worked example v0001: world 16, tp2 cp2 dp2 pp2 / etp1 ep4 edp2") {
  const auto g = groups_of({.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1});
  check_groups(
      g,
      {
          {"dp-cp", groups_from_text("[0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]")},
          {"dp", groups_from_text("[0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]")},
          {"cp", groups_from_text("[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]")},
          {"tp-pp", groups_from_text("[0,1,8,9] [2,3,10,11] [4,5,12,13] [6,7,14,15]")},
          {"tp", groups_from_text("[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]")},
          {"pp", groups_from_text("[0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]")},
          {"embd", groups_from_text("[0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]")},
          {"pos_embd", singletons(8)},
          {"tp-dp-cp", groups_from_text("[0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]")},
          {"tp-dp", groups_from_text("[0,1,4,5] [2,3,6,7] [8,9,12,13] [10,11,14,15]")},
          {"tp-cp", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"ep", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"etp", singletons(16)},
          {"tp-ep", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"tp-ep-pp", groups_from_text("[0,1,2,3,8,9,10,11] [4,5,6,7,12,13,14,15]")},
          {"edp", groups_from_text("[0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]")},
          {"intra_dist_opt_instance", groups_from_text("[0,1,2,3,8,9,10,11,4,5,6,7,12,13,14,15]")},
      });
}

TEST_CASE("worked example v0002: world 64, tp2 dp8 pp4 / etp1 ep8 edp2 (spot checks)") {
  const auto f = make_folded({.world = 64, .tp = 2, .pp = 4, .ep = 8, .etp = 1}).value();
  CHECK(f.dp() == 8);
  CHECK(f.edp() == 2);
  const megatron_groups g(f);
  CHECK(g(group_kind::dp_cp)[1].to_vector() == std::vector<int>{1, 3, 5, 7, 9, 11, 13, 15});
  CHECK(g(group_kind::tp_pp)[7].to_vector() == std::vector<int>{14, 15, 30, 31, 46, 47, 62, 63});
  CHECK(g(group_kind::embd)[15].to_vector() == std::vector<int>{15, 63});
  CHECK(g(group_kind::ep)[3].to_vector() == std::vector<int>{24, 25, 26, 27, 28, 29, 30, 31});
  CHECK(g(group_kind::edp)[31].to_vector() == std::vector<int>{55, 63});
  CHECK(g(group_kind::tp_ep_pp).count() == 2);
  CHECK(g(group_kind::intra_dist_opt_instance)(0, 32) == 8);
}

TEST_CASE("worked example v0003: pp not last, valid because tp*cp == etp*ep") {
  const auto g = groups_of(
      {.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1, .order = "tp-cp-ep-pp-dp"});
  check_groups(
      g,
      {
          {"dp-cp", groups_from_text("[0,2,8,10] [1,3,9,11] [4,6,12,14] [5,7,13,15]")},
          {"dp", groups_from_text("[0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]")},
          {"cp", groups_from_text("[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]")},
          {"tp-pp", groups_from_text("[0,1,4,5] [2,3,6,7] [8,9,12,13] [10,11,14,15]")},
          {"tp", groups_from_text("[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]")},
          {"pp", groups_from_text("[0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]")},
          {"embd", groups_from_text("[0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]")},
          {"pos_embd", groups_from_text("[0] [1] [2] [3] [8] [9] [10] [11]")},
          {"tp-dp-cp", groups_from_text("[0,1,2,3,8,9,10,11] [4,5,6,7,12,13,14,15]")},
          {"tp-dp", groups_from_text("[0,1,8,9] [2,3,10,11] [4,5,12,13] [6,7,14,15]")},
          {"tp-cp", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"ep", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"etp", singletons(16)},
          {"tp-ep", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
          {"tp-ep-pp", groups_from_text("[0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]")},
          {"edp", groups_from_text("[0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]")},
          {"intra_dist_opt_instance", groups_from_text("[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]")},
      });
}

TEST_CASE("section 5 snippets: distributed-optimizer instances, hierarchical CP, rank offset") {
  const auto g = groups_of({.world = 16, .tp = 1, .cp = 2, .pp = 2, .ep = 2, .etp = 1},
                           {.dist_opt_instances = 2});
  check_groups(
      g, {
             {"dp-cp", groups_from_text("[0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]")},
             {"intra_dp_cp", groups_from_text("[0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]")},
             {"edp", groups_from_text("[0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]")},
             {"intra_ep_dp",
              groups_from_text("[0,2] [4,6] [1,3] [5,7] [8,10] [12,14] [9,11] [13,15]")},
             {"inter_ep_dp",
              groups_from_text("[0,4] [2,6] [1,5] [3,7] [8,12] [10,14] [9,13] [11,15]")},
             {"tp-ep-pp", groups_from_text("[0,1,8,9] [2,3,10,11] [4,5,12,13] [6,7,14,15]")},
             {"intra_dist_opt_instance",
              groups_from_text("[0,1,8,9,2,3,10,11] [4,5,12,13,6,7,14,15]")},
         });
  CHECK(g.num_kinds() == 20);
  CHECK(to_string(g.kind_at(17)) == "intra_dp_cp");
  CHECK(to_string(g.kind_at(19)) == "inter_ep_dp");

  const auto h = groups_of({.world = 16, .cp = 4, .pp = 2}, {.hierarchical_cp = {2, 2}});
  CHECK(h.num_kinds() == 19);
  CHECK(to_string(h.kind_at(17)) == "hcp_L0");
  CHECK(h(group_kind::cp).to_vectors()[1] == std::vector<int>{4, 5, 6, 7});
  CHECK(h(group_kind::hcp, 0).to_vectors() ==
        groups_from_text("[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]"));
  CHECK(h(group_kind::hcp, 1).to_vectors() ==
        groups_from_text("[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]"));

  CHECK_FALSE(h.has(group_kind::hcp, 2));
  CHECK(h(group_kind::hcp, 2).count() == 0);  // a level that is not built: empty, not garbage
  CHECK(h(group_kind::hcp, -1).count() == 0);
  const auto o = groups_of({.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1}, {.rank_offset = 8});
  CHECK(o(group_kind::tp).to_vectors() == groups_from_text("[8,9] [10,11] [12,13] [14,15]"));
  CHECK(o(group_kind::intra_dist_opt_instance)(0, 0) == 8);
}

TEST_CASE("fold validation: each rule has its own error kind and names the values") {
  struct bad {
    fold_config c;
    errc code;
    const char* text;
  };
  const bad cases[] = {
      {{.world = 0}, errc::invalid_size, "world must be >= 1 (got 0)"},
      {{.world = 8, .tp = -2}, errc::invalid_size, "tp must be >= 1 (got -2)"},
      {{.world = 8, .etp = 0}, errc::invalid_size, "etp must be >= 1 (got 0)"},
      {{.world = 12, .tp = 4, .pp = 2}, errc::world_not_divisible, "rule 2"},
      {{.world = 16, .cp = 2, .order = "tp-ep-dp-pp"}, errc::order_missing_axis, "lacks 'cp'"},
      {{.world = 16, .ep = 2, .order = "tp-cp-dp-pp"}, errc::order_missing_axis, "rule 6"},
      {{.world = 16, .pp = 2, .order = "tp-cp-ep-dp"}, errc::order_missing_axis, "lacks 'pp'"},
      {{.world = 16, .order = "tp-cp-xp-dp-pp"}, errc::order_unknown_token, "'xp'"},
      {{.world = 16, .order = "tp-cp-ep-dp-dp"}, errc::order_duplicate_token, "twice"},
      {{.world = 12, .pp = 2, .ep = 4},
       errc::moe_world_not_divisible,
       "world size 12 is not divisible by etp * ep * pp = 1 * 4 * 2 = 8"},
      {{.world = 64, .tp = 2, .pp = 4, .ep = 8, .etp = 1, .order = "tp-cp-ep-pp-dp"},
       errc::fold_data_parallel_mismatch,
       "edp = 2 and dp = 8"},
      {{.world = 16, .tp = 2, .pp = 2, .ep = 2, .etp = 1, .order = "tp-pp-cp-ep-dp"},
       errc::fold_pipeline_mismatch,
       "rule 8"},
      {{.world = 1 << 30, .tp = 1 << 16, .cp = 1 << 16, .pp = 2}, errc::overflow, "exceeds"},
  };
  for (const auto& b : cases) {
    CAPTURE(b.text);
    auto f = make_folded(b.c);
    REQUIRE_FALSE(f);
    CHECK(f.error().code == b.code);
    CHECK(f.error().message.find(b.text) != std::string::npos);
  }
}

TEST_CASE("group options: rules 9, 11 and 13 and bad values") {
  const auto f = make_folded({.world = 16, .cp = 2, .pp = 2, .ep = 2, .etp = 1}).value();
  CHECK(megatron_groups::make(f, {.dist_opt_instances = 3}).error().code ==
        errc::dist_opt_dp_not_divisible);
  CHECK(megatron_groups::make(f, {.dist_opt_instances = 0}).error().code == errc::invalid_size);
  CHECK(megatron_groups::make(f, {.hierarchical_cp = {2, 2}}).error().code ==
        errc::hierarchical_cp_mismatch);
  CHECK(megatron_groups::make(f, {.hierarchical_cp = {2, 0}}).error().code == errc::invalid_size);
  CHECK(megatron_groups::make(f, {.hierarchical_cp = {1, 2, 1}}).has_value());
  CHECK(megatron_groups::make(f, {.rank_offset = -1}).error().code == errc::invalid_size);
  CHECK(megatron_groups::make(f, {.rank_offset = 2147483647}).error().code == errc::overflow);
  // dp*cp = 8 divisible by 8, edp = 4 is not: rule 13.
  auto e = megatron_groups::make(f, {.dist_opt_instances = 8});
  CHECK(e.error().code == errc::dist_opt_edp_not_divisible);
  CHECK(e.error().message.find("edp = 4") != std::string::npos);
}

namespace {
template <int TP, int CP, int DP, int PP, int EP, int ETP>
using fold6 = folded_mesh<mesh<axis::tp<TP>, axis::cp<CP>, axis::dp<DP>, axis::pp<PP>>,
                          mesh<axis::etp<ETP>, axis::ep<EP>>>;
constexpr int D = dynamic;

template <class F>
F make_v0001() {
  if constexpr (F::is_static())
    return F{};
  else
    return F::make(F::attention_mesh_type::make(2, 2, 2, 2).value(),
                   F::moe_input_mesh_type::make(1, 4).value())
        .value();
}
}  // namespace

TEST_CASE_TEMPLATE("folds behave the same whatever is static", F, fold6<2, 2, 2, 2, 4, 1>,
                   fold6<D, 2, 2, 2, 4, 1>, fold6<2, 2, D, 2, 4, 1>, fold6<2, 2, 2, D, D, 1>,
                   fold6<D, D, D, D, D, D>) {
  const F f = make_v0001<F>();
  CHECK(static_cast<int>(f.world_size()) == 16);
  CHECK(f.edp() == 2);
  CHECK(static_cast<int>(f.template size<axis::edp>()) == 2);
  const megatron_groups g(f);
  const auto ref = groups_of({.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1});
  for (int i = 0; i < ref.num_kinds(); ++i) CHECK(g(ref.kind_at(i)) == ref(ref.kind_at(i)));
  // Coordinate maps agree with the groups: a tp group holds tp = 0..tp-1 at fixed cp, dp, pp.
  for (int r = 0; r < 16; ++r) {
    const auto a = f.attention_coord_of(r);
    const auto m = f.moe_coord_of(r);
    CHECK(f.rank_of(a) == r);
    CHECK(f.rank_of(m) == r);
    CHECK(a.pp == m.pp);  // only pp is shared
    const auto tpg = g(group_kind::tp).find(r);
    CHECK(tpg.position == a.tp);
    const auto epg = g(group_kind::ep).find(r);
    CHECK(epg.position == m.ep);
    CHECK(g(group_kind::edp).find(r).position == m.edp);
  }
}

TEST_CASE("a fully static fold is empty and its groups are compile-time values") {
  using F = fold6<2, 2, 2, 2, 4, 1>;
  static_assert(std::is_empty_v<F>);
  static_assert(std::is_same_v<decltype(F{}.size<axis::edp>()), std::integral_constant<int, 2>>);
  static_assert(std::is_same_v<decltype(F{}.world_size()), std::integral_constant<int, 16>>);
  constexpr megatron_groups g{F{}};
  // v0001: ep = [0,1,2,3] [4,5,6,7] ..., dp-cp = [0,2,4,6] [1,3,5,7] ...
  static_assert(g(group_kind::ep)(1, 0) == 4 && g(group_kind::ep).group_size() == 4);
  static_assert(g(group_kind::dp_cp)(1, 3) == 7);
  static_assert(g(group_kind::intra_dist_opt_instance)(0, 8) == 4);
  static_assert(F{}.moe_coord_of(13).ep == 1 && F{}.moe_coord_of(13).edp == 1);
  using P = folded_mesh<mesh<axis::tp<2>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                        mesh<axis::etp<1>, axis::ep<4>>, megatron_order{"tp-cp-ep-pp-dp"}>;
  static_assert(megatron_groups{P{}}(group_kind::dp_cp)(0, 2) == 8);  // v0003
  // The checked factory runs at compile time too.
  static_assert(make_folded({.world = 64, .tp = 2, .pp = 4, .ep = 8, .etp = 1}).value().edp() == 2);
  static_assert(!make_folded({.world = 12, .tp = 4, .pp = 2}).has_value());
}

TEST_CASE("two different folds live side by side in one process (no global state)") {
  const auto a = make_folded({.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1}).value();
  const auto b = make_folded({.world = 16, .tp = 4, .ep = 16, .etp = 1}).value();
  const megatron_groups ga(a), gb(b);
  CHECK(ga(group_kind::ep).group_size() == 4);
  CHECK(gb(group_kind::ep).group_size() == 16);  // EP folded over TP and DP
  CHECK(ga(group_kind::ep).group_size() == 4);
  CHECK_FALSE(a == b);
}

TEST_CASE("a fold with a dynamic order") {
  using F = folded_mesh<mesh<axis::tp<2>, axis::cp<2>, axis::dp<2>, axis::pp<2>>,
                        mesh<axis::etp<1>, axis::ep<4>>, dynamic_order>;
  auto f = F::make({}, {}, "TP-CP-EP-PP-DP");
  REQUIRE(f);
  CHECK(f->order() == tp_pp_dp_order);
  CHECK(F::make({}, {}, "tp-cp-ep-dp").error().code == errc::order_missing_axis);
  // tp*cp == etp*ep passes rule 7, but before pp the meshes span tp = 2 vs etp = 1: rule 8.
  CHECK(F::make({}, {}, "tp-pp-cp-ep-dp").error().code == errc::fold_pipeline_mismatch);
  CHECK(F::make({}, {}, "pp-tp-cp-ep-dp").has_value());
  using G = folded_mesh<mesh<axis::tp<>, axis::dp<>, axis::pp<>>,
                        mesh<axis::etp<>, axis::ep<>, axis::pp<>>>;
  auto bad_pp = G::make(G::attention_mesh_type::make(1, 4, 2).value(),
                        G::moe_input_mesh_type::make(1, 2, 4).value());
  CHECK(bad_pp.error().code == errc::fold_pipeline_mismatch);
}
