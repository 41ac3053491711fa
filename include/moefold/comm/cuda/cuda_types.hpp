//! @file cuda_types.hpp
//! @brief CUDA's 16-bit float types in moefold's element-type vocabulary: __nv_bfloat16 and
//! __half are the same bits as moefold::bfloat16 and float16, so both name the same dtype, and
//! device code sees moefold's host types as CUDA's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "../../core/dtype.hpp"

namespace moefold {
inline namespace v0_1 {

template <>
inline constexpr dtype dtype_of<__nv_bfloat16> = dtype::bf16;
template <>
inline constexpr dtype dtype_of<__half> = dtype::f16;

static_assert(sizeof(__nv_bfloat16) == sizeof(bfloat16) && sizeof(__half) == sizeof(float16));

//! The type device code uses for T: CUDA's 16-bit types for moefold's, T otherwise.
template <class T>
using device_type_t = std::conditional_t<std::is_same_v<T, bfloat16>, __nv_bfloat16,
                                         std::conditional_t<std::is_same_v<T, float16>, __half, T>>;

}  // namespace v0_1
}  // namespace moefold
