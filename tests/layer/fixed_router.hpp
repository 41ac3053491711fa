// A user router for the layer tests, written from the routing::router concept alone
// (routing/router.hpp): token t goes to experts t % E, (t + 1) % E, ... with probability 0.7 for
// the first and the rest shared equally, whatever the logits, so the router weight gets no
// gradient. The assignment is a kernel body launched on the context (any context: host_exec runs
// it as a loop, cpu_exec on fibers over device memory), the backward a fill. Beside it, the fp64
// reference fed that assignment (dispatch_harness.hpp's reference_token) on EP = W ranks.
#pragma once

#include <moefold/core/simt_launch.hpp>
#include <moefold/routing/router.hpp>

#include <cstddef>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"
#include "../support/mlp_layout.hpp"

namespace moefold::test {

template <class R>
struct fixed_assignment_kernel {
  static constexpr int block_threads = 64;
  static constexpr const char* name = "fixed_assignment";
  int* indices;  // [N, k], rows idx_stride apart
  R* probs;      // [N, k], rows prob_stride apart
  long long idx_stride, prob_stride;
  int n, k, experts;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long step = static_cast<long long>(c.grid_blocks()) * Ctx::block_threads;
    for (long long i = static_cast<long long>(c.block()) * Ctx::block_threads + c.thread();
         i < static_cast<long long>(n) * k; i += step) {
      const long long t = i / k, j = i % k;
      indices[t * idx_stride + j] = static_cast<int>((t + j) % experts);
      probs[t * prob_stride + j] = j == 0 ? R(0.7) : R(0.3) / static_cast<R>(k - 1);
    }
  }
};

template <class R>
struct fixed_router {
  using value_type = R;
  int experts = 0, k = 0;
  [[nodiscard]] int num_experts() const { return experts; }
  [[nodiscard]] int topk() const { return k; }
  template <class Exec>
  [[nodiscard]] status route(Exec& x,
                             const router_route_args<R, typename Exec::memory_space>& f) const {
    if (!f.expert_bias.empty())
      return make_error(errc::invalid_argument, "fixed_router: takes no expert bias");
    return launch(x, launch_grid{.blocks = 2},
                  fixed_assignment_kernel<R>{.indices = f.indices.data(),
                                             .probs = f.probs.data(),
                                             .idx_stride = f.indices.stride(),
                                             .prob_stride = f.probs.stride(),
                                             .n = f.indices.rows(),
                                             .k = k,
                                             .experts = experts});
  }
  template <class Exec>
  [[nodiscard]] status backward(
      Exec& x, const router_backward_args<R, typename Exec::memory_space>& b) const {
    return x.fill(b.dlogits, R(0));
  }
};

// What the fp64 reference gives on each of W ranks (EP = W, ETP = EDP = 1) for the fixed
// assignment: the output and input gradient [N, H] (no router part: the assignment ignores the
// logits), and the rank's experts' weight gradients in the library's layout
// (support/mlp_layout.hpp), each expert having seen every rank's tokens.
struct fixed_reference {
  std::vector<std::vector<double>> out, dx, dw1, dw2;  // per rank
};
inline fixed_reference fixed_assignment_reference(const problem& p, int W) {
  const data w = make_weights(p);
  reference_grads g;
  const int L = p.experts / W, H = p.hidden, F = p.ffn, k = p.topk;
  const auto R = static_cast<std::size_t>(W);
  fixed_reference ref{.out = std::vector<std::vector<double>>(R),
                      .dx = std::vector<std::vector<double>>(R),
                      .dw1 = std::vector<std::vector<double>>(R),
                      .dw2 = std::vector<std::vector<double>>(R)};
  for (int r = 0; r < W; ++r)
    for (int t = 0; t < p.tokens; ++t) {
      token_data d = make_token(p, r, t);
      d.expert.clear();
      d.prob.clear();
      for (int j = 0; j < k; ++j) {
        d.expert.push_back((t + j) % p.experts);
        d.prob.push_back(j == 0 ? 0.7 : 0.3 / (k - 1));
      }
      std::vector<double> o1, dx1, dp;
      reference_token(w, d, o1, dx1, dp, g);
      auto& out = ref.out[static_cast<std::size_t>(r)];
      auto& dx = ref.dx[static_cast<std::size_t>(r)];
      out.insert(out.end(), o1.begin(), o1.end());
      dx.insert(dx.end(), dx1.begin(), dx1.end());
    }
  for (int r = 0; r < W; ++r)
    for (int l = 0; l < L; ++l) {
      auto d1 = g.dw1[r * L + l], d2 = g.dw2[r * L + l];  // empty for an expert no token chose
      d1.resize(static_cast<std::size_t>(H * 2 * F), 0.0);
      d2.resize(static_cast<std::size_t>(F * H), 0.0);
      append_fc1_shard<double>(d1, H, 2, F, 1, 0, ref.dw1[static_cast<std::size_t>(r)]);
      append_fc2_shard<double>(d2, F, H, 1, 0, ref.dw2[static_cast<std::size_t>(r)]);
    }
  return ref;
}

}  // namespace moefold::test
