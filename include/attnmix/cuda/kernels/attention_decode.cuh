#pragma once
// Softmax attention and FoX decoding on CUDA (flash-decoding): one query token a row against keys
// of their own (a cache's slots through key_slots / key_lengths, or cu_seqlens_k), the keys a row
// sees split over blocks of `block_keys`; a block serves the G query heads of one key/value head,
// so that the group reads each key and value once. The gate cumsum G and each key's last hard
// reset come from the call's scans (attention_setup), as for the forward kernels;
// split_decode_combine_kernel merges the blocks' states.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_decode.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Grid (splits, H, N), 128 threads; row n holds one query token (a dense batch of T = 1). Dynamic
// shared memory (attention_decode_smem): floats sq [G][Dmax], sz [G][block_keys], so [4][Dmax].
// With a gate G <= 32.
template <class T, int Dmax>
__global__ void __launch_bounds__(128)
    attention_decode_kernel(const attention_kernel_params p, const split_decode_parts parts,
                            int block_keys) {
  constexpr int threads = 128, lanes = Dmax / 8, per_pass = threads / lanes;
  extern __shared__ float smem[];
  __shared__ double sgate[32];    // G at the query's position, a query head of the group each
  __shared__ index_t sreset[32];  // its last hard reset: keys before it have weight 0
  const int G = p.group, D = p.head_dim, Dv = p.value_dim, HQ = p.q_heads;
  const int split = blockIdx.x, h = blockIdx.y, n = blockIdx.z, tid = threadIdx.x;
  float* sq = smem;                 // [G][Dmax], times scale * log2(e)
  float* sz = sq + G * Dmax;        // [G][block_keys]
  float* so = sz + G * block_keys;  // [4][Dmax]

  index_t batch, start, length, kbatch, kstart, klength, lo, hi;
  p.sequence(n, batch, start, length);
  p.key_sequence(n, kbatch, kstart, klength);
  p.key_range(0, length, klength, lo, hi);  // the row's one query, at key position klength - 1
  const index_t j_begin = lo + static_cast<index_t>(split) * block_keys;
  const index_t j_end = j_begin + block_keys < hi + 1 ? j_begin + block_keys : hi + 1;
  if (length == 0 || j_begin >= j_end) {
    split_decode_empty(parts, n, h * G, G, split);
    return;
  }

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + start * p.q_stride[1] +
               (h * G) * p.q_stride[2];
  for (int idx = tid; idx < G * Dmax; idx += threads) {
    const int g = idx / Dmax, d = idx % Dmax;
    sq[idx] = d < D ? p.scale_log2 * to_float(q[g * p.q_stride[2] + d]) : 0.f;
  }
  const bool gated = p.gate_cumsum != nullptr;
  const index_t keys_at = (kbatch * p.key_layout_tokens() + kstart) * HQ + h * G;
  const index_t at = klength - length;
  if (gated && tid < G) {
    sgate[tid] = p.gate_cumsum[keys_at + at * HQ + tid];
    sreset[tid] = p.gate_reset != nullptr ? p.gate_reset[keys_at + at * HQ + tid] : 0;
  }
  __syncthreads();

  const int kl = tid % lanes, d0 = kl * 8;
  const T* k = static_cast<const T*>(p.k) + kbatch * p.k_stride[0] + kstart * p.k_stride[1] +
               h * p.k_stride[2];
  for (index_t jb = j_begin; jb < j_end; jb += per_pass) {
    const index_t j = jb + tid / lanes;
    const bool live = j < j_end;
    float x[8] = {};  // lanes off the run or past D score zeros and store nothing
    if (live && d0 < D) load8(x, k + j * p.k_stride[1] + d0);
    for (int g = 0; g < G; ++g) {
      const float s = split_decode_dot<lanes>(sq + g * Dmax, d0, x);
      if (kl == 0 && live) {
        float z = s;
        if (gated)
          z = j < sreset[g]
                  ? -INFINITY
                  : z + p.gate_coef_log2 *
                            static_cast<float>(sgate[g] - p.gate_cumsum[keys_at + j * HQ + g]);
        sz[g * block_keys + (j - j_begin)] = z;
      }
    }
  }
  __syncthreads();

  const T* v = static_cast<const T*>(p.v) + kbatch * p.v_stride[0] +
               (kstart + j_begin) * p.v_stride[1] + h * p.v_stride[2];
  for (int g = 0; g < G; ++g)
    split_decode_values<T, Dmax>(sz + g * block_keys, static_cast<int>(j_end - j_begin), v,
                                 p.v_stride[1], Dv, so, parts.ml_at(n, h * G + g, split),
                                 parts.o_at(n, h * G + g, split));
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
