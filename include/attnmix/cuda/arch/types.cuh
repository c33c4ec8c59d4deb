#pragma once
// attnmix's storage scalars as the CUDA types the kernels compute with.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "attnmix/core/scalar.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

template <class T>
struct device_type {
  using type = T;
};
template <>
struct device_type<half> {
  using type = __half;
};
template <>
struct device_type<bfloat16> {
  using type = __nv_bfloat16;
};
template <class T>
using device_t = typename device_type<std::remove_const_t<T>>::type;

template <class T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return static_cast<float>(x);
  }
}

template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return static_cast<T>(x);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
