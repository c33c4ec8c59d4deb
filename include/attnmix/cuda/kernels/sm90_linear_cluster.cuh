#pragma once
// Bidirectional linear attention in one kernel for compute capability 9.0 and later (thread-block
// clusters, distributed shared memory): D = Dv = 64, half and bfloat16, built from the reduce and
// read phases of collective/linear_tiles.cuh.

#include <cooperative_groups.h>

#include <cstdint>

#include "attnmix/cuda/collective/linear_tiles.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- one cluster a head: reduce, merge, read (D = Dv = 64, compute capability 9.0) -------------
// When the KV heads times a few CTAs fill the GPU about once, one kernel does the whole call: a
// cluster of n CTAs per (KV head, sequence), grid (n, H, N). CTA r reduces tokens [r b, (r + 1)
// b) into its partial state in shared memory (reduce_fast_tiles); after a cluster barrier every
// CTA merges the n partials over distributed shared memory, with combine_head's log-sum-exp
// weights, straight into its staged state, then reads the query rows of its own tokens for every
// query head of the group (fast_read). One launch: no scratch memory, no memset, and no state
// round trip through global memory.

__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}

template <class T, class Policy>
__global__ void __launch_bounds__(linear_fast_threads, linear_cluster_ctas)
    linear_cluster_fast_kernel(const linear_kernel_params p, index_t block_tokens) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int D = 64, Dv = 64, vecs = (D * Dv + D) / 4, per_thread = (vecs + 255) / 256;
  constexpr bool gated = Policy::gate != key_gate::off;
  using reader_t = fast_read<T, Policy, D, Dv>;
  constexpr int ss = reader_t::ss;
  static_assert(linear_fast_threads == linear_mma_reduce_threads, "one block shape");
  extern __shared__ __align__(16) unsigned char linear_smem[];
  __shared__ __align__(16) T sS[D * ss];
  __shared__ float scratch[8];
  __shared__ float stats[2];  // this CTA's gate statistics M, ell
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, warp = tid / 32;
  const int rank = int(cluster.block_rank()), ranks = int(cluster.num_blocks());
  const int h = blockIdx.y, n = blockIdx.z;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = rank * block_tokens, t1 = min(t0 + block_tokens, length);
  float* red = reinterpret_cast<float*>(linear_smem);  // the partial state, once the ring is done
  float* sgamma = reinterpret_cast<float*>(linear_smem + linear_cluster_ring);

  float M = 0.f, ell = 0.f;
  reduce_fast_tiles<T, Policy, linear_mma_stages<false>>(
      p, batch, start, h, t0, t1, linear_smem, scratch, M, ell,
      [&](int i, float4 x) { reinterpret_cast<float4*>(red)[i] = x; });
  if (tid == 0) stats[0] = M, stats[1] = ell;
  stage_gamma<Policy>(p, h * p.group, p.group, Dv, sgamma);
  cluster.sync();  // every partial and its statistics sit in its CTA's shared memory

  // Rank r's weight: exp(M_r - M) over the merged mass, M the largest block max (1 without a
  // gate). Remote loads are issued in batches (a rank's loads together), since each one takes
  // a round trip to the peer's SM.
  float Mg = -INFINITY, ellg = 0.f;
  {
    float Mr[linear_cluster_max], lr[linear_cluster_max];
#pragma unroll
    for (int r = 0; r < linear_cluster_max; ++r) {
      const float* st = cluster.map_shared_rank(stats, r < ranks ? r : 0);
      Mr[r] = st[0], lr[r] = st[1];
    }
#pragma unroll
    for (int r = 0; r < linear_cluster_max; ++r)
      if (r < ranks && lr[r] > 0.f) Mg = fmaxf(Mg, Mr[r]);
#pragma unroll
    for (int r = 0; r < linear_cluster_max; ++r)
      if (r < ranks) ellg += (gated ? shifted_exp(Mr[r], Mg) : 1.f) * lr[r];
  }
  float4 merged[per_thread];
#pragma unroll
  for (int u = 0; u < per_thread; ++u) merged[u] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int r = 0; r < ranks; ++r) {
    const float* st = cluster.map_shared_rank(stats, r);
    const float4* part = reinterpret_cast<const float4*>(cluster.map_shared_rank(red, r));
    float4 x[per_thread];
#pragma unroll
    for (int u = 0; u < per_thread; ++u) x[u] = part[min(tid + u * linear_fast_threads, vecs - 1)];
    const float alpha = gated ? (st[1] > 0.f ? __expf(st[0] - Mg) : 0.f) : 1.f;
#pragma unroll
    for (int u = 0; u < per_thread; ++u)
      merged[u].x += alpha * x[u].x, merged[u].y += alpha * x[u].y, merged[u].z += alpha * x[u].z,
          merged[u].w += alpha * x[u].w;
  }
  const float inv = gated ? (ellg > 0.f ? 1.f / ellg : 0.f) : 1.f;
  float vmax = 0.f;
#pragma unroll
  for (int u = 0; u < per_thread; ++u) {
    float4& s = merged[u];
    s.x *= inv, s.y *= inv, s.z *= inv, s.w *= inv;
    if (tid + u * linear_fast_threads < vecs)
      vmax = fmaxf(vmax, fmaxf(fmaxf(fabsf(s.x), fabsf(s.y)), fmaxf(fabsf(s.z), fabsf(s.w))));
  }
  cluster_arrive();  // done with the peers' shared memory
  // The first query rows are in flight while the state is staged (primed only now: their
  // registers held through the merge cost more than the overlap gains).
  reader_t reader(p, batch, start + t0, max(index_t(0), t1 - t0), h * p.group, p.group);
  reader.prime(warp);

  // The caller's state, from rank 0.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int u = 0; u < per_thread; ++u) {
      const int i = tid + u * linear_fast_threads;
      if (i < vecs) {
        const float x[4] = {merged[u].x, merged[u].y, merged[u].z, merged[u].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) f(4 * i + k, x[k]);
      }
    }
  };
  if (rank == 0 && (p.S_out != nullptr || p.z_out != nullptr))
    each([&](int idx, float x) { store_state_out(p, n, h, idx, x); });
  if (gated && rank == 0 && tid == 0) store_lse_out(p, n, h, Mg, ellg);

  // The staged state, as combine_head writes it (half keeps it under 1 by a power of two).
  float unmul;
  const float mul = staged_scale<T>(vmax, p.scale, scratch, unmul);
#pragma unroll
  for (int u = 0; u < per_thread; ++u) {
    const int i = tid + u * linear_fast_threads;
    if (i < vecs) stage_state4<T, D, Dv>(sS, unsigned(i), merged[u], mul);
  }
  __syncthreads();  // the staged state and the norm weights are complete
  reader.run(warp, sS, sgamma, unmul);
  cluster_wait();  // this CTA's partial stays until every peer has read it
#else
  __trap();  // launched only on devices of compute capability 9.0 and later
#endif
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
