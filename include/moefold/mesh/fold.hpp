//! @file fold.hpp
//! @brief `folded_mesh`: an attention mesh (tp, cp, dp, pp) and an MoE mesh (etp, ep, edp, pp)
//! over one world, laid out by one Megatron order string. Only pp is shared.
//!
//! Illegal folds are compile errors when the sizes involved are static, and a checked factory
//! result (`make`, `make_folded`) when they are dynamic. EDP is always derived:
//! edp = world / (etp * ep * pp).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "../core/checked_int.hpp"
#include "../core/expected.hpp"
#include "axis.hpp"
#include "group_list.hpp"
#include "mesh.hpp"
#include "order.hpp"

namespace moefold {
inline namespace v0_1 {

//! A rank's place in the attention mesh.
struct attention_coord {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  friend constexpr bool operator==(const attention_coord&, const attention_coord&) = default;
};
//! A rank's place in the MoE mesh.
struct moe_coord {
  int etp = 0, ep = 0, edp = 0, pp = 0;
  friend constexpr bool operator==(const moe_coord&, const moe_coord&) = default;
};

namespace detail {

template <class M>
constexpr bool mesh_axes_within(std::initializer_list<axis_id> allowed) {
  for (std::size_t i = 0; i < M::num_axes(); ++i) {
    bool ok = false;
    for (axis_id a : allowed) ok = ok || M::axis(i) == a;
    if (!ok) return false;
  }
  return true;
}

//! The sizes that lay out a fold, all run-time ints (the common ground of every fold type).
struct fold_sizes {
  int tp = 1, cp = 1, dp = 1, pp = 1, ep = 1, etp = 1;
};

//! Size of each order token in the attention (moe = false) or MoE (moe = true) generator.
constexpr int token_size(const fold_sizes& s, int edp, bool moe, order_token t) noexcept {
  switch (t) {
    case order_token::tp: return moe ? s.etp : s.tp;
    case order_token::cp: return moe ? 1 : s.cp;
    case order_token::ep: return moe ? s.ep : 1;
    case order_token::dp: return moe ? edp : s.dp;
    case order_token::pp: return s.pp;
  }
  return 1;
}

constexpr grid generator_grid(const fold_sizes& s, int edp, bool moe,
                              const megatron_order& o) noexcept {
  grid g{};
  g.num_axes = 5;
  for (std::size_t i = 0; i < 5; ++i) g.sizes[i] = token_size(s, edp, moe, o.tokens[i]);
  return g;
}

//! Every fold rule of megatron-rank-groups.md section 4 that concerns sizes and the order, in
//! Megatron-Core's order (2, 4/4b, 5, 6, 7, 8). Sizes are already >= 1 and tp*cp*dp*pp fits in
//! int. Returns edp.
constexpr expected<int> check_fold(const fold_sizes& s, const megatron_order& o) {
  const int world = s.tp * s.cp * s.dp * s.pp;
  // Worded only on an error: the checks that pass build no std::string, so that a fold that
  // holds is a constant expression with clang and libstdc++ 12 as well.
  const auto ord = [&o] { return "order '" + o.str() + "'"; };
  // Rules 4 and 6: a token left out of the order must have size 1 in its generator. Megatron
  // checks tp, pp, dp, ep, cp in this order, first for the attention generator.
  auto missing = [&](bool moe, int edp) -> expected<int> {
    for (order_token t :
         {order_token::tp, order_token::pp, order_token::dp, order_token::ep, order_token::cp}) {
      const int n = token_size(s, edp, moe, t);
      if (!o.written(t) && n != 1) {
        const std::string what = moe ? (t == order_token::tp   ? "etp"
                                        : t == order_token::dp ? "edp"
                                                               : std::string(to_string(t)))
                                     : std::string(to_string(t));
        return make_error(errc::order_missing_axis,
                          ord() + " lacks '" + std::string(to_string(t)) + "' but " + what + " = " +
                              to_decimal(n) + " (Megatron rule " + (moe ? "6" : "4") +
                              ": every axis of size > 1 must appear in the order)");
      }
    }
    return 0;
  };
  if (auto m = missing(false, 1); !m) return unexpected<error>(m.error());
  // Rule 5: the MoE grid must tile the world.
  int etp_ep = 0, moe_stage = 0;
  if (!checked_mul(s.etp, s.ep, etp_ep) || !checked_mul(etp_ep, s.pp, moe_stage))
    return make_error(errc::overflow, "etp * ep * pp exceeds 2^31-1");
  if (world % moe_stage != 0)
    return make_error(errc::moe_world_not_divisible,
                      "world size " + to_decimal(world) + " is not divisible by etp * ep * pp = " +
                          to_decimal(s.etp) + " * " + to_decimal(s.ep) + " * " + to_decimal(s.pp) +
                          " = " + to_decimal(moe_stage) +
                          " (Megatron rule 5: the MoE mesh must tile the world)");
  const int edp = world / moe_stage;
  if (auto m = missing(true, edp); !m) return unexpected<error>(m.error());
  // Rule 7: with pp not last, the data-parallel sizes of both meshes must agree.
  if (!o.pp_last() && s.pp != 1 && edp != s.dp)
    return make_error(errc::fold_data_parallel_mismatch,
                      ord() + " does not end with pp, so edp must equal dp, but edp = " +
                          to_decimal(edp) + " and dp = " + to_decimal(s.dp) +
                          " (Megatron rule 7: tp * cp = " + to_decimal(s.tp * s.cp) +
                          " must equal etp * ep = " + to_decimal(etp_ep) + ")");
  // Rule 8: identical pp groups <=> pp == 1 or the axes left of pp have the same product.
  if (s.pp != 1) {
    long long left_attn = 1, left_moe = 1;
    for (int i = 0; i < o.position(order_token::pp); ++i) {
      left_attn *= token_size(s, edp, false, o.tokens[static_cast<std::size_t>(i)]);
      left_moe *= token_size(s, edp, true, o.tokens[static_cast<std::size_t>(i)]);
    }
    if (left_attn != left_moe)
      return make_error(errc::fold_pipeline_mismatch,
                        ord() + " gives different pipeline groups: the axes before pp span " +
                            to_decimal(left_attn) + " ranks in the attention mesh but " +
                            to_decimal(left_moe) +
                            " in the MoE mesh (Megatron rule 8: both meshes must have the "
                            "same pp groups)");
  }
  return edp;
}

}  // namespace detail

//! The attention mesh `Attn` (axes among tp, cp, dp, pp; a missing axis has size 1) folded with
//! the MoE mesh `Moe` (axes among etp, ep, pp; edp is derived) under the order `Order`
//! (a megatron_order, or `dynamic_order` to choose it at run time).
template <class Attn, class Moe, megatron_order Order = default_order>
class folded_mesh {
  static_assert(detail::mesh_axes_within<Attn>({axis_id::tp, axis_id::cp, axis_id::dp,
                                                axis_id::pp}),
                "moefold fold: the attention mesh may only have the axes tp, cp, dp and pp");
  static_assert(!Moe::has(axis_id::edp),
                "moefold fold: EDP is derived as world / (etp * ep * pp), never supplied: leave "
                "axis::edp out of the MoE mesh");
  static_assert(detail::mesh_axes_within<Moe>({axis_id::etp, axis_id::ep, axis_id::pp}),
                "moefold fold: the MoE mesh may only have the axes etp, ep and pp");

  static constexpr bool static_order_ = !Order.is_dynamic;
  static constexpr int s_tp_ = Attn::static_size(axis_id::tp);
  static constexpr int s_cp_ = Attn::static_size(axis_id::cp);
  static constexpr int s_dp_ = Attn::static_size(axis_id::dp);
  static constexpr int s_pp_ = Attn::static_size(axis_id::pp);
  static constexpr int s_ep_ = Moe::static_size(axis_id::ep);
  static constexpr int s_etp_ = Moe::static_size(axis_id::etp);
  static constexpr int s_moe_pp_ = Moe::static_size(axis_id::pp);
  static constexpr bool known(int v) { return v != dynamic; }
  static constexpr bool world_static_ = Attn::is_static();
  static constexpr long long s_world_ =
      world_static_ ? static_cast<long long>(s_tp_) * s_cp_ * s_dp_ * s_pp_ : dynamic;
  static constexpr bool moe_stage_static_ = known(s_etp_) && known(s_ep_) && known(s_pp_);
  static constexpr bool edp_static_ = world_static_ && moe_stage_static_;

  static_assert(!Moe::has(axis_id::pp) || !known(s_pp_) || !known(s_moe_pp_) || s_pp_ == s_moe_pp_,
                "moefold fold rule (pp shared): the MoE mesh's pp differs from the attention "
                "mesh's pp");
  static_assert(!edp_static_ || s_world_ % (static_cast<long long>(s_etp_) * s_ep_ * s_pp_) == 0,
                "moefold fold rule 5 (moe_world_not_divisible): the world size must be divisible "
                "by etp * ep * pp");
  static constexpr int s_edp_ =
      edp_static_ ? static_cast<int>(s_world_ / (static_cast<long long>(s_etp_) * s_ep_ * s_pp_))
                  : dynamic;

  static constexpr bool static_missing_ok(bool moe) {
    if (!static_order_) return true;
    const int sizes[5] = {moe ? s_etp_ : s_tp_, moe ? 1 : s_cp_, moe ? s_ep_ : 1,
                          moe ? s_edp_ : s_dp_, s_pp_};
    for (int t = 0; t < 5; ++t)
      if (!Order.written(static_cast<order_token>(t)) && known(sizes[t]) && sizes[t] != 1)
        return false;
    return true;
  }
  static_assert(static_missing_ok(false),
                "moefold fold rule 4 (order_missing_axis): an attention axis of size > 1 is "
                "missing from the order");
  static_assert(static_missing_ok(true),
                "moefold fold rule 6 (order_missing_axis): an MoE axis of size > 1 is missing "
                "from the order");
  static_assert(!static_order_ || Order.pp_last() || !known(s_pp_) || s_pp_ == 1 ||
                    !(known(s_tp_) && known(s_cp_) && known(s_etp_) && known(s_ep_)) ||
                    s_tp_ * s_cp_ == s_etp_ * s_ep_,
                "moefold fold rule 7 (fold_data_parallel_mismatch): with pp not last in the order, "
                "edp must equal dp, i.e. tp * cp == etp * ep");
  static constexpr bool static_pp_groups_ok() {
    if (!static_order_ || !known(s_pp_) || s_pp_ == 1) return true;
    const int attn[5] = {s_tp_, s_cp_, 1, s_dp_, s_pp_};
    const int moe[5] = {s_etp_, 1, s_ep_, s_edp_, s_pp_};
    long long la = 1, lm = 1;
    for (int i = 0; i < Order.position(order_token::pp); ++i) {
      const auto t = static_cast<int>(Order.tokens[static_cast<std::size_t>(i)]);
      if (!known(attn[t]) || !known(moe[t])) return true;  // decided at run time
      la *= attn[t];
      lm *= moe[t];
    }
    return la == lm;
  }
  static_assert(static_pp_groups_ok(),
                "moefold fold rule 8 (fold_pipeline_mismatch): the attention and MoE meshes would "
                "have different pipeline groups under this order");

 public:
  using attention_mesh_type = Attn;
  using moe_input_mesh_type = Moe;
  //! The MoE mesh with its derived edp (static when world, etp, ep and pp are).
  using moe_mesh_type =
      mesh<axis::etp<s_etp_>, axis::ep<s_ep_>, axis::edp<s_edp_>, axis::pp<s_pp_>>;

  //! True when sizes and order are all compile-time values (the type is then empty).
  [[nodiscard]] static constexpr bool is_static() noexcept {
    return Attn::is_static() && Moe::is_static() && static_order_;
  }

  //! A fully static fold needs no arguments; its rules were checked at compile time.
  constexpr folded_mesh() noexcept
      requires(Attn::is_static() && Moe::is_static() && !Order.is_dynamic) = default;

  //! Checked construction with a compile-time order.
  [[nodiscard]] static constexpr expected<folded_mesh> make(
      const Attn& attention, const Moe& moe) requires(!Order.is_dynamic) {
    return make_impl(attention, moe, Order);
  }
  //! Checked construction with a run-time order string.
  [[nodiscard]] static constexpr expected<folded_mesh> make(
      const Attn& attention, const Moe& moe, std::string_view order) requires(Order.is_dynamic) {
    auto o = megatron_order::parse(order);
    if (!o) return unexpected<error>(o.error());
    return make_impl(attention, moe, *o);
  }

  //! Size of axis A (any of the seven): std::integral_constant when static, int otherwise.
  template <template <int> class A>
  [[nodiscard]] constexpr auto size() const noexcept {
    constexpr axis_id id = axis_id_of<A>;
    if constexpr (id == axis_id::edp) {
      if constexpr (known(s_edp_))
        return std::integral_constant<int, s_edp_>{};
      else
        return edp();
    } else if constexpr (id == axis_id::etp || id == axis_id::ep) {
      return moe_.template size<A>();
    } else {
      return attn_.template size<A>();
    }
  }
  [[nodiscard]] constexpr int tp() const noexcept { return attn_.size(axis_id::tp); }
  [[nodiscard]] constexpr int cp() const noexcept { return attn_.size(axis_id::cp); }
  [[nodiscard]] constexpr int dp() const noexcept { return attn_.size(axis_id::dp); }
  [[nodiscard]] constexpr int pp() const noexcept { return attn_.size(axis_id::pp); }
  [[nodiscard]] constexpr int ep() const noexcept { return moe_.size(axis_id::ep); }
  [[nodiscard]] constexpr int etp() const noexcept { return moe_.size(axis_id::etp); }
  [[nodiscard]] constexpr int edp() const noexcept {
    if constexpr (known(s_edp_))
      return s_edp_;
    else
      return world_size() / (etp() * ep() * pp());
  }
  //! Number of ranks (std::integral_constant when static).
  [[nodiscard]] constexpr auto world_size() const noexcept { return attn_.world_size(); }

  [[nodiscard]] constexpr const Attn& attention() const noexcept { return attn_; }
  //! The MoE mesh with edp filled in. Its own rank_of is declaration-order; use the fold's maps.
  [[nodiscard]] constexpr moe_mesh_type moe() const {
    if constexpr (moe_mesh_type::is_static())
      return moe_mesh_type{};
    else
      return moe_mesh_type::make(etp(), ep(), edp(), pp()).value();
  }
  //! The order that lays out both meshes.
  [[nodiscard]] constexpr megatron_order order() const noexcept {
    if constexpr (static_order_)
      return Order;
    else
      return order_.value;
  }
  //! The plain sizes (for code that works on any fold type).
  [[nodiscard]] constexpr detail::fold_sizes sizes() const noexcept {
    return {tp(), cp(), dp(), pp(), ep(), etp()};
  }

  //! The attention generator: five axes in order-token order, ep of size 1.
  [[nodiscard]] constexpr detail::grid attention_grid() const noexcept {
    return detail::generator_grid(sizes(), edp(), false, order());
  }
  //! The MoE generator: five axes in order-token order, cp of size 1, tp = etp, dp = edp.
  [[nodiscard]] constexpr detail::grid moe_grid() const noexcept {
    return detail::generator_grid(sizes(), edp(), true, order());
  }

  //! Where a rank sits in the attention mesh. Precondition: 0 <= rank < world_size().
  [[nodiscard]] constexpr attention_coord attention_coord_of(int rank) const noexcept {
    const auto c = decompose(attention_grid(), rank);
    return {c[pos(order_token::tp)], c[pos(order_token::cp)], c[pos(order_token::dp)],
            c[pos(order_token::pp)]};
  }
  //! Where a rank sits in the MoE mesh. Precondition: 0 <= rank < world_size().
  [[nodiscard]] constexpr moe_coord moe_coord_of(int rank) const noexcept {
    const auto c = decompose(moe_grid(), rank);
    return {c[pos(order_token::tp)], c[pos(order_token::ep)], c[pos(order_token::dp)],
            c[pos(order_token::pp)]};
  }
  //! The rank at an attention coordinate. Precondition: each index inside its axis.
  [[nodiscard]] constexpr int rank_of(const attention_coord& c) const noexcept {
    std::array<int, 5> idx{};
    idx[pos(order_token::tp)] = c.tp;
    idx[pos(order_token::cp)] = c.cp;
    idx[pos(order_token::dp)] = c.dp;
    idx[pos(order_token::pp)] = c.pp;
    return compose(attention_grid(), idx);
  }
  //! The rank at an MoE coordinate. Precondition: each index inside its axis.
  [[nodiscard]] constexpr int rank_of(const moe_coord& c) const noexcept {
    std::array<int, 5> idx{};
    idx[pos(order_token::tp)] = c.etp;
    idx[pos(order_token::ep)] = c.ep;
    idx[pos(order_token::dp)] = c.edp;
    idx[pos(order_token::pp)] = c.pp;
    return compose(moe_grid(), idx);
  }

  friend constexpr bool operator==(const folded_mesh& a, const folded_mesh& b) noexcept {
    return a.attn_ == b.attn_ && a.moe_ == b.moe_ && a.order() == b.order();
  }

 private:
  struct order_storage {
    megatron_order value{};
    friend constexpr bool operator==(const order_storage&, const order_storage&) = default;
  };
  struct no_order_storage {
    friend constexpr bool operator==(const no_order_storage&, const no_order_storage&) = default;
  };

  constexpr folded_mesh(const Attn& a, const Moe& m, const megatron_order& o) noexcept
      : attn_(a), moe_(m) {
    if constexpr (!static_order_) order_.value = o;
  }

  static constexpr expected<folded_mesh> make_impl(const Attn& a, const Moe& m,
                                                   const megatron_order& o) {
    if (Moe::has(axis_id::pp) && m.size(axis_id::pp) != a.size(axis_id::pp))
      return make_error(
          errc::fold_pipeline_mismatch,
          "the MoE mesh has pp = " + detail::to_decimal(m.size(axis_id::pp)) +
              " but the attention mesh has pp = " + detail::to_decimal(a.size(axis_id::pp)) +
              " (rule: both meshes share one pipeline axis)");
    const detail::fold_sizes s{a.size(axis_id::tp), a.size(axis_id::cp), a.size(axis_id::dp),
                               a.size(axis_id::pp), m.size(axis_id::ep), m.size(axis_id::etp)};
    auto edp = detail::check_fold(s, o);
    if (!edp) return unexpected<error>(edp.error());
    return folded_mesh(a, m, o);
  }

  constexpr std::size_t pos(order_token t) const noexcept {
    return static_cast<std::size_t>(order().position(t));
  }
  static constexpr std::array<int, 5> decompose(const detail::grid& g, int rank) noexcept {
    std::array<int, 5> c{};
    for (std::size_t i = 0; i < 5; ++i) {
      c[i] = rank % g.sizes[i];
      rank /= g.sizes[i];
    }
    return c;
  }
  static constexpr int compose(const detail::grid& g, const std::array<int, 5>& c) noexcept {
    int r = 0;
    for (std::size_t i = 5; i-- > 0;) r = r * g.sizes[i] + c[i];
    return r;
  }

  MOEFOLD_NO_UNIQUE_ADDRESS Attn attn_{};
  MOEFOLD_NO_UNIQUE_ADDRESS Moe moe_{};
  MOEFOLD_NO_UNIQUE_ADDRESS std::conditional_t<static_order_, no_order_storage, order_storage>
      order_{};
};

//! A fold whose every size and order are run-time values.
using dynamic_folded_mesh = folded_mesh<mesh<axis::tp<>, axis::cp<>, axis::dp<>, axis::pp<>>,
                                        mesh<axis::etp<>, axis::ep<>>, dynamic_order>;

//! A fold described the way Megatron-Core's initialize_model_parallel takes it.
struct fold_config {
  int world = 1;             //!< number of ranks
  int tp = 1;                //!< tensor parallel
  int cp = 1;                //!< context parallel
  int pp = 1;                //!< pipeline parallel (shared)
  int ep = 1;                //!< expert parallel
  std::optional<int> etp{};  //!< expert tensor parallel; unset means etp = tp (Megatron)
  std::string_view order = "tp-cp-ep-dp-pp";
};

//! Checks a configuration against every fold rule and builds its fold. dp and edp are derived.
[[nodiscard]] constexpr expected<dynamic_folded_mesh> make_folded(const fold_config& c) {
  const int etp = c.etp.value_or(c.tp);
  const std::pair<const char*, int> sizes[] = {{"world", c.world}, {"tp", c.tp}, {"cp", c.cp},
                                               {"pp", c.pp},       {"ep", c.ep}, {"etp", etp}};
  for (auto [name, v] : sizes)
    if (v < 1)
      return make_error(errc::invalid_size,
                        std::string(name) + " must be >= 1 (got " + detail::to_decimal(v) + ")");
  int tp_cp = 0, stage = 0;
  if (!detail::checked_mul(c.tp, c.cp, tp_cp) || !detail::checked_mul(tp_cp, c.pp, stage))
    return make_error(errc::overflow, "tp * cp * pp exceeds 2^31-1");
  if (c.world % stage != 0)
    return make_error(errc::world_not_divisible,
                      "world size " + detail::to_decimal(c.world) +
                          " is not divisible by tp * cp * pp = " + detail::to_decimal(c.tp) +
                          " * " + detail::to_decimal(c.cp) + " * " + detail::to_decimal(c.pp) +
                          " = " + detail::to_decimal(stage) +
                          " (Megatron rule 2: the attention mesh must tile the world)");
  using A = dynamic_folded_mesh::attention_mesh_type;
  using M = dynamic_folded_mesh::moe_input_mesh_type;
  auto attn = A::make(c.tp, c.cp, c.world / stage, c.pp);
  if (!attn) return unexpected<error>(attn.error());
  auto moe = M::make(etp, c.ep);
  if (!moe) return unexpected<error>(moe.error());
  return dynamic_folded_mesh::make(*attn, *moe, c.order);
}

}  // namespace v0_1
}  // namespace moefold
