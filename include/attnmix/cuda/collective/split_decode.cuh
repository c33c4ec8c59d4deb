#pragma once
// What the decoding kernels share (flash-decoding: a query row's keys split over blocks of
// `block_keys` keys, each block a partial softmax state, then a merge): 8-element vector loads
// and stores, sums over the lanes of a key, a block's value pass and the partial states the merge
// kernel (kernels/split_decode.cuh) reads. Used by the PaTH decoding step (path_decode.cuh) and the
// softmax / FoX decoding kernel (attention_decode.cuh).
//
// A key or value row is handled by Dmax / 8 consecutive threads holding 8 elements each (one
// 16- or 32-byte vector); D and Dv are multiples of 8.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmix/config.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <class S>
__device__ __forceinline__ void load8(float (&x)[8], const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    const float4 a = reinterpret_cast<const float4*>(p)[0],
                 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
  }
}

template <class S>
__device__ __forceinline__ void store8(S* p, const float (&x)[8]) {
  if constexpr (std::is_same_v<S, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint4 raw;
    S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = from_float<S>(x[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

// Sum over the `Lanes` consecutive lanes that share a key.
template <int Lanes>
__device__ __forceinline__ float group_sum(float s) {
#pragma unroll
  for (int off = 1; off < Lanes; off *= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// A key's score against a query row q (Dmax floats in shared memory, zero past D) from this
// lane's 8 elements x of the key (at d0 = 8 * (lane within the key)), summed over the key's lanes.
template <int Lanes>
__device__ __forceinline__ float split_decode_dot(const float* q, int d0, const float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(q + d0)[0],
               b = reinterpret_cast<const float4*>(q + d0)[1];
  return group_sum<Lanes>(a.x * x[0] + a.y * x[1] + a.z * x[2] + a.w * x[3] + b.x * x[4] +
                          b.y * x[5] + b.z * x[6] + b.w * x[7]);
}

// The blocks' partial softmax states of a decoding step and where their merge writes: row n
// (one query token), query head hq.
struct split_decode_parts {
  float* ml;  // [N, HQ, splits, 2]: each block's running max (base 2) and sum
  float* o;   // [N, HQ, splits, Dv]: each block's unnormalised output
  int splits, q_heads, value_dim;
  void* out;  // out + n * out_s[0] + hq * out_s[1]
  index_t out_s[2];
  float* lse;  // nullptr: not requested
  index_t lse_s[2];
  __device__ float* ml_at(int n, int hq, int split) const {
    return ml + ((static_cast<index_t>(n) * q_heads + hq) * splits + split) * 2;
  }
  __device__ float* o_at(int n, int hq, int split) const {
    return o + ((static_cast<index_t>(n) * q_heads + hq) * splits + split) * value_dim;
  }
};

// A block's value pass for one query head, called by all 128 threads: the max of its `count`
// scores z (base 2, in shared memory; -inf for masked keys), their probabilities and sum, and
// o = sum_j p_j v_j over value rows vals + j * v_row (8-element vectors, Dv <= Dmax); written to
// ml (max, sum) and o (Dv floats). so: shared scratch of [4][Dmax] floats. A value row is read by
// Dmax / 8 lanes, so a warp covers 32 / (Dmax / 8) keys at a time.
template <class Store, int Dmax>
__device__ __forceinline__ void split_decode_values(const float* z, int count, const Store* vals,
                                                    index_t v_row, int Dv, float* so, float* ml,
                                                    float* o) {
  constexpr int vlanes = Dmax / 8, keys_per_warp = 32 / vlanes;
  static_assert(32 % vlanes == 0, "a warp covers whole value rows");
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int vl = lane % vlanes, e0 = vl * 8, ksub = lane / vlanes;
  float mx = -INFINITY;
  for (int j = lane; j < count; j += 32) mx = fmaxf(mx, z[j]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float acc[8] = {};
  float sum = 0.f;
#pragma unroll 4  // keeps several value loads in flight
  for (int j = warp * keys_per_warp + ksub; j < count; j += 4 * keys_per_warp) {
    const float pj = fast_exp2(z[j] - mx);
    sum += pj;
    if (e0 < Dv) {
      float v8[8];
      load8(v8, vals + j * v_row + e0);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += pj * v8[e];
    }
  }
  // Fold the warp's key subsets (lanes with the same vl), then its lanes' sums (each key's
  // probability was added by all vlanes lanes of its subset: count it once).
#pragma unroll
  for (int off = vlanes; off < 32; off *= 2)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
  sum = vl == 0 ? sum : 0.f;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (ksub == 0)
#pragma unroll
    for (int e = 0; e < 8; ++e) so[warp * Dmax + e0 + e] = acc[e];
  __syncthreads();
  if (warp == 0)  // each warp summed a quarter of the keys
    for (int e = lane; e < Dv; e += 32)
      o[e] = so[e] + so[Dmax + e] + so[2 * Dmax + e] + so[3 * Dmax + e];
  __syncthreads();
  if (lane == 0) so[warp] = sum;
  __syncthreads();
  if (tid == 0) ml[0] = mx, ml[1] = so[0] + so[1] + so[2] + so[3];
  __syncthreads();
}

// A block whose run holds no key of its row: an empty state for each of its G query heads.
__device__ __forceinline__ void split_decode_empty(const split_decode_parts& p, int n, int hq0,
                                                   int G, int split) {
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    float* ml = p.ml_at(n, hq0 + g, split);
    ml[0] = -INFINITY, ml[1] = 0.f;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
