#pragma once
// PaTH on CUDA cores (spec/path_fox.md §1.5-1.7, §3): the per-chunk UT transform, the portable
// forward (float inputs, any head dim up to 128, unaligned views) and the prefill key cache.
//
// Chunks are C = 64 positions of one sequence (restarting at each sequence). Per (chunk, KV
// head) the preparation writes, head-major ([B, H, T, .], rows of a chunk contiguous):
//   U  = (I + stril(diag(beta) W W^T))^-1 diag(beta) W       [n, D]  H_last...H_first = I - W^T U
//   M  = (I + ...)^-1 diag(beta) stril(W K^T)                 [n, C]  (columns >= n are zero)
//   K~ = K - M^T W                                            [n, D]  keys carried to chunk end
// and, for the tensor-core forward, W rounded to half. path_prepare_kernel below computes U, M
// and K~ in float on CUDA cores, for the portable forward and the prefill key cache; the
// tensor-core forward's preparation (16-bit outputs, and W in half) is path_prepare_mma.cuh.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// The UT transform of one (chunk, KV head, sequence) = (blockIdx.x, .y, .z); 256 threads.
// Shared memory (floats): W [C][Dr+4], L [C][C+4], X [C][Dr+C+4] (= [beta W | R], solved in place
// into [U | M]; K sits in X's first Dr columns until the Gram products are done). D <= Dmax (64 or
// 128). 66 KB at D = 64: three blocks per SM.
template <class T, class KT, class TU, int Dmax>
__global__ void __launch_bounds__(256) path_prepare_kernel(const path_kernel_params p) {
  constexpr int C = path_chunk, threads = 256;
  extern __shared__ __align__(16) float smem[];
  __shared__ float sbeta[C];
  // Rows are padded to Dr = D rounded up to 4 (zeros) so that the Gram products read float4s;
  // M starts at column Dr of X. Strides of 4 (mod 32) keep the float4 reads conflict-free.
  const int D = p.a.head_dim, Dr = (D + 3) & ~3, ld = Dr + 4, ldx = Dr + C + 4, cols = Dr + C;
  constexpr int lds = C + 4;  // L's rows, 16-byte aligned for float4 reads
  const int tid = threadIdx.x;
  float* sw = smem;
  float* sl = sw + C * ld;
  float* sx = sl + C * lds;

  const int h = blockIdx.y;
  index_t batch, start, length, c0;
  int n;
  if (!p.prepare_chunk(batch, start, length, c0, n)) return;
  const index_t t0 = start + c0;

  const T* k = static_cast<const T*>(p.a.k) + batch * p.a.k_stride[0] + t0 * p.a.k_stride[1] +
               h * p.a.k_stride[2];
  const float* w = p.w + batch * p.w_stride[0] + t0 * p.w_stride[1] + h * p.w_stride[2];
  for (int idx = tid; idx < C * Dr; idx += threads) {
    const int a = idx / Dr, d = idx % Dr;
    const bool ok = a < n && d < D;
    sw[a * ld + d] = ok ? w[a * p.w_stride[1] + d] : 0.f;
    sx[a * ldx + d] = ok ? to_float(k[a * p.a.k_stride[1] + d]) : 0.f;  // K, for now
  }
  if (tid < C)
    sbeta[tid] = tid < n ? p.beta[batch * p.beta_stride[0] + (t0 + tid) * p.beta_stride[1] +
                                  h * p.beta_stride[2]]
                         : 0.f;
  __syncthreads();

  // L = stril(diag(beta) W W^T) and R = diag(beta) stril(W K^T): 4 x 4 outputs per thread.
  {
    const int ty = tid / 16, tx = tid % 16;
    float gl[4][4] = {}, gr[4][4] = {};
    for (int d = 0; d < Dr; d += 4) {
      float4 wa[4], wb[4], kb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wa[i] = *reinterpret_cast<const float4*>(sw + (ty + 16 * i) * ld + d);
        wb[i] = *reinterpret_cast<const float4*>(sw + (tx + 16 * i) * ld + d);
        kb[i] = *reinterpret_cast<const float4*>(sx + (tx + 16 * i) * ldx + d);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j <= i; ++j) {  // rows 16 i + ty > columns 16 j + tx needs j <= i
          gl[i][j] += wa[i].x * wb[j].x + wa[i].y * wb[j].y + wa[i].z * wb[j].z + wa[i].w * wb[j].w;
          gr[i][j] += wa[i].x * kb[j].x + wa[i].y * kb[j].y + wa[i].z * kb[j].z + wa[i].w * kb[j].w;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int a = ty + 16 * i, b = tx + 16 * j;
        const bool lower = a > b;
        sl[a * lds + b] = lower ? sbeta[a] * gl[i][j] : 0.f;
        sx[a * ldx + Dr + b] = lower ? sbeta[a] * gr[i][j] : 0.f;
      }
  }
  __syncthreads();  // K is no longer read: beta W takes its place
  for (int idx = tid; idx < C * Dr; idx += threads) {
    const int a = idx / Dr, d = idx % Dr;
    sx[a * ldx + d] = sbeta[a] * sw[a * ld + d];  // zero in the padding columns
  }
  __syncthreads();

  // (I + L) X = [beta W | R] by blocked forward substitution: per 16-row block, subtract what
  // the solved rows above contribute (all threads), then substitute within the block (a thread
  // per column, no synchronisation between its rows).
  for (int blk = 0; blk < C; blk += 16) {
    if (blk > 0) {  // 2 rows x 4 consecutive columns per task, 4 solved rows per step
      const int quads = cols / 4;
      for (int t = tid; t < 8 * quads; t += threads) {
        const int r = blk + 2 * (t / quads), c = 4 * (t % quads);
        float4 acc0 = make_float4(0.f, 0.f, 0.f, 0.f), acc1 = acc0;
        for (int b = 0; b < blk; b += 4) {
          const float4 l0 = *reinterpret_cast<const float4*>(sl + r * lds + b);
          const float4 l1 = *reinterpret_cast<const float4*>(sl + (r + 1) * lds + b);
          const float lr0[4] = {l0.x, l0.y, l0.z, l0.w}, lr1[4] = {l1.x, l1.y, l1.z, l1.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float4 x = *reinterpret_cast<const float4*>(sx + (b + q) * ldx + c);
            acc0.x += lr0[q] * x.x, acc0.y += lr0[q] * x.y, acc0.z += lr0[q] * x.z,
                acc0.w += lr0[q] * x.w;
            acc1.x += lr1[q] * x.x, acc1.y += lr1[q] * x.y, acc1.z += lr1[q] * x.z,
                acc1.w += lr1[q] * x.w;
          }
        }
        float4* x0 = reinterpret_cast<float4*>(sx + r * ldx + c);
        float4* x1 = reinterpret_cast<float4*>(sx + (r + 1) * ldx + c);
        x0->x -= acc0.x, x0->y -= acc0.y, x0->z -= acc0.z, x0->w -= acc0.w;
        x1->x -= acc1.x, x1->y -= acc1.y, x1->z -= acc1.z, x1->w -= acc1.w;
      }
      __syncthreads();
    }
    for (int c = tid; c < cols; c += threads)
      for (int r = blk + 1; r < blk + 16; ++r) {
        float s = 0.f;
        for (int b = blk; b < r; ++b) s += sl[r * lds + b] * sx[b * ldx + c];
        sx[r * ldx + c] -= s;
      }
    __syncthreads();
  }

  // Write U, M (all C columns), and K~ = K - M^T W.
  KT* kt = static_cast<KT*>(p.kt) + p.row(batch, h, t0) * D;
  TU* u = static_cast<TU*>(p.u) + p.row(batch, h, t0) * D;
  TU* m = static_cast<TU*>(p.m) + p.row(batch, h, t0) * C;
  for (int idx = tid; idx < n * D; idx += threads)
    u[idx] = from_float<TU>(sx[(idx / D) * ldx + idx % D]);
  // Row a of K~ is key a minus the later rows' M[r][a] w_r: keys a = 4 ty + i, elements
  // d = 4 tx + 64 jj + e of this thread (float4 reads of M's and W's rows). Elements past D
  // read other rows' (finite) data and are dropped.
  {
    constexpr int J = Dmax / 64;
    const int ty = tid / 16, tx = tid % 16;
    float acc[4][J][4] = {};
    for (int r = 4 * ty + 1; r < n; ++r) {
      const float4 mv = *reinterpret_cast<const float4*>(sx + r * ldx + Dr + 4 * ty);
      float mr[4] = {mv.x, mv.y, mv.z, mv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (r <= 4 * ty + i) mr[i] = 0.f;  // only later rows
#pragma unroll
      for (int jj = 0; jj < J; ++jj) {
        const float4 wv = *reinterpret_cast<const float4*>(sw + r * ld + 4 * tx + 64 * jj);
        const float wr[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][jj][e] += mr[i] * wr[e];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jj = 0; jj < J; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int a = 4 * ty + i, d = 4 * tx + 64 * jj + e;
          if (a < n && d < D)
            kt[a * D + d] = from_float<KT>(to_float(k[a * p.a.k_stride[1] + d]) - acc[i][jj][e]);
        }
  }
  for (int idx = tid; idx < n * C; idx += threads)
    m[idx] = from_float<TU>(sx[(idx / C) * ldx + Dr + idx % C]);
}

inline int path_prepare_smem_bytes(int D) {
  constexpr int C = path_chunk;
  const int Dr = (D + 3) & ~3;
  return static_cast<int>(sizeof(float)) * (C * (Dr + 4) + C * (C + 4) + C * (Dr + C + 4));
}

// Sum over the four threads of a row of x . y, each thread holding elements part + 4 e.
template <int E, class Y>
__device__ __forceinline__ float quad_dot(const float (&x)[E], int part, int D, const Y* y) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = part + 4 * e;
    if (d < D) s += x[e] * to_float(y[d]);
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  return s;
}

// The portable forward: one 256-thread block per (query chunk, query head, sequence); four
// threads per query row, each holding every fourth element of the row's running query r and of
// its output. Scores and the transition coefficients go through shared memory. Chunk data in
// float (the preparation's KT = TU = float). Dmax >= D, Dv.
template <class T, int Dmax>
__global__ void __launch_bounds__(256) path_forward_simt_kernel(const path_kernel_params p) {
  constexpr int C = path_chunk, E = Dmax / 4;
  __shared__ float ss[C][C + 1];  // scores (base 2) of each row against the chunk's keys
  __shared__ float sx[C][C + 1];  // r . w_b of each row (the transition coefficients)
  __shared__ float gate_col[C];
  const int tid = threadIdx.x, rl = tid / 4, part = tid % 4;
  const int hq = blockIdx.y, D = p.a.head_dim, Dv = p.a.value_dim, h = hq / p.a.group;
  index_t batch, start, length, ci, c0;
  int n;
  if (!p.query_chunk(batch, start, length, ci, c0, n)) return;
  const bool valid = rl < n;

  const float* kt = static_cast<const float*>(p.kt) + p.row(batch, h, start) * D;
  const float* u = static_cast<const float*>(p.u) + p.row(batch, h, start) * D;
  const float* mm = static_cast<const float*>(p.m) + p.row(batch, h, start + c0) * C;
  const float* w = p.w + batch * p.w_stride[0] + start * p.w_stride[1] + h * p.w_stride[2];
  const T* k = static_cast<const T*>(p.a.k) + batch * p.a.k_stride[0] + start * p.a.k_stride[1] +
               h * p.a.k_stride[2];
  const T* v = static_cast<const T*>(p.a.v) + batch * p.a.v_stride[0] + start * p.a.v_stride[1] +
               h * p.a.v_stride[2];

  float r[E], o[E] = {};
  {
    const T* q = static_cast<const T*>(p.a.q) + batch * p.a.q_stride[0] +
                 (start + c0 + rl) * p.a.q_stride[1] + hq * p.a.q_stride[2];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = part + 4 * e;
      r[e] = valid && d < D ? to_float(q[d]) : 0.f;
    }
  }
  const double* G = p.a.gate_cumsum != nullptr
                        ? p.a.gate_cumsum + (batch * p.a.tokens + start) * p.a.q_heads + hq
                        : nullptr;
  const double g_ref = G != nullptr ? G[c0 * p.a.q_heads] : 0.0;
  const float gate_row =
      G != nullptr ? p.a.gate_coef_log2 *
                         static_cast<float>(G[(c0 + (valid ? rl : 0)) * p.a.q_heads] - g_ref)
                   : 0.f;
  // Keys before the row's last hard reset have weight 0.
  const index_t lo_row =
      valid ? p.a.reset_lo((batch * p.a.tokens + start + c0 + rl) * p.a.q_heads + hq) : 0;

  float m_run = -INFINITY, l_run = 0.f;
  // Online softmax over ss[rl][0, cols) (masked entries -inf), values from token j0 on.
  auto fold = [&](index_t j0, int cols) {
    float mx = m_run;
    for (int b = 0; b < cols; ++b) mx = fmaxf(mx, ss[rl][b]);
    const float alpha = exp2f(m_run - mx);
    l_run *= alpha;
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] *= alpha;
    for (int b = 0; b < cols; ++b) {
      const float pb = exp2f(ss[rl][b] - mx);
      l_run += pb;
      const T* vb = v + (j0 + b) * p.a.v_stride[1];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = part + 4 * e;
        if (d < Dv) o[e] += pb * to_float(vb[d]);
      }
    }
    m_run = mx;
  };
  auto load_gate_col = [&](index_t j0) {
    __syncthreads();  // gate_col of the previous chunk is no longer read
    if (G != nullptr && tid < C) {
      const index_t j = j0 + tid < length ? j0 + tid : length - 1;
      gate_col[tid] = p.a.gate_coef_log2 * static_cast<float>(G[j * p.a.q_heads] - g_ref);
    }
    __syncthreads();
  };
  // r <- r - sum_b sx[rl][b] u_b over the chunk's rows starting at token j0.
  auto transition = [&](index_t j0, int rows) {
    for (int b = 0; b < rows; ++b) {
      const float xb = sx[rl][b];
      const float* ub = u + (j0 + b) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = part + 4 * e;
        if (d < D) r[e] -= xb * ub[d];
      }
    }
  };

  // The diagonal chunk: x_b = q . w_b (b <= row), scores q . k_b - sum_b' x_b' M[b'][b].
  load_gate_col(c0);
  for (int b = 0; b < n; ++b) {
    const float xb = quad_dot(r, part, D, w + (c0 + b) * p.w_stride[1]);
    if (part == 0) sx[rl][b] = b <= rl ? xb : 0.f;
  }
  __syncwarp();
  for (int b = 0; b < n; ++b) {
    float s = quad_dot(r, part, D, k + (c0 + b) * p.a.k_stride[1]);
    float corr = 0.f;
    for (int bp = part; bp <= rl && bp < n; bp += 4) corr += sx[rl][bp] * mm[bp * C + b];
    corr += __shfl_xor_sync(0xffffffffu, corr, 1);
    corr += __shfl_xor_sync(0xffffffffu, corr, 2);
    s = (s - corr) * p.a.scale_log2 + (G != nullptr ? gate_row - gate_col[b] : 0.f);
    if (part == 0) ss[rl][b] = b <= rl && c0 + b >= lo_row ? s : -INFINITY;
  }
  __syncwarp();
  fold(c0, n);
  transition(c0, n);

  // Earlier chunks, right to left: score against K~, then move r through the chunk.
  for (index_t cj = ci - 1; cj >= 0; --cj) {
    const index_t j0 = cj * C;
    load_gate_col(j0);
    for (int b = 0; b < C; ++b) {
      const float s = quad_dot(r, part, D, kt + (j0 + b) * D) * p.a.scale_log2 +
                      (G != nullptr ? gate_row - gate_col[b] : 0.f);
      if (part == 0) ss[rl][b] = j0 + b >= lo_row ? s : -INFINITY;
    }
    __syncwarp();
    fold(j0, C);
    if (cj == 0) break;
    for (int b = 0; b < C; ++b) {
      const float xb = quad_dot(r, part, D, w + (j0 + b) * p.w_stride[1]);
      if (part == 0) sx[rl][b] = xb;
    }
    __syncwarp();
    transition(j0, C);
  }

  if (!valid) return;
  const index_t i = start + c0 + rl;
  T* out = static_cast<T*>(p.a.out) + batch * p.a.out_stride[0] + i * p.a.out_stride[1] +
           hq * p.a.out_stride[2];
  const float inv = 1.f / l_run;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int d = part + 4 * e;
    if (d < Dv) out[d] = from_float<T>(o[e] * inv);
  }
  if (p.a.lse != nullptr && part == 0)
    p.a.lse[batch * p.a.lse_stride[0] + i * p.a.lse_stride[1] + hq * p.a.lse_stride[2]] =
        (m_run + log2f(l_run)) * 0.6931471805599453f;
}

