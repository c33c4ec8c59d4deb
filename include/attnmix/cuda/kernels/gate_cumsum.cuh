#pragma once
// The forget-gate cumsum G (inclusive, restarting at each sequence), in double: the kernels take
// differences G_i - G_j of nearby tokens, which a float cumsum of a long sequence would lose.

#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// G is computed in parts of gate_part tokens of a sequence, a CTA per (part, 32 query heads,
// sequence), in two passes: gate_part_sum_kernel sums each part, gate_cumsum_kernel adds the sums
// of the parts before its own and scans it. A warp takes 32 tokens with the heads across its lanes,
// so that each read takes a token's neighbouring heads at once (g is [B, T, HQ], heads
// innermost), and a thread holds its 32 gates in registers. part_sums: [sequence][part][HQ].

// The gates of this thread's head over its warp's 32 tokens of the part (0 past the sequence or
// past the heads), and their sum; the sequence's batch row, start and length, and the first token.
template <class A>
__device__ __forceinline__ double gate_segment(const A* g, index_t g_stride0, index_t g_stride1,
                                               index_t g_stride2, const attention_kernel_params& p,
                                               index_t& batch, index_t& start, index_t& length,
                                               index_t& t0, A (&v)[32]) {
  const int h = blockIdx.y * 32 + threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool head = h < p.q_heads;
  p.sequence(blockIdx.z, batch, start, length);
  t0 = static_cast<index_t>(blockIdx.x) * gate_part + warp * 32;
  const A* gs = g + batch * g_stride0 + start * g_stride1 + (head ? h : 0) * g_stride2;
  double sum = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    v[i] = head && t0 + i < length ? gs[(t0 + i) * g_stride1] : A(0);
    sum += static_cast<double>(v[i]);
  }
  return sum;
}

template <class A>
__global__ void __launch_bounds__(gate_part)
    gate_part_sum_kernel(const A* g, index_t g_stride0, index_t g_stride1, index_t g_stride2,
                         const attention_kernel_params p, double* part_sums) {
  __shared__ double warp_sum[gate_warps][32];
  index_t batch, start, length, t0;
  A v[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, h = blockIdx.y * 32 + lane;
  warp_sum[warp][lane] =
      gate_segment(g, g_stride0, g_stride1, g_stride2, p, batch, start, length, t0, v);
  __syncthreads();
  if (warp > 0 || h >= p.q_heads) return;
  double total = 0;
#pragma unroll
  for (int w = 0; w < gate_warps; ++w) total += warp_sum[w][lane];
  part_sums[(static_cast<index_t>(blockIdx.z) * gridDim.x + blockIdx.x) * p.q_heads + h] = total;
}

template <class A>
__global__ void __launch_bounds__(gate_part)
    gate_cumsum_kernel(const A* g, index_t g_stride0, index_t g_stride1, index_t g_stride2,
                       const attention_kernel_params p, const double* part_sums, double* G) {
  __shared__ double warp_sum[gate_warps][32];
  __shared__ double before[gate_warps][32];  // the sums of the parts before, a share a warp
  index_t batch, start, length, t0;
  A v[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, h = blockIdx.y * 32 + lane;
  warp_sum[warp][lane] =
      gate_segment(g, g_stride0, g_stride1, g_stride2, p, batch, start, length, t0, v);
  double share = 0;
  if (h < p.q_heads) {
    const double* sums = part_sums + static_cast<index_t>(blockIdx.z) * gridDim.x * p.q_heads + h;
    for (unsigned q = warp; q < blockIdx.x; q += gate_warps) share += sums[q * p.q_heads];
  }
  before[warp][lane] = share;
  __syncthreads();
  double running = 0;
#pragma unroll
  for (int w = 0; w < gate_warps; ++w)
    running += before[w][lane] + (w < warp ? warp_sum[w][lane] : 0.0);
  if (h >= p.q_heads) return;
  double* Gs = G + (batch * p.tokens + start) * p.q_heads + h;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    running += static_cast<double>(v[i]);
    if (t0 + i < length) Gs[(t0 + i) * p.q_heads] = running;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
