// The communicator concept checks every call form the library makes: the span forms of int and
// std::int64_t (moves) and of float, double, bfloat16 and float16 (moves and reductions), each
// with the element type deduced and named (`c.template f<T>(...)`), plus rank, size and barrier.
// Fakes that lack exactly one form are rejected, one static_assert per form, so dropping a form
// from the concept fails this test; a fake with every form, and the thread world, satisfy it.
// Then every required form of the thread world runs once on three ranks, for each element type.
#include <moefold/comm/thread_world.hpp>

#include <doctest/doctest.h>

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

using namespace moefold;

static_assert(communicator<thread_communicator>);
static_assert(communicator<thread_device_communicator>);

namespace {

// What a fake lacks: a collective (for one element type U), or rank, size or barrier.
enum class op {
  none,
  all_gather,
  all_gather_v,
  all_to_all_v,
  broadcast,
  all_reduce,
  reduce_scatter_v,
  barrier,
  rank,
  size
};
// Which form of the collective is missing: both, only `c.f(...)` (T is not deducible), or only
// `c.template f<U>(...)` (a plain overload for U instead of the member template).
enum class lack { both, deduced, named };
struct no_type {};

// A communicator with every form of every element type, except op M on U in the forms L.
template <op M = op::none, class U = no_type, lack L = lack::both>
struct fake_comm {
  // The member template serves T unless it is the missing U of op O.
  template <op O, class T>
  static constexpr bool full = !(M == O && std::same_as<T, U>);
  // Only the named form of O on U (T is not deducible).
  template <op O, class T>
  static constexpr bool named_only = M == O&& std::same_as<T, U>&& L == lack::deduced;
  // Only the deduced form of O on U (a plain overload).
  template <op O>
  static constexpr bool deduced_only = M == O&& L == lack::named;
  template <class T>
  using id = std::type_identity_t<T>;

  int rank() const requires(M != op::rank) { return 0; }
  int size() const requires(M != op::size) { return 1; }
  status barrier() requires(M != op::barrier) { return {}; }

  template <class T>
  requires full<op::all_gather, T> status all_gather(std::span<const T>, std::span<T>) {
    return {};
  }
  template <class T>
  requires named_only<op::all_gather, T> status all_gather(std::span<const id<T>>,
                                                           std::span<id<T>>) {
    return {};
  }
  status all_gather(std::span<const U>, std::span<U>) requires deduced_only<op::all_gather> {
    return {};
  }

  template <class T>
  requires full<op::all_gather_v, T> status all_gather_v(std::span<const T>, std::span<T>,
                                                         std::span<const int>) {
    return {};
  }
  template <class T>
  requires named_only<op::all_gather_v, T> status all_gather_v(std::span<const id<T>>,
                                                               std::span<id<T>>,
                                                               std::span<const int>) {
    return {};
  }
  status all_gather_v(std::span<const U>, std::span<U>,
                      std::span<const int>) requires deduced_only<op::all_gather_v> {
    return {};
  }

  template <class T>
  requires full<op::all_to_all_v, T> status all_to_all_v(std::span<const T>, std::span<const int>,
                                                         std::span<T>, std::span<const int>) {
    return {};
  }
  template <class T>
  requires named_only<op::all_to_all_v, T> status all_to_all_v(std::span<const id<T>>,
                                                               std::span<const int>,
                                                               std::span<id<T>>,
                                                               std::span<const int>) {
    return {};
  }
  status all_to_all_v(std::span<const U>, std::span<const int>, std::span<U>,
                      std::span<const int>) requires deduced_only<op::all_to_all_v> {
    return {};
  }

  template <class T>
  requires full<op::broadcast, T> status broadcast(std::span<T>, int) { return {}; }
  template <class T>
  requires named_only<op::broadcast, T> status broadcast(std::span<id<T>>, int) { return {}; }
  status broadcast(std::span<U>, int) requires deduced_only<op::broadcast> { return {}; }

