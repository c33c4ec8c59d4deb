#pragma once
// The softmax-family backward on tensor cores, FlashAttention-2's kernels, a body for both
// instruction sets: Products = sm80_backward_products (mma.sync m16n8k16, sm_80 and later) or
// sm90_backward_products (wgmma, sm_90a), collective/backward_products.cuh. Half and bfloat16,
// D = Dv in {64, 128}, rows of q, k, v and dout 16-byte aligned. The delta and gate kernels are
// attention_backward_simt.cuh's.
//
//   dk/dv: a CTA of 4 warps owns 64 keys of one KV head (a warp 16 of them), with K and V in
//          shared memory and dK, dV in registers (float) over every query tile of every query
//          head of the group. Query tiles of Br = Products::stream rows (q, dout and the rows'
//          lse, delta and visible keys) stream through two buffers with cp.async. The CTA
//          computes S^T = K Q^T and dP^T = V dO^T for its keys (64 x Br), P^T and
//          dS^T = P^T (dP^T - delta) in place, and dV += P^T dO, dK += dS^T Q with P and dS
//          taken from the accumulators as 16-bit operands (as the forward does with P).
//   dq:    a CTA of 4 warps owns 64 query rows (a warp 16) with q and dout in shared memory, and
//          streams key tiles of Bc = Products::stream keys (k, v) through two buffers:
//          S = Q K^T, dP = dO V^T, dS, dQ += dS K.
// Masks (window, causal, hard resets, the tiles' tails) are applied per element from each row's
// first and last visible key. Every sum runs in a fixed order: the same bits on every run.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/wgmma.cuh"
#include "attnmix/cuda/collective/backward_products.cuh"
#include "attnmix/cuda/kernels/attention_backward_params.cuh"
#include "attnmix/cuda/kernels/attention_backward_shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr float backward_log2e = 1.4426950408889634f;

// ---- dk, dv --------------------------------------------------------------------------------

// Dynamic shared memory aligned as Products' tile layout needs (the plan adds the slack).
template <class Products>
__device__ __forceinline__ unsigned char* backward_smem_base(unsigned char* raw) {
  constexpr int A = Products::align;
  return raw + ((A - smem_address(raw) % A) % A);
}

