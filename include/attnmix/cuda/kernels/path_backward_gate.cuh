#pragma once
// The PaTH-FoX backward's gate kernels, shared by every query-kernel set (path_backward_tiled.cuh,
// sm80_path_backward.cuh): before the query kernel, the gate cumsum G in double and each token's
// last hard reset; after the chunk kernel, the slices' dG summed in slice order and taken back
// to dg by a reverse cumsum (0 at hard resets). A warp per (sequence, query head), 32 tokens a
// step, in double.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- the gate cumsum with hard resets ------------------------------------------------------
// Lane i's inclusive segmented sum over lanes 0 .. i (v, with `reset` starting a segment at its
// lane) and whether lanes 0 .. i hold a reset.
__device__ __forceinline__ double warp_segmented_sum(double v, bool& reset) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const double up = __shfl_up_sync(0xffffffffu, v, off);
    const bool up_reset = __shfl_up_sync(0xffffffffu, int(reset), off) != 0;
    if (lane >= off) {
      if (!reset) v += up;
      reset = reset || up_reset;
    }
  }
  return v;
}

// A warp per (sequence, query head), 32 tokens a step: a segmented inclusive scan over the lanes
// (a hard reset starts a segment) plus the sum carried from the steps before, in double.
__global__ void __launch_bounds__(32 * path_gate_warps)
    path_backward_gate_kernel(const float* g, index_t g_s0, index_t g_s1, index_t g_s2,
                              const attention_kernel_params a, double* G, std::int32_t* reset) {
  const int lane = threadIdx.x % 32;
  const int hq = blockIdx.x * path_gate_warps + threadIdx.x / 32;
  if (hq >= a.q_heads) return;  // whole warps
  index_t batch, start, length;
  a.sequence(blockIdx.y, batch, start, length);
  double carry = 0;
  std::int32_t last = 0;
  for (index_t t0 = 0; t0 < length; t0 += 32) {
    const index_t t = t0 + lane;
    const double x =
        t < length ? static_cast<double>(g[batch * g_s0 + (start + t) * g_s1 + hq * g_s2]) : 0.0;
    bool hard = t < length && isinf(x) && x < 0;
    std::int32_t at_reset = hard ? static_cast<std::int32_t>(t) : -1;
#pragma unroll
    for (int off = 1; off < 32; off *= 2)
      at_reset = max(at_reset, __shfl_up_sync(0xffffffffu, at_reset, off));
    const double sum = warp_segmented_sum(hard ? 0.0 : x, hard);
    const double total = hard ? sum : carry + sum;
    const std::int32_t latest = max(last, at_reset);
    if (t < length) {
      const index_t at = (batch * a.tokens + start + t) * a.q_heads + hq;
      G[at] = total;
      reset[at] = latest;
    }
    carry = __shfl_sync(0xffffffffu, total, 31);
    last = __shfl_sync(0xffffffffu, latest, 31);
  }
}

// ---- dg = reverse cumsum of dG ------------------------------------------------------------
// A warp per (sequence, query head), 32 tokens a step from the end, as the gate kernel.
__global__ void __launch_bounds__(32 * path_gate_warps)
    path_backward_dg_kernel(const float* g, index_t g_s0, index_t g_s1, index_t g_s2,
                            const attention_kernel_params a, const double* dgate,
                            index_t slice_gate, int slices, float* dg, index_t dg_s0, index_t dg_s1,
                            index_t dg_s2) {
  const int lane = threadIdx.x % 32;
  const int hq = blockIdx.x * path_gate_warps + threadIdx.x / 32;
  if (hq >= a.q_heads) return;  // whole warps
  index_t batch, start, length;
  a.sequence(blockIdx.y, batch, start, length);
  double carry = 0;
  for (index_t top = length - 1; top >= 0; top -= 32) {
    const index_t t = top - lane;  // lanes walk the tokens backwards
    bool hard = false;
    double d = 0;
    if (t >= 0) {
      const double x = static_cast<double>(g[batch * g_s0 + (start + t) * g_s1 + hq * g_s2]);
      hard = isinf(x) && x < 0;
      const index_t at = (batch * a.tokens + start + t) * a.q_heads + hq;
      if (!hard)
        for (int s = 0; s < slices; ++s) d += dgate[s * slice_gate + at];
    }
    const bool own = hard;
    const double sum = warp_segmented_sum(d, hard);
    const double total = hard ? sum : carry + sum;
    if (t >= 0) dg[batch * dg_s0 + (start + t) * dg_s1 + hq * dg_s2] = own ? 0.f : float(total);
    carry = __shfl_sync(0xffffffffu, total, 31);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
