// No heap allocation in steady state, for what moves rows: global operator new is counted across
// the whole process while every rank of a thread world (EP 4 x ETP 2 on 8 ranks) runs steps 2-5
// of a dispatch round trip (dispatch, combine, combine_backward, dispatch_backward, the EDP
// all_reduce of the expert gradients) on both dispatchers, in pad mode and without, plus a
// broadcast and a barrier. Step 1 sizes every buffer (the communicators' schedules, the
// all_reduce scratch); after it the count must stay 0. The expert functor runs outside the
// counted window (reference_mlp is a test oracle that allocates its temporaries).
// The whole layer's steady state is tests/layer/steady_state_alloc_test.cpp.
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_gather_dispatcher.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>

#include <doctest/doctest.h>

#include <vector>

#include "dispatch_harness.hpp"
#include "support/count_new.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// Steps of one dispatcher path on every rank; returns the operator new calls of each step.
template <class Path>
std::vector<long long> count_steps(const problem& p) {
  using comm = thread_communicator;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const data w = make_weights(p);
  constexpr int steps = 5;
  std::vector<long long> news(steps, -1);
  const auto sts = run_thread_world(fold.world_size(), [&](comm& world) -> status {
    const int r = world.rank();
    auto get = [&](group_kind k) { return group_communicator(world, groups, {k}).value(); };
    auto ep = get(group_kind::ep), etp = get(group_kind::etp), tp_ep = get(group_kind::tp_ep),
         edp = get(group_kind::edp);
    auto [n, x, expert, probs, dout] = inputs_of(p, groups, r);
    auto disp = make_dispatcher<Path>(p, fold);
    if (!disp) return unexpected<error>(disp.error());
    const std::optional<int> cap = p.pad ? std::optional<int>(p.capacity) : std::nullopt;
    host_workspace ws(disp->workspace_sizes(cap));
    const dispatch_groups<comm> g{ep, etp, tp_ep};
    host_exec hx;
    auto mlp = rank_experts<double>(p, fold, r, w.w1, w.w2);
    if (!mlp) return unexpected<error>(mlp.error());
    // Sized for the largest batch a step can produce (the receive bound).
    const auto R = detail::uz(p.max_recv_rows.value_or(p.tokens * p.topk * fold.ep() * fold.etp()));
    const auto H = detail::uz(p.hidden);
    std::vector<double> y(R * H), dy(R * H), dx_rows(R * H), dp_rows(R), out(x.size()),
        dx(x.size()), dprob(probs.size()), bcast(7, 1.0);
    const auto counting = [&](bool on) -> status {
      // All ranks line up before rank 0 switches the count, and again after.
      if (auto s = world.barrier(); !s) return s;
      if (r == 0) test::counting.store(on);
      return world.barrier();
    };
    for (int step = 0; step < steps; ++step) {
      if (auto s = counting(true); !s) return s;
      auto h =
          disp->dispatch(hx, host_input(disp->shape(), n, x, expert, probs, cap), g, ws.view());
      if (!h) return unexpected<error>(h.error());
      const auto M = detail::uz(h->num_rows());
      if (auto s = counting(false); !s) return s;
      if (auto s = mlp->forward(h->batch(), std::span(y).first(M * H)); !s) return s;
      if (auto s = counting(true); !s) return s;
      const int Mr = h->num_rows(), Hr = p.hidden;
      for (const status& st :
           {disp->combine(hx, *h, rows_of(y, Hr).first(Mr), g, rows_of(out, Hr)),
            disp->combine_backward(hx, *h, rows_of(dout, Hr), g, rows_of(dy, Hr).first(Mr))})
        if (!st) return st;
      if (auto s = counting(false); !s) return s;
      if (auto s = mlp->backward(h->batch(), std::span<const double>(dy).first(M * H),
                                 std::span(dx_rows).first(M * H), std::span(dp_rows).first(M));
          !s)
        return s;
      if (auto s = counting(true); !s) return s;
      for (const status& st : {disp->dispatch_backward(hx, *h, rows_of(dx_rows, Hr).first(Mr),
                                                       rows_of(dp_rows, 1).first(Mr), g,
                                                       rows_of(dx, Hr), rows_of(dprob, p.topk)),
                               edp.template all_reduce<double>(mlp->grads_fc1(), reduce_op::sum),
                               edp.template all_reduce<double>(mlp->grads_fc2(), reduce_op::sum),
                               world.template broadcast<double>(bcast, 3)})
        if (!st) return st;
      if (auto s = counting(false); !s) return s;
      if (r == 0) news[static_cast<std::size_t>(step)] = test::news.exchange(0);
    }
    return {};
  });
  for (const auto& s : sts) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  return news;
}

problem ep4_etp2() {
  problem p{.fold = {.world = 8, .tp = 2, .ep = 4, .etp = 2}};
  p.experts = 8;
  p.tokens = 6;
  p.hidden = 4;
  return p;
}

template <class Path>
void check_steady(const problem& p) {
  const auto news = count_steps<Path>(p);
  MESSAGE("operator new calls per step: ", news[0], " ", news[1], " ", news[2], " ", news[3], " ",
          news[4]);
  CHECK(news[0] > 0);  // the counter counts: step 1 sizes the schedules and scratch
  for (std::size_t s = 1; s < news.size(); ++s) CHECK(news[s] == 0);
}

}  // namespace

TEST_CASE("steady state: the All-to-All dispatcher and the thread world allocate nothing") {
  problem p = ep4_etp2();
  check_steady<all_to_all_path<thread_communicator>>(p);
  p.capacity = 2;  // pad mode: no count exchange, every expert C rows from each rank
  p.pad = true;
  check_steady<all_to_all_path<thread_communicator>>(p);
}

TEST_CASE("steady state: the AllGather dispatcher and the thread world allocate nothing") {
  problem p = ep4_etp2();
  check_steady<all_gather_path<thread_communicator>>(p);
  p.max_recv_rows = 64;  // the bound checked on the gathered record every step
  check_steady<all_gather_path<thread_communicator>>(p);
}
