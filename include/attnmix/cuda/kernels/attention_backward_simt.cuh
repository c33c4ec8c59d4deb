#pragma once
// The softmax-family backward on CUDA cores (FlashAttention-2's split, deterministic):
//   attention_backward_delta_kernel  delta_i = dout_i . out_i, a warp a (row, query head)
//   attention_backward_dkdv_kernel   a CTA a (key tile, KV head, sequence): recomputes
//                                    P = exp(z - lse) for the group's query heads and the rows
//                                    that see its keys, dv = sum P^T dout, dk = scale sum dS^T q,
//                                    and with a gate the column sums of dS per query head
//   attention_backward_dq_kernel     a CTA a (query tile, query head, sequence): dq = scale dS k
//                                    over the keys its rows see, and with a gate dS's row sums
// with dS = P (dout . v - delta). Tiles of q, dout, k, v, P and dS are staged in shared memory
// as float; each thread owns fixed entries of the accumulators and sums in a fixed order, so
// the result has the same bits on every run. The gate kernels (FoX) are below.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/backward_tiles.cuh"
#include "attnmix/cuda/kernels/attention_backward_params.cuh"
#include "attnmix/cuda/kernels/attention_backward_shapes.hpp"
#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- per-row kernels: delta, and dq from the fused kernel's sums ----------------------------

// The (token, query head) a warp of the per-row kernels owns on the preprocess grid: token i of
// sequence blockIdx.z, query head blockIdx.y; `ok` false past the sequence's end.
struct backward_warp_row {
  int lane, hq;
  index_t batch, start, i;
  bool ok;
  __device__ explicit backward_warp_row(const attention_backward_params& p)
      : lane(int(threadIdx.x) % 32), hq(blockIdx.y) {
    index_t length;
    p.f.sequence(blockIdx.z, batch, start, length);
    i = static_cast<index_t>(blockIdx.x) * attention_backward_preprocess_rows + threadIdx.x / 32;
    ok = i < length;
  }
  // Element 0 of the row in a [B, T, H, .] tensor of strides s.
  template <class T>
  __device__ T* in(T* base, const index_t (&s)[3]) const {
    return base + batch * s[0] + (start + i) * s[1] + hq * s[2];
  }
};

