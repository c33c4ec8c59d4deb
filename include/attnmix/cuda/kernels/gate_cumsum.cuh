#pragma once
// The forget-gate cumsum G (inclusive, restarting at each sequence; hard resets apart), in
// double: the kernels take differences G_i - G_j of nearby tokens, which a float cumsum of a long
// sequence would lose.

#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// G is computed over the keys' layout (the queries' unless keys differ: attention_kernel_params::
// key_row), in parts of gate_part tokens of a row, a CTA per (part, 32 query heads, row), in two
// passes: gate_part_sum_kernel summarises each part, gate_cumsum_kernel combines
// the summaries of the parts before its own and scans it. A warp takes 32 tokens with the heads
// across its lanes, so that each read takes a token's neighbouring heads at once (g is [B, T, HQ],
// heads innermost), and a thread holds its 32 gates in registers.
// A hard reset (g = -inf) zeroes the weight of every key before it: G sums it as 0, and `reset`
// keeps each token's last reset for the kernels' key ranges (attention_kernel_params::reset_lo),
// so that no kernel takes a difference across one, and G stays as smooth as without resets (the
// kernels' float gate terms are relative to a nearby G). A span's summary: the sum of its finite
// gates and its last reset (-1 if none). part_sums: [sequence][part][HQ] summaries (two doubles).
struct gate_span {
  double sum = 0;
  index_t reset = -1;
  __device__ void then(const gate_span& b) {
    sum += b.sum;
    if (b.reset >= 0) reset = b.reset;
  }
};

// The gates of this thread's head over its warp's 32 tokens of the part (0 past the sequence or
// past the heads), and their summary; the sequence's batch row, start and length, and the first
// token.
template <class A>
__device__ __forceinline__ gate_span gate_segment(const A* g, index_t g_stride0, index_t g_stride1,
                                                  index_t g_stride2,
                                                  const attention_kernel_params& p, index_t& batch,
                                                  index_t& start, index_t& length, index_t& t0,
                                                  A (&v)[32]) {
  const int h = blockIdx.y * 32 + threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool head = h < p.q_heads;
  p.key_row(blockIdx.z, batch, start, length);
  t0 = static_cast<index_t>(blockIdx.x) * gate_part + warp * 32;
  const A* gs = g + batch * g_stride0 + start * g_stride1 + (head ? h : 0) * g_stride2;
  gate_span span;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    v[i] = head && t0 + i < length ? gs[(t0 + i) * g_stride1] : A(0);
    if (v[i] == -INFINITY)
      span.reset = t0 + i;
    else
      span.sum += static_cast<double>(v[i]);
  }
  return span;
}

template <class A>
__global__ void __launch_bounds__(gate_part)
    gate_part_sum_kernel(const A* g, index_t g_stride0, index_t g_stride1, index_t g_stride2,
                         const attention_kernel_params p, double* part_sums) {
  __shared__ gate_span warp_span[gate_warps][32];
  index_t batch, start, length, t0;
  A v[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, h = blockIdx.y * 32 + lane;
  warp_span[warp][lane] =
      gate_segment(g, g_stride0, g_stride1, g_stride2, p, batch, start, length, t0, v);
  __syncthreads();
  if (warp > 0 || h >= p.q_heads) return;
  gate_span total;
#pragma unroll
  for (int w = 0; w < gate_warps; ++w) total.then(warp_span[w][lane]);
  double* out =
      part_sums + ((static_cast<index_t>(blockIdx.z) * gridDim.x + blockIdx.x) * p.q_heads + h) * 2;
  out[0] = total.sum, out[1] = static_cast<double>(total.reset);
}

template <class A>
__global__ void __launch_bounds__(gate_part)
    gate_cumsum_kernel(const A* g, index_t g_stride0, index_t g_stride1, index_t g_stride2,
                       const attention_kernel_params p, const double* part_sums, double* G,
                       int* reset) {
  __shared__ gate_span warp_span[gate_warps][32];
  index_t batch, start, length, t0;
  A v[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, h = blockIdx.y * 32 + lane;
  warp_span[warp][lane] =
      gate_segment(g, g_stride0, g_stride1, g_stride2, p, batch, start, length, t0, v);
  __syncthreads();
  if (h >= p.q_heads) return;
  // The parts before this one, in order (every warp alike; the reads hit the cache), then the
  // warps before this one.
  gate_span running;
  const double* sums =
      part_sums + static_cast<index_t>(blockIdx.z) * gridDim.x * p.q_heads * 2 + h * 2;
  for (unsigned q = 0; q < blockIdx.x; ++q) {
    gate_span s;
    s.sum = sums[q * p.q_heads * 2], s.reset = static_cast<index_t>(sums[q * p.q_heads * 2 + 1]);
    running.then(s);
  }
  for (int w = 0; w < warp; ++w) running.then(warp_span[w][lane]);
  double* Gs = G + (batch * p.key_layout_tokens() + start) * p.q_heads + h;
  int* Rs = reset + (batch * p.key_layout_tokens() + start) * p.q_heads + h;
  double run = running.sum;
  index_t last = running.reset < 0 ? 0 : running.reset;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    if (v[i] == -INFINITY)
      last = t0 + i;
    else
      run += static_cast<double>(v[i]);
    if (t0 + i < length) {
      Gs[(t0 + i) * p.q_heads] = run;
      Rs[(t0 + i) * p.q_heads] = static_cast<int>(last);
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
