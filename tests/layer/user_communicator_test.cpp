// A user communicator, written from docs/comm.md alone ("The concept", "Row views, memory spaces
// and execution contexts") and not delegating to the thread world: ranks are std::threads that
// share one board per group (a slot per rank and a std::barrier); a collective publishes its
// buffers, waits, reads its peers' buffers directly, and waits again before anyone may reuse
// them. Its groups fill a moe_layer_communicators bundle by name (no split), and the layer on it
// equals the layer on the thread world bitwise (both sum in rank order).
#include <moefold/comm/thread_world.hpp>
#include <moefold/dispatch/all_to_all_dispatcher.hpp>
#include <moefold/dispatch/drop_policy_full_sequence.hpp>
#include <moefold/layer/moe_layer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../dispatch/dispatch_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// What the ranks of one group share.
struct board {
  explicit board(int n) : sync(n), slots(static_cast<std::size_t>(n)) {}
  struct slot {
    int op = 0;  // which collective, and the element size, to catch mismatches
    std::size_t elem = 0;
    const std::byte* send = nullptr;
    std::size_t send_elems = 0;
    std::span<const int> counts{};  // send counts (all_to_all_v) or per-rank counts
    std::span<const int> recv_counts{};
    int root = 0;
    bool ok = true;
  };
  std::barrier<> sync;
  std::vector<slot> slots;
};

class shm_communicator {
 public:
  using memory_space = host_space;

