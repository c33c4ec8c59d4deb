#pragma once
// Tensor-core kernels of the bidirectional linear-attention backward (bla, gbla) for half and
// bfloat16 inputs with D = Dv = 64 (spec gbla.md §3.4): the three passes of
// linear_backward_simt.cuh that carry the products, on mma.sync m16n8k16 with float accumulation.
//   reduce: [S | z] of a range of tokens = (w phi(K))^T [V | 1]
//   query:  [num | den] = R [S | z] (R = scale phi(Q)); the gated norm's backward on the
//           accumulator fragments; g = do / den, delta = -(o . g); dq = (g S^T + delta z)
//           phi'(q) scale; the range's [dS | dz] += R^T [g | delta]
//   key:    e = [V | 1] [dS | dz]^T; dv = w phi(K) dS; dk = w e phi'(k); da = w (phi(k) . e - jac)
// The other kernels (gate statistics, combines, jac, folds) are the SIMT ones: they move
// O(parts D Dv) floats. A reduce or query CTA has D / 16 warps and takes tiles of 16 warps
// tokens: warp w owns tile rows 16 w .. 16 w + 15 in the row products and state rows d = 16 w ..
// in the sums over tokens; the key pass's warps each walk their own slabs of 16 tokens. Operands
// are bfloat16 (half's range would not hold the states, which sum a whole sequence), and every
// operand that is not an input is kept in two bfloat16 parts (about 16 bits; products of two split
// operands take three mma: hi hi, lo hi, hi lo): the normaliser's gradient subtracts the part of S
// g along z, and e = dS v + dz and phi(k) . e - jac cancel the same way, so that one rounding of R,
// g, S or dS would cost its relative error many times over (lbm_stage_state). z and delta ride
// along as the last columns of the [x | z] operands. Sums run in a fixed order: identical bits on
// every run. Needs q, k, v rows 16-byte aligned and dout, gate, dq, dk, dv, dgate rows 4-byte
// aligned.

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/linear_bwd_tiles.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- staging -------------------------------------------------------------------------------

// A [D x Dv | D] float state (S row-major, then z; z = 0 without the normaliser) into hi and
// lo [D][ld_v] with S = hi + lo to about 16 bits: hi holds bfloat16(S), then z's own two parts
// in columns Dv and Dv + 1, then zeros to Dv + 15; lo holds S - hi, then zeros; zf (when given)
// z in float. The products that read a state cancel (the normaliser's gradient subtracts the
// part of S g along z), so one rounding of the state would cost its relative error over again.
template <int D, int Dv, bool WithZ>
__device__ void lbm_stage_state(lbm_op* hi, lbm_op* lo, float* zf, const float* state) {
  using L = linear_bwd_mma_layout<D, Dv>;
  for (int i = threadIdx.x; i < D * Dv / 4; i += L::threads) {
    const float4 x = reinterpret_cast<const float4*>(state)[i];
    const int at = 4 * i / Dv * L::ld_v + 4 * i % Dv;
    std::uint32_t* ph = reinterpret_cast<std::uint32_t*>(hi + at);
    std::uint32_t* pl = reinterpret_cast<std::uint32_t*>(lo + at);
    split2(x.x, x.y, ph[0], pl[0]);
    split2(x.z, x.w, ph[1], pl[1]);
  }
  for (int d = threadIdx.x; d < D; d += L::threads) {
    const float z = WithZ ? state[D * Dv + d] : 0.f;
    const float zh = unpack2<lbm_op>(pack2<lbm_op>(z, 0.f)).x;
    uint4* ph = reinterpret_cast<uint4*>(hi + d * L::ld_v + Dv);
    uint4* pl = reinterpret_cast<uint4*>(lo + d * L::ld_v + Dv);
    ph[0] = make_uint4(pack2<lbm_op>(zh, z - zh), 0u, 0u, 0u);
    ph[1] = pl[0] = pl[1] = make_uint4(0u, 0u, 0u, 0u);
    if (zf != nullptr) zf[d] = z;
  }
}

// v (rows of V, and of Vl for half inputs, which keep v's low part there: half's 11 bits do not
// fit one bfloat16, and the key pass's e = dS v + dz cancels).
template <class Dev>
__device__ __forceinline__ void lbm_stage_v(lbm_op* V, lbm_op* Vl, int at, uint4 raw, bool ok) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (std::is_same_v<Dev, __half>) {
    uint4 hi = zero, lo = zero;
    if (ok) lbm_split8<Dev>(raw, hi, lo);
    *reinterpret_cast<uint4*>(V + at) = hi;
    *reinterpret_cast<uint4*>(Vl + at) = lo;
  } else {  // bfloat16 already
    *reinterpret_cast<uint4*>(V + at) = ok ? raw : zero;
  }
}

