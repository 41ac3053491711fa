//! @file capacity.hpp
//! @brief The keep decision of the capacity policies as kernels: the rule of
//! docs/dispatch-semantics.md section 3 (bit for bit the host reference the tests hold it
//! against). Per expert: at most C routed pairs are all kept; beyond, `probs` keeps the C
//! highest probabilities (ties: earlier in sequence order) and `position` the C earliest. Pad mode
//! fills an expert's column to exactly C with the earliest rows not routed to it. Sub-sequence
//! dropping runs it over the rank's own rows; full-sequence over the TP x CP group's gathered
//! rows with their order keys, counting only the rank's own slice [first, first + count).
//!
//! Three launches, in this order: expert_lists_kernel, keep_rank_kernel, drop_totals_kernel.
//! The first two need no barrier (a barrier costs the CPU executor a context switch per thread,
//! and the work is small); the rank is O(m) per pair for an expert with m routed pairs, the
//! reference rule, where a GPU at large m wants a segmented sort (CUB) after measurement. The
//! expert offsets come from expert_histogram_kernel and the exclusive scan (kernels/histogram.hpp,
//! kernels/scan.hpp), which also reject expert ids outside [0, E): such a pair is in no list, so
//! its keep byte is not written (the ranks run over the listed pairs only, offsets[E], which keeps
//! every access in bounds); kept_record_kernel passes its id on for the dispatcher to report.
#pragma once

#include <cstddef>
#include <cstdint>

#include <moefold/core/config.hpp>
#include <moefold/core/drop_by.hpp>
#include <moefold/core/dtype.hpp>

#include "simt/block_scan.hpp"

namespace moefold::kernels {

//! Shapes: expert, probs, keep [N * k] (contiguous records); order [N] or null (row t's rank in
//! true sequence order; null: row order); by_order [N] (the row at each rank, order's inverse;
//! required with pad and order); offsets [E + 1] (where each expert's pairs start when grouped by
//! expert); scratch [N * k]; routed, dropped, padded [E]; filler_map [count, E] or null.
template <class P>
struct keep_args {
  const int* expert;
  const P* probs;
  const long long* order;
  const long long* by_order;
  const int* offsets;
  int* scratch;  //!< the pairs grouped by expert, in pair order within an expert
  int num_tokens, topk, num_experts, capacity;
  drop_by by;  //!< which pairs stay beyond capacity
  bool pad;
  long long first, count;  //!< the rows counted (this rank's, inside a gathered group)
  std::uint8_t* keep;      //!< every pair written: 1 kept, 0 dropped
  int* routed;             //!< pairs of rows [first, first + count) per expert
  int* dropped;            //!< those beyond capacity
  int* padded;             //!< filler rows of [first, first + count) per expert (pad mode)
  std::uint8_t* filler_map;

