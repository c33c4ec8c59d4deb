#pragma once
// The merge of flash-decoding's partial softmax states (collective/split_decode.cuh), for the PaTH
// decoding step (path_decode.cuh) and the softmax / FoX decoding kernel (attention_decode.cuh).

#include <cmath>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_decode.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Merges the blocks' partial states: grid (HQ, N), 128 threads (Dv <= 128).
template <class T>
__global__ void split_decode_combine_kernel(const split_decode_parts p) {
  const int hq = blockIdx.x, n = blockIdx.y, e = threadIdx.x;
  const float* ml = p.ml_at(n, hq, 0);
  const float* po = p.o_at(n, hq, 0);
  float M = -INFINITY;
  for (int s = 0; s < p.splits; ++s) M = fmaxf(M, ml[2 * s]);
  float l = 0.f, o = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    if (ml[2 * s] == -INFINITY) continue;
    const float f = exp2f(ml[2 * s] - M);
    l += f * ml[2 * s + 1];
    if (e < p.value_dim) o += f * po[s * p.value_dim + e];
  }
  if (e < p.value_dim)
    static_cast<T*>(p.out)[n * p.out_s[0] + hq * p.out_s[1] + e] = from_float<T>(o / l);
  if (e == 0 && p.lse != nullptr)
    p.lse[n * p.lse_s[0] + hq * p.lse_s[1]] = (M + log2f(l)) * 0.6931471805599453f;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