// Columns Dv .. Dv + 15 of row t of the v tiles: in V, a one (the column that sums z) where the
// row counts and zeros else; in Vl (half inputs) zeros.
template <class Dev, int Dv, int Ld>
__device__ __forceinline__ void lbm_stage_v_tail(lbm_op* V, lbm_op* Vl, int t, bool on) {
  uint4* p = reinterpret_cast<uint4*>(V + t * Ld + Dv);
  p[0] = make_uint4(pack2<lbm_op>(on ? 1.f : 0.f, 0.f), 0u, 0u, 0u);
  p[1] = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (std::is_same_v<Dev, __half>) {
    uint4* pl = reinterpret_cast<uint4*>(Vl + t * Ld + Dv);
    pl[0] = pl[1] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// ---- reduce --------------------------------------------------------------------------------

// CTA (part, KV head h, sequence n): the partial [S | z] of tokens [part * part_tokens, ...) with
// the gate weights of `stats` (none: 1 at valid tokens).
template <class Dev, class Policy, int D, int Dv>
__global__ void __launch_bounds__(linear_bwd_mma_layout<D, Dv>::threads,
                                  linear_bwd_mma_layout<D, Dv>::reduce_ctas)
    linear_bwd_reduce_mma_kernel(const linear_backward_params bp, index_t part_tokens,
                                 index_t parts, const float* stats, float* partial) {
  using L = linear_bwd_mma_layout<D, Dv>;
  constexpr int TR = L::rows, NT = L::ntv;
  constexpr bool split_v = std::is_same_v<Dev, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  lbm_op* P = reinterpret_cast<lbm_op*>(smem_raw);  // [TR][ld_d] w phi(k), high part
  lbm_op* Pl = P + L::d_tile;                       // [TR][ld_d] low part
  lbm_op* V = Pl + L::d_tile;                       // [TR][ld_v] v | 1
  lbm_op* Vl = V + L::v_tile;                       // half: [TR][ld_v] v's low part | 0
  float* W = reinterpret_cast<float*>(V + (split_v ? 2 : 1) * L::v_tile);
  const linear_kernel_params& f = bp.f;
  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c2 = 2 * (lane & 3);
  const part_range range(f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  float acc[NT][4] = {};
  lbm_tile_loads<Dev, D, TR, L::threads> kn;
  lbm_tile_loads<Dev, Dv, TR, L::threads> vn;
  if (t0 < t1) {
    kn.fetch(f, f.k, f.k_stride, batch, start, t0, t1, h);
    vn.fetch(f, f.v, f.v_stride, batch, start, t0, t1, h);
  }
  for (index_t base = t0; base < t1; base += TR) {
    const int rows = int(min(index_t(TR), t1 - base));
    __syncthreads();
    if (threadIdx.x < TR) {
      const int t = threadIdx.x;
      const float w = t < rows ? gate_weight(f, Policy::gate != key_gate::off ? stats : nullptr, n,
                                             batch, start + base + t, h)
                               : 0.f;
      W[t] = w;
      lbm_stage_v_tail<Dev, Dv, L::ld_v>(V, Vl, t, w != 0.f);
    }
    __syncthreads();
    // Tokens of weight 0 (pads, rows past the end) are selected away: their k, v may be NaN.
#pragma unroll
    for (int i = 0; i < kn.count; ++i) {
      const int t = kn.row(i), at = t * L::ld_d + 8 * kn.piece(i);
      const float w = W[t];
      lbm_phi8<Dev, Policy>(kn.raw[i], w, w != 0.f, P + at, Pl + at);
    }
#pragma unroll
    for (int i = 0; i < vn.count; ++i) {
      const int t = vn.row(i);
      lbm_stage_v<Dev>(V, Vl, t * L::ld_v + 8 * vn.piece(i), vn.raw[i], W[t] != 0.f);
    }
    if (base + TR < t1) {
      kn.fetch(f, f.k, f.k_stride, batch, start, base + TR, t1, h);
      vn.fetch(f, f.v, f.v_stride, batch, start, base + TR, t1, h);
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < TR / 16; ++ks) {
      std::uint32_t a[4], al[4];
      frag_a_t(a, P, L::ld_d, 16 * ks, 16 * warp);
      frag_a_t(al, Pl, L::ld_d, 16 * ks, 16 * warp);
#pragma unroll
      for (int jp = 0; jp < (NT + 1) / 2; ++jp) {
        std::uint32_t b[4];
        frag_b2_t(b, V, L::ld_v, 16 * ks, 16 * jp);
        mma_pairs(acc, a, b, jp);
        mma_pairs(acc, al, b, jp);
        if (split_v && jp < Dv / 16) {
          frag_b2_t(b, Vl, L::ld_v, 16 * ks, 16 * jp);
          mma_pairs(acc, a, b, jp);
        }
      }
    }
  }
  float* out = partial + ((index_t(n) * parts + part) * f.kv_heads + h) * (D * Dv + D);
  const int d = 16 * warp + g;
#pragma unroll
  for (int j = 0; j < NT - 1; ++j) {
    *reinterpret_cast<float2*>(out + d * Dv + 8 * j + c2) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(out + (d + 8) * Dv + 8 * j + c2) = make_float2(acc[j][2], acc[j][3]);
  }
  if (c2 == 0) out[D * Dv + d] = acc[NT - 1][0], out[D * Dv + d + 8] = acc[NT - 1][2];
}

// ---- pass A: query rows --------------------------------------------------------------------

// CTA (part, KV head h, sequence n): what linear_bwd_query_kernel computes, for every query head
// of h's group and every row of the part.
template <class Dev, class Policy, int D, int Dv>
__global__ void __launch_bounds__(linear_bwd_mma_layout<D, Dv>::threads,
                                  linear_bwd_mma_layout<D, Dv>::query_ctas)
    linear_bwd_query_mma_kernel(const linear_backward_params bp, index_t part_tokens, index_t parts,
                                const float* state, float* partial, float* dgamma_part) {
  using L = linear_bwd_mma_layout<D, Dv>;
  constexpr int TR = L::rows, NT = L::ntv, NV = Dv / 8, ND = D / 8;
  constexpr bool normed = Policy::norm != gated_norm::off;
  constexpr bool normalize = Policy::normalize;
  constexpr bool gate_first = Policy::order == norm_gate_order::gate_then_norm;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  lbm_op* St = reinterpret_cast<lbm_op*>(smem_raw);       // [D][ld_v] S | z, high parts
  lbm_op* Sl = St + L::state_elems;                       // [D][ld_v] S, low parts
  lbm_op* Qs = Sl + L::state_elems;                       // [TR][ld_d] q (raw bits of Dev)
  lbm_op* Rs = Qs + L::d_tile;                            // [TR][ld_d] r = scale phi(q), high part
  lbm_op* Rl = Rs + L::d_tile;                            // [TR][ld_d] low part
  lbm_op* Gs = Rl + L::d_tile;                            // [TR][ld_v] g | delta, high part
  lbm_op* Gl = Gs + L::v_tile;                            // [TR][ld_v] g, low part | 0
  float* red = reinterpret_cast<float*>(Gl + L::v_tile);  // [warps][Dv] dgamma terms
  float* zf = red + L::warps * Dv;                        // [D] z
  int* okr = reinterpret_cast<int*>(zf + D);              // [TR] row valid
  float* gms = reinterpret_cast<float*>(okr + TR);        // [Dv] the query head's gamma
  const linear_kernel_params& f = bp.f;
  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c2 = 2 * (lane & 3);
  const part_range range(f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  const int SS = D * Dv + D;
  const bool with_dgamma = normed && dgamma_part != nullptr;

  lbm_stage_state<D, Dv, normalize>(St, Sl, zf, state + (index_t(n) * f.kv_heads + h) * SS);
  for (int i = threadIdx.x; i < TR; i += L::threads) {
    uint4* p = reinterpret_cast<uint4*>(Gs + i * L::ld_v + Dv);
    p[0] = p[1] = make_uint4(0u, 0u, 0u, 0u);
    p = reinterpret_cast<uint4*>(Gl + i * L::ld_v + Dv);
    p[0] = p[1] = make_uint4(0u, 0u, 0u, 0u);
  }
  for (int i = threadIdx.x; i < L::warps * Dv; i += L::threads) red[i] = 0.f;

  float ds[NT][4] = {};
  const int r0 = 16 * warp;
  // Step s: query head h * group + s / tiles, tile s % tiles of the part.
  const index_t tiles = (t1 - t0 + TR - 1) / TR, steps = tiles * f.group;
  lbm_tile_loads<Dev, D, TR, L::threads> qn;
  if (steps > 0) qn.fetch(f, f.q, f.q_stride, batch, start, t0, t1, h * f.group);
  if (with_dgamma && tiles == 0)  // no rows: zero terms
    for (int i = threadIdx.x; i < f.group * Dv; i += L::threads)
      dgamma_part[((index_t(n) * parts + part) * f.q_heads + h * f.group) * Dv + i] = 0.f;
  for (index_t step = 0; step < steps; ++step) {
    const int hq = h * f.group + int(step / tiles);
    const index_t base = t0 + (step % tiles) * TR;
    {
      const int rows = int(min(index_t(TR), t1 - base));
      const int ra = r0 + g, rb = ra + 8;
      const index_t ta = start + base + ra, tb = start + base + rb;
      __syncthreads();  // the previous tile's readers are done
      // The warp's own rows of dout (into Gs) and of the gate (into Gl), raw, at the [g | delta]
      // tiles' row stride: copied while R is staged and [num | den] multiplied, then read at the
      // accumulators' places by the lanes that own them, each of which overwrites its places
      // with g's parts only after reading them. Rows past the tile are zero-filled; pad rows
      // are selected away below.
      auto stage_rows = [&](lbm_op* dst, const void* src, const index_t* st) {
        if (bp.rows16) {
          lbm_warp_copy16<Dev, Dv, L::ld_v>(dst + r0 * L::ld_v, src, st, batch, start, base + r0,
                                            base + rows, hq);
          return;
        }
#pragma unroll
        for (int e = lane; e < 16 * (Dv / 8); e += 32) {  // 4-byte aligned rows: four loads
          const int r = r0 + e / (Dv / 8), c = 8 * (e % (Dv / 8));
          const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(
              static_cast<const Dev*>(src) + batch * st[0] +
              (start + base + min(r, rows - 1)) * st[1] + hq * st[2] + c);
          *reinterpret_cast<uint4*>(dst + r * L::ld_v + c) =
              r < rows ? make_uint4(w[0], w[1], w[2], w[3]) : make_uint4(0u, 0u, 0u, 0u);
        }
      };
      stage_rows(Gs, bp.dout, bp.dout_stride);
      if constexpr (normed) stage_rows(Gl, f.gate, f.gate_stride);
      cp_async_commit();
      auto raw_pair = [&](const lbm_op* tile, int r, int j) {
        return *reinterpret_cast<const std::uint32_t*>(tile + r * L::ld_v + 8 * j + c2);
      };
      if (threadIdx.x < TR)
        okr[threadIdx.x] =
            int(int(threadIdx.x) < rows && f.valid(batch, start + base + threadIdx.x));
      if (normed && step % tiles == 0)  // a query head's first tile
        for (int c = threadIdx.x; c < Dv; c += L::threads)
          gms[c] = f.gamma == nullptr
                       ? 1.f
                       : f.gamma[(Policy::weight == norm_weight::per_head ? hq * Dv + c : c) *
                                 f.gamma_stride];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < qn.count; ++i) {
        const int t = qn.row(i), at = t * L::ld_d + 8 * qn.piece(i);
        *reinterpret_cast<uint4*>(Qs + at) = qn.raw[i];
        lbm_phi8<Dev, Policy>(qn.raw[i], f.scale, okr[t] != 0, Rs + at, Rl + at);
      }
      if (step + 1 < steps) {
        const index_t next = t0 + ((step + 1) % tiles) * TR;
        qn.fetch(f, f.q, f.q_stride, batch, start, next, t1, h * f.group + int((step + 1) / tiles));
      }
      __syncthreads();

      // [num | den] of the warp's 16 rows: ra = r0 + g, rb = ra + 8.
      float o[NT][4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        std::uint32_t a[4], al[4];
        frag_a(a, Rs, L::ld_d, r0, 16 * ks);
        frag_a(al, Rl, L::ld_d, r0, 16 * ks);
#pragma unroll
        for (int jp = 0; jp < (NT + 1) / 2; ++jp) {
          std::uint32_t b[4];
          frag_b2_t(b, St, L::ld_v, 16 * ks, 16 * jp);
          mma_pairs(o, a, b, jp);
          mma_pairs(o, al, b, jp);
        }
#pragma unroll
        for (int jp = 0; jp < NV / 2; ++jp) {
          std::uint32_t b[4];
          frag_b2_t(b, Sl, L::ld_v, 16 * ks, 16 * jp);
          mma_pairs(o, a, b, jp);
        }
      }
      const bool oka = okr[ra] != 0, okb = okr[rb] != 0;
      // den: columns Dv and Dv + 1 (z's two parts) of the lane with c2 = 0.
      const float den_a = __shfl_sync(0xffffffffu, o[NT - 1][0] + o[NT - 1][1], lane & ~3);
      const float den_b = __shfl_sync(0xffffffffu, o[NT - 1][2] + o[NT - 1][3], lane & ~3);
      // 0 at pad rows, whose o, g and delta are then 0 whatever eps.
      const float inv_a = !oka ? 0.f : normalize ? 1.f / (den_a + f.eps) : 1.f;
      const float inv_b = !okb ? 0.f : normalize ? 1.f / (den_b + f.eps) : 1.f;
      cp_async_wait<0>();
      __syncwarp();  // the warp's rows of dout and the gate are in
      float dy[NV][4];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        o[j][0] *= inv_a, o[j][1] *= inv_a, o[j][2] *= inv_b, o[j][3] *= inv_b;
        const float2 ya = oka ? unpack2<Dev>(raw_pair(Gs, ra, j)) : make_float2(0.f, 0.f);
        const float2 yb = okb ? unpack2<Dev>(raw_pair(Gs, rb, j)) : make_float2(0.f, 0.f);
        dy[j][0] = ya.x, dy[j][1] = ya.y, dy[j][2] = yb.x, dy[j][3] = yb.y;
      }
      if constexpr (normed) {
        // The per-head gated RMSNorm's backward (norm_row_backward) on the fragments: dy -> do.
        auto gate2 = [&](int j, int r, bool ok) {
          return ok ? unpack2<Dev>(raw_pair(Gl, r == 0 ? ra : rb, j)) : make_float2(0.f, 0.f);
        };
        // xg = gate_first ? o act : o; the row's sum of squares.
        float ssa = 0.f, ssb = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          float xg[4] = {o[j][0], o[j][1], o[j][2], o[j][3]};
          if constexpr (gate_first) {
            const float2 ga = gate2(j, 0, oka), gb = gate2(j, 1, okb);
            const float gv[4] = {ga.x, ga.y, gb.x, gb.y};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              float act, dact;
              lbm_gate<Policy>(gv[i], act, dact);
              xg[i] *= act;
            }
          }
          ssa += xg[0] * xg[0] + xg[1] * xg[1];
          ssb += xg[2] * xg[2] + xg[3] * xg[3];
        }
        const float rstd_a = rsqrtf(quad_sum(ssa) / float(Dv) + f.norm_eps);
        const float rstd_b = rsqrtf(quad_sum(ssb) / float(Dv) + f.norm_eps);
        // dn (in dy), dgate for norm_then_gate, the dgamma terms, the projection.
        float pa = 0.f, pb = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int c = 8 * j + c2;
          const float2 ga = gate2(j, 0, oka), gb = gate2(j, 1, okb);
          const float gv[4] = {ga.x, ga.y, gb.x, gb.y};
          const float gm[2] = {gms[c], gms[c + 1]};
          float dgt[4], dgm[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float rstd = i < 2 ? rstd_a : rstd_b;
            float act, dact;
            lbm_gate<Policy>(gv[i], act, dact);
            const float xg = gate_first ? o[j][i] * act : o[j][i];
            float dn = gate_first ? dy[j][i] : dy[j][i] * act;
            dgm[i] = rstd * dn * xg;
            dgt[i] = gate_first ? 0.f : rstd * dy[j][i] * xg * dact * gm[i % 2];
            dn *= gm[i % 2];
            dy[j][i] = dn;
            (i < 2 ? pa : pb) += dn * xg;
          }
          if (!oka) dgm[0] = dgm[1] = 0.f;
          if (!okb) dgm[2] = dgm[3] = 0.f;
          if (with_dgamma) {
            float s0 = dgm[0] + dgm[2], s1 = dgm[1] + dgm[3];
#pragma unroll
            for (int off = 4; off < 32; off *= 2) {
              s0 += __shfl_xor_sync(0xffffffffu, s0, off);
              s1 += __shfl_xor_sync(0xffffffffu, s1, off);
            }
            if (g == 0) red[warp * Dv + c] += s0, red[warp * Dv + c + 1] += s1;
          }
          if constexpr (!gate_first) {
            if (ra < rows)
              lbm_store2<Dev>(bp.dgate, bp.dgate_stride, batch, ta, hq, c, oka ? dgt[0] : 0.f,
                              oka ? dgt[1] : 0.f);
            if (rb < rows)
              lbm_store2<Dev>(bp.dgate, bp.dgate_stride, batch, tb, hq, c, okb ? dgt[2] : 0.f,
                              okb ? dgt[3] : 0.f);
          }
        }
        pa = rstd_a * rstd_a * quad_sum(pa) / float(Dv);
        pb = rstd_b * rstd_b * quad_sum(pb) / float(Dv);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int c = 8 * j + c2;
          float dgt[4];
          const float2 ga = gate2(j, 0, oka), gb = gate2(j, 1, okb);
          const float gv[4] = {ga.x, ga.y, gb.x, gb.y};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float rstd = i < 2 ? rstd_a : rstd_b, proj = i < 2 ? pa : pb;
            if constexpr (!gate_first) {
              dy[j][i] = rstd * (dy[j][i] - proj * o[j][i]);
            } else {
              float act, dact;
              lbm_gate<Policy>(gv[i], act, dact);
              const float dx = rstd * (dy[j][i] - proj * o[j][i] * act);
              dgt[i] = dx * o[j][i] * dact;
              dy[j][i] = dx * act;
            }
          }
          if constexpr (gate_first) {
            if (ra < rows)
              lbm_store2<Dev>(bp.dgate, bp.dgate_stride, batch, ta, hq, c, oka ? dgt[0] : 0.f,
                              oka ? dgt[1] : 0.f);
            if (rb < rows)
              lbm_store2<Dev>(bp.dgate, bp.dgate_stride, batch, tb, hq, c, okb ? dgt[2] : 0.f,
                              okb ? dgt[3] : 0.f);
          }
        }
      }
      // g = do / den (0 at pad rows) in two parts, as A fragments (high ga, low gl) and into
      // Gs, Gl; delta = -(o . g).
      std::uint32_t ga[NV / 2][4], gl[NV / 2][4];
      float da_ = 0.f, db_ = 0.f;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const float g0 = oka ? dy[j][0] * inv_a : 0.f, g1 = oka ? dy[j][1] * inv_a : 0.f;
        const float g2 = okb ? dy[j][2] * inv_b : 0.f, g3 = okb ? dy[j][3] * inv_b : 0.f;
        std::uint32_t xh, xl, yh, yl;
        split2(g0, g1, xh, xl);
        split2(g2, g3, yh, yl);
        ga[j / 2][(j % 2) * 2] = xh, ga[j / 2][(j % 2) * 2 + 1] = yh;
        gl[j / 2][(j % 2) * 2] = xl, gl[j / 2][(j % 2) * 2 + 1] = yl;
        *reinterpret_cast<std::uint32_t*>(Gs + ra * L::ld_v + 8 * j + c2) = xh;
        *reinterpret_cast<std::uint32_t*>(Gs + rb * L::ld_v + 8 * j + c2) = yh;
        *reinterpret_cast<std::uint32_t*>(Gl + ra * L::ld_v + 8 * j + c2) = xl;
        *reinterpret_cast<std::uint32_t*>(Gl + rb * L::ld_v + 8 * j + c2) = yl;
        da_ += o[j][0] * g0 + o[j][1] * g1;
        db_ += o[j][2] * g2 + o[j][3] * g3;
      }
      const float del_a = normalize ? -quad_sum(da_) : 0.f;
      const float del_b = normalize ? -quad_sum(db_) : 0.f;
      if (c2 == 0) {  // delta's two parts in columns Dv, Dv + 1 (dz is their sum)
        auto parts = [](float v) {
          const float hi = unpack2<lbm_op>(pack2<lbm_op>(v, 0.f)).x;
          return pack2<lbm_op>(hi, v - hi);
        };
        *reinterpret_cast<std::uint32_t*>(Gs + ra * L::ld_v + Dv) = parts(del_a);
        *reinterpret_cast<std::uint32_t*>(Gs + rb * L::ld_v + Dv) = parts(del_b);
      }
      // x = g S^T + delta z (S in its two parts, z in float); dq = scale x phi'(q).
      float x[ND][4] = {};