  // The row at rank j of the true order.
  [[nodiscard]] MOEFOLD_HOST_DEVICE long long row_at(long long j) const {
    return (order != nullptr && by_order != nullptr) ? by_order[j] : j;
  }
  // Row t's rank in true order.
  [[nodiscard]] MOEFOLD_HOST_DEVICE long long ord(long long t) const {
    return order != nullptr ? order[t] : t;
  }
  // Row t names expert e among its k.
  [[nodiscard]] MOEFOLD_HOST_DEVICE bool routes_to(long long t, int e) const {
    for (int i = 0; i < topk; ++i)
      if (expert[t * topk + i] == e) return true;
    return false;
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE bool counted(long long t) const {
    return t >= first && t < first + count;
  }
  // Pair q comes before pair p in the expert's keep order (a strict order: pair index last).
  [[nodiscard]] MOEFOLD_HOST_DEVICE bool comes_first(int q, int p) const {
    if (by == drop_by::probs) {
      const auto a = moefold::detail::widen(probs[q]), b = moefold::detail::widen(probs[p]);
      if (a != b) return a > b;
    }
    const long long oq = ord(q / topk), op = ord(p / topk);
    if (oq != op) return oq < op;
    return q < p;
  }
};

//! Launch 1: one thread per expert (grid-strided) lists the expert's pairs in pair order, counts
//! the routed pairs of the counted rows, zeroes its dropped count for launch 2, and in pad mode
//! picks its filler rows: walking the true order, the first C - m rows not routed to it (only
//! ranks below C can qualify). Sequential per expert, so no barrier: O(E N k) reads in all.
template <class P>
struct expert_lists_kernel {
  static constexpr int block_threads = 128;
  static constexpr const char* name = "expert_lists";
  keep_args<P> a;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long pairs = static_cast<long long>(a.num_tokens) * a.topk;
    for (int e = c.block() * block_threads + c.thread(); e < a.num_experts;
         e += c.grid_blocks() * block_threads) {
      int at = a.offsets[e], routed = 0;
      for (long long p = 0; p < pairs; ++p)
        if (a.expert[p] == e) {
          a.scratch[at++] = static_cast<int>(p);
          routed += a.counted(p / a.topk) ? 1 : 0;
        }
      a.routed[e] = routed;
      a.dropped[e] = 0;
      if (a.filler_map != nullptr)
        for (long long t = 0; t < a.count; ++t) a.filler_map[t * a.num_experts + e] = 0;
      int padded = 0;
      const long long m = a.offsets[e + 1] - a.offsets[e];
      if (a.pad && m < a.capacity) {
        long long need = a.capacity - m;
        for (long long j = 0; j < a.num_tokens && need > 0; ++j) {
          const long long t = a.row_at(j);
          if (a.routes_to(t, e)) continue;
          --need;
          if (!a.counted(t)) continue;
          ++padded;
          if (a.filler_map != nullptr) a.filler_map[(t - a.first) * a.num_experts + e] = 1;
        }
      }
      a.padded[e] = padded;
    }
  }
};

//! Launch 2: one thread per grouped pair (grid-strided): its rank among its expert's m pairs
//! (the list position, or the pairs that come first: O(m) per pair), kept when below C; dropped
//! pairs of the counted rows added to dropped[e] with an integer atomic.
template <class P>
struct keep_rank_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "keep_rank";
  keep_args<P> a;
  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    // The listed pairs: all N k of a valid record, fewer when ids outside [0, E) were left out.
    const long long listed = a.offsets[a.num_experts];
    for (long long i = static_cast<long long>(c.block()) * block_threads + c.thread(); i < listed;
         i += static_cast<long long>(c.grid_blocks()) * block_threads) {
      // The expert of list position i: the last e with offsets[e] <= i (binary search).
      int lo = 0, hi = a.num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a.offsets[mid] <= i)
          lo = mid;
        else
          hi = mid - 1;
      }
      const int e = lo;
      const int* list = a.scratch + a.offsets[e];
      const long long m = a.offsets[e + 1] - a.offsets[e], at = i - a.offsets[e];
      const int p = list[at];
      bool kept = true;
      if (m > a.capacity) {
        long long rank = at;  // row order by position: the list's own order
        if (a.by == drop_by::probs || a.order != nullptr) {
          rank = 0;
          for (long long j = 0; j < m; ++j) rank += a.comes_first(list[j], p) ? 1 : 0;
        }
        kept = rank < a.capacity;
      }
      a.keep[p] = kept ? 1 : 0;
      if (!kept && a.counted(p / a.topk)) c.atomic_add(&a.dropped[e], 1);
    }
  }
};

//! Launch 3, after keep_rank_kernel: the pairs dropped in total (sum of dropped) and the rows of
//! [first, first + count) that lost all k experts. One block; totals [2] = {dropped pairs,
//! fully dropped rows}.
struct drop_totals_kernel {
  static constexpr int block_threads = 256;
  static constexpr bool cooperative = true;  // two block scans
  static constexpr const char* name = "drop_totals";
  const std::uint8_t* keep;  // [N * k]
  const int* dropped;        // [E]
  int topk, num_experts;
  long long first, count;
  long long* totals;

