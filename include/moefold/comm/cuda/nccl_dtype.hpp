//! @file nccl_dtype.hpp
//! @brief moefold's element types as NCCL data types: the ncclDataType_t of T, and the elements
//! NCCL moves per T (sizeof(T) bytes for types NCCL does not know).
#pragma once

#include <nccl.h>

#include <cstddef>

#include "../../core/dtype.hpp"
#include "cuda_types.hpp"  // CUDA's 16-bit types are dtype::bf16 / f16 here too

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! The NCCL data type T moves as (ncclUint8 for types NCCL does not know).
template <class T>
constexpr ncclDataType_t nccl_type() noexcept {
  switch (dtype_of<T>) {
    case dtype::i8: return ncclInt8;
    case dtype::u8: return ncclUint8;
    case dtype::i32: return ncclInt32;
    case dtype::u32: return ncclUint32;
    case dtype::i64: return ncclInt64;
    case dtype::u64: return ncclUint64;
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::other: return ncclUint8;  // moved as bytes
  }
  return ncclUint8;
}
//! NCCL elements per T: sizeof(T) for types moved as bytes, else 1.
template <class T>
constexpr std::size_t nccl_scale() noexcept {
  return dtype_of<T> == dtype::other ? sizeof(T) : 1;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
