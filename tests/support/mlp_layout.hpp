// The tests' own layout of expert weights and the library's (include/moefold/experts/
// mlp_params.hpp), and the conversions between them. The fp64 references in the tests (for
// example dispatch_harness.hpp's) keep their layout:
//   full fc1 [H, G*F], columns [gate | up] (G = 2 under GLU, else 1); full fc2 [F, H];
//   a rank's shard per local expert: fc1 [H, F1], columns [gate shard | up shard]
//   (F1 = G * Fs, Fs = F / ETP); fc2 [Fs, H].
// The library's (Megatron-Core / Hugging Face, torch.nn.Linear's [out, in]):
//   full fc1 [G*F, H], rows [gate; up]; full fc2 [H, F];
//   shard per local expert: fc1 [F1, H], rows [gate shard; up shard]; fc2 [H, Fs].
// Gradients have the weights' layouts on both sides.
//
// One direction only: reference -> library. Tests convert their reference's weights before
// handing them to the library (load_full, or a fill of weights_fc1()), and the reference's
// expected gradients (or offsets into them) before comparing with the library's buffers; the
// library's buffers are never converted back. Every conversion is a pure rearrangement (each
// value is copied, none is computed), so every logical weight keeps the value it had before the
// layout change and the library computes bitwise what it computed then.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace moefold::test {

// Each of `count` consecutive row-major [rows, cols] matrices of `m`, transposed to [cols, rows].
template <class T>
std::vector<T> transpose_each(std::span<const T> m, int count, int rows, int cols) {
  const auto R = static_cast<std::size_t>(rows), C = static_cast<std::size_t>(cols);
  std::vector<T> t(static_cast<std::size_t>(count) * R * C);
  for (std::size_t k = 0; k < static_cast<std::size_t>(count); ++k)
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) t[k * R * C + c * R + r] = m[k * R * C + r * C + c];
  return t;
}

// Full fc1 for load_full: the reference's [H, G*F] (columns [gate | up]) as [G*F, H]
// (rows [gate; up]).
template <class T>
std::vector<T> megatron_fc1_from_columns(std::span<const T> w1, int H, int G, int F) {
  return transpose_each(w1, 1, H, G * F);
}
template <class T>
std::vector<T> megatron_fc1_from_columns(const std::vector<T>& w1, int H, int G, int F) {
  return megatron_fc1_from_columns(std::span<const T>(w1), H, G, F);
}

// Full fc2 for load_full: the reference's [F, H] as [H, F].
template <class T>
std::vector<T> megatron_fc2_from_rows(std::span<const T> w2, int F, int H) {
  return transpose_each(w2, 1, F, H);
}
template <class T>
std::vector<T> megatron_fc2_from_rows(const std::vector<T>& w2, int F, int H) {
  return megatron_fc2_from_rows(std::span<const T>(w2), F, H);
}

// A rank's fc1 shards of L local experts: the reference's [L, H, F1] as the library's
// [L, F1, H].
template <class T>
std::vector<T> fc1_shards_from_columns(std::span<const T> w1, int L, int H, int F1) {
  return transpose_each(w1, L, H, F1);
}
// A rank's fc2 shards of L local experts: the reference's [L, Fs, H] as the library's
// [L, H, Fs].
template <class T>
std::vector<T> fc2_shards_from_rows(std::span<const T> w2, int L, int Fs, int H) {
  return transpose_each(w2, L, Fs, H);
}

// Where the reference's shard entry sits in the library's shard of one local expert:
// fc1 entry (h, j) of [H, F1] (j < Fs: gate column j, else up column j - Fs) -> [F1, H];
// fc2 entry (c, h) of [Fs, H] -> [H, Fs].
inline std::size_t fc1_offset(int h, int j, int H) {
  return static_cast<std::size_t>(j) * static_cast<std::size_t>(H) + static_cast<std::size_t>(h);
}
inline std::size_t fc2_offset(int c, int h, int Fs) {
  return static_cast<std::size_t>(h) * static_cast<std::size_t>(Fs) + static_cast<std::size_t>(c);
}

// The library's fc1 shard [F1, H] (ETP shard `part` of `parts`) of one expert's full fc1 in the
// reference's layout [H, G*F], appended to `out`: this shard's gate rows, then its up rows.
template <class T>
void append_fc1_shard(std::type_identity_t<std::span<const T>> full, int H, int G, int F, int parts,
                      int part, std::vector<T>& out) {
  const int fs = F / parts;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < fs; ++c)
      for (int h = 0; h < H; ++h)
        out.push_back(full[static_cast<std::size_t>(h) * static_cast<std::size_t>(G * F) +
                           static_cast<std::size_t>(g * F + part * fs + c)]);
}
// The library's fc2 shard [H, Fs] of one expert's full fc2 in the reference's layout [F, H],
// appended to `out`: columns [part * Fs, (part + 1) * Fs) of [H, F].
template <class T>
void append_fc2_shard(std::type_identity_t<std::span<const T>> full, int F, int H, int parts,
                      int part, std::vector<T>& out) {
  const int fs = F / parts;
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < fs; ++c)
      out.push_back(full[static_cast<std::size_t>(part * fs + c) * static_cast<std::size_t>(H) +
                         static_cast<std::size_t>(h)]);
}

}  // namespace moefold::test
