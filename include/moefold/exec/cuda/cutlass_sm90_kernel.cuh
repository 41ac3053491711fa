//! @file cutlass_sm90_kernel.cuh
//! @brief The CUTLASS kernels behind cutlass_sm90 (exec/cutlass_sm90.hpp), for the units of the
//! moefold_cutlass_sm90 library (exec/cuda/cutlass_sm90_units/*.cu, one kernel each: about 70 s
//! and 3.5 GB of nvcc per unit). Needs nvcc, the CUTLASS headers (nvidia-cutlass 4.2, CUTLASS's
//! sm90 pointer-array grouped GEMM) and -DNDEBUG (without it ptxas serializes the wgmma pipeline,
//! warning C7510).
//!
//! The kernel: CUTLASS's warp-specialized cooperative grouped GEMM (TMA loads into a multistage
//! shared-memory pipeline, wgmma from two consumer warpgroups, a persistent grid scheduled over
//! every group's tiles, no split-K or stream-K: each output is one CTA's, so runs repeat bit for
//! bit), bf16 A and B, fp32 accumulate, problem shapes, pointers and strides read from the arrays
//! kernels/grouped_gemm_arrays.hpp writes on the device. bf16 D with no C (beta = 0: nothing is
//! read), or fp32 D = C with beta = 1 (weight gradients added into main gradients).
//!
//! The arrays' plain layouts are checked here against CuTe's types (static_assert), so that
//! kernels/ needs no CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <moefold/kernels/grouped_gemm_arrays.hpp>

#include "../../core/cuda/cuda_check.hpp"
#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "cutlass_sm90.hpp"

#if !defined(NDEBUG)
#error "cutlass_sm90_kernel.cuh: build CUTLASS units with -DNDEBUG (ptxas serializes wgmma without)"
#endif

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! One kernel of cutlass_sm90_layouts: A's and B's layout tags (CUTLASS's names: RowMajor A is
//! K-major, ColumnMajor B is K-major) and D's element type, with C = D read (beta = 1) for fp32.
template <class LayoutA, class LayoutB, class ElementD>
struct cutlass_sm90_config {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  static constexpr bool accumulate = std::is_same_v<ElementD, float>;
  using ElementC = std::conditional_t<accumulate, float, void>;  // void: no source, nothing read
  using LayoutC = cutlass::layout::RowMajor;
  using ElementAccumulator = float;
  static constexpr int align_ab = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 bytes
  static constexpr int align_cd = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      ElementC, LayoutC*, align_cd, ElementD, LayoutC*, align_cd,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator, ElementC,
                                                   ElementAccumulator>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, align_ab, ElementB,
      LayoutB*, align_ab, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

//! The arrays as CUTLASS's arguments, checked, then the kernel on `stream`.
template <class Config, class TC>
[[nodiscard]] status cutlass_sm90_run(const kernels::grouped_gemm_arrays<bfloat16, bfloat16, TC>& g,
                                      std::span<std::byte> workspace, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using Shape = typename Config::ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using ElementD = typename Config::Epilogue::ElementD;
  // The arrays' layouts (kernels/grouped_gemm_arrays.hpp) are CuTe's: three ints per shape, one
  // int64 per stride (the others static), element types of the same bits.
  static_assert(std::is_same_v<Shape, cute::Shape<int, int, int>> &&
                sizeof(Shape) == 3 * sizeof(int));
  static_assert(sizeof(StrideA) == sizeof(long long) && sizeof(StrideB) == sizeof(long long) &&
                sizeof(StrideD) == sizeof(long long));
  static_assert(sizeof(cutlass::bfloat16_t) == sizeof(bfloat16) && sizeof(ElementD) == sizeof(TC));
  static_assert(
      std::is_same_v<ElementD,
                     std::conditional_t<std::is_same_v<TC, float>, float, cutlass::bfloat16_t>>);

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {g.groups, reinterpret_cast<Shape*>(g.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const cutlass::bfloat16_t**>(g.a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(g.lda);
  args.mainloop.ptr_B = reinterpret_cast<const cutlass::bfloat16_t**>(g.b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(g.ldb);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = Config::accumulate ? 1.0f : 0.0f;
  if constexpr (Config::accumulate) {
    args.epilogue.ptr_C = const_cast<const ElementD**>(reinterpret_cast<ElementD**>(g.c));
    args.epilogue.dC = reinterpret_cast<StrideD*>(g.ldc);
  }
  args.epilogue.ptr_D = reinterpret_cast<ElementD**>(g.c);
  args.epilogue.dD = reinterpret_cast<StrideD*>(g.ldc);
  int device = 0;
  if (auto st = cuda_check(cudaGetDevice(&device), "cudaGetDevice"); !st) return st;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);

  const auto fail = [](const std::string& what) {
    return status(make_error(errc::backend_error, "cutlass_sm90: " + what));
  };
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return fail("CUTLASS's can_implement refused the arguments");
  const std::size_t need = Gemm::get_workspace_size(args);
  if (need > workspace.size())
    return fail("CUTLASS asks for " + std::to_string(need) + " bytes of workspace, " +
                std::to_string(workspace.size()) +
                " reserved (cutlass_sm90::library_workspace_bytes: a GPU with more SMs)");
  if (auto s = gemm.initialize(args, workspace.data(), stream); s != cutlass::Status::kSuccess)
    return fail(std::string("initialize: ") + cutlass::cutlassGetStatusString(s));
  if (auto s = gemm.run(stream); s != cutlass::Status::kSuccess)
    return fail(std::string("run: ") + cutlass::cutlassGetStatusString(s));
  return cuda_check(cudaGetLastError(), "cutlass_sm90 kernel launch");
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
