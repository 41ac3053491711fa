// One rank's dispatch, "experts", combine and backward with every buffer of the dispatcher in an
// execution context's memory (cpu_exec over the thread world in device_dispatcher_test.cpp,
// cuda_exec over the loopback world in the GPU test), copied back to the host, with the
// transfers the context counted.
#pragma once

#include <doctest/doctest.h>
#include <moefold/comm/group_communicator.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/exec_workspace.hpp>
#include <moefold/exec/exec.hpp>
#include <moefold/exec/exec_buffer.hpp>

#include <cstddef>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "dispatch_harness.hpp"

namespace moefold::test {

// A context that counts its copies (cpu_exec, cuda_exec).
template <class Exec>
inline constexpr bool counts_copies = requires(Exec& x) {
  x.copies();
  x.reset_copies();
};

// What one rank computed, copied back to the host.
template <class T, class P = T>
struct trip {
  std::vector<T> batch_x, out, dy, dx;
  std::vector<P> batch_p, dprobs;
  std::vector<int> counts;
  std::vector<int> offsets;  // batch_offsets(), where the dispatch left the counts on the context
  int hidden = 0, batch_stride = 0;               // H, and batch_rows()' stride
  bool host_space = false;                        // the context's memory is host accessible
  copy_counts dispatch_copies{}, later_copies{};  // contexts that count their copies
};

// The library's workspace on a context (dispatch/exec_workspace.hpp), as the tests name it.
using moefold::exec_workspace;
using moefold::make_exec_workspace;

template <class T, class Exec>
expected<exec_buffer<T, Exec>> upload(Exec& x, const std::vector<T>& v, int rows, int width) {
  auto b = exec_buffer<T, Exec>::make(x, rows, width);
  if (!b) return b;
  if (auto st = x.copy(row_view<const T>(v.data(), rows, width), b->view()); !st)
    return unexpected<error>(st.error());
  return b;
}

template <class T, class S, class Exec>
expected<std::vector<T>> download(Exec& x, row_view<const T, S> v) {
  std::vector<T> h(static_cast<std::size_t>(v.rows()) * static_cast<std::size_t>(v.width()));
  if (auto st = x.copy(v, row_view<T>(h.data(), v.rows(), v.width())); !st)
    return unexpected<error>(st.error());
  return h;
}

#define TRY(e)                             \
  if (auto st_ = (e); !st_) {              \
    return unexpected<error>(st_.error()); \
  }
#define TRY_ASSIGN(v, e) \
  auto v = (e);          \
  if (!v) return unexpected<error>(v.error());

// A rank's fold of the problem and its three dispatcher communicators.
template <class Comm>
struct rank_groups {
  dynamic_folded_mesh fold;
  megatron_groups groups;
  Comm ep, etp, tp_ep;
  [[nodiscard]] dispatch_groups<Comm> dispatch() noexcept { return {ep, etp, tp_ep}; }
};

template <class Comm>
expected<rank_groups<Comm>> groups_of(const problem& p, Comm& world) {
  auto fold = make_folded(p.fold);
  if (!fold) return unexpected<error>(fold.error());
  megatron_groups groups(*fold);
  auto ep = group_communicator(world, groups, {group_kind::ep});
  auto etp = group_communicator(world, groups, {group_kind::etp});
  auto tp_ep = group_communicator(world, groups, {group_kind::tp_ep});
  if (!ep || !etp || !tp_ep) return make_error(errc::invalid_argument, "groups");
  return rank_groups<Comm>{*fold, groups, std::move(*ep), std::move(*etp), std::move(*tp_ep)};
}

// Dispatch, "experts" (a fixed function of the batch, on the host), combine, and the backward,
// every buffer of the dispatcher in Exec's memory; probabilities in P.
// `routed`: the input's every_pair_routed word.
template <template <class, class, class, class> class Disp, class T, class P, class Exec,
          class Comm>
expected<trip<T, P>> round_trip(const problem& p, Comm& world, Exec& x, bool routed = false) {
  TRY_ASSIGN(rg, groups_of(p, world));
  const auto& fold = rg->fold;
  const dispatch_groups<Comm> g = rg->dispatch();
  const rank_inputs in = inputs_of(p, rg->groups, world.rank());
  auto cast = [](const std::vector<double>& v) { return std::vector<T>(v.begin(), v.end()); };
  auto cast_p = [](const std::vector<double>& v) { return std::vector<P>(v.begin(), v.end()); };
  const int n = in.n, H = p.hidden, K = p.topk;
  TRY_ASSIGN(dx_in, upload(x, cast(in.x), n, H));
  TRY_ASSIGN(de_in, upload(x, in.expert, n, K));
  TRY_ASSIGN(dp_in, upload(x, cast_p(in.probs), n, K));
  TRY_ASSIGN(ddout, upload(x, cast(in.dout), n, H));
  auto disp = Disp<T, Comm, Exec, P>::make({.max_tokens = p.tokens,
                                            .hidden = H,
                                            .topk = K,
                                            .num_experts = p.experts,
                                            .ep = fold.ep(),
                                            .etp = fold.etp()});
  if (!disp) return unexpected<error>(disp.error());
  const std::optional<int> cap = p.pad ? std::optional<int>(p.capacity) : std::nullopt;
  TRY_ASSIGN(wsb, make_exec_workspace(x, disp->workspace_sizes(cap)));
  const dispatch_workspace ws = wsb->view();
  using S = typename Exec::memory_space;
  const dispatch_input<T, S, P> din{.num_tokens = n,
                                    .x = dx_in->cview(),
                                    .expert = de_in->cview(),
                                    .probs = dp_in->cview(),
                                    .capacity = cap,
                                    .every_pair_routed = routed};
  trip<T, P> res;
  if constexpr (counts_copies<Exec>) x.reset_copies();
  TRY_ASSIGN(h, disp->dispatch(x, din, g, ws));
  if constexpr (counts_copies<Exec>) res.dispatch_copies = x.copies();
  TRY_ASSIGN(bx, (download<T>(x, h->batch_rows())));
  TRY_ASSIGN(bp, (download<P>(x, h->batch_probs())));
  res.batch_x = *bx;
  res.hidden = H;
  res.batch_stride = static_cast<int>(h->batch_rows().stride());
  res.host_space = host_accessible_v<S>;
  res.batch_p = *bp;
  res.counts.assign(h->batch_counts().begin(), h->batch_counts().end());
  if (!h->batch_offsets().empty()) {
    TRY_ASSIGN(off, (download<int>(x, h->batch_offsets())));
    res.offsets = *off;
  }
  // The "experts": y = x / 2 + p, dx_rows = x - 1, dprob_rows = 2 p (the same on both contexts).
  const int M = h->num_rows();
  std::vector<T> y(res.batch_x.size()), dxr(res.batch_x.size());
  std::vector<P> dpr(res.batch_p.size());
  for (int m = 0; m < M; ++m) {
    const double pm =
        static_cast<double>(static_cast<float>(res.batch_p[static_cast<std::size_t>(m)]));
    dpr[static_cast<std::size_t>(m)] = static_cast<P>(2 * pm);
    for (int c = 0; c < H; ++c) {
      const auto i =
          static_cast<std::size_t>(m) * static_cast<std::size_t>(H) + static_cast<std::size_t>(c);
      const double v = static_cast<double>(static_cast<float>(res.batch_x[i]));
      y[i] = static_cast<T>(v / 2 + pm);
      dxr[i] = static_cast<T>(v - 1);
    }
  }
  TRY_ASSIGN(dy_ex, upload(x, y, M, H));
  TRY_ASSIGN(dxr_ex, upload(x, dxr, M, H));
  TRY_ASSIGN(dpr_ex, upload(x, dpr, M, 1));
  TRY_ASSIGN(out, (exec_buffer<T, Exec>::make(x, n, H)));
  TRY_ASSIGN(dy, (exec_buffer<T, Exec>::make(x, M, H)));
  TRY_ASSIGN(dx, (exec_buffer<T, Exec>::make(x, n, H)));
  TRY_ASSIGN(dprobs, (exec_buffer<P, Exec>::make(x, n, K)));
  if constexpr (counts_copies<Exec>) x.reset_copies();
  TRY(disp->combine(x, *h, dy_ex->cview(), g, out->view()));
  TRY(disp->combine_backward(x, *h, ddout->cview(), g, dy->view()));
  TRY(disp->dispatch_backward(x, *h, dxr_ex->cview(), dpr_ex->cview(), g, dx->view(),
                              dprobs->view()));
  if constexpr (counts_copies<Exec>) res.later_copies = x.copies();
  TRY_ASSIGN(o, (download<T>(x, out->cview())));
  TRY_ASSIGN(gy, (download<T>(x, dy->cview())));
  TRY_ASSIGN(gx, (download<T>(x, dx->cview())));
  TRY_ASSIGN(gp, (download<P>(x, dprobs->cview())));
  res.out = *o;
  res.dy = *gy;
  res.dx = *gx;
  res.dprobs = *gp;
  return res;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Two contexts' round trips on one rank: the same bits everywhere (every rank's experts receive
// rows in the problems these tests use) ...
template <class T, class P>
void check_same_values(const trip<T, P>& a, const trip<T, P>& b) {
  CHECK(!a.batch_x.empty());
  // The host's batch is one span (stride H); a context's batch rows start 16 bytes apart, H
  // padded up (the row kernels' 16-byte path). Either trip may be either kind (the GPU test
  // compares cuda_exec with cpu_exec).
  const trip<T, P>* both[] = {&a, &b};  // an array: nvcc rejects a braced list here
  for (const trip<T, P>* t : both) {
    if (t->host_space) {
      CHECK(t->batch_stride == t->hidden);
    } else {
      CHECK(t->batch_stride * sizeof(T) % 16 == 0);
      CHECK(t->batch_stride >= t->hidden);
      CHECK((t->batch_stride - t->hidden) * sizeof(T) < 16);
    }
  }
  CHECK(same_bits(a.batch_x, b.batch_x));
  CHECK(same_bits(a.batch_p, b.batch_p));
  CHECK(same_bits(a.out, b.out));
  CHECK(same_bits(a.dy, b.dy));
  CHECK(same_bits(a.dx, b.dx));
  CHECK(same_bits(a.dprobs, b.dprobs));
}
// ... and the same counts on the host.
template <class T, class P>
void check_same_results(const trip<T, P>& a, const trip<T, P>& b) {
  CHECK(a.counts == b.counts);
  check_same_values(a, b);
}

inline problem folded_problem(bool pad) {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 4, .etp = 2}};
  p.experts = 8;
  p.topk = 2;
  p.hidden = 5;
  p.tokens = 6;
  p.drop = 0.2;
  p.capacity = pad ? 3 : -1;
  p.pad = pad;
  return p;
}

}  // namespace moefold::test
