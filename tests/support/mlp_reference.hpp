// The fp64 reference of moefold's experts, written as host loops from the definitions (not from
// the library's code): per row of local expert l, a = fc1_l x, act_out = act(gate) * up (gated)
// or act(a), h = act_out * p, y = fc2_l h; and from dy: dh = fc2_l^T dy, dp = <act_out, dh>,
// da = p dh act'(.) (and p dh act(gate) for the up rows), dx = fc1_l^T da, and the weight
// gradients dfc2_l += dy h^T, dfc1_l += da x^T summed over the expert's rows. Inputs are widened
// to double once; everything after is double. Layouts are the library's
// (experts/mlp_params.hpp): fc1 [L, F1, H], fc2 [L, H, F / ETP].
#pragma once

#include <moefold/core/dtype.hpp>
#include <moefold/experts/mlp_params.hpp>

#include <cstddef>
#include <span>
#include <vector>

#include "activation_ref.hpp"

namespace moefold::test {

struct mlp_reference_result {
  std::vector<double> y, dx, dprobs;  // [M, H], [M, H], [M]
  std::vector<double> g1, g2;         // this batch's weight gradients (from 0), the weights' layout
};

template <class U>
double wide64(const U& v) {
  return static_cast<double>(moefold::detail::widen(v));
}

// `dy` may be empty: the forward only.
template <class T, class P>
mlp_reference_result mlp_reference(const mlp_shape& s, std::span<const int> counts,
                                   std::span<const T> x, std::span<const P> p,
                                   std::span<const T> w1, std::span<const T> w2,
                                   std::span<const T> dy) {
  const int H = s.hidden, fs = s.ffn / s.etp, f1 = (is_gated(s.act) ? 2 : 1) * fs;
  const auto uz = [](long long v) { return static_cast<std::size_t>(v); };
  const auto n = mlp_sizes(s);
  mlp_reference_result r;
  r.y.assign(x.size(), 0.0);
  r.dx.assign(x.size(), 0.0);
  r.dprobs.assign(p.size(), 0.0);
  r.g1.assign(n.fc1, 0.0);
  r.g2.assign(n.fc2, 0.0);
  std::vector<double> a(uz(f1)), out(uz(fs)), h(uz(fs)), dh(uz(fs)), da(uz(f1));
  long long row = 0;
  for (std::size_t l = 0; l < counts.size(); ++l)
    for (int i = 0; i < counts[l]; ++i, ++row) {
      const auto W1 = [&](int c, int k) {
        return wide64(w1[(l * uz(f1) + uz(c)) * uz(H) + uz(k)]);
      };
      const auto W2 = [&](int o, int c) {
        return wide64(w2[(l * uz(H) + uz(o)) * uz(fs) + uz(c)]);
      };
      const auto X = [&](int k) { return wide64(x[uz(row) * uz(H) + uz(k)]); };
      const double pr = wide64(p[uz(row)]);
      for (int c = 0; c < f1; ++c) {
        double v = 0;
        for (int k = 0; k < H; ++k) v += W1(c, k) * X(k);
        a[uz(c)] = v;
      }
      for (int c = 0; c < fs; ++c) {
        out[uz(c)] =
            is_gated(s.act) ? act_ref(s.act, a[uz(c)]) * a[uz(fs + c)] : act_ref(s.act, a[uz(c)]);
        h[uz(c)] = out[uz(c)] * pr;
      }
      for (int o = 0; o < H; ++o) {
        double v = 0;
        for (int c = 0; c < fs; ++c) v += W2(o, c) * h[uz(c)];
        r.y[uz(row) * uz(H) + uz(o)] = v;
      }
      if (dy.empty()) continue;
      const auto DY = [&](int o) { return wide64(dy[uz(row) * uz(H) + uz(o)]); };
      double dp = 0;
      for (int c = 0; c < fs; ++c) {
        double v = 0;
        for (int o = 0; o < H; ++o) v += W2(o, c) * DY(o);
        dh[uz(c)] = v;
        dp += out[uz(c)] * v;
        const double d = pr * v;
        if (is_gated(s.act)) {
          const double gate = a[uz(c)], up = a[uz(fs + c)];
          da[uz(c)] = d * up * act_ref_derivative(s.act, gate);
          da[uz(fs + c)] = d * act_ref(s.act, gate);
        } else {
          da[uz(c)] = d * act_ref_derivative(s.act, a[uz(c)]);
        }
      }
      r.dprobs[uz(row)] = dp;
      for (int k = 0; k < H; ++k) {
        double v = 0;
        for (int c = 0; c < f1; ++c) v += W1(c, k) * da[uz(c)];
        r.dx[uz(row) * uz(H) + uz(k)] = v;
      }
      for (int o = 0; o < H; ++o)
        for (int c = 0; c < fs; ++c) r.g2[(l * uz(H) + uz(o)) * uz(fs) + uz(c)] += DY(o) * h[uz(c)];
      for (int c = 0; c < f1; ++c)
        for (int k = 0; k < H; ++k) r.g1[(l * uz(f1) + uz(c)) * uz(H) + uz(k)] += da[uz(c)] * X(k);
    }
  return r;
}

}  // namespace moefold::test