// Fused (wgmma only): the kernel also takes each row tile's dQ = dS K and adds it to p.dq_acc
// (the tile through shared memory, one bulk reduce-add that one thread issues, as
// FlashAttention-3 does; FoX's row sums of dS to p.rowsum with red.add) in the order of the key
// blocks, so that no dq kernel recomputes S and dP: the row tiles are aligned to Br rows, and key
// block j adds to a tile once the blocks before it (those whose rows reach the tile) have: its
// turn, p.dq_turn, counts them.
// Blocks are launched in blockIdx.x order and take their key blocks in turn order (descending
// when causal, below), so a block waits only on blocks that run or have run.
template <class Products, class T, int D, bool Fused = false>
__global__ void __launch_bounds__(attention_backward_v2_threads,
                                  Fused ? 2 : attention_backward_v2_min_blocks(D))
    attention_backward_dkdv_mma_kernel(const attention_backward_params p) {
  constexpr int Bc = attention_backward_v2_fixed, Br = Products::stream;
  constexpr int NT = attention_backward_v2_threads;
  static_assert(Bc == 16 * (NT / 32), "16 keys a warp");
  static_assert(!Fused || Br == Bc, "fused: square tiles");
  extern __shared__ __align__(128) unsigned char v2_smem[];
  T* sk = reinterpret_cast<T*>(backward_smem_base<Products>(v2_smem));  // [Bc][D]
  T* sv = sk + Bc * D;                                                  // [Bc][D]
  T* sq = sv + Bc * D;                                                  // [2][Br][D]
  T* sd = sq + 2 * Br * D;                                              // [2][Br][D] dout
  T* s_ds = sd + 2 * Br * D;  // fused: dS^T [Bc][Br], the A operand of dQ
  // fused: dQ of the tile [Br][D], the source of its bulk add
  float* s_dq = reinterpret_cast<float*>(s_ds + (Fused ? Bc * Br : 0));
  // The streamed rows' G (gate cumsum), lse, delta and last reset, and the keys' G, as read.
  // The streamed rows' lse becomes their term gi, the keys' G their term gj (below), once a tile
  // by the thread that copied it.
  double* s_gi = reinterpret_cast<double*>(s_dq + (Fused ? Br * D : 0));  // [2][Br]
  double* s_gj = s_gi + 2 * Br;                                           // [2][Bc]
  float* s_lse = reinterpret_cast<float*>(s_gj + 2 * Bc);                 // [2][Br]
  float* s_delta = s_lse + 2 * Br;                                        // [2][Br]
  int* s_reset = reinterpret_cast<int*>(s_delta + 2 * Br);                // [2][Br]
  float* s_gjf = reinterpret_cast<float*>(s_reset + 2 * Br);              // [2][Bc]
  float* s_rs = s_gjf + 2 * Bc;  // fused, FoX: each warp's row sums of dS [4][Br]

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c2 = 2 * (lane % 4);
  const int h = blockIdx.y, group = p.f.group;
  index_t batch, start, length;
  p.f.sequence(blockIdx.z, batch, start, length);
  // Fused and causal: key blocks in descending order (blockIdx.x 0 takes the last), the order
  // of their turns, so that a block waits only on blocks launched before it, and, each walking
  // its row tiles up from its own, never waits on one (the block after it reaches a tile a step
  // after it does).
  const index_t blocks = (length + Bc - 1) / Bc;
  const bool descending = Fused && p.f.causal;
  const index_t jb = descending ? blocks - 1 - index_t(blockIdx.x) : index_t(blockIdx.x);
  if (jb < 0 || jb >= blocks) return;
  const index_t j0 = jb * Bc;
  const int cols = length - j0 < Bc ? static_cast<int>(length - j0) : Bc;

  // The query rows [lo, hi) that see some key of the tile (as attention_backward_dkdv_kernel).
  const index_t W = p.f.window;
  const index_t first_row = backward_first_row(j0, W, p.f.causal);
  const index_t lo = Fused ? first_row / Br * Br : first_row;
  const index_t hi = backward_end_row(j0 + cols, W, length);
  const int row_tiles = static_cast<int>((hi - lo + Br - 1) / Br);
  const int items = group * row_tiles;  // (query head of the group, row tile), heads outer
  const bool gated = p.gated();
  const float scale_log2 = p.scale * backward_log2e;

  const T* kg = static_cast<const T*>(p.f.k) + batch * p.f.k_stride[0] +
                (start + j0) * p.f.k_stride[1] + h * p.f.k_stride[2];
  const T* vg = static_cast<const T*>(p.f.v) + batch * p.f.v_stride[0] +
                (start + j0) * p.f.v_stride[1] + h * p.f.v_stride[2];
  Products::template load<Bc, D>(sk, kg, p.f.k_stride[1], cols);
  Products::template load<Bc, D>(sv, vg, p.f.v_stride[1], cols);
  cp_async_commit();

  // The logits less lse in base 2 are s scale log2 e + gi - gj: without a gate gi = -lse_i log2 e
  // and gj = 0; with one gi = (coef G_i - ref - lse_i) log2 e of the rows and gj = (coef G_j -
  // ref) log2 e of the keys, formed in double and rounded once to float, ref = coef G_j0 of the
  // query head: the floats stay small wherever P is not negligible (as the forward's g_ref).
  // An item's ref is read when its copies are issued and used a step later.
  double ref_next = 0.0;
  auto load_item = [&](int t, int buf) {
    const int hq = h * group + t / row_tiles;
    if (gated) ref_next = p.gate_coef * p.G[p.at(batch, start, j0, hq)];
    const index_t i0 = lo + static_cast<index_t>(t % row_tiles) * Br;
    const index_t rows = hi - i0 < Br ? hi - i0 : index_t{Br};
    const T* qg = static_cast<const T*>(p.f.q) + batch * p.f.q_stride[0] +
                  (start + i0) * p.f.q_stride[1] + hq * p.f.q_stride[2];
    const T* dg = static_cast<const T*>(p.dout) + batch * p.dout_stride[0] +
                  (start + i0) * p.dout_stride[1] + hq * p.dout_stride[2];
    Products::template load<Br, D>(sq + buf * Br * D, qg, p.f.q_stride[1], rows);
    Products::template load<Br, D>(sd + buf * Br * D, dg, p.dout_stride[1], rows);
    if (threadIdx.x < Br) {  // rows past `rows` read as 0 (and are masked)
      const int r = threadIdx.x, b = buf * Br + r;
      const bool ok = r < rows;
      const index_t i = i0 + (ok ? r : 0), a = p.at(batch, start, i, hq);
      cp_async_4(
          s_lse + b,
          p.lse + batch * p.lse_stride[0] + (start + i) * p.lse_stride[1] + hq * p.lse_stride[2],
          ok);
      cp_async_4(s_delta + b, p.delta + a, ok);
      if (gated) {
        cp_async_8(s_gi + b, p.G + a, ok);
        cp_async_4(s_reset + b, p.reset + a, ok);
      }
    }
    if (gated && threadIdx.x < Bc) {  // keys past `cols` read as 0 (and are masked)
      const int key = threadIdx.x;
      const bool ok = key < cols;
      cp_async_8(s_gj + buf * Bc + key, p.G + p.at(batch, start, j0 + (ok ? key : 0), hq), ok);
    }
  };
  load_item(0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = 0.f, dv[n][e] = 0.f;
  // This thread's keys: 16 warp + g + 8 h (h = 0, 1), sequence-local j0 + that.
  const int key0 = 16 * warp + g;
  float colsum[2] = {0.f, 0.f};
  // Fused: the turn this block holds, passed on a tile later, once its adds are visible.
  int* held = nullptr;
  int held_rank = 0;

  for (int t = 0; t < items; ++t) {
    const int buf = t % 2;
    const double ref = ref_next;
    if (t + 1 < items) load_item(t + 1, buf ^ 1);
    cp_async_commit();
    const int hq = h * group + t / row_tiles;
    cp_async_wait<1>();
    Products::ready();
    if (int(threadIdx.x) < Br) {  // the row this thread copied: its term
      const int b = buf * Br + threadIdx.x;
      const float lse = s_lse[b];
      s_lse[b] = gated
                     ? static_cast<float>((p.gate_coef * s_gi[b] - ref - static_cast<double>(lse)) *
                                          1.4426950408889634)
                     : -lse * backward_log2e;
    }
    if (gated && int(threadIdx.x) < Bc) {  // the key this thread copied: its term
      const int b = buf * Bc + threadIdx.x;
      s_gjf[b] = static_cast<float>((p.gate_coef * s_gj[b] - ref) * 1.4426950408889634);
    }
    // Whether a row of the tile restarts (a hard reset) past the CTA's first key: each thread reads
    // the reset of the row whose terms it copied (its own copies are complete).
    const bool restarts = gated && int(threadIdx.x) < Br && s_reset[buf * Br + threadIdx.x] > j0;
    const bool any_restart = __syncthreads_or(restarts);
    const T* sqb = sq + buf * Br * D;
    const T* sdb = sd + buf * Br * D;
    const index_t i0 = lo + static_cast<index_t>(t % row_tiles) * Br;
    const int rows = hi - i0 < Br ? static_cast<int>(hi - i0) : Br;
    float gj[2] = {0.f, 0.f};
    if (gated) gj[0] = s_gjf[buf * Bc + key0], gj[1] = s_gjf[buf * Bc + key0 + 8];

    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys and the tile's Br rows.
    float s[Br / 8][4], dp[Br / 8][4];
    Products::template scores<T, D, Br>(s, dp, sk, sqb, sv, sdb);

    // A row's visible keys [first_key, last_key] as key_range gives them, the first raised to its
    // last reset. (A window of the sequence's length or more sees what no window sees: clamped
    // to it.) Both bounds grow with the row, so every row of the tile sees every key of the CTA
    // when the last row's first key and the first row's last key enclose them: then no mask.
    const int len = static_cast<int>(length);
    const int W = p.f.window < length ? static_cast<int>(p.f.window) : len;
    const auto first_key = [&](int i) {
      return W > 0 ? (i - W + 1 > 0 ? i - W + 1 : 0) : 0;
    };
    const auto last_key = [&](int i) {
      return p.f.causal ? i : (W > 0 && i + W - 1 < len - 1 ? i + W - 1 : len - 1);
    };
    const bool interior = rows == Br && cols == Bc && !any_restart &&
                          first_key(static_cast<int>(i0) + Br - 1) <= static_cast<int>(j0) &&
                          last_key(static_cast<int>(i0)) >= static_cast<int>(j0) + Bc - 1;

    // P^T in place of S^T, element (key key0 + 8 (e / 2), row 8 n + c2 + e % 2), then
    // dS^T = P^T (dP^T - delta) in place of dP^T; where Products overlap, P's exponentials run
    // while dP^T is on the tensor cores, and dS while dV += P^T dO is.
    const auto to_p = [&](auto masked) {
#pragma unroll
      for (int n = 0; n < Br / 8; ++n) {
        const int rb = buf * Br + 8 * n + c2;
        const float2 gi2 = *reinterpret_cast<const float2*>(s_lse + rb);  // the rows' terms
        const float gi[2] = {gi2.x, gi2.y};
        int klo[2] = {0, 0}, khi[2] = {0, 0};
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          const int r = 8 * n + c2 + odd, i = static_cast<int>(i0) + r;
          if constexpr (decltype(masked)::value) {
            klo[odd] = first_key(i), khi[odd] = last_key(i);
            if (gated) klo[odd] = max(klo[odd], s_reset[rb + odd]);
            if (r >= rows) klo[odd] = 1, khi[odd] = 0;  // no key visible: P = 0
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e / 2, odd = e % 2;
          float P = fast_exp2(fmaf(s[n][e], scale_log2, gi[odd] - gj[hh]));
          if constexpr (decltype(masked)::value) {
            const int j = static_cast<int>(j0) + key0 + 8 * hh;
            const bool seen = key0 + 8 * hh < cols && j >= klo[odd] && j <= khi[odd];
            P = seen ? P : 0.f;
          }
          s[n][e] = P;
        }
      }
    };
    if (interior)
      to_p(std::false_type{});
    else
      to_p(std::true_type{});
    constexpr bool overlap = Products::overlap(D);
    std::uint32_t fp[Br / 16][4], fds[Br / 16][4];
    if constexpr (overlap) {
      Products::template grad<T, Br, D>(dv, s, sdb, fp);  // dV += P^T dO
      Products::template wait_scores<1>(dp);
    }
#pragma unroll
    for (int n = 0; n < Br / 8; ++n) {
      const float2 delta2 = *reinterpret_cast<const float2*>(s_delta + buf * Br + 8 * n + c2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float ds = s[n][e] * (dp[n][e] - (e % 2 ? delta2.y : delta2.x));
        dp[n][e] = ds;
        if (gated) colsum[e / 2] += ds;
      }
    }
    // dK += dS^T Q (the rows past the tile's are 0 in P and dS).
    if constexpr (overlap) {
      Products::template grad<T, Br, D>(dk, dp, sqb, fds);
      Products::done(dv, dk, fp, fds);
    } else {
      Products::template grads<T, Br, D>(dv, s, sdb, dk, dp, sqb);
    }

    if constexpr (Fused) {
      // dQ of the tile's rows, dS K (dS^T through shared memory as the transposed A).
      Products::template store_tile<T, Br>(s_ds, dp);
      if (gated) {  // this warp's keys' sums of dS for each row, over the quad's lanes g
#pragma unroll
        for (int n = 0; n < Br / 8; ++n)
#pragma unroll
          for (int odd = 0; odd < 2; ++odd) {
            float x = dp[n][odd] + dp[n][2 + odd];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if (g == 0) s_rs[warp * Br + 8 * n + c2 + odd] = x;
          }
      }
      fence_proxy_async();
      // The previous tile's adds, issued a tile's products ago, are complete and visible before
      // its turn passes on (after the barrier), and its dQ tile is free again.
      if (held != nullptr) {
        if (threadIdx.x == 0) bulk_wait<0>(), fence_proxy_async_global();
        if (gated) __threadfence();  // the row sums' adds
      }
      __syncthreads();
      if (threadIdx.x == 0 && held != nullptr) st_release_gpu(held, held_rank + 1);
      float dqp[D / 8][4];
      Products::template xt_b<T, Bc, D>(dqp, s_ds, sk);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * warp + g + 8 * hh;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<float2*>(s_dq + r * D + 8 * n + c2) =
              make_float2(dqp[n][2 * hh], dqp[n][2 * hh + 1]);
      }
      fence_proxy_async();
      // This block's turn on the tile (backward_turn): the key blocks before it whose rows reach
      // it have added theirs. Then the tile's rows, one span of dq_acc, in one bulk add.
      int* turn = p.dq_turn + (index_t(blockIdx.z) * p.f.q_heads + hq) * p.dq_tiles + i0 / Br;
      int rank = 0;
      if (threadIdx.x == 0) {
        rank = static_cast<int>(backward_turn(i0, jb, W, length, descending));
        while (ld_acquire_gpu(turn) != rank) __nanosleep(64);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        fence_proxy_async_global();
        bulk_reduce_add(p.dq_acc + p.dq_at(batch, start, i0, hq) * D, s_dq,
                        rows * D * int(sizeof(float)));
        bulk_commit();
      }
      if (gated && int(threadIdx.x) < rows) {
        const int r = threadIdx.x;
        red_add(p.rowsum + p.at(batch, start, i0 + r, hq),
                ((s_rs[r] + s_rs[Br + r]) + s_rs[2 * Br + r]) + s_rs[3 * Br + r]);
      }
      held = turn, held_rank = rank;
    }

    if (gated && t % row_tiles == row_tiles - 1) {  // the head's last tile: its column sums
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float x = colsum[hh];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int key = key0 + 8 * hh;
        if (lane % 4 == 0 && key < cols) p.colsum[p.at(batch, start, j0 + key, hq)] = x;
        colsum[hh] = 0.f;
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }
  if (Fused && held != nullptr) {  // the last tile's turn
    if (threadIdx.x == 0) bulk_wait<0>(), fence_proxy_async_global();
    if (gated) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) st_release_gpu(held, held_rank + 1);
  }

  T* dk_out = static_cast<T*>(p.dk) + batch * p.dk_stride[0] + (start + j0) * p.dk_stride[1] +
              h * p.dk_stride[2];
  T* dv_out = static_cast<T*>(p.dv) + batch * p.dv_stride[0] + (start + j0) * p.dv_stride[1] +
              h * p.dv_stride[2];
  store_rows_v2<T, D>(dk_out, p.dk_stride[1], 16 * warp, cols, dk, p.scale);
  store_rows_v2<T, D>(dv_out, p.dv_stride[1], 16 * warp, cols, dv, 1.f);
}

