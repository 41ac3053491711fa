// Test helpers for the routing tests: seeded random inputs and every router variant.
#pragma once

#include "../support/host_topk_router.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace moefold::test {

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double lo = -2.0, double hi = 2.0) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(g));
  return v;
}

struct variant {
  std::string name;
  topk_router_options opt;
};

//! Every router variant the tests sweep, for E experts (E divisible by 4, E >= 8).
inline std::vector<variant> all_variants(int E) {
  std::vector<variant> v;
  v.push_back({"softmax post k2", {.num_experts = E, .topk = 2}});
  v.push_back({"softmax post k3 scaled", {.num_experts = E, .topk = 3, .scaling_factor = 2.5}});
  v.push_back({"softmax pre k1", {.num_experts = E, .topk = 1, .pre_softmax = true}});
  v.push_back({"softmax pre k2", {.num_experts = E, .topk = 2, .pre_softmax = true}});
  v.push_back({"softmax post groups 4/2 k4",
               {.num_experts = E, .topk = 4, .num_groups = 4, .group_topk = 2}});
  v.push_back(
      {"softmax pre groups 4/2 k2",
       {.num_experts = E, .topk = 2, .pre_softmax = true, .num_groups = 4, .group_topk = 2}});
  v.push_back({"sigmoid k1", {.num_experts = E, .topk = 1, .score = score_function::sigmoid}});
  v.push_back({"sigmoid k3", {.num_experts = E, .topk = 3, .score = score_function::sigmoid}});
  v.push_back({"sigmoid k4 groups bias scaled",
               {.num_experts = E,
                .topk = 4,
                .score = score_function::sigmoid,
                .num_groups = 4,
                .group_topk = 2,
                .scaling_factor = 2.5,
                .expert_bias = true}});
  v.push_back(
      {"sigmoid k2 bias",
       {.num_experts = E, .topk = 2, .score = score_function::sigmoid, .expert_bias = true}});
  v.push_back(
      {"sqrt_softplus k2", {.num_experts = E, .topk = 2, .score = score_function::sqrt_softplus}});
  v.push_back({"sqrt_softplus k4 groups bias",
               {.num_experts = E,
                .topk = 4,
                .score = score_function::sqrt_softplus,
                .num_groups = 4,
                .group_topk = 2,
                .expert_bias = true}});
  return v;
}

}  // namespace moefold::test
