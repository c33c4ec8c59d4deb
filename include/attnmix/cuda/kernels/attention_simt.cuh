#pragma once
// Portable softmax-family attention kernel on CUDA cores: one warp per query row, keys one at
// a time with an online softmax, float accumulation. It serves float inputs (the tensor cores'
// tf32 would miss float accuracy), head dims the tensor-core kernel does not tile, and
// unaligned views. D and Dv up to 32 * MaxChunks.

#include <cmath>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <class T, int MaxChunks>
__global__ void attention_simt_kernel(const attention_kernel_params p) {
  constexpr int rows_per_block = 4;  // one warp each
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int hq = blockIdx.y, seq = blockIdx.z;
  index_t batch, start, length;
  p.sequence(seq, batch, start, length);
  const index_t i = static_cast<index_t>(blockIdx.x) * rows_per_block + warp;
  if (i >= length) return;
  const int hkv = hq / p.group;
  index_t kbatch, kstart, klength;  // the keys; query i at key position at
  p.key_sequence(seq, kbatch, kstart, klength);
  const index_t at = i + klength - length;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + (start + i) * p.q_stride[1] +
               hq * p.q_stride[2];
  const T* k = static_cast<const T*>(p.k) + kbatch * p.k_stride[0] + kstart * p.k_stride[1] +
               hkv * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + kbatch * p.v_stride[0] + kstart * p.v_stride[1] +
               hkv * p.v_stride[2];

  float qr[MaxChunks], o[MaxChunks];
#pragma unroll
  for (int c = 0; c < MaxChunks; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < p.head_dim ? to_float(q[d]) * p.scale_log2 : 0.f;
    o[c] = 0.f;
  }
  const index_t keys_at = (kbatch * p.key_layout_tokens() + kstart) * p.q_heads + hq;
  const double* G = p.gate_cumsum != nullptr ? p.gate_cumsum + keys_at : nullptr;
  const double g_i = G != nullptr ? G[at * p.q_heads] : 0.0;

  index_t lo, hi;
  p.key_range(i, length, klength, lo, hi);
  if (p.gate_reset != nullptr) lo = max(lo, index_t(p.gate_reset[keys_at + at * p.q_heads]));
  float m = -INFINITY, l = 0.f;
  for (index_t j = lo; j <= hi; ++j) {
    const T* kj = k + j * p.k_stride[1];
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < MaxChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < p.head_dim) s += qr[c] * to_float(kj[d]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (G != nullptr) s += p.gate_coef_log2 * static_cast<float>(g_i - G[j * p.q_heads]);
    const float m_new = fmaxf(m, s);
    const float alpha = exp2f(m - m_new), weight = exp2f(s - m_new);
    l = l * alpha + weight;
    const T* vj = v + j * p.v_stride[1];
#pragma unroll
    for (int c = 0; c < MaxChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < p.value_dim) o[c] = o[c] * alpha + weight * to_float(vj[d]);
    }
    m = m_new;
  }

  T* out = static_cast<T*>(p.out) + batch * p.out_stride[0] + (start + i) * p.out_stride[1] +
           hq * p.out_stride[2];
#pragma unroll
  for (int c = 0; c < MaxChunks; ++c) {
    const int d = lane + 32 * c;
    if (d < p.value_dim) out[d] = from_float<T>(o[c] / l);
  }
  if (p.lse != nullptr && lane == 0)
    p.lse[batch * p.lse_stride[0] + (start + i) * p.lse_stride[1] + hq * p.lse_stride[2]] =
        (m + log2f(l)) * 0.6931471805599453f;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
