#pragma once
// Host side of the split decoding kernels (kernels/split_decode.cuh): where a step's partial
// states go and what its merge writes.

#include <cstddef>

#include <cuda_runtime.h>

#include "attnmix/attention/args.hpp"
#include "attnmix/cuda/kernels/split_decode.cuh"
#include "attnmix/cuda/plan/split_decode.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// The partial states of a step planned as `plan` in `work` (the maxima and sums at 0, the
// outputs after them), merged into a.out ([N, 1, HQ, Dv]) and, if given, a.lse ([N, 1, HQ]).
template <class T>
split_decode_parts split_parts(const attention_args<T>& a, const split_decode_plan& plan,
                               unsigned char* work) {
  split_decode_parts p{};
  p.ml = reinterpret_cast<float*>(work);
  p.o = reinterpret_cast<float*>(work + plan.ml_bytes);
  p.splits = plan.splits;
  p.q_heads = static_cast<int>(a.out.extent(2));
  p.value_dim = static_cast<int>(a.out.extent(3));
  p.out = a.out.data();
  p.out_s[0] = a.out.stride(0), p.out_s[1] = a.out.stride(2);
  p.lse = a.lse.has_value() ? a.lse.data() : nullptr;
  if (a.lse.has_value()) p.lse_s[0] = a.lse.stride(0), p.lse_s[1] = a.lse.stride(2);
  return p;
}

// The merge of the blocks' states into the output, on `stream`.
template <class Dev>
void launch_split_combine(const split_decode_parts& parts, const split_decode_plan& plan,
                          cudaStream_t stream) {
  split_decode_combine_kernel<Dev>
      <<<dim3(plan.combine_grid.x, plan.combine_grid.y), split_decode_threads, 0, stream>>>(parts);
  check(cudaGetLastError(), "split_decode_combine_kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