template <class T>
__global__ void __launch_bounds__(attention_backward_threads)
    attention_backward_delta_kernel(const attention_backward_params p) {
  const backward_warp_row w(p);
  if (!w.ok) return;
  const T* o = w.in(static_cast<const T*>(p.f.out), p.f.out_stride);
  const T* d = w.in(static_cast<const T*>(p.dout), p.dout_stride);
  float s = 0.f;
  for (int c = w.lane; c < p.f.value_dim; c += 32) s += to_float(o[c]) * to_float(d[c]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (w.lane == 0) p.delta[p.at(w.batch, w.start, w.i, w.hq)] = s;
}

// dq = scale * the float sums of the fused dk/dv kernel (p.dq_acc).
template <class T>
__global__ void __launch_bounds__(attention_backward_threads)
    attention_backward_dq_convert_kernel(const attention_backward_params p) {
  const backward_warp_row w(p);
  if (!w.ok) return;
  const float* acc = p.dq_acc + p.dq_at(w.batch, w.start, w.i, w.hq) * p.f.head_dim;
  T* dq = w.in(static_cast<T*>(p.dq), p.dq_stride);
  for (int c = w.lane; c < p.f.head_dim; c += 32) dq[c] = from_float<T>(acc[c] * p.scale);
}

// ---- dk, dv --------------------------------------------------------------------------------

// D, Dv <= 32 * Chunks. Warp w owns the keys w + 8 m of the tile, lane l their elements
// l + 32 k, of dk and dv: per row it reads P and dS of its keys (broadcasts) and the row's q and
// dout elements once each.
template <class T, int Chunks>
__global__ void __launch_bounds__(attention_backward_threads)
    attention_backward_dkdv_kernel(const attention_backward_params p) {
  constexpr int B = attention_backward_tile(Chunks), warps = attention_backward_threads / 32;
  constexpr int RM = B / warps;
  static_assert(RM * warps == B, "whole keys a warp");
  extern __shared__ __align__(16) unsigned char backward_smem[];
  const int D = p.f.head_dim, Dv = p.f.value_dim, group = p.f.group;
  const backward_tiles<B> t(backward_smem, D, Dv);
  const int h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, w = tid / 32;
  index_t batch, start, length, kbatch, kstart, keys;
  p.f.sequence(blockIdx.z, batch, start, length);
  p.f.key_sequence(blockIdx.z, kbatch, kstart, keys);
  const index_t j0 = static_cast<index_t>(blockIdx.x) * B;
  if (j0 >= keys) return;
  const int cols = keys - j0 < B ? static_cast<int>(keys - j0) : B;

  // The query rows [lo, hi) that see some key of the tile (row i at key position i + off).
  const index_t W = p.f.window, j1 = j0 + cols, off = keys - length;
  index_t lo = p.f.causal ? j0 - off : (W > 0 ? j0 - W + 1 - off : 0);
  lo = lo > 0 ? lo : 0;
  index_t hi = W > 0 ? (j1 + W - 1 - off < length ? j1 + W - 1 - off : length) : length;
  hi = hi > lo ? hi : lo;

  load_keys<T>(p, t, kbatch, kstart, j0, cols, h);
  float dk[RM][Chunks], dv[RM][Chunks];
#pragma unroll
  for (int m = 0; m < RM; ++m)
#pragma unroll
    for (int k = 0; k < Chunks; ++k) dk[m][k] = 0.f, dv[m][k] = 0.f;

  for (int g = 0; g < group; ++g) {
    const int hq = h * group + g;
    load_key_gates(p, t, kbatch, kstart, j0, cols, hq);
    float colsum = 0.f;  // of key tid (tid < B)
    for (index_t i0 = lo; i0 < hi; i0 += B) {
      const int rows = hi - i0 < B ? static_cast<int>(hi - i0) : B;
      load_query_rows<T>(p, t, batch, start, i0, rows, hq);
      __syncthreads();
      scores_to_ds(p, t, length, keys, i0, rows, j0, cols);
      __syncthreads();
      for (int r = 0; r < rows; ++r) {
        float pr[RM], dsr[RM];
#pragma unroll
        for (int m = 0; m < RM; ++m)
          pr[m] = t.p[r * t.ps + w + warps * m], dsr[m] = t.ds[r * t.ps + w + warps * m];
#pragma unroll
        for (int k = 0; k < Chunks; ++k) {
          const int col = lane + 32 * k;
          if (col < Dv) {
            const float x = t.dout[r * t.vs + col];
#pragma unroll
            for (int m = 0; m < RM; ++m) dv[m][k] += pr[m] * x;
          }
          if (col < D) {
            const float x = t.q[r * t.qs + col];
#pragma unroll
            for (int m = 0; m < RM; ++m) dk[m][k] += dsr[m] * x;
          }
        }
      }
      if (tid < B)
        for (int r = 0; r < rows; ++r) colsum += t.ds[r * t.ps + tid];
      __syncthreads();  // before the next rows (and the next head's key gates) overwrite tiles
    }
    if (p.gated() && tid < cols) p.colsum[p.at(kbatch, kstart, j0 + tid, hq)] = colsum;
    __syncthreads();
  }

  T* dk_out = static_cast<T*>(p.dk) + kbatch * p.dk_stride[0] + (kstart + j0) * p.dk_stride[1] +
              h * p.dk_stride[2];
  T* dv_out = static_cast<T*>(p.dv) + kbatch * p.dv_stride[0] + (kstart + j0) * p.dv_stride[1] +
              h * p.dv_stride[2];
#pragma unroll
  for (int m = 0; m < RM; ++m) {
    const int c = w + warps * m;
    if (c >= cols) continue;
#pragma unroll
    for (int k = 0; k < Chunks; ++k) {
      const int col = lane + 32 * k;
      if (col < D) dk_out[c * p.dk_stride[1] + col] = from_float<T>(dk[m][k] * p.scale);
      if (col < Dv) dv_out[c * p.dv_stride[1] + col] = from_float<T>(dv[m][k]);
    }
  }
}

// ---- dq ------------------------------------------------------------------------------------

// Warp w owns the rows w + 8 m of the tile, lane l their elements l + 32 k, of dq.
template <class T, int Chunks>
__global__ void __launch_bounds__(attention_backward_threads)
    attention_backward_dq_kernel(const attention_backward_params p) {
  constexpr int B = attention_backward_tile(Chunks), warps = attention_backward_threads / 32;
  constexpr int RM = B / warps;
  static_assert(RM * warps == B, "whole rows a warp");
  extern __shared__ __align__(16) unsigned char backward_smem[];
  const int D = p.f.head_dim, Dv = p.f.value_dim;
  const backward_tiles<B> t(backward_smem, D, Dv);
  const int hq = blockIdx.y, h = hq / p.f.group, tid = threadIdx.x, lane = tid % 32, w = tid / 32;
  index_t batch, start, length, kbatch, kstart, keys;
  p.f.sequence(blockIdx.z, batch, start, length);
  const index_t i0 = static_cast<index_t>(blockIdx.x) * B;
  if (i0 >= length) return;
  p.f.key_sequence(blockIdx.z, kbatch, kstart, keys);
  const int rows = length - i0 < B ? static_cast<int>(length - i0) : B;

  // Keys [j_lo, j_hi] that some row of the tile sees; a row's last reset only moves forward.
  index_t j_lo, j_hi, unused;
  p.f.key_range(i0, length, keys, j_lo, unused);
  p.f.key_range(i0 + rows - 1, length, keys, unused, j_hi);
  if (p.gated()) {
    const index_t r = p.reset[p.at(batch, start, i0, hq)];
    j_lo = r > j_lo ? r : j_lo;
  }

  load_query_rows<T>(p, t, batch, start, i0, rows, hq);
  float dq[RM][Chunks];
#pragma unroll
  for (int m = 0; m < RM; ++m)
#pragma unroll
    for (int k = 0; k < Chunks; ++k) dq[m][k] = 0.f;
  float rowsum = 0.f;  // of row tid (tid < B)

  for (index_t j0 = j_lo; j0 <= j_hi; j0 += B) {
    const int cols = j_hi + 1 - j0 < B ? static_cast<int>(j_hi + 1 - j0) : B;
    load_keys<T>(p, t, kbatch, kstart, j0, cols, h);
    load_key_gates(p, t, kbatch, kstart, j0, cols, hq);
    __syncthreads();
    scores_to_ds(p, t, length, keys, i0, rows, j0, cols);
    __syncthreads();
    for (int c = 0; c < cols; ++c) {
      float dsr[RM];
#pragma unroll
      for (int m = 0; m < RM; ++m) dsr[m] = t.ds[(w + warps * m) * t.ps + c];
#pragma unroll
      for (int k = 0; k < Chunks; ++k) {
        const int col = lane + 32 * k;
        if (col < D) {
          const float x = t.k[c * t.qs + col];
#pragma unroll
          for (int m = 0; m < RM; ++m) dq[m][k] += dsr[m] * x;
        }
      }
    }
    if (tid < B)
      for (int c = 0; c < cols; ++c) rowsum += t.ds[tid * t.ps + c];
    __syncthreads();  // before the next keys overwrite the tiles
  }

  T* dq_out = static_cast<T*>(p.dq) + batch * p.dq_stride[0] + (start + i0) * p.dq_stride[1] +
              hq * p.dq_stride[2];
#pragma unroll
  for (int m = 0; m < RM; ++m) {
    const int r = w + warps * m;
    if (r >= rows) continue;
#pragma unroll
    for (int k = 0; k < Chunks; ++k) {
      const int col = lane + 32 * k;
      if (col < D) dq_out[r * p.dq_stride[1] + col] = from_float<T>(dq[m][k] * p.scale);
    }
  }
  if (p.gated() && tid < rows) p.rowsum[p.at(batch, start, i0 + tid, hq)] = rowsum;
}

// ---- the gate (FoX) ------------------------------------------------------------------------
// Both gate kernels run a CTA per (32 query heads, sequence) over the sequence in parts of
// attention_backward_threads tokens: a warp takes 32 tokens with the heads across its lanes (g
// is [B, T, HQ], heads innermost), a thread scans its 32 tokens in double, and the warps' sums
// are combined in a fixed order through shared memory, with the carry of the parts before.
// A log gate of -inf is a hard reset: the sum restarts there (as on the CPU, cpu/fox.hpp).

// G (inclusive cumsum of g, 0 at a reset) and the position of the last reset at or before t.
// (Threads: attention_backward_threads; a template so that the header defines no kernel symbol
// of its own in every translation unit.)
template <int Threads>
__global__ void __launch_bounds__(Threads)
    attention_backward_gate_cumsum_kernel(const attention_backward_params p) {
  constexpr int warps = Threads / 32;
  __shared__ double part_sum[warps][32];
  __shared__ int part_reset[warps][32];  // last reset of the warp's tokens, -1 when none
  __shared__ double carry_sum[32];
  __shared__ int carry_reset[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, hq = blockIdx.x * 32 + lane;
  const bool head = hq < p.f.q_heads;
  index_t batch, start, length;
  p.f.sequence(blockIdx.y, batch, start, length);
  if (warp == 0) carry_sum[lane] = 0.0, carry_reset[lane] = 0;
  const float* g =
      p.g + batch * p.g_stride[0] + start * p.g_stride[1] + (head ? hq : 0) * p.g_stride[2];
  for (index_t part = 0; part < length; part += Threads) {
    const index_t t0 = part + warp * 32;
    float x[32];
    double sum = 0;
    int last = -1;
#pragma unroll
    for (int u = 0; u < 32; ++u) {
      x[u] = head && t0 + u < length ? g[(t0 + u) * p.g_stride[1]] : 0.f;
      if (x[u] == -INFINITY) {
        sum = 0, last = static_cast<int>(t0) + u;
      } else {
        sum += static_cast<double>(x[u]);
      }
    }
    part_sum[warp][lane] = sum, part_reset[warp][lane] = last;
    __syncthreads();
    double running = carry_sum[lane];
    int reset = carry_reset[lane];
    for (int w = 0; w < warp; ++w) {
      if (part_reset[w][lane] >= 0) {
        running = part_sum[w][lane], reset = part_reset[w][lane];
      } else {
        running += part_sum[w][lane];
      }
    }
#pragma unroll
    for (int u = 0; u < 32; ++u) {
      const index_t tok = t0 + u;
      if (x[u] == -INFINITY) {
        running = 0, reset = static_cast<int>(tok);
      } else {
        running += static_cast<double>(x[u]);
      }
      if (head && tok < length) {
        const index_t a = p.at(batch, start, tok, hq);
        p.G[a] = running;
        p.reset[a] = reset;
      }
    }
    __syncthreads();  // every warp has read the carry and the part sums
    if (warp == warps - 1) carry_sum[lane] = running, carry_reset[lane] = reset;
  }
}

// dg_t = sum of dG_i over the tokens i >= t of t's reset segment, dG_i = coef (rowsum_i -
// colsum_i); 0 at a reset, whose keys' weights do not depend on it. Parts from the last.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    attention_backward_gate_grad_kernel(const attention_backward_params p) {
  constexpr int warps = Threads / 32;
  __shared__ double part_sum[warps][32];  // sum of the warp's tokens before its first reset
  __shared__ bool part_reset[warps][32];
  __shared__ double carry[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, hq = blockIdx.x * 32 + lane;
  const bool head = hq < p.f.q_heads;
  index_t batch, start, length;
  p.f.sequence(blockIdx.y, batch, start, length);
  if (warp == 0) carry[lane] = 0.0;
  const float* g =
      p.g + batch * p.g_stride[0] + start * p.g_stride[1] + (head ? hq : 0) * p.g_stride[2];
  float* dg =
      p.dg + batch * p.dg_stride[0] + start * p.dg_stride[1] + (head ? hq : 0) * p.dg_stride[2];
  const index_t parts = (length + Threads - 1) / Threads;
  for (index_t part = parts - 1; part >= 0; --part) {
    const index_t t0 = part * Threads + warp * 32;
    double dG[32];
    bool cut[32];
    double sum = 0;
    bool any = false;
#pragma unroll
    for (int u = 31; u >= 0; --u) {
      const index_t tok = t0 + u;
      const bool in = head && tok < length;
      cut[u] = in && g[tok * p.g_stride[1]] == -INFINITY;
      if (in) {
        const index_t a = p.at(batch, start, tok, hq);
        dG[u] = p.gate_coef * (static_cast<double>(p.rowsum[a]) - static_cast<double>(p.colsum[a]));
      } else {
        dG[u] = 0.0;
      }
      if (cut[u]) {
        sum = 0, any = true;
      } else {
        sum += dG[u];
      }
    }
    part_sum[warp][lane] = sum, part_reset[warp][lane] = any;
    __syncthreads();
    double running = carry[lane];
    for (int w = warps - 1; w > warp; --w)
      running = part_reset[w][lane] ? part_sum[w][lane] : running + part_sum[w][lane];
#pragma unroll
    for (int u = 31; u >= 0; --u) {
      const index_t tok = t0 + u;
      if (cut[u]) {
        running = 0;
      } else {
        running += dG[u];
      }
      if (head && tok < length) dg[tok * p.dg_stride[1]] = static_cast<float>(running);
    }
    __syncthreads();  // every warp has read the carry and the part sums
    if (warp == 0) carry[lane] = running;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
