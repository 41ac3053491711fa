// Properties over a sweep of folds (world sizes up to 256, powers of two and not): every kind
// partitions the world as it should, both meshes have identical pipeline groups, kinds that must
// stay inside one pipeline stage do, groups agree with the coordinate maps, and invalid inputs
// give the error kind an independent predicate expects. Integer extremes are fed in as well, so
// that the UBSan build proves the checks are free of overflow.
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <doctest/doctest.h>

#include <climits>
#include <random>
#include <set>
#include <vector>

using namespace moefold;

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

struct sweep_config {
  fold_config c;
  group_options o;
};

// The error kind Megatron's rules predict for a configuration (written from the rules of
// megatron-rank-groups.md section 4, independently of the library's check_fold).
errc predicted(const fold_config& c, int etp) {
  if (c.world < 1 || c.tp < 1 || c.cp < 1 || c.pp < 1 || c.ep < 1 || etp < 1)
    return errc::invalid_size;
  if (c.world % (c.tp * c.cp * c.pp)) return errc::world_not_divisible;
  const int dp = c.world / (c.tp * c.cp * c.pp);
  const std::string o(c.order);
  const bool pp_last = o.size() >= 2 && o.substr(o.size() - 2) == "pp";
  if (c.world % (etp * c.ep * c.pp)) return errc::moe_world_not_divisible;
  const int edp = c.world / (etp * c.ep * c.pp);
  if (!pp_last && c.pp > 1 && edp != dp) return errc::fold_data_parallel_mismatch;
  return errc::success;
}

}  // namespace

TEST_CASE("property sweep over at least 500 folds") {
  std::mt19937 rng(20261130);
  const std::vector<int> worlds = {1,  2,   3,   4,   5,   6,   7,   8,   9,   10, 12,
                                   16, 18,  24,  27,  30,  32,  36,  48,  60,  64, 72,
                                   96, 100, 120, 128, 144, 192, 210, 216, 240, 256};
  const char* orders[] = {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-dp-cp-ep-pp", "cp-tp-ep-dp-pp",
                          "ep-tp-cp-dp-pp", "tp-ep-cp-dp-pp", "pp-tp-cp-ep-dp", "dp-tp-cp-ep-pp"};
  int valid = 0, invalid = 0, non_pow2 = 0, with_options = 0, folded_ep = 0;
  auto pick = [&](const std::vector<int>& v) { return v[rng() % v.size()]; };
  for (int iter = 0; iter < 4000 && valid < 600; ++iter) {
    const int world = worlds[static_cast<std::size_t>(iter) % worlds.size()];
    const auto dv = divisors(world);
    fold_config c{.world = world,
                  .tp = pick(dv),
                  .cp = pick(dv),
                  .pp = pick(dv),
                  .ep = pick(dv),
                  .etp = pick(dv),
                  .order = orders[rng() % 8]};
    const errc want = predicted(c, *c.etp);
    auto f = make_folded(c);
    if (want != errc::success) {
      // The predicate covers rules 2, 5 and 7; rule 8 may also reject (checked below).
      REQUIRE_FALSE(f);
      CHECK(f.error().code == want);
      ++invalid;
      continue;
    }
    if (!f) {
      CHECK(f.error().code == errc::fold_pipeline_mismatch);
      ++invalid;
      continue;
    }
    ++valid;
    if (world & (world - 1)) ++non_pow2;
    if (c.ep > f->dp() || c.ep > c.world / (c.tp * c.pp)) ++folded_ep;
    group_options opt{};
    // Distributed-optimizer instances and hierarchical CP on some configurations.
    for (int nd : {4, 3, 2})
      if (iter % 3 == 0 && (f->dp() * f->cp()) % nd == 0 && f->edp() % nd == 0) {
        opt.dist_opt_instances = nd;
        break;
      }
    if (iter % 4 == 1 && c.cp % 2 == 0) opt.hierarchical_cp = {2, c.cp / 2};
    if (iter % 5 == 2) opt.rank_offset = 8 * (iter % 7);
    if (opt.dist_opt_instances > 1 || opt.hierarchical_cp.levels > 0) ++with_options;
    const auto g = megatron_groups::make(*f, opt).value();
    const int off = opt.rank_offset;
    CAPTURE(world);
    CAPTURE(c.tp);
    CAPTURE(c.cp);
    CAPTURE(c.pp);
    CAPTURE(c.ep);
    CAPTURE(*c.etp);
    CAPTURE(std::string(c.order));

    for (int i = 0; i < g.num_kinds(); ++i) {
      const auto kind = g.kind_at(i);
      const auto list = g(kind);
      const bool partial = kind.kind == group_kind::embd || kind.kind == group_kind::pos_embd;
      std::set<int> seen;
      for (auto grp : list)
        for (int r : grp) {
          CHECK(r >= off);
          CHECK(r < off + world);
          seen.insert(r);
        }
      if (!partial) {
        CHECK(list.count() * list.group_size() == world);  // a partition: covers, no repeats
        CHECK(static_cast<int>(seen.size()) == world);
      }
      // Every kind but pp, tp-pp, embd, tp-ep-pp and intra_dist_opt_instance stays in a stage.
      const bool crosses = kind.kind == group_kind::pp || kind.kind == group_kind::tp_pp ||
                           kind.kind == group_kind::embd || kind.kind == group_kind::tp_ep_pp ||
                           kind.kind == group_kind::intra_dist_opt_instance;
      if (!crosses)
        for (auto grp : list)
          for (int k = 1; k < grp.size(); ++k)
            CHECK(f->attention_coord_of(grp[k] - off).pp == f->attention_coord_of(grp[0] - off).pp);
    }
    // Sizes of the generator kinds.
    CHECK(g(group_kind::tp).group_size() == c.tp);
    CHECK(g(group_kind::dp_cp).group_size() == f->dp() * c.cp);
    CHECK(g(group_kind::ep).group_size() == c.ep);
    CHECK(g(group_kind::etp).group_size() == *c.etp);
    CHECK(g(group_kind::edp).group_size() == f->edp());
    CHECK(g(group_kind::tp_dp_cp).group_size() == world / c.pp);
    // Identical pipeline groups in both meshes: the MoE generator's own pp groups.
    const auto moe_pp = group_list(
        detail::masked_groups(f->moe_grid(), 1u << f->order().position(order_token::pp), off));
    CHECK(moe_pp == g(group_kind::pp));
    // Groups agree with the coordinate maps: a tp group = one (cp, dp, pp), tp = 0..tp-1 in order.
    for (auto grp : g(group_kind::tp))
      for (int k = 0; k < grp.size(); ++k) {
        const auto a = f->attention_coord_of(grp[k] - off);
        const auto a0 = f->attention_coord_of(grp[0] - off);
        CHECK(a.tp == k);
        CHECK((a.cp == a0.cp && a.dp == a0.dp && a.pp == a0.pp));
      }
    for (auto grp : g(group_kind::ep))
      for (int k = 0; k < grp.size(); ++k) {
        const auto m = f->moe_coord_of(grp[k] - off);
        const auto m0 = f->moe_coord_of(grp[0] - off);
        CHECK(m.ep == k);
        CHECK((m.etp == m0.etp && m.edp == m0.edp && m.pp == m0.pp));
      }
    for (auto grp : g(group_kind::edp))
      for (int k = 0; k < grp.size(); ++k) CHECK(f->moe_coord_of(grp[k] - off).edp == k);
    // intra_dist_opt_instance i = union of the i-th intra_dp_cp slices (as sets). This holds for
    // the two orders Megatron's trainer uses; with dp ahead of cp or tp in the order the
    // attention slices and the concatenated MoE groups need not coincide (nor do they in
    // Megatron-Core, whose layout we reproduce, not repair).
    const std::string ord(c.order);
    if (opt.dist_opt_instances > 1 && (ord == "tp-cp-ep-dp-pp" || ord == "tp-cp-ep-pp-dp")) {
      const int nd = opt.dist_opt_instances;
      for (int inst = 0; inst < nd; ++inst) {
        std::set<int> a, b;
        for (int r : g(group_kind::intra_dist_opt_instance)[inst]) a.insert(r);
        const auto slices = g(group_kind::intra_dp_cp);
        for (int s = inst; s < slices.count(); s += nd)
          for (int r : slices[s]) b.insert(r);
        CHECK(a == b);
      }
    }
  }
  CHECK(valid >= 500);
  CHECK(invalid >= 100);
  CHECK(non_pow2 >= 150);
  CHECK(with_options >= 50);
  CHECK(folded_ep >= 50);
  MESSAGE("valid " << valid << ", invalid " << invalid << ", non-power-of-two " << non_pow2
                   << ", with options " << with_options << ", EP folded over TP/DP " << folded_ep);
}

