#pragma once
// Checks every CUDA launcher makes before it launches: the sizes fit
// what the kernels hold and the grid can express, and which views allow vector loads.

#include <cstdint>
#include <string>

#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// The same for the linear-attention kinds.
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
