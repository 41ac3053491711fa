//! @file router_launch.hpp
//! @brief How the router's team kernels are launched, one place for the router and its losses:
//! the team E takes (a warp per token up to E = 256, a block of 128 per token up to E = 1,024; on
//! host_exec either runs as a thread per token) and the grid over N tokens (capped at the
//! context's limit; the bodies stride over the tokens).
#pragma once

#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_block.hpp>

#include "../core/expected.hpp"
#include "../core/simt_launch.hpp"
#include "../exec/exec.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! f.template operator()<Team>() with the team a router of E experts runs its bodies over.
template <class F>
[[nodiscard]] status by_router_team(int num_experts, F&& f) {
  if (num_experts <= kernels::detail_router::warp_per_token::max_experts)
    return f.template operator()<kernels::detail_router::warp_per_token>();
  return f.template operator()<kernels::detail_router::block_per_token>();
}

//! Launches team kernel K (a body over Team) over n tokens: four tokens per block of 128 for a
//! warp team, one for a block team.
template <class Team, class Exec, class K>
[[nodiscard]] status launch_per_token(Exec& exec, const K& kernel, int n) {
  const int per_block = Team::width == 32 ? K::block_threads / 32 : 1;
  return launch(exec, capped_grid<Exec, K>(n, per_block), kernel);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