#pragma unroll
      for (int ks = 0; ks < NV / 2; ++ks) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          std::uint32_t b[4];
          frag_b2(b, St, L::ld_v, 16 * dp, 16 * ks);
          mma_pairs(x, ga[ks], b, dp);
          mma_pairs(x, gl[ks], b, dp);
          frag_b2(b, Sl, L::ld_v, 16 * dp, 16 * ks);
          mma_pairs(x, ga[ks], b, dp);
        }
      }
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        const int d = 8 * j + c2;
        x[j][0] += del_a * zf[d], x[j][1] += del_a * zf[d + 1];
        x[j][2] += del_b * zf[d], x[j][3] += del_b * zf[d + 1];
        const float2 qa =
            unpack2<Dev>(*reinterpret_cast<const std::uint32_t*>(Qs + ra * L::ld_d + d));
        const float2 qb =
            unpack2<Dev>(*reinterpret_cast<const std::uint32_t*>(Qs + rb * L::ld_d + d));
        auto dq = [&](float xv, float qv) {
          return f.scale * xv *
                 fast_phi_derivative<Policy::phi>(qv, fast_feature_map<Policy::phi>(qv));
        };
        const float y[4] = {oka ? dq(x[j][0], qa.x) : 0.f, oka ? dq(x[j][1], qa.y) : 0.f,
                            okb ? dq(x[j][2], qb.x) : 0.f, okb ? dq(x[j][3], qb.y) : 0.f};
        if (bp.dq_rows16) {  // over this lane's own q, read above; sent out below
          *reinterpret_cast<std::uint32_t*>(Qs + ra * L::ld_d + d) = pack2<Dev>(y[0], y[1]);
          *reinterpret_cast<std::uint32_t*>(Qs + rb * L::ld_d + d) = pack2<Dev>(y[2], y[3]);
        } else {
          if (ra < rows) lbm_store2<Dev>(bp.dq, bp.dq_stride, batch, ta, hq, d, y[0], y[1]);
          if (rb < rows) lbm_store2<Dev>(bp.dq, bp.dq_stride, batch, tb, hq, d, y[2], y[3]);
        }
      }
      if (bp.dq_rows16) {  // the warp's dq rows in 16-byte pieces
        __syncwarp();
#pragma unroll
        for (int e = lane; e < 16 * (D / 8); e += 32) {
          const int r = r0 + e / (D / 8), c = 8 * (e % (D / 8));
          if (r < rows)
            *reinterpret_cast<uint4*>(static_cast<Dev*>(bp.dq) + batch * bp.dq_stride[0] +
                                      (start + base + r) * bp.dq_stride[1] + hq * bp.dq_stride[2] +
                                      c) = *reinterpret_cast<const uint4*>(Qs + r * L::ld_d + c);
        }
      }
      __syncthreads();  // Gs complete
                        // [dS | dz] rows d = 16 warp .. += R^T [g | delta].