TEST_CASE("integer extremes give errors, never overflow (run under UBSan in CI)") {
  const int extremes[] = {INT_MIN, INT_MIN + 1, -65536, -1,      0,           1,      2,
                          3,       46341,       65536,  1 << 30, INT_MAX - 1, INT_MAX};
  int checked = 0;
  for (int w : extremes)
    for (int a : extremes)
      for (int b : {1, 2, INT_MAX, 0, -1, 65536}) {
        for (int which = 0; which < 5; ++which) {
          fold_config c{.world = w};
          int* slot[] = {&c.tp, &c.cp, &c.pp, &c.ep};
          if (which < 4)
            *slot[which] = a;
          else
            c.etp = a;
          *slot[(which + 1) % 4] = b;
          auto f = make_folded(c);
          if (f) {
            // Whatever was accepted is consistent and its groups can be enumerated.
            CHECK(f->world_size() == w);
            const megatron_groups g(*f);
            CHECK(g(group_kind::tp).count() * g(group_kind::tp).group_size() == w);
          } else {
            CHECK(f.error().code != errc::success);
            CHECK_FALSE(f.error().message.empty());
          }
          ++checked;
        }
      }
  for (int v : extremes) {
    const auto f = make_folded({.world = 4, .tp = 2}).value();
    auto g = megatron_groups::make(f, {.dist_opt_instances = v, .rank_offset = v});
    if (g) CHECK(g->rank_offset() == v);
    auto h = megatron_groups::make(f, {.hierarchical_cp = {v, v, v}});
    CHECK((v == 1 ? h.has_value() : !h.has_value()));
  }
  CHECK(checked > 3000);
}
