#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
struct emu_dim {
  unsigned x = 0, y = 0, z = 0;
};
inline emu_dim threadIdx, blockIdx, blockDim, gridDim;
inline void __syncthreads() {}
inline bool emu_reverse = std::getenv("EMU_REVERSE") != nullptr;

inline std::vector<float> emu_smem_buf;
namespace attnmix {
namespace detail {
namespace cuda {
template <class T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <class T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
struct path_kernel_params {
  attention_kernel_params a;
  const float* w;
  const float* beta;
  index_t w_stride[3], beta_stride[3];
  int kv_heads;
  void* kt;
  void* u;
  void* m;
  void* wh;
  void* e;
  index_t row(index_t batch, int h, index_t t) const {
    return (batch * kv_heads + h) * a.tokens + t;
  }
};
}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