// The prefill key cache, one 256-thread block per (KV head, sequence): walks the chunks from the
// last, keeping S = P_last ... P_{c+1} (D x D, float, shared memory); kappa_b = S k~_b for the
// rows of chunk c, then S <- S P_c = S - (S W_c^T) U_c. O(T D^2). Where it goes: key_cache_rows.
template <class KT, class TU, class Out>
__global__ void __launch_bounds__(256)
    path_key_cache_kernel(const path_kernel_params p, Out* out, index_t out_s0, index_t out_s1,
                          index_t out_s2, const std::int32_t* slot_of, float* recent,
                          float* transitions) {
  constexpr int C = path_chunk, threads = 256;
  extern __shared__ __align__(16) float smem[];
  const int D = p.a.head_dim, lds = D + 1, tid = threadIdx.x, h = blockIdx.x;
  float* S = smem;         // [D][D+1]
  float* Y = S + D * lds;  // [D][C+1]  S W_c^T
  index_t batch, start, length;
  p.a.sequence(blockIdx.y, batch, start, length);
  if (length == 0) return;
  for (int idx = tid; idx < D * D; idx += threads)
    S[(idx / D) * lds + idx % D] = idx / D == idx % D ? 1.f : 0.f;
  __syncthreads();
  const KT* kt = static_cast<const KT*>(p.kt) + p.row(batch, h, start) * D;
  const TU* u = static_cast<const TU*>(p.u) + p.row(batch, h, start) * D;
  const float* w = p.w + batch * p.w_stride[0] + start * p.w_stride[1] + h * p.w_stride[2];
  const key_cache_rows<Out> rows(p, out, out_s0, out_s1, out_s2, slot_of, recent, transitions, h,
                                 batch, start, length);

  for (index_t ci = (length + C - 1) / C - 1; ci >= 0; --ci) {
    const index_t j0 = ci * C;
    const int n = length - j0 < C ? static_cast<int>(length - j0) : C;
    for (int idx = tid; idx < n * D; idx += threads) {  // kappa_b[i] = sum_d S[i][d] k~_b[d]
      const int b = idx / D, i = idx % D;
      const KT* kb = kt + (j0 + b) * D;
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += S[i * lds + d] * to_float(kb[d]);
      rows.put(j0 + b, i, s);
    }
    if (ci == 0) break;
    for (int idx = tid; idx < D * n; idx += threads) {  // Y[i][b] = sum_d S[i][d] w_b[d]
      const int i = idx / n, b = idx % n;
      const float* wb = w + (j0 + b) * p.w_stride[1];
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += S[i * lds + d] * wb[d];
      Y[i * (C + 1) + b] = s;
    }
    __syncthreads();
    for (int idx = tid; idx < D * D; idx += threads) {  // S[i][d] -= sum_b Y[i][b] u_b[d]
      const int i = idx / D, d = idx % D;
      float s = 0.f;
      for (int b = 0; b < n; ++b) s += Y[i * (C + 1) + b] * to_float(u[(j0 + b) * D + d]);
      S[i * lds + d] -= s;
    }
    __syncthreads();
  }
}