  static constexpr std::size_t smem_bytes = sizeof(long long) * (block_threads / 32 + 1);

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0) return;  // one block's work (a larger grid is harmless)
    long long* smem = c.template shared<long long>();
    long long d = 0, f = 0;
    for (int e = c.thread(); e < num_experts; e += Ctx::block_threads) d += dropped[e];
    for (long long t = first + c.thread(); t < first + count; t += Ctx::block_threads) {
      bool any = false;
      for (int i = 0; i < topk; ++i) any = any || keep[t * topk + i] != 0;
      f += any ? 0 : 1;
    }
    long long d_total = 0, f_total = 0;
    (void)simt::block_exclusive_scan(c, d, smem, d_total);
    (void)simt::block_exclusive_scan(c, f, smem, f_total);
    if (c.thread() == 0) {
      totals[0] = d_total;
      totals[1] = f_total;
    }
  }
};

//! After keep_rank_kernel, what the dispatcher and the expert bias take: the kept record
//! (kept[p] = expert[p] where keep[p], else -1: a dropped pair; an id outside [0, E) unchanged) and
//! the rows each expert receives from the counted rows, dispatched[e] = routed[e] - dropped[e] +
//! padded[e] (Megatron-Core's post-drop routing map, which the expert bias counts). Grid-strided
//! over pairs, then experts.
struct kept_record_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "kept_record";
  const int* expert;         // [N * k]
  const std::uint8_t* keep;  // [N * k]
  long long pairs;
  int* kept;  // [N * k]
  const int *routed, *dropped, *padded;
  int num_experts;
  int* dispatched;  // [E]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    const long long step = static_cast<long long>(c.grid_blocks()) * block_threads,
                    first = static_cast<long long>(c.block()) * block_threads + c.thread();
    // An id outside [0, E) (a router fed NaN) was in no expert's list, so its keep byte was
    // never written: it passes through, for the dispatcher to report with its position.
    for (long long p = first; p < pairs; p += step) {
      const int e = expert[p];
      kept[p] = (e < 0 || e >= num_experts || keep[p] != 0) ? e : -1;
    }
    for (long long e = first; e < num_experts; e += step)
      dispatched[e] = routed[e] - dropped[e] + padded[e];
  }
};

//! The experts' first rows when the pairs are grouped by expert, from their counts:
//! offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e] (E + 1 entries; offsets[E] the listed
//! pairs). One thread: E is at most a few thousand, a few microseconds on a GPU, no scan scratch.
struct expert_offsets_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "expert_offsets";
  const int* counts;  // [E]
  int num_experts;
  int* offsets;  // [E + 1]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0 || c.thread() != 0) return;
    int at = 0;
    for (int e = 0; e < num_experts; ++e) {
      offsets[e] = at;
      at += counts[e];
    }
    offsets[num_experts] = at;
  }
};

//! Lowers sticky fault words to a decision's own (atomic min, so that the first fault stays):
//! sticky[i] = min(sticky[i], fault[i]) for i < words. One thread.
struct sticky_fault_kernel {
  static constexpr int block_threads = 32;
  static constexpr const char* name = "sticky_fault";
  const int* fault;  // [words]
  int words;
  int* sticky;  // [words]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    if (c.block() != 0 || c.thread() != 0) return;
    for (int i = 0; i < words; ++i) c.atomic_min(&sticky[i], fault[i]);
  }
};

//! The kept pairs' probabilities in the type they travel in to the experts: probs[p] where the
//! pair is kept (kept[p] != -1, kept_record_kernel's record), 0 for a dropped pair. Grid-strided.
template <class P, class Q>
struct kept_probs_kernel {
  static constexpr int block_threads = 256;
  static constexpr const char* name = "kept_probs";
  const int* kept;  // [N * k]
  const P* probs;   // [N * k]
  long long pairs;
  Q* out;  // [N * k]

  template <class Ctx>
  MOEFOLD_HOST_DEVICE void operator()(Ctx& c) const {
    for (long long p = static_cast<long long>(c.block()) * block_threads + c.thread(); p < pairs;
         p += static_cast<long long>(c.grid_blocks()) * block_threads)
      out[p] = kept[p] == -1
                   ? Q(0)
                   : moefold::detail::narrow<Q>(static_cast<moefold::accumulator_t<Q>>(probs[p]));
  }
};

}  // namespace moefold::kernels
