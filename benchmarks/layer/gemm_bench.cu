// The grouped-GEMM backends against dense cuBLAS, measured in the same run (docs/performance.md,
// "The layer against its GEMMs"): L = 8 experts of R rows each, R = 128, 512, 1,024 and 4,096,
// bf16 operands, fp32 accumulation, in the layer's three layouts at the Qwen2-57B-A14B expert
// shape (H 3,584, F 2,560, SwiGLU: fc1 to 2F):
//   - forward (rows_are_m, B K-major: fc1's [2F, H] per expert), into bf16;
//   - data gradient (rows_are_m, B N-major: dx = dh fc1), into bf16;
//   - weight gradient (rows_are_k, beta = 1 into fp32 main gradients [L, 2F, H]).
// Backends: cutlass_sm90 (row ranges on the device, as the dropless layer gives them), cublas_dense
// (one cuBLAS call per expert), cublas_strided (one strided batch: pad mode's uniform groups),
// simt_gemm (at 128 rows only: the portable reference, not a fast path). The ceiling of the
// forward and data gradient: one dense cuBLAS GEMM over all L R rows with one expert's weight; of
// the weight gradient: its roofline, the larger time of its FLOPs at the dense weight-gradient
// rate (one dense GEMM reducing all L R rows) and its main-gradient bytes (read and written, fp32)
// at the device's copy bandwidth (a device-to-device copy, measured here).
// Each time: the median of 10 event-timed runs after 3 warm-ups. Output: one JSON object per line,
// then a table.
//
//   build/benchmarks/layer/bench-gemm [--quick]
#include <moefold/exec/cublas_dense.hpp>
#include <moefold/exec/cublas_strided.hpp>
#include <moefold/exec/cuda/cuda_exec.cuh>
#include <moefold/exec/cutlass_sm90.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/simt_gemm.hpp>

#include "step_timer.cuh"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace moefold;
namespace k = moefold::kernels;
using moefold::bench::keep;
using moefold::bench::median_seconds;