// ---- dq ------------------------------------------------------------------------------------

template <class Products, class T, int D>
__global__ void __launch_bounds__(attention_backward_v2_threads,
                                  attention_backward_v2_min_blocks(D))
    attention_backward_dq_mma_kernel(const attention_backward_params p) {
  constexpr int Br = attention_backward_v2_fixed, Bc = Products::stream;
  constexpr int NT = attention_backward_v2_threads;
  static_assert(Br == 16 * (NT / 32), "16 rows a warp");
  extern __shared__ __align__(128) unsigned char v2_smem[];
  T* sq = reinterpret_cast<T*>(backward_smem_base<Products>(v2_smem));  // [Br][D]
  T* sd = sq + Br * D;                                                  // [Br][D] dout
  T* sk = sd + Br * D;                                                  // [2][Bc][D]
  T* sv = sk + 2 * Bc * D;                                              // [2][Bc][D]
  double* s_gj = reinterpret_cast<double*>(sv + 2 * Bc * D);  // [2][Bc] the keys' G, as read
  float* s_gjf = reinterpret_cast<float*>(s_gj + 2 * Bc);     // [2][Bc] their terms gj (below)

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c2 = 2 * (lane % 4);
  const int hq = blockIdx.y, h = hq / p.f.group;
  index_t batch, start, length;
  p.f.sequence(blockIdx.z, batch, start, length);
  // The last row tiles first: with a causal mask they see the most keys, and starting them early
  // shortens the tail of the grid.
  const index_t i0 = static_cast<index_t>(gridDim.x - 1 - blockIdx.x) * Br;
  if (i0 >= length) return;
  const int rows = length - i0 < Br ? static_cast<int>(length - i0) : Br;
  const bool gated = p.gated();
  const float scale_log2 = p.scale * backward_log2e;

  // Keys [j_lo, j_hi] that some row of the tile sees; a row's last reset only moves forward.
  index_t j_lo, j_hi, unused;
  p.f.key_range(i0, length, j_lo, unused);
  p.f.key_range(i0 + rows - 1, length, unused, j_hi);
  if (gated) {
    const index_t r = p.reset[p.at(batch, start, i0, hq)];
    j_lo = r > j_lo ? r : j_lo;
  }
  const int key_tiles = static_cast<int>((j_hi - j_lo + Bc) / Bc);
  // A row's first and last visible keys grow with the row (its last reset too), so every row
  // sees every key of a tile when the last row's first key and the first row's last key enclose
  // it: then no mask.
  index_t lo_last, hi_first;
  p.f.key_range(i0 + rows - 1, length, lo_last, unused);
  p.f.key_range(i0, length, unused, hi_first);
  if (gated) {
    const index_t r = p.reset[p.at(batch, start, i0 + rows - 1, hq)];
    lo_last = r > lo_last ? r : lo_last;
  }
  // The gate terms as in the dk/dv kernel, relative to ref = coef G_i0.
  const double ref = gated ? p.gate_coef * p.G[p.at(batch, start, i0, hq)] : 0.0;

  const T* qg = static_cast<const T*>(p.f.q) + batch * p.f.q_stride[0] +
                (start + i0) * p.f.q_stride[1] + hq * p.f.q_stride[2];
  const T* dg = static_cast<const T*>(p.dout) + batch * p.dout_stride[0] +
                (start + i0) * p.dout_stride[1] + hq * p.dout_stride[2];
  Products::template load<Br, D>(sq, qg, p.f.q_stride[1], rows);
  Products::template load<Br, D>(sd, dg, p.dout_stride[1], rows);
  const T* kg = static_cast<const T*>(p.f.k) + batch * p.f.k_stride[0] + start * p.f.k_stride[1] +
                h * p.f.k_stride[2];
  const T* vg = static_cast<const T*>(p.f.v) + batch * p.f.v_stride[0] + start * p.f.v_stride[1] +
                h * p.f.v_stride[2];
  auto load_keys_v2 = [&](int t, int buf) {
    const index_t j = j_lo + static_cast<index_t>(t) * Bc;
    const T* kj = kg + j * p.f.k_stride[1];
    const T* vj = vg + j * p.f.v_stride[1];
    Products::template load<Bc, D>(sk + buf * Bc * D, kj, p.f.k_stride[1], j_hi + 1 - j);
    Products::template load<Bc, D>(sv + buf * Bc * D, vj, p.f.v_stride[1], j_hi + 1 - j);
    if (gated && threadIdx.x < Bc) {  // keys past j_hi read as 0 (and are masked)
      const bool ok = j + threadIdx.x <= j_hi;
      cp_async_8(s_gj + buf * Bc + threadIdx.x,
                 p.G + p.at(batch, start, j + (ok ? threadIdx.x : 0), hq), ok);
    }
  };
  load_keys_v2(0, 0);
  cp_async_commit();  // q, dout and the first key tile

  // This thread's rows 16 warp + g + 8 hh: lse, delta, gate term, visible keys.
  float lse2[2], delta[2], gi[2];
  int klo[2], khi[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + g + 8 * hh;
    lse2[hh] = 0.f, delta[hh] = 0.f, gi[hh] = 0.f, klo[hh] = 1, khi[hh] = 0;
    if (r < rows) {
      const index_t i = i0 + r;
      const float lse =
          p.lse[batch * p.lse_stride[0] + (start + i) * p.lse_stride[1] + hq * p.lse_stride[2]];
      index_t a_lo, a_hi;
      p.f.key_range(i, length, a_lo, a_hi);
      const index_t a = p.at(batch, start, i, hq);
      if (gated) {
        gi[hh] = static_cast<float>((p.gate_coef * p.G[a] - ref - static_cast<double>(lse)) *
                                    1.4426950408889634);
        const index_t reset = p.reset[a];
        a_lo = reset > a_lo ? reset : a_lo;
      }
      lse2[hh] = lse * backward_log2e;
      delta[hh] = p.delta[a];
      klo[hh] = static_cast<int>(a_lo);
      khi[hh] = static_cast<int>(a_hi);
    }
  }

  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.f;
  float rowsum[2] = {0.f, 0.f};

  for (int t = 0; t < key_tiles; ++t) {
    const int buf = t % 2;
    if (t + 1 < key_tiles) load_keys_v2(t + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    Products::ready();
    if (gated && int(threadIdx.x) < Bc) {  // the key this thread copied: (coef G_j - ref) log2 e
      const int b = buf * Bc + threadIdx.x;
      s_gjf[b] = static_cast<float>((p.gate_coef * s_gj[b] - ref) * 1.4426950408889634);
    }
    __syncthreads();
    const T* skb = sk + buf * Bc * D;
    const T* svb = sv + buf * Bc * D;
    const int j0 = static_cast<int>(j_lo) + t * Bc;

    float s[Bc / 8][4], dp[Bc / 8][4];
    Products::template scores<T, D, Bc>(s, dp, sq, skb, sd, svb);

    // P in place of S while dP is on the tensor cores, then dS in place of dP: element (row
    // 16 warp + g + 8 (e / 2), key j0 + 8 n + c2 + e % 2).
    const bool interior = rows == Br && j0 >= lo_last && j0 + Bc - 1 <= hi_first;
    const auto to_p = [&](auto masked) {
#pragma unroll
      for (int n = 0; n < Bc / 8; ++n) {
        float2 gj2 = make_float2(0.f, 0.f);  // the two keys' terms
        if (gated) gj2 = *reinterpret_cast<const float2*>(s_gjf + buf * Bc + 8 * n + c2);
        const float gj[2] = {gj2.x, gj2.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e / 2, odd = e % 2, j = j0 + 8 * n + c2 + odd;
          const float z = fmaf(s[n][e], scale_log2, gated ? gi[hh] - gj[odd] : -lse2[hh]);
          float P = fast_exp2(z);
          if constexpr (decltype(masked)::value) P = j >= klo[hh] && j <= khi[hh] ? P : 0.f;
          s[n][e] = P;
        }
      }
    };
    if (interior)
      to_p(std::false_type{});
    else
      to_p(std::true_type{});
    Products::template wait_scores<0>(dp);
#pragma unroll
    for (int n = 0; n < Bc / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float ds = s[n][e] * (dp[n][e] - delta[e / 2]);
        dp[n][e] = ds;
        if (gated) rowsum[e / 2] += ds;
      }

    std::uint32_t fds[Bc / 16][4];
    Products::template grad<T, Bc, D>(dq, dp, skb, fds);  // dQ += dS K
    Products::done(dq, fds);
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  T* dq_out = static_cast<T*>(p.dq) + batch * p.dq_stride[0] + (start + i0) * p.dq_stride[1] +
              hq * p.dq_stride[2];
  store_rows_v2<T, D>(dq_out, p.dq_stride[1], 16 * warp, rows, dq, p.scale);
  if (gated) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float x = rowsum[hh];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      const int r = 16 * warp + g + 8 * hh;
      if (lane % 4 == 0 && r < rows) p.rowsum[p.at(batch, start, i0 + r, hq)] = x;
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
