#pragma once
// Checks every CUDA launcher makes before it launches: the views are device memory, the sizes fit
// what the kernels hold and the grid can express, and which views allow vector loads.

#include <cstdint>
#include <string>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/linear_args.hpp"
#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Every view of `a` that is given must point to device memory (cudaPointerGetAttributes).
template <class T>
void check_device_pointers(const std::string& fn, const attention_args<T>& a) {
  check_device_pointer(fn, "q", a.q);
  check_device_pointer(fn, "k", a.k);
  check_device_pointer(fn, "v", a.v);
  check_device_pointer(fn, "w", a.w);
  check_device_pointer(fn, "beta", a.beta);
  check_device_pointer(fn, "g", a.g);
  check_device_pointer(fn, "out", a.out);
  check_device_pointer(fn, "lse", a.lse);
}

// The same for the linear-attention kinds.
template <class T>
void check_device_pointers(const std::string& fn, const linear_attention_args<T>& a) {
  check_device_pointer(fn, "q", a.q);
  check_device_pointer(fn, "k", a.k);
  check_device_pointer(fn, "v", a.v);
  check_device_pointer(fn, "out", a.out);
  check_device_pointer(fn, "mask", a.mask);
  check_device_pointer(fn, "a", a.a);
  check_device_pointer(fn, "gate", a.gate);
  check_device_pointer(fn, "gamma", a.gamma);
  check_device_pointer(fn, "state_in.S", a.state_in.S);
  check_device_pointer(fn, "state_in.z", a.state_in.z);
  check_device_pointer(fn, "state_in.lse", a.state_in.lse);
  check_device_pointer(fn, "state_out.S", a.state_out.S);
  check_device_pointer(fn, "state_out.z", a.state_out.z);
  check_device_pointer(fn, "state_out.lse", a.state_out.lse);
}

// What every CUDA launch relies on: head dims up to what the `kernels` hold on chip, and no more
// sequences than a grid's y / z extent.
template <class Problem>
void check_launch_sizes(const std::string& fn, const Problem& p, index_t max_dim,
                        const char* kernels) {
  require(p.head_dim <= max_dim, fn, "q", "has head dim D = ", p.head_dim, " but the CUDA ",
          kernels, " support D <= ", max_dim);
  require(p.value_dim <= max_dim, fn, "v", "has head dim Dv = ", p.value_dim, " but the CUDA ",
          kernels, " support Dv <= ", max_dim);
  const index_t grid = current_properties().max_grid_z;
  require(p.num_sequences <= grid, fn, "cu_seqlens", "holds ", p.num_sequences,
          " sequences but the CUDA backend supports at most ", grid);
}

// True when `elems` consecutive elements of `elem_bytes` at every (batch, token, head) start
// can be moved as one aligned vector.
inline bool aligned_for_vectors(const void* p, index_t s0, index_t s1, index_t s2, int elems,
                                int elem_bytes = 2) {
  return reinterpret_cast<std::uintptr_t>(p) % (elem_bytes * elems) == 0 && s0 % elems == 0 &&
         s1 % elems == 0 && s2 % elems == 0;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
