//! @file groups.hpp
//! @brief Every process group Megatron-Core builds for a fold, with the same ranks in the same
//! order, listed in the same order (megatron-rank-groups.md, section 3).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "../core/checked_int.hpp"
#include "../core/expected.hpp"
#include "../core/size.hpp"
#include "fold.hpp"
#include "group_list.hpp"

namespace moefold {
inline namespace v0_1 {

//! The group kinds, in the order moefold lists them.
enum class group_kind : std::uint8_t {
  tp,                       //!< tensor parallel
  cp,                       //!< context parallel
  dp,                       //!< data parallel (without CP)
  dp_cp,                    //!< data x context: the attention gradient domain
  tp_cp,                    //!< tensor x context
  tp_dp,                    //!< tensor x data
  tp_dp_cp,                 //!< a whole pipeline stage of the attention mesh
  pp,                       //!< pipeline
  tp_pp,                    //!< model parallel (tensor x pipeline)
  embd,                     //!< first and last rank of each pipeline group
  pos_embd,                 //!< first rank of each pipeline group
  ep,                       //!< expert parallel
  etp,                      //!< expert tensor parallel
  tp_ep,                    //!< expert tensor x expert parallel
  tp_ep_pp,                 //!< expert tensor x expert x pipeline
  edp,                      //!< expert data parallel: the expert gradient domain
  intra_dist_opt_instance,  //!< one distributed-optimizer instance
  intra_dp_cp,              //!< dp-cp inside one optimizer instance (instances > 1)
  intra_ep_dp,              //!< edp inside one optimizer instance (instances > 1)
  inter_ep_dp,              //!< edp across optimizer instances (instances > 1)
  hcp,                      //!< hierarchical context parallel, one kind per level
};

inline constexpr int max_hierarchical_cp_levels = 8;

//! Hierarchical context-parallel sizes, innermost level first; their product must equal cp.
struct hierarchical_cp_sizes {
  std::array<int, max_hierarchical_cp_levels> sizes{};
  int levels = 0;

  constexpr hierarchical_cp_sizes() = default;
  constexpr hierarchical_cp_sizes(std::initializer_list<int> s) noexcept {
    for (int v : s)
      if (levels < max_hierarchical_cp_levels) sizes[static_cast<std::size_t>(levels++)] = v;
    too_many_ = s.size() > static_cast<std::size_t>(max_hierarchical_cp_levels);
  }
  [[nodiscard]] constexpr bool too_many() const noexcept { return too_many_; }

 private:
  bool too_many_ = false;
};

//! What Megatron-Core takes besides the sizes: distributed-optimizer instances, hierarchical CP
//! and a rank offset (every rank shifted by it).
struct group_options {
  int dist_opt_instances = 1;
  hierarchical_cp_sizes hierarchical_cp{};
  int rank_offset = 0;
};

//! A group kind and, for hcp, its level.
struct named_kind {
  group_kind kind = group_kind::tp;
  int level = 0;
  friend constexpr bool operator==(const named_kind&, const named_kind&) = default;
};

//! The name of a kind as Megatron-Core's groups are named in moefold's output ("dp-cp",
//! "hcp_L1").
[[nodiscard]] inline std::string to_string(named_kind k) {
  switch (k.kind) {
    case group_kind::tp: return "tp";
    case group_kind::cp: return "cp";
    case group_kind::dp: return "dp";
    case group_kind::dp_cp: return "dp-cp";
    case group_kind::tp_cp: return "tp-cp";
    case group_kind::tp_dp: return "tp-dp";
    case group_kind::tp_dp_cp: return "tp-dp-cp";
    case group_kind::pp: return "pp";
    case group_kind::tp_pp: return "tp-pp";
    case group_kind::embd: return "embd";
    case group_kind::pos_embd: return "pos_embd";
    case group_kind::ep: return "ep";
    case group_kind::etp: return "etp";
    case group_kind::tp_ep: return "tp-ep";
    case group_kind::tp_ep_pp: return "tp-ep-pp";
    case group_kind::edp: return "edp";
    case group_kind::intra_dist_opt_instance: return "intra_dist_opt_instance";
    case group_kind::intra_dp_cp: return "intra_dp_cp";
    case group_kind::intra_ep_dp: return "intra_ep_dp";
    case group_kind::inter_ep_dp: return "inter_ep_dp";
    case group_kind::hcp: return "hcp_L" + std::to_string(k.level);
  }
  return "?";
}
[[nodiscard]] inline std::string to_string(group_kind k) { return to_string(named_kind{k, 0}); }

//! True for the kinds that are laid out by the MoE mesh (the others follow the attention mesh).
[[nodiscard]] constexpr bool is_moe_kind(group_kind k) noexcept {
  switch (k) {
    case group_kind::ep:
    case group_kind::etp:
    case group_kind::tp_ep:
    case group_kind::tp_ep_pp:
    case group_kind::edp:
    case group_kind::intra_dist_opt_instance:
    case group_kind::intra_ep_dp:
    case group_kind::inter_ep_dp: return true;
    default: return false;
  }
}

//! All the groups of one fold under given options. A value: copy it, keep several.
class megatron_groups {
 public:
  //! Groups with the default options (one optimizer instance, no hierarchical CP, offset 0).
  //! Cannot fail: the fold was checked when it was made.
  template <class Fold>
  constexpr explicit megatron_groups(const Fold& f) noexcept
      : attn_(f.attention_grid()),
        moe_(f.moe_grid()),
        order_(f.order()),
        sizes_(f.sizes()),
        edp_(f.edp()) {}

  //! Groups with options, checked against Megatron rules 9, 11 and 13.
  template <class Fold>
  [[nodiscard]] static constexpr expected<megatron_groups> make(const Fold& f,
                                                                const group_options& opt) {
    megatron_groups g(f);
    auto ok = g.apply(opt);
    if (!ok) return unexpected<error>(ok.error());
    return g;
  }

  //! The groups of a kind (for hcp: of a level). A kind that is not built under these options
  //! (see has()) gives an empty list.
  [[nodiscard]] constexpr group_list operator()(group_kind k, int level = 0) const noexcept {
    using detail::derivation;
    auto a = [&](std::initializer_list<order_token> t) { return slice(attn_, t); };
    auto m = [&](std::initializer_list<order_token> t) { return slice(moe_, t); };
    using T = order_token;
    switch (k) {
      case group_kind::tp: return group_list(a({T::tp}));
      case group_kind::cp: return group_list(a({T::cp}));
      case group_kind::dp: return group_list(a({T::dp}));
      case group_kind::dp_cp: return group_list(a({T::dp, T::cp}));
      case group_kind::tp_cp: return group_list(a({T::tp, T::cp}));
      case group_kind::tp_dp: return group_list(a({T::tp, T::dp}));
      case group_kind::tp_dp_cp: return group_list(a({T::tp, T::dp, T::cp}));
      case group_kind::pp: return group_list(a({T::pp}));
      case group_kind::tp_pp: return group_list(a({T::tp, T::pp}));
      case group_kind::embd: return group_list(a({T::pp}), derivation::first_and_last);
      case group_kind::pos_embd: return group_list(a({T::pp}), derivation::first);
      case group_kind::ep: return group_list(m({T::ep}));
      case group_kind::etp: return group_list(m({T::tp}));
      case group_kind::tp_ep: return group_list(m({T::tp, T::ep}));
      case group_kind::tp_ep_pp: return group_list(m({T::tp, T::ep, T::pp}));
      case group_kind::edp: return group_list(m({T::dp}));
      case group_kind::intra_dist_opt_instance:
        // Concatenate every edp / instances consecutive tp-ep-pp groups.
        return group_list(m({T::tp, T::ep, T::pp}), derivation::concat, edp_ / instances_);
      case group_kind::intra_dp_cp:
        return group_list(a({T::dp, T::cp}), derivation::chunks, instances_);
      case group_kind::intra_ep_dp: return group_list(m({T::dp}), derivation::chunks, instances_);
      case group_kind::inter_ep_dp: return group_list(m({T::dp}), derivation::strided, instances_);
      case group_kind::hcp: {
        if (level < 0 || level >= hcp_.levels) return {};  // not built: an empty list
        // Level i views each cp group as (l, s, u), u fastest: u = prod(h[:i]), s = h[i],
        // l = prod(h[i+1:]).
        int u = 1, l = 1;
        for (int j = 0; j < hcp_.levels; ++j) {
          if (j < level) u *= hcp_.sizes[static_cast<std::size_t>(j)];
          if (j > level) l *= hcp_.sizes[static_cast<std::size_t>(j)];
        }
        return group_list(a({T::cp}), derivation::hierarchical, l,
                          hcp_.sizes[static_cast<std::size_t>(level)], u);
      }
    }
    return {};
  }

  //! True when Megatron-Core builds this kind under these options.
  [[nodiscard]] constexpr bool has(group_kind k, int level = 0) const noexcept {
    switch (k) {
      case group_kind::intra_dp_cp:
      case group_kind::intra_ep_dp:
      case group_kind::inter_ep_dp: return instances_ > 1;
      case group_kind::hcp: return level >= 0 && level < hcp_.levels;
      default: return level == 0;
    }
  }

  //! The kinds built under these options, in listing order.
  [[nodiscard]] constexpr int num_kinds() const noexcept {
    return 17 + (instances_ > 1 ? 3 : 0) + hcp_.levels;
  }
  [[nodiscard]] constexpr named_kind kind_at(int i) const noexcept {
    if (i < 17) return {static_cast<group_kind>(i), 0};
    if (instances_ > 1 && i < 20) return {static_cast<group_kind>(i), 0};
    return {group_kind::hcp, i - 17 - (instances_ > 1 ? 3 : 0)};
  }
  //! Groups of a named kind.
  [[nodiscard]] constexpr group_list operator()(named_kind k) const noexcept {
    return (*this)(k.kind, k.level);
  }

  [[nodiscard]] constexpr int world_size() const noexcept { return attn_.volume(); }
  [[nodiscard]] constexpr int rank_offset() const noexcept { return offset_; }
  [[nodiscard]] constexpr int dist_opt_instances() const noexcept { return instances_; }
  [[nodiscard]] constexpr const hierarchical_cp_sizes& hierarchical_cp() const noexcept {
    return hcp_;
  }

 private:
  constexpr status apply(const group_options& opt) {
    if (opt.dist_opt_instances < 1)
      return make_error(errc::invalid_size, "dist_opt_instances must be >= 1 (got " +
                                                detail::to_decimal(opt.dist_opt_instances) + ")");
    if (opt.rank_offset < 0)
      return make_error(errc::invalid_size, "rank_offset must be >= 0 (got " +
                                                detail::to_decimal(opt.rank_offset) + ")");
    int last = 0;
    if (!detail::checked_add(opt.rank_offset, world_size() - 1, last))
      return make_error(errc::overflow, "rank_offset + world_size - 1 exceeds 2^31-1");
    const int dp_cp = sizes_.dp * sizes_.cp;
    // Rule 9, then 11, then 13: Megatron's order.
    if (dp_cp % opt.dist_opt_instances != 0)
      return make_error(errc::dist_opt_dp_not_divisible,
                        "dp * cp = " + detail::to_decimal(dp_cp) +
                            " is not divisible by dist_opt_instances = " +
                            detail::to_decimal(opt.dist_opt_instances) +
                            " (Megatron rule 9: each optimizer instance holds whole dp-cp slices)");
    const auto& h = opt.hierarchical_cp;
    if (h.too_many())
      return make_error(errc::hierarchical_cp_mismatch,
                        "more than " + detail::to_decimal(max_hierarchical_cp_levels) +
                            " hierarchical context-parallel levels");
    if (h.levels > 0) {
      long long prod = 1;
      std::string list;
      for (int i = 0; i < h.levels; ++i) {
        const int v = h.sizes[static_cast<std::size_t>(i)];
        if (v < 1)
          return make_error(errc::invalid_size, "hierarchical context-parallel size " +
                                                    detail::to_decimal(v) + " must be >= 1");
        if (prod <= max_int) prod *= v;
        list += (i ? "," : "") + detail::to_decimal(v);
      }
      if (prod != sizes_.cp)
        return make_error(
            errc::hierarchical_cp_mismatch,
            "hierarchical context-parallel sizes [" + list + "] multiply to " +
                (prod > max_int ? std::string("more than 2^31-1") : detail::to_decimal(prod)) +
                ", not cp = " + detail::to_decimal(sizes_.cp) +
                " (Megatron rule 11: their product must equal cp)");
    }
    if (edp_ % opt.dist_opt_instances != 0)
      return make_error(errc::dist_opt_edp_not_divisible,
                        "edp = " + detail::to_decimal(edp_) +
                            " is not divisible by dist_opt_instances = " +
                            detail::to_decimal(opt.dist_opt_instances) +
                            " (Megatron rule 13: each optimizer instance holds whole edp slices)");
    instances_ = opt.dist_opt_instances;
    hcp_ = h;
    offset_ = opt.rank_offset;
    return {};
  }

  constexpr detail::strided_groups slice(const detail::grid& g,
                                         std::initializer_list<order_token> tokens) const noexcept {
    unsigned mask = 0;
    for (order_token t : tokens) mask |= 1u << order_.position(t);
    return detail::masked_groups(g, mask, offset_);
  }

  detail::grid attn_{};
  detail::grid moe_{};
  megatron_order order_{};
  detail::fold_sizes sizes_{};
  int edp_ = 1;
  int instances_ = 1;
  hierarchical_cp_sizes hcp_{};
  int offset_ = 0;
};

}  // namespace v0_1
}  // namespace moefold