#pragma unroll
      for (int ks = 0; ks < TR / 16; ++ks) {
        std::uint32_t a[4], al[4];
        frag_a_t(a, Rs, L::ld_d, 16 * ks, r0);
        frag_a_t(al, Rl, L::ld_d, 16 * ks, r0);
#pragma unroll
        for (int jp = 0; jp < (NT + 1) / 2; ++jp) {
          std::uint32_t b[4];
          frag_b2_t(b, Gs, L::ld_v, 16 * ks, 16 * jp);
          mma_pairs(ds, a, b, jp);
          mma_pairs(ds, al, b, jp);
          if (jp < NV / 2) {
            frag_b2_t(b, Gl, L::ld_v, 16 * ks, 16 * jp);
            mma_pairs(ds, a, b, jp);
          }
        }
      }
    }
    if (with_dgamma && step % tiles == tiles - 1) {  // the head's last tile
      __syncthreads();
      for (int c = threadIdx.x; c < Dv; c += L::threads) {
        float s = 0.f;
        for (int w = 0; w < L::warps; ++w) s += red[w * Dv + c];
        dgamma_part[((index_t(n) * parts + part) * f.q_heads + hq) * Dv + c] = s;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < L::warps * Dv; i += L::threads) red[i] = 0.f;
    }
  }
  float* out = partial + ((index_t(n) * parts + part) * f.kv_heads + h) * SS;
  const int d = r0 + g;