  template <class T>
  requires full<op::all_reduce, T> status all_reduce(std::span<T>, reduce_op) { return {}; }
  template <class T>
  requires named_only<op::all_reduce, T> status all_reduce(std::span<id<T>>, reduce_op) {
    return {};
  }
  status all_reduce(std::span<U>, reduce_op) requires deduced_only<op::all_reduce> { return {}; }

  template <class T>
  requires full<op::reduce_scatter_v, T> status reduce_scatter_v(std::span<const T>,
                                                                 std::span<const int>, std::span<T>,
                                                                 reduce_op) {
    return {};
  }
  template <class T>
  requires named_only<op::reduce_scatter_v, T> status reduce_scatter_v(std::span<const id<T>>,
                                                                       std::span<const int>,
                                                                       std::span<id<T>>,
                                                                       reduce_op) {
    return {};
  }
  status reduce_scatter_v(std::span<const U>, std::span<const int>, std::span<U>,
                          reduce_op) requires deduced_only<op::reduce_scatter_v> {
    return {};
  }
};

// Every form, and one that cannot be moved.
static_assert(communicator<fake_comm<>>);
struct pinned_comm : fake_comm<> {
  pinned_comm() = default;
  pinned_comm(pinned_comm&&) = delete;
};
static_assert(!communicator<pinned_comm>);

// Controls: the fakes lack only what they say. Forms the library never calls (reductions of int
// and std::int64_t, any form of char) may be missing.
static_assert(communicator<fake_comm<op::all_reduce, int>>);
static_assert(communicator<fake_comm<op::reduce_scatter_v, std::int64_t>>);
static_assert(communicator<fake_comm<op::all_gather, char, lack::deduced>>);
static_assert(communicator<fake_comm<op::all_gather, char, lack::named>>);

// Op O on T is required in both forms: a fake without it, without its deduced form, or without
// its named form is rejected (the static_assert that fails names O and T).
template <op O, class T>
constexpr bool required() {
  static_assert(!communicator<fake_comm<O, T, lack::both>>, "op O of T is required");
  static_assert(!communicator<fake_comm<O, T, lack::deduced>>, "c.f(s, ...) of T is required");
  static_assert(!communicator<fake_comm<O, T, lack::named>>, "c.template f<T>(s, ...) is required");
  return true;
}
template <op O, class... T>
constexpr bool required_for = (required<O, T>() && ...);

// The moves, of every element type.
static_assert(required_for<op::all_gather, int, std::int64_t, float, double, bfloat16, float16>);
static_assert(required_for<op::all_gather_v, int, std::int64_t, float, double, bfloat16, float16>);
static_assert(required_for<op::all_to_all_v, int, std::int64_t, float, double, bfloat16, float16>);
static_assert(required_for<op::broadcast, int, std::int64_t, float, double, bfloat16, float16>);
// The reductions, of the floating-point types.
static_assert(required_for<op::all_reduce, float, double, bfloat16, float16>);
static_assert(required_for<op::reduce_scatter_v, float, double, bfloat16, float16>);
// And the rest.
static_assert(!communicator<fake_comm<op::barrier>>);
static_assert(!communicator<fake_comm<op::rank>>);
static_assert(!communicator<fake_comm<op::size>>);

template <class T>
T val(int v) {
  return static_cast<T>(static_cast<float>(v));
}
template <class T>
int num(T v) {
  return static_cast<int>(static_cast<float>(v));
}

// Each form the concept requires for T, named and deduced, on this rank of C; "" when all held.
template <class T, communicator C>
std::string exercise(C& c) {
  const int P = c.size(), me = c.rank();
  const auto uP = static_cast<std::size_t>(P);
  std::string bad;
  auto expect = [&](const status& st, bool ok, const char* what, bool named) {
    if (!st || !ok) bad += std::string(what) + (named ? " (named) " : " (deduced) ");
  };
  for (bool named : {true, false}) {
    {  // all_gather: {me, me} from every rank
      const std::vector<T> s{val<T>(me), val<T>(me)};
      std::vector<T> r(2 * uP);
      auto st = named ? c.template all_gather<T>(std::span<const T>(s), std::span<T>(r))
                      : c.all_gather(std::span<const T>(s), std::span<T>(r));
      bool ok = true;
      for (std::size_t i = 0; i < r.size(); ++i) ok = ok && num(r[i]) == static_cast<int>(i / 2);
      expect(st, ok, "all_gather", named);
    }
    std::vector<int> counts;  // rank i sends i + 1 elements
    for (int i = 0; i < P; ++i) counts.push_back(i + 1);
    {  // all_gather_v: rank i's i + 1 copies of i
      const std::vector<T> s(static_cast<std::size_t>(me + 1), val<T>(me));
      std::vector<T> r(uP * (uP + 1) / 2);
      const std::span<const int> n(counts);
      auto st = named ? c.template all_gather_v<T>(std::span<const T>(s), std::span<T>(r), n)
                      : c.all_gather_v(std::span<const T>(s), std::span<T>(r), n);
      bool ok = true;
      std::size_t at = 0;
      for (int i = 0; i < P; ++i)
        for (int k = 0; k <= i; ++k) ok = ok && num(r[at++]) == i;
      expect(st, ok, "all_gather_v", named);
    }
    {  // all_to_all_v: one element 10 * me + j to each rank j
      std::vector<T> s, r(uP);
      for (int j = 0; j < P; ++j) s.push_back(val<T>(10 * me + j));
      const std::vector<int> ones(uP, 1);
      const std::span<const int> n(ones);
      auto st = named ? c.template all_to_all_v<T>(std::span<const T>(s), n, std::span<T>(r), n)
                      : c.all_to_all_v(std::span<const T>(s), n, std::span<T>(r), n);
      bool ok = true;
      for (int j = 0; j < P; ++j) ok = ok && num(r[static_cast<std::size_t>(j)]) == 10 * j + me;
      expect(st, ok, "all_to_all_v", named);
    }
    {  // broadcast from the last rank
      std::vector<T> b{val<T>(me == P - 1 ? 7 : 0)};
      auto st = named ? c.template broadcast<T>(std::span<T>(b), P - 1)
                      : c.broadcast(std::span<T>(b), P - 1);
      expect(st, num(b[0]) == 7, "broadcast", named);
    }
    if constexpr (!std::is_integral_v<T>) {
      {  // all_reduce: the sum of me + 1
        std::vector<T> b{val<T>(me + 1), val<T>(2 * (me + 1))};
        auto st = named ? c.template all_reduce<T>(std::span<T>(b), reduce_op::sum)
                        : c.all_reduce(std::span<T>(b), reduce_op::sum);
        const int sum = P * (P + 1) / 2;
        expect(st, num(b[0]) == sum && num(b[1]) == 2 * sum, "all_reduce", named);
      }
      {  // reduce_scatter_v: chunk i (one element) of rank r is (r + 1) * (i + 1)
        std::vector<T> s;
        for (int i = 0; i < P; ++i) s.push_back(val<T>((me + 1) * (i + 1)));
        std::vector<T> r(1);
        const std::vector<int> ones(uP, 1);
        const std::span<const int> n(ones);
        auto st =
            named ? c.template reduce_scatter_v<T>(std::span<const T>(s), n, std::span<T>(r),
                                                   reduce_op::sum)
                  : c.reduce_scatter_v(std::span<const T>(s), n, std::span<T>(r), reduce_op::sum);
        expect(st, num(r[0]) == P * (P + 1) / 2 * (me + 1), "reduce_scatter_v", named);
      }
    }
  }
  expect(c.barrier(), true, "barrier", false);
  return bad;
}

}  // namespace

TEST_CASE_TEMPLATE("the thread world runs every form the concept requires", T, int, std::int64_t,
                   float, double, bfloat16, float16) {
  std::vector<std::string> found(3);
  const auto st = run_thread_world(3, [&](thread_communicator& c) {
    found[static_cast<std::size_t>(c.rank())] = exercise<T>(c);
  });
  for (std::size_t r = 0; r < st.size(); ++r) {
    CAPTURE(r);
    CHECK(st[r]);
    CHECK(found[r] == "");
  }
}