  shm_communicator(std::shared_ptr<board> b, int rank) : b_(std::move(b)), rank_(rank) {}
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return static_cast<int>(b_->slots.size()); }

  // ---- Span forms (counts in elements) ----
  template <class T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    publish(1, sizeof(T), buf.data(), buf.size());
    std::vector<T> acc(buf.size());  // the reduction in rank order, then in place
    bool ok = true;
    for (const auto& s : peers()) ok = ok && s.send_elems == buf.size();
    if (ok)
      for (std::size_t i = 0; i < buf.size(); ++i) {
        T v = elem<T>(0, i);
        for (int r = 1; r < size(); ++r)
          v = op == reduce_op::sum ? v + elem<T>(r, i) : std::max(v, elem<T>(r, i));
        acc[i] = v;
      }
    if (auto st = finish(ok, "all_reduce: sizes differ"); !st) return st;
    std::copy(acc.begin(), acc.end(), buf.begin());
    return {};
  }
  template <class T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send,
                                  std::span<T> recv) {
    publish(2, sizeof(T), send.data(), send.size());
    bool ok = recv.size() >= send.size() * static_cast<std::size_t>(size());
    for (const auto& s : peers()) ok = ok && s.send_elems == send.size();
    if (ok)
      for (int r = 0; r < size(); ++r)
        for (std::size_t i = 0; i < send.size(); ++i) recv[r * send.size() + i] = elem<T>(r, i);
    return finish(ok, "all_gather: sizes differ");
  }
  template <class T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts) {
    publish(3, sizeof(T), send.data(), send.size(), counts);
    bool ok = counts.size() == static_cast<std::size_t>(size());
    std::size_t at = 0;
    for (int r = 0; ok && r < size(); ++r) {
      const auto n = static_cast<std::size_t>(counts[r]);
      ok = counts[r] >= 0 && same_counts(r, counts) && slot(r).send_elems >= n &&
           at + n <= recv.size();
      for (std::size_t i = 0; ok && i < n; ++i) recv[at + i] = elem<T>(r, i);
      at += n;
    }
    return finish(ok, "all_gather_v: counts differ or buffers too small");
  }
  template <class T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts) {
    publish(4, sizeof(T), send.data(), send.size(), send_counts, recv_counts);
    bool ok = send_counts.size() == static_cast<std::size_t>(size()) &&
              recv_counts.size() == send_counts.size();
    std::size_t at = 0;
    for (int r = 0; ok && r < size(); ++r) {
      const auto& s = slot(r);
      if (s.counts.size() != send_counts.size()) {
        ok = false;
        break;
      }
      // Peer r's chunk for me starts after its chunks for ranks before me.
      std::size_t from = 0;
      for (int q = 0; q < rank_; ++q) from += static_cast<std::size_t>(s.counts[q]);
      const auto n = static_cast<std::size_t>(recv_counts[r]);
      ok = s.counts[rank_] == recv_counts[r] && from + n <= s.send_elems && at + n <= recv.size();
      for (std::size_t i = 0; ok && i < n; ++i) recv[at + i] = elem<T>(r, from + i);
      at += n;
    }
    return finish(ok, "all_to_all_v: counts disagree");
  }
  template <class T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op) {
    publish(5, sizeof(T), send.data(), send.size(), counts);
    bool ok = counts.size() == static_cast<std::size_t>(size());
    std::size_t from = 0, total = 0;
    for (int r = 0; ok && r < size(); ++r) {
      ok = counts[r] >= 0 && same_counts(r, counts);
      total += static_cast<std::size_t>(counts[r]);
      if (r < rank_) from += static_cast<std::size_t>(counts[r]);
    }
    const auto n = ok ? static_cast<std::size_t>(counts[rank_]) : 0;
    for (int r = 0; ok && r < size(); ++r) ok = slot(r).send_elems >= total;
    ok = ok && recv.size() >= n;
    for (std::size_t i = 0; ok && i < n; ++i) {
      T v = elem<T>(0, from + i);
      for (int r = 1; r < size(); ++r)
        v = op == reduce_op::sum ? v + elem<T>(r, from + i) : std::max(v, elem<T>(r, from + i));
      recv[i] = v;
    }
    return finish(ok, "reduce_scatter_v: counts differ");
  }
  template <class T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    publish(6, sizeof(T), buf.data(), buf.size(), {}, {}, root);
    bool ok = root >= 0 && root < size();
    for (const auto& s : peers()) ok = ok && s.root == root && s.send_elems == buf.size();
    std::vector<T> copy;
    if (ok && rank_ != root)
      for (std::size_t i = 0; i < buf.size(); ++i) copy.push_back(elem<T>(root, i));
    if (auto st = finish(ok, "broadcast: roots or sizes differ"); !st) return st;
    if (rank_ != root) std::copy(copy.begin(), copy.end(), buf.begin());
    return {};
  }
  [[nodiscard]] status barrier() {
    b_->sync.arrive_and_wait();
    return {};
  }

  // ---- Row-view forms (counts in rows, contiguous views, the context unused on the host) ----
  template <class Exec, class T>
  [[nodiscard]] status all_reduce(Exec&, row_view<T, host_space> buf, reduce_op op) {
    return all_reduce<T>(flat(buf), op);
  }
  template <class Exec, class T>
  [[nodiscard]] status all_gather(Exec&, row_view<const std::type_identity_t<T>, host_space> s,
                                  row_view<T, host_space> r) {
    return all_gather<T>(flat(s), flat(r));
  }
  template <class Exec, class T>
  [[nodiscard]] status all_gather_v(Exec&, row_view<const std::type_identity_t<T>, host_space> s,
                                    row_view<T, host_space> r, std::span<const int> rows) {
    return all_gather_v<T>(flat(s), flat(r), elements(rows, s.width(), 0));
  }
  template <class Exec, class T>
  [[nodiscard]] status all_to_all_v(Exec&, row_view<const std::type_identity_t<T>, host_space> s,
                                    std::span<const int> sn, row_view<T, host_space> r,
                                    std::span<const int> rn) {
    return all_to_all_v<T>(flat(s), elements(sn, s.width(), 0), flat(r),
                           elements(rn, r.width(), 1));
  }
  template <class Exec, class T>
  [[nodiscard]] status reduce_scatter_v(Exec&,
                                        row_view<const std::type_identity_t<T>, host_space> s,
                                        std::span<const int> rows, row_view<T, host_space> r,
                                        reduce_op op) {
    return reduce_scatter_v<T>(flat(s), elements(rows, s.width(), 0), flat(r), op);
  }
  template <class Exec, class T>
  [[nodiscard]] status broadcast(Exec&, row_view<T, host_space> buf, int root) {
    return broadcast<T>(flat(buf), root);
  }
  template <class Exec>
  [[nodiscard]] status barrier(Exec&) {
    return barrier();
  }

 private:
  board::slot& slot(int r) const { return b_->slots[static_cast<std::size_t>(r)]; }
  const std::vector<board::slot>& peers() const { return b_->slots; }
  template <class T>
  T elem(int r, std::size_t i) const {
    T v;
    std::memcpy(&v, slot(r).send + i * sizeof(T), sizeof(T));
    return v;
  }
  bool same_counts(int r, std::span<const int> mine) const {
    const auto& c = slot(r).counts;
    return c.size() == mine.size() && std::equal(c.begin(), c.end(), mine.begin());
  }
  // Publishes this rank's buffers and waits for every rank; then checks that all called the same
  // collective on the same element size.
  template <class U>
  void publish(int op, std::size_t elem_size, const U* send, std::size_t n,
               std::span<const int> counts = {}, std::span<const int> recv_counts = {},
               int root = 0) {
    slot(rank_) = {.op = op,
                   .elem = elem_size,
                   .send = reinterpret_cast<const std::byte*>(send),
                   .send_elems = n,
                   .counts = counts,
                   .recv_counts = recv_counts,
                   .root = root,
                   .ok = true};
    b_->sync.arrive_and_wait();
  }
  // Every rank's verdict, so that all return the same: waits until all have read, votes, waits.
  [[nodiscard]] status finish(bool ok, const char* what) {
    for (const auto& s : peers()) ok = ok && s.op == slot(rank_).op && s.elem == slot(rank_).elem;
    b_->sync.arrive_and_wait();  // every rank has read its peers' buffers
    slot(rank_).ok = ok;
    b_->sync.arrive_and_wait();
    bool all = true;
    for (const auto& s : peers()) all = all && s.ok;
    b_->sync.arrive_and_wait();  // the votes are read before the next collective publishes
    if (!all) return make_error(errc::comm_mismatch, std::string("shm_communicator: ") + what);
    return {};
  }
  template <class T>
  static std::span<T> flat(row_view<T, host_space> v) {
    return {v.data(), static_cast<std::size_t>(v.rows()) * static_cast<std::size_t>(v.width())};
  }
  // Row counts as element counts (one scratch per direction).
  std::span<const int> elements(std::span<const int> rows, int width, int which) {
    auto& e = scratch_[which];
    e.assign(rows.begin(), rows.end());
    for (int& c : e) c *= width;
    return e;
  }

  std::shared_ptr<board> b_;
  int rank_ = 0;
  std::vector<int> scratch_[2];
};

