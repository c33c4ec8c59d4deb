#pragma once
// The forget-gate cumsum G (inclusive, restarting at each sequence), in double: the kernels take
// differences G_i - G_j of nearby tokens, which a float cumsum of a long sequence would lose.

#include "attnmix/cuda/detail/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// One block of 256 threads per (query head, sequence); each thread sums a contiguous segment,
// a block scan of the segment sums gives each segment's offset. G: [B, T, HQ] contiguous.
template <class A>
__global__ void gate_cumsum_kernel(const A* g, index_t g_stride0, index_t g_stride1,
                                   index_t g_stride2, const attention_kernel_params p, double* G) {
  constexpr int threads = 256;
  __shared__ double partial[threads];
  const int hq = blockIdx.x, seq = blockIdx.y;
  index_t batch, start, length;
  p.sequence(seq, batch, start, length);
  const index_t per = (length + threads - 1) / threads;
  const index_t t0 = threadIdx.x * per, t1 = t0 + per < length ? t0 + per : length;
  const A* gs = g + batch * g_stride0 + start * g_stride1 + hq * g_stride2;
  double sum = 0;
  for (index_t t = t0; t < t1; ++t) sum += static_cast<double>(gs[t * g_stride1]);
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int off = 1; off < threads; off *= 2) {  // Hillis-Steele inclusive scan
    const double add = threadIdx.x >= off ? partial[threadIdx.x - off] : 0.0;
    __syncthreads();
    partial[threadIdx.x] += add;
    __syncthreads();
  }
  double running = threadIdx.x > 0 ? partial[threadIdx.x - 1] : 0.0;
  double* Gs = G + (batch * p.tokens + start) * p.q_heads + hq;
  for (index_t t = t0; t < t1; ++t) {
    running += static_cast<double>(gs[t * g_stride1]);
    Gs[t * p.q_heads] = running;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