// Copies each sequence's values and gate cumsum (zero without a gate) into its decoding-cache
// slot: values [slots, capacity, H, Dv], gates [slots, capacity, HQ]; keys before the sequence's
// last hard reset get G = +inf, weight 0 for every later query (the CPU cache's convention). One
// block per (token block, sequence).
template <class T, class Store>
__global__ void path_cache_fill_kernel(const path_kernel_params p, Store* values, double* gates,
                                       index_t capacity, const std::int32_t* slot_of) {
  index_t batch, start, length;
  p.a.sequence(blockIdx.y, batch, start, length);
  const index_t slot = slot_of[blockIdx.y];
  const int H = p.kv_heads, Dv = p.a.value_dim, HQ = p.a.q_heads;
  const T* v = static_cast<const T*>(p.a.v) + batch * p.a.v_stride[0] + start * p.a.v_stride[1];
  const double* G = p.a.gate_cumsum != nullptr
                        ? p.a.gate_cumsum + (batch * p.a.tokens + start) * p.a.q_heads
                        : nullptr;
  for (index_t j = blockIdx.x; j < length; j += gridDim.x) {
    for (int idx = threadIdx.x; idx < H * Dv; idx += blockDim.x)
      values[(slot * capacity + j) * H * Dv + idx] = from_float<Store>(
          to_float(v[j * p.a.v_stride[1] + (idx / Dv) * p.a.v_stride[2] + idx % Dv]));
    for (int hq = threadIdx.x; hq < HQ; hq += blockDim.x) {
      const index_t cut = p.a.reset_lo((batch * p.a.tokens + start + length - 1) * HQ + hq);
      gates[(slot * capacity + j) * HQ + hq] = G == nullptr ? 0.0
                                               : j < cut    ? static_cast<double>(INFINITY)
                                                            : G[j * p.a.q_heads + hq];
    }
  }
}

inline int path_key_cache_smem_bytes(int D) {
  return static_cast<int>(sizeof(float)) * (D * (D + 1) + D * (path_chunk + 1));
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