static_assert(communicator<shm_communicator>);
static_assert(communicator_for<shm_communicator, host_exec, double>);

struct rank_run {
  std::vector<double> out, dx, router_grad, w1, w2;
  double aux = 0;
};

// One rank's layer step on the bundle `c` (any communicator).
template <class Comm>
expected<rank_run> layer_step(const problem& p, const dynamic_folded_mesh& fold, int r,
                              moe_layer_communicators<Comm>& c) {
  using layer_t = moe_layer<double, host_exec, Comm, full_sequence,
                            all_to_all_dispatcher<double, Comm>, reference_mlp<double>>;
  const data w = make_weights(p);
  host_exec ex;
  // The layer holds the bundle `c` by reference: the caller keeps it alive and unmoved.
  auto layer = layer_t::make(ex,
                             {.hidden = p.hidden,
                              .max_tokens = p.tokens,
                              .router = {.num_experts = p.experts, .topk = p.topk},
                              .aux_loss_coeff = 0.01,
                              .z_loss_coeff = 0.001,
                              .global_aux_loss_coeff = 0.02},
                             c, full_sequence{.capacity_factor = 1.0},
                             rank_experts<double>(p, fold, r, w.w1, w.w2).value());
  if (!layer) return unexpected<error>(layer.error());
  for (std::size_t i = 0; i < layer->router_weight().flat().size(); ++i)
    layer->router_weight().flat()[i] = unit(9, static_cast<std::uint64_t>(i), 0);
  std::vector<double> x, dout;
  for (int t = 0; t < p.tokens; ++t) {
    const auto d = make_token(p, r, t);
    x.insert(x.end(), d.x.begin(), d.x.end());
    dout.insert(dout.end(), d.dout.begin(), d.dout.end());
  }
  rank_run res;
  res.out.resize(x.size());
  res.dx.resize(x.size());
  auto f = layer->forward(ex, p.tokens, x, {}, res.out);
  if (!f) return unexpected<error>(f.error());
  // The forward's losses are views in the layer's memory; their host values come back here.
  auto v = read_forward_stats(ex, *f);
  if (!v) return unexpected<error>(v.error());
  res.aux = v->aux_loss + v->global_aux_loss + v->z_loss;
  if (auto b = layer->backward(ex, dout, 1.0, res.dx); !b) return unexpected<error>(b.error());
  if (auto s =
          layer->reduce_gradients(ex, {layer->experts().grads_fc1(), layer->experts().grads_fc2()});
      !s)
    return unexpected<error>(s.error());
  auto take = [](std::span<double> v) { return std::vector<double>(v.begin(), v.end()); };
  res.router_grad = take(layer->router_weight_grad().flat());
  res.w1 = take(layer->experts().grads_fc1());
  res.w2 = take(layer->experts().grads_fc2());
  return res;
}

}  // namespace

