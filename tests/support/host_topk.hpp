//! @file host_topk.hpp
//! @brief The tests' host reference: Top-k with a documented tie rule, plain and group-limited
//! (DeepSeek device/node-limited routing). Megatron-Core leaves exact ties to torch.topk; moefold
//! breaks them toward the lower index, always, so that routing is reproducible across backends and
//! parallel mappings.
#pragma once

#include <algorithm>
#include <numeric>
#include <span>
#include <vector>

namespace moefold {
inline namespace v0_1 {

namespace detail {
// a ranks before b: larger value first, then the lower index.
template <class T>
[[nodiscard]] bool ranks_before(const T* x, int a, int b) noexcept {
  return x[a] > x[b] || (x[a] == x[b] && a < b);
}
}  // namespace detail

//! The k largest entries of x, as indices sorted by value descending, ties by lower index first.
//! `scratch` is reused across calls (host reference; no allocation once it has grown).
//! Preconditions (checked by the callers that take user input): 0 <= k <= x.size(), no NaN.
template <class T>
void topk_indices(std::span<const T> x, int k, std::span<int> out, std::vector<int>& scratch) {
  const int n = static_cast<int>(x.size());
  scratch.resize(static_cast<std::size_t>(n));
  std::iota(scratch.begin(), scratch.end(), 0);
  const T* p = x.data();
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(),
                    [p](int a, int b) { return detail::ranks_before(p, a, b); });
  std::copy_n(scratch.begin(), k, out.begin());
}

//! Group-limited top-k (Megatron-Core `group_limited_topk`): the experts form `num_groups`
//! equal groups; a group scores the sum of its top-(k / group_topk) values; the `group_topk`
//! best groups are kept (ties: lower group index); then the top-k of the experts in kept groups.
//! Preconditions: x.size() % num_groups == 0, 1 <= group_topk <= num_groups,
//! group_topk <= k <= group_topk * x.size() / num_groups.
//! What group_limited_topk_indices works in, kept by the caller across calls (no allocation once
//! grown).
template <class T>
struct group_topk_scratch {
  std::vector<int> order{}, best{}, kept{}, cand{};
  std::vector<T> group_score{};
};

template <class T>
void group_limited_topk_indices(std::span<const T> x, int k, int num_groups, int group_topk,
                                std::span<int> out, group_topk_scratch<T>& ws) {
  const int n = static_cast<int>(x.size());
  const int per = n / num_groups;
  const int take = k / group_topk;
  ws.group_score.resize(static_cast<std::size_t>(num_groups));
  ws.best.resize(static_cast<std::size_t>(take));
  for (int g = 0; g < num_groups; ++g) {
    topk_indices(x.subspan(static_cast<std::size_t>(g * per), static_cast<std::size_t>(per)), take,
                 std::span<int>(ws.best), ws.order);
    // Summed in descending order, as torch sums the sorted top-k values.
    T s = 0;
    for (int i : ws.best) s += x[static_cast<std::size_t>(g * per + i)];
    ws.group_score[static_cast<std::size_t>(g)] = s;
  }
  ws.kept.resize(static_cast<std::size_t>(group_topk));
  topk_indices(std::span<const T>(ws.group_score), group_topk, std::span<int>(ws.kept), ws.order);
  // Candidates: the experts of the kept groups, in expert order (so index ties resolve the same
  // way as in a plain top-k over the masked row).
  std::sort(ws.kept.begin(), ws.kept.end());
  ws.cand.clear();
  for (int g : ws.kept)
    for (int i = 0; i < per; ++i) ws.cand.push_back(g * per + i);
  const T* p = x.data();
  std::partial_sort(ws.cand.begin(), ws.cand.begin() + k, ws.cand.end(),
                    [p](int a, int b) { return detail::ranks_before(p, a, b); });
  std::copy_n(ws.cand.begin(), k, out.begin());
}

//! The same with scratch of its own (allocates per call).
template <class T>
void group_limited_topk_indices(std::span<const T> x, int k, int num_groups, int group_topk,
                                std::span<int> out, std::vector<int>& scratch) {
  group_topk_scratch<T> ws;
  ws.order.swap(scratch);
  group_limited_topk_indices(x, k, num_groups, group_topk, out, ws);
  ws.order.swap(scratch);
}

}  // namespace v0_1
}  // namespace moefold