namespace {

constexpr int L = 8, H = 3584, F2 = 2 * 2560;

enum class layout { forward, dgrad, wgrad };
const char* name_of(layout l) {
  return l == layout::forward ? "forward" : l == layout::dgrad ? "dgrad" : "wgrad";
}

// Operands for `groups` groups of `rows` rows each (groups 1: the dense ceiling, one weight).
struct problem_bufs {
  exec_buffer<bfloat16, cuda_exec> a, b;
  exec_buffer<bfloat16, cuda_exec> c16;
  exec_buffer<float, cuda_exec> c32;
  exec_buffer<long long, cuda_exec> off;
  std::vector<long long> host_off;
};

problem_bufs make_bufs(cuda_exec& x, layout l, int groups, long long rows) {
  const long long M = groups * rows;
  const long long n = l == layout::forward ? F2 : l == layout::dgrad ? H : H;
  const long long kk = l == layout::forward ? H : l == layout::dgrad ? F2 : F2;
  problem_bufs p;
  const auto mk = [&](auto tag, long long elems) {
    using V = decltype(tag);
    auto b = exec_buffer<V, cuda_exec>::make(x, 1, std::max<long long>(elems, 1)).value();
    (void)x.fill<V>(b.view(), V(0.01f));
    return b;
  };
  if (l == layout::wgrad) {  // A [m = 2F, M] (dh^T), B [M, n = H] (x), C [groups, 2F, H] fp32
    p.a = mk(bfloat16{}, M * F2);
    p.b = mk(bfloat16{}, M * H);
    p.c32 = mk(float{}, static_cast<long long>(groups) * F2 * H);
  } else {
    p.a = mk(bfloat16{}, M * kk);
    p.b = mk(bfloat16{}, static_cast<long long>(groups) * n * kk);
    p.c16 = mk(bfloat16{}, M * n);
  }
  p.host_off.resize(static_cast<std::size_t>(groups) + 1);
  for (int g = 0; g <= groups; ++g) p.host_off[static_cast<std::size_t>(g)] = g * rows;
  p.off = exec_buffer<long long, cuda_exec>::make(x, 1, groups + 1).value();
  (void)x.copy(row_view<const long long>(p.host_off.data(), 1, groups + 1), p.off.view());
  return p;
}

template <class TC>
grouped_gemm_args<bfloat16, bfloat16, TC> args_of(layout l, int groups, problem_bufs& p,
                                                  bool device_offsets) {
  grouped_gemm_args<bfloat16, bfloat16, TC> a;
  a.groups = groups;
  if (l == layout::wgrad) {
    const long long M = p.host_off.back();
    a.grouping = k::gemm_grouping::rows_are_k;
    a.m = F2;
    a.n = H;
    a.accumulate = true;
    a.a = {p.a.view().data(), 1, F2, 0};  // A [m, K] = dh^T: dh [K, 2F] row-major
    a.b = {p.b.view().data(), H, 1, 0};
    if constexpr (std::is_same_v<TC, float>)
      a.c = {p.c32.view().data(), H, 1, static_cast<long long>(F2) * H};
  } else {
    const long long n = l == layout::forward ? F2 : H, kk = l == layout::forward ? H : F2;
    a.grouping = k::gemm_grouping::rows_are_m;
    a.n = static_cast<int>(n);
    a.k = static_cast<int>(kk);
    a.a = {p.a.view().data(), kk, 1, 0};
    a.b = l == layout::forward ? k::gemm_operand<const bfloat16>{p.b.view().data(), 1, kk, n * kk}
                               : k::gemm_operand<const bfloat16>{p.b.view().data(), n, 1, n * kk};
    if constexpr (std::is_same_v<TC, bfloat16>) a.c = {p.c16.view().data(), n, 1, 0};
  }
  if (device_offsets) {
    a.offsets = p.off.view().data();
    a.row_bound = p.host_off.back();
  } else {
    a.host_offsets = p.host_off;
  }
  return a;
}

// Seconds per run of backend G, or a negative value with the reason printed where it refuses.
template <class G>
double time_backend(cuda_exec& x, const typename G::args_type& a, std::string& why) {
  if (auto st = G::can_implement(a); !st) {
    why = st.error().message;
    return -1;
  }
  const std::size_t bytes = G::workspace_bytes(a);
  auto ws = exec_buffer<std::byte, cuda_exec>::make(x, 1, std::max<std::size_t>(bytes, 1)).value();
  G g;
  if (auto st = g.initialize(x, a, {ws.view().data(), bytes}); !st) {
    why = st.error().message;
    return -1;
  }
  std::optional<error> last;
  const double t = median_seconds(
      x.stream(), [&] { return g.run(x); }, last);
  if (last) {
    why = last->message;
    return -1;
  }
  return t;
}

struct row {
  std::string layout_name, backend;
  long long rows;
  double tflops, ceiling_tflops, ratio;
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto x = cuda_exec::make(s).value();
  // The copy bandwidth (bytes read + written), for the weight gradient's roofline.
  double copy_bps = 0;
  {
    const long long n = 1LL << 28;  // 512 MiB of bf16 each way
    auto src = exec_buffer<bfloat16, cuda_exec>::make(x, 1, n).value();
    auto dst = exec_buffer<bfloat16, cuda_exec>::make(x, 1, n).value();
    std::optional<error> last;
    const double t = median_seconds(
        s, [&] { return x.copy(src.cview(), dst.view()); }, last);
    if (last) {
      std::fprintf(stderr, "copy: %s\n", last->message.c_str());
      return 1;
    }
    copy_bps = 2.0 * static_cast<double>(n) * 2 / t;
  }
  std::printf("{\"bench\": \"gemm\", \"ceiling\": \"copy\", \"TBps_rw\": %.3f}\n", copy_bps / 1e12);
  std::vector<row> rows_out;
  const std::vector<long long> sizes =
      quick ? std::vector<long long>{128, 1024} : std::vector<long long>{128, 512, 1024, 4096};
  for (layout l : {layout::forward, layout::dgrad, layout::wgrad}) {
    for (long long R : sizes) {
      const double flops = 2.0 * L * R * H * F2;
      auto grouped = make_bufs(x, l, L, R);
      auto dense = make_bufs(x, l, 1, L * R);
      std::string why;
      // The ceiling: the dense GEMM over all rows (cuBLAS, one call).
      double t_dense = 0;
      if (l == layout::wgrad)
        t_dense = time_backend<cublas_dense<bfloat16, bfloat16, float>>(
            x, args_of<float>(l, 1, dense, false), why);
      else
        t_dense = time_backend<cublas_dense<bfloat16, bfloat16, bfloat16>>(
            x, args_of<bfloat16>(l, 1, dense, false), why);
      if (t_dense <= 0) {
        std::fprintf(stderr, "dense %s: %s\n", name_of(l), why.c_str());
        return 1;
      }
      double ceiling_t = t_dense;
      if (l == layout::wgrad)  // the roofline: FLOPs at the dense rate or the main grads' bytes
        ceiling_t = std::max(t_dense, 2.0 * L * F2 * H * sizeof(float) / copy_bps);
      const double ceiling = flops / ceiling_t / 1e12;
      const auto report = [&](const char* backend, double t, const std::string& reason) {
        if (t <= 0) {
          std::printf(
              "{\"bench\": \"gemm\", \"layout\": \"%s\", \"rows_per_expert\": %lld, \"experts\": "
              "%d, \"backend\": \"%s\", \"refused\": \"%s\"}\n",
              name_of(l), R, L, backend, reason.substr(0, 160).c_str());
          return;
        }
        const double tf = flops / t / 1e12;
        std::printf(
            "{\"bench\": \"gemm\", \"layout\": \"%s\", \"rows_per_expert\": %lld, \"experts\": %d, "
            "\"H\": %d, \"2F\": %d, \"backend\": \"%s\", \"tflops\": %.1f, \"dense_tflops\": %.1f, "
            "\"ceiling_tflops\": %.1f, \"ratio\": %.3f}\n",
            name_of(l), R, L, H, F2, backend, tf, flops / t_dense / 1e12, ceiling, tf / ceiling);
        rows_out.push_back({name_of(l), backend, R, tf, ceiling, tf / ceiling});
      };
      const auto each = [&]<class TC>(TC) {
#if defined(MOEFOLD_CUTLASS_SM90)
        std::string r1;
        report("cutlass_sm90",
               time_backend<cutlass_sm90<bfloat16, bfloat16, TC>>(
                   x, args_of<TC>(l, L, grouped, true), r1),
               r1);
#endif
        std::string r2, r3, r4;
        report("cublas_dense",
               time_backend<cublas_dense<bfloat16, bfloat16, TC>>(
                   x, args_of<TC>(l, L, grouped, false), r2),
               r2);
        report("cublas_strided",
               time_backend<cublas_strided<bfloat16, bfloat16, TC>>(
                   x, args_of<TC>(l, L, grouped, false), r3),
               r3);
        if (R == 128)
          report("simt_gemm",
                 time_backend<simt_gemm<bfloat16, bfloat16, TC>>(
                     x, args_of<TC>(l, L, grouped, true), r4),
                 r4);
      };
      if (l == layout::wgrad)
        each(float{});
      else
        each(bfloat16{});
    }
  }
  if (auto st = x.device_status(); !st) {
    std::fprintf(stderr, "%s\n", st.error().message.c_str());
    return 1;
  }
  std::printf(
      "\n| layout | rows/expert | backend | TFLOP/s | ceiling | ratio "
      "|\n|---|---|---|---|---|---|\n");
  for (const row& r : rows_out)
    std::printf("| %s | %lld | %s | %.0f | %.0f | %.2f |\n", r.layout_name.c_str(), r.rows,
                r.backend.c_str(), r.tflops, r.ceiling_tflops, r.ratio);
  cudaStreamDestroy(s);
  return 0;
}