#pragma unroll
  for (int j = 0; j < NT - 1; ++j) {
    *reinterpret_cast<float2*>(out + d * Dv + 8 * j + c2) = make_float2(ds[j][0], ds[j][1]);
    *reinterpret_cast<float2*>(out + (d + 8) * Dv + 8 * j + c2) = make_float2(ds[j][2], ds[j][3]);
  }
  if (c2 == 0)
    out[D * Dv + d] = ds[NT - 1][0] + ds[NT - 1][1],
                 out[D * Dv + d + 8] = ds[NT - 1][2] + ds[NT - 1][3];
}

// ---- pass B: keys --------------------------------------------------------------------------

// CTA (part, KV head h, sequence n): what linear_bwd_key_kernel computes. Each row is its own
// (no sum over tokens), so each warp walks its own slabs of 16 tokens (slab warp, warp + warps,
// ... of the range) with no barrier between warps: k and v are copied two slabs ahead into the
// warp's two stages (cp.async), and the products read them there as A fragments, the feature
// map (and half v's split) applied in registers; dv and dk leave through the warp's 16 result
// rows in shared memory as 16-byte pieces where their rows allow. The CTA stages dS once, in two
// parts; dz is added to e in float. Pad rows and rows past the range are selected away (their
// k, v may be anything, and copies past the range are zero-filled).
template <class Dev, class Policy, int D, int Dv>
__global__ void __launch_bounds__(linear_bwd_mma_layout<D, Dv>::key_threads,
                                  linear_bwd_mma_layout<D, Dv>::key_ctas)
    linear_bwd_key_mma_kernel(const linear_backward_params bp, index_t part_tokens,
                              const float* stats, const float* dstate, const float* jac,
                              float* da_heads) {
  using L = linear_bwd_mma_layout<D, Dv>;
  constexpr int NV = Dv / 8, ND = D / 8, LD = L::ld_d, LV = L::key_ld_v, W = L::key_warps;
  constexpr int LO = L::key_ld_o;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool split_v = std::is_same_v<Dev, __half>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  lbm_op* DSt = reinterpret_cast<lbm_op*>(smem_raw);  // [D][LV] dS, high parts
  lbm_op* DSl = DSt + D * LV;                         // [D][LV] dS, low parts
  lbm_op* stages = DSl + D * LV;                      // [W][2][k: 16 x LD | v: 16 x LV] raw bits
  lbm_op* outs = stages + 2 * W * L::key_stage;       // [W][16][LO] a warp's dv, then dk rows
  float* dzf = reinterpret_cast<float*>(outs + W * 16 * LO);  // [D] dz
  const linear_kernel_params& f = bp.f;
  const int part = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c2 = 2 * (lane & 3);
  const part_range range(f, n, part, part_tokens);
  const index_t batch = range.batch, start = range.start, t0 = range.t0, t1 = range.t1;
  const index_t slabs = (t1 - t0 + 15) / 16;
  const index_t walk = slabs > warp ? (slabs - warp + W - 1) / W : 0;  // this warp's slabs
  lbm_op* const mine = stages + 2 * warp * L::key_stage;
  // Slab i of the warp into stage i % 2 (one commit group a slab, empty past the walk).
  auto fetch = [&](index_t i) {
    if (i < walk) {
      const index_t base = t0 + (warp + i * W) * 16;
      lbm_op* K = mine + (i % 2) * L::key_stage;
      lbm_warp_copy16<Dev, D, LD>(K, f.k, f.k_stride, batch, start, base, t1, h);
      lbm_warp_copy16<Dev, Dv, LV>(K + 16 * LD, f.v, f.v_stride, batch, start, base, t1, h);
    }
    cp_async_commit();
  };
  fetch(0);
  fetch(1);

  const float* ds = dstate + (index_t(n) * f.kv_heads + h) * (D * Dv + D);
  for (int i = threadIdx.x; i < D * Dv / 4; i += L::key_threads) {
    const float4 x = reinterpret_cast<const float4*>(ds)[i];
    const int at = 4 * i / Dv * LV + 4 * i % Dv;
    std::uint32_t* ph = reinterpret_cast<std::uint32_t*>(DSt + at);
    std::uint32_t* pl = reinterpret_cast<std::uint32_t*>(DSl + at);
    split2(x.x, x.y, ph[0], pl[0]);
    split2(x.z, x.w, ph[1], pl[1]);
  }
  for (int d = threadIdx.x; d < D; d += L::key_threads)
    dzf[d] = Policy::normalize ? ds[D * Dv + d] : 0.f;
  // The sequence's gate statistics (max, 1 / sum) and jac, read from shared memory where used
  // (kept in registers through the walk they were spilled).
  volatile float* consts = dzf + D;
  if (gated && threadIdx.x == 0) {
    const int gh = f.gate_heads == 1 ? 0 : h;
    consts[0] = stats[(index_t(n) * f.gate_heads + gh) * 2];
    consts[1] = stats[(index_t(n) * f.gate_heads + gh) * 2 + 1];
    consts[2] = jac[index_t(n) * f.kv_heads + h];
  }
  __syncthreads();

  // Whether the lane's two rows (g, g + 8) of slab i are in the range and not pads, and their
  // gate logits: asked for a slab ahead of their use.
  bool oka_n = false, okb_n = false;
  float la_n = 0.f, lb_n = 0.f;
  auto peek = [&](index_t i) {
    if (i >= walk) return;
    const index_t base = t0 + (warp + i * W) * 16, ta = start + base + g, tb = ta + 8;
    const bool ia = base + g < t1, ib = base + g + 8 < t1;
    oka_n = ia && f.valid(batch, ta), okb_n = ib && f.valid(batch, tb);
    if constexpr (gated) {
      const index_t hg = (f.gate_heads == 1 ? 0 : h) * f.a_stride[2];
      la_n = ia ? f.a[batch * f.a_stride[0] + ta * f.a_stride[1] + hg] : 0.f;
      lb_n = ib ? f.a[batch * f.a_stride[0] + tb * f.a_stride[1] + hg] : 0.f;
    }
  };
  peek(0);

  for (index_t i = 0; i < walk; ++i) {
    const index_t base = t0 + (warp + i * W) * 16;
    const int rows = int(min(index_t(16), t1 - base));
    const int ra = g, rb = g + 8;
    const index_t ta = start + base + ra, tb = start + base + rb;
    // The lane's two rows: in the range and not a pad, and their weights (0 where not).
    const bool oka = oka_n, okb = okb_n;
    float wa = oka ? 1.f : 0.f, wb = okb ? 1.f : 0.f;
    if constexpr (gated) {
      const float gate_max = consts[0], gate_inv = consts[1];
      wa = oka && gate_inv > 0.f ? __expf(la_n - gate_max) * gate_inv : 0.f;
      wb = okb && gate_inv > 0.f ? __expf(lb_n - gate_max) * gate_inv : 0.f;
    }
    peek(i + 1);
    cp_async_wait<1>();
    __syncwarp();
    lbm_op* const K = mine + (i % 2) * L::key_stage;
    lbm_op* const V = K + 16 * LD;
    // A result's pair at (row r, column c) of the slab: into the warp's rows of `outs` when dk
    // and dv rows are 16-byte aligned (flush then sends whole rows out in 16-byte pieces), else
    // straight to global memory.
    lbm_op* const ob = outs + warp * 16 * LO;
    auto put = [&](void* dst, const index_t* st, int r, int c, float x, float y) {
      if (bp.dkv_rows16)
        *reinterpret_cast<std::uint32_t*>(ob + r * LO + c) = pack2<Dev>(x, y);
      else if (r < rows)
        lbm_store2<Dev>(dst, st, batch, start + base + r, h, c, x, y);
    };
    auto flush = [&](void* dst, const index_t* st, auto cols) {
      if (!bp.dkv_rows16) return;
      constexpr int per_row = decltype(cols)::value / 8;
      __syncwarp();
#pragma unroll
      for (int e = lane; e < 16 * per_row; e += 32) {
        const int r = e / per_row, c = 8 * (e % per_row);
        if (r < rows)
          *reinterpret_cast<uint4*>(static_cast<Dev*>(dst) + batch * st[0] +
                                    (start + base + r) * st[1] + h * st[2] + c) =
              *reinterpret_cast<const uint4*>(ob + r * LO + c);
      }
      __syncwarp();  // the rows are out: ob may be written again
    };
    // A fragment registers 0, 2 hold row ra; 1, 3 row rb.
    auto select = [&](std::uint32_t(&a)[4]) {
      if (!oka) a[0] = a[2] = 0u;
      if (!okb) a[1] = a[3] = 0u;
    };

    // phi(k) dS (16 x Dv); phi(k) once rounded (dv sums no cancelling terms).
    float dv[NV][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      std::uint32_t a[4];
      frag_a(a, K, LD, 0, 16 * ks);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float2 x = unpack2<Dev>(a[r]);
        a[r] =
            pack2<lbm_op>(fast_feature_map<Policy::phi>(x.x), fast_feature_map<Policy::phi>(x.y));
      }
      select(a);
#pragma unroll
      for (int jp = 0; jp < NV / 2; ++jp) {
        std::uint32_t b[4];
        frag_b2_t(b, DSt, LV, 16 * ks, 16 * jp);
        mma_pairs(dv, a, b, jp);
        frag_b2_t(b, DSl, LV, 16 * ks, 16 * jp);
        mma_pairs(dv, a, b, jp);
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      put(bp.dv, bp.dv_stride, ra, 8 * j + c2, wa * dv[j][0], wa * dv[j][1]);
      put(bp.dv, bp.dv_stride, rb, 8 * j + c2, wb * dv[j][2], wb * dv[j][3]);
    }
    flush(bp.dv, bp.dv_stride, std::integral_constant<int, Dv>());
    // e = v dS^T (16 x D), dz added below.
    float e[ND][4] = {};
#pragma unroll
    for (int ks = 0; ks < Dv / 16; ++ks) {
      std::uint32_t a[4], al[4];
      frag_a(a, V, LV, 0, 16 * ks);
      select(a);
      if constexpr (split_v) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 x = unpack2<Dev>(a[r]);
          split2(x.x, x.y, a[r], al[r]);
        }
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t b[4];
        frag_b2(b, DSt, LV, 16 * dp, 16 * ks);
        mma_pairs(e, a, b, dp);
        if constexpr (split_v) mma_pairs(e, al, b, dp);
        frag_b2(b, DSl, LV, 16 * dp, 16 * ks);
        mma_pairs(e, a, b, dp);
      }
    }
    // dk = w e phi'(k); da = w (phi(k) . e - jac).
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int d = 8 * j + c2;
      const float2 ka = unpack2<Dev>(*reinterpret_cast<const std::uint32_t*>(K + ra * LD + d));
      const float2 kb = unpack2<Dev>(*reinterpret_cast<const std::uint32_t*>(K + rb * LD + d));
      const float kv[4] = {ka.x, ka.y, kb.x, kb.y}, dz[2] = {dzf[d], dzf[d + 1]};
      float y[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const bool ok = r < 2 ? oka : okb;
        const float p = fast_feature_map<Policy::phi>(kv[r]), ev = e[j][r] + dz[r % 2];
        y[r] = ok ? (r < 2 ? wa : wb) * ev * fast_phi_derivative<Policy::phi>(kv[r], p) : 0.f;
        if (ok) (r < 2 ? sa : sb) += p * ev;
      }
      put(bp.dk, bp.dk_stride, ra, d, y[0], y[1]);
      put(bp.dk, bp.dk_stride, rb, d, y[2], y[3]);
    }
    flush(bp.dk, bp.dk_stride, std::integral_constant<int, D>());
    if constexpr (gated) {
      sa = quad_sum(sa), sb = quad_sum(sb);
      if (c2 == 0) {
        const float jh = consts[2];
        const float v[2] = {oka ? wa * (sa - jh) : 0.f, okb ? wb * (sb - jh) : 0.f};
        const index_t tt[2] = {ta, tb};
        const int rr[2] = {ra, rb};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (rr[r] >= rows) continue;
          if (da_heads != nullptr)
            da_heads[(index_t(h) * bp.batch + batch) * f.tokens + tt[r]] = v[r];
          else
            bp.da[batch * bp.da_stride[0] + tt[r] * bp.da_stride[1] +
                  (f.gate_heads == 1 ? 0 : h) * bp.da_stride[2]] = v[r];
        }
      }
    }
    __syncwarp();  // the stage's readers are done
    fetch(i + 2);
  }
  cp_async_wait<0>();
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