TEST_CASE("The MoE layer runs on a user communicator and equals the thread world bitwise") {
  // EP 2 x ETP 2 x EDP 2 over TP 2 on 8 ranks, full-sequence dropping (collective over tp-cp),
  // the micro-batch, global and z losses.
  problem p{.fold = {.world = 8, .tp = 2, .ep = 2, .etp = 2}, .experts = 4, .topk = 2};
  p.ffn = 4;
  p.tokens = 6;
  const auto fold = make_folded(p.fold).value();
  const megatron_groups groups(fold);
  const int W = fold.world_size();
  // The thread world's run.
  std::vector<rank_run> want(static_cast<std::size_t>(W));
  const auto st = run_thread_world(W, [&](thread_communicator& world) -> status {
    auto c = make_layer_communicators(world, groups);
    if (!c) return unexpected<error>(c.error());
    auto r = layer_step(p, fold, world.rank(), *c);
    if (!r) return unexpected<error>(r.error());
    want[static_cast<std::size_t>(world.rank())] = std::move(*r);
    return {};
  });
  for (const auto& s : st) REQUIRE_MESSAGE(s.has_value(), s.error().message);
  // The user communicator's: one board per group of each kind, a thread per rank.
  std::map<std::pair<int, int>, std::shared_ptr<board>> boards;  // (kind, group) -> board
  auto comm_of = [&](group_kind k, int r) {
    const auto list = groups(k);
    const auto at = list.find(r);
    auto& b = boards[{static_cast<int>(k), at.group}];
    if (!b) b = std::make_shared<board>(list[at.group].size());
    return shm_communicator(b, at.position);
  };
  std::vector<moe_layer_communicators<shm_communicator>> bundles;
  for (int r = 0; r < W; ++r) {
    bundles.push_back({.tp = comm_of(group_kind::tp, r),
                       .tp_cp = comm_of(group_kind::tp_cp, r),
                       .tp_dp_cp = comm_of(group_kind::tp_dp_cp, r),
                       .dp_cp = comm_of(group_kind::dp_cp, r),
                       .ep = comm_of(group_kind::ep, r),
                       .etp = comm_of(group_kind::etp, r),
                       .tp_ep = comm_of(group_kind::tp_ep, r),
                       .edp = comm_of(group_kind::edp, r)});
  }
  std::vector<rank_run> got(static_cast<std::size_t>(W));
  std::vector<std::string> errors(static_cast<std::size_t>(W));
  {
    std::vector<std::jthread> ranks;
    for (int r = 0; r < W; ++r)
      ranks.emplace_back([&, r] {
        auto res = layer_step(p, fold, r, bundles[static_cast<std::size_t>(r)]);
        if (res)
          got[static_cast<std::size_t>(r)] = std::move(*res);
        else
          errors[static_cast<std::size_t>(r)] = res.error().message;
      });
  }
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    const auto& a = got[static_cast<std::size_t>(r)];
    const auto& b = want[static_cast<std::size_t>(r)];
    REQUIRE(errors[static_cast<std::size_t>(r)].empty());
    CHECK(a.out == b.out);
    CHECK(a.dx == b.dx);
    CHECK(a.router_grad == b.router_grad);
    CHECK(a.w1 == b.w1);
    CHECK(a.w2 == b.w2);
    CHECK(a.aux == b.aux);
    CHECK(a.out != std::vector<double>(a.out.size(), 0.0));
  }
}
