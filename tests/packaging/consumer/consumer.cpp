// A consumer of an installed moefold (tests/packaging/consumers.py builds it with CMake, with
// meson through pkg-config and with meson using moefold as a subproject). It uses the library as a
// trainer would: a folded mapping checked at run time, its process groups, and the CPU MoE layer
// (router, All-to-All dispatcher, reference experts) on 2 simulated ranks, whose outputs must equal
// those of the same layer on 1 rank. The build states the version its package tool found.
#include <moefold/moefold.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#ifndef MOEFOLD_FOUND_VERSION
#error "the consumer build passes MOEFOLD_FOUND_VERSION, the version its package tool found"
#endif

namespace {

using namespace moefold;

constexpr int H = 4, F = 6, E = 4, topk = 2, tokens = 6;

double weight(int tensor, int expert, int i) {
  return std::sin(1.0 + 0.37 * i + 1.3 * expert + tensor);
}
double input(int t, int h) { return std::cos(0.5 + 0.71 * t + 0.23 * h); }

// The layer's output for all `tokens` tokens, the world split in EP `world` ways.
std::vector<double> run_layer(int world_size, std::string& failure) {
  const auto fold = make_folded({.world = world_size, .ep = world_size, .etp = 1});
  if (!fold) {
    failure = fold.error().message;
    return {};
  }
  const megatron_groups groups(*fold);
  const int per_rank = tokens / world_size, L = E / world_size;
  std::vector<double> out(static_cast<std::size_t>(tokens * H));
  std::mutex m;
  const auto st = run_thread_world(world_size, [&](thread_communicator& world) -> status {
    const int r = world.rank();
    // The layer's groups, split from the world by name; the layer holds them by reference, so
    // they live (unmoved) until this rank's run ends.
    auto comms = make_layer_communicators(world, groups);
    if (!comms) return unexpected<error>(comms.error());
    auto mlp = reference_mlp<double>::make(
        {.hidden = H, .ffn = F, .num_local_experts = L, .etp = 1, .etp_rank = 0});
    if (!mlp) return unexpected<error>(mlp.error());
    for (int l = 0; l < L; ++l) {
      const int e = fold->moe_coord_of(r).ep * L + l;
      // Full fc1 [2F, H] (rows [gate; up]) and fc2 [H, F]; entry (j, h) of fc1 takes the value
      // at h * 2F + j, entry (h, c) of fc2 the value at c * H + h.
      std::vector<double> w1, w2;
      for (int j = 0; j < 2 * F; ++j)
        for (int h = 0; h < H; ++h) w1.push_back(weight(0, e, h * 2 * F + j));
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < F; ++c) w2.push_back(weight(1, e, c * H + h));
      if (auto s = mlp->load_full(l, w1, w2); !s) return s;
    }
    using layer_t =
        moe_layer<double, host_exec, thread_communicator, dropless,
                  all_to_all_dispatcher<double, thread_communicator>, reference_mlp<double>>;
    host_exec exec;  // every layer call runs on it; the layer keeps none
    auto layer = layer_t::make(exec,
                               {.hidden = H,
                                .max_tokens = per_rank,
                                .ep = world_size,
                                .etp = 1,
                                .router = {.num_experts = E, .topk = topk}},
                               *comms, dropless{}, std::move(*mlp));
    if (!layer) return unexpected<error>(layer.error());
    for (int i = 0; i < E * H; ++i)
      layer->router_weight().flat()[static_cast<std::size_t>(i)] = weight(2, 0, i);
    std::vector<double> x(static_cast<std::size_t>(per_rank * H)), y(x.size());
    for (int t = 0; t < per_rank; ++t)
      for (int h = 0; h < H; ++h)
        x[static_cast<std::size_t>(t * H + h)] = input(r * per_rank + t, h);
    auto stats = layer->forward(exec, per_rank, x, {}, y);
    if (!stats) return unexpected<error>(stats.error());
    const std::lock_guard lock(m);
    std::memcpy(&out[static_cast<std::size_t>(r * per_rank * H)], y.data(),
                y.size() * sizeof(double));
    return {};
  });
  for (const auto& s : st)
    if (!s) failure = s.error().message;
  return out;
}

}  // namespace

int main() {
  if (std::strcmp(MOEFOLD_FOUND_VERSION, moefold::version_string) != 0) {
    std::printf("the package says version %s, the headers %s\n", MOEFOLD_FOUND_VERSION,
                moefold::version_string);
    return 1;
  }
  // The mesh: a fold checked at run time and one of its groups.
  auto f = make_folded({.world = 16, .tp = 2, .cp = 2, .pp = 2, .ep = 4, .etp = 1});
  if (!f) return 1;
  const megatron_groups groups(*f);
  std::vector<int> edp0;
  for (int r : groups(group_kind::edp)[0]) edp0.push_back(r);
  if (edp0 != std::vector<int>{0, 4}) {
    std::printf("EDP group 0 is not [0, 4]\n");
    return 1;
  }
  // The layer: EP 2 on 2 ranks equals 1 rank.
  std::string failure;
  const auto one = run_layer(1, failure), two = run_layer(2, failure);
  if (!failure.empty()) {
    std::printf("layer failed: %s\n", failure.c_str());
    return 1;
  }
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    diff = std::fmax(diff, std::fabs(one[i] - two[i]));
    norm += std::fabs(one[i]);
  }
  std::printf(
      "moefold %s: EDP group 0 = [0, 4]; layer output |1 rank - 2 ranks| = %.3g (sum |y| %.3f)\n",
      moefold::version_string, diff, norm);
  return diff < 1e-12 && norm > 0.1 ? 0 : 1;
}
