#pragma once
// Tensor-core kernels of the causal linear-attention backward (kind::linear_causal) for bfloat16
// inputs at D = Dv = 64 with 64-token chunks: the three kernels of linear_backward_causal.cuh
// that carry the products, same grid, scratch and results, on mma.sync m16n8k16 with float
// accumulation. The scans between them are the CUDA-core ones.
//   chunk sums: a chunk's [S | z] = phi(K)^T [V | 1]
//   query:      [num | den] = R [S | z] + A [V | 1] (A = R phi(K)^T on j <= i, R = scale phi(Q));
//               g = do / den, delta = -(do . num) / den^2; dq = scale phi'(q) ([g | delta]
//               [S | z]^T + dA phi(K)) with dA = [g | delta] [V | 1]^T on j <= i; the chunk's
//               [dS | dz] += R^T [g | delta] over the group's heads
//   key:        e = [V | 1] [dS | dz]^T + dA^T R, dv = phi(K) dS + A^T g over the chunk's query
//               rows i >= j of every head of the group; dk = e phi'(k)
// A CTA walks the `walk` chunks of one state slot: the sums and query kernels forward, carrying
// the state past each chunk, the key kernel backward, carrying the state's gradient (the slot
// holds its value after the slot's last chunk; each chunk adds its R^T [g | delta] on the way
// down). The running sum sits in float in shared memory, in the accumulators' layout, and as two
// bfloat16 parts in the tile the products read; the scans between the kernels move a slot a walk.
// Warp w of four owns rows 16 w .. 16 w + 15 of the chunk (queries in the query kernel, keys in
// the key kernel) and state rows d = 16 w .. in the sums over tokens. [x | z] operands carry z (or
// delta, or a row's 1) in column 64 of an 80-wide tile. Every operand that is not a bfloat16
// input is kept in two bfloat16 parts: the normaliser's gradient cancels (g . v_j + delta is
// do . (v_j - o) / den), as in sm80_linear_backward.cuh. Sums run in a fixed order.
// Needs q, k, v rows 16-byte aligned and dout, dq, dk, dv rows 4-byte aligned.
//
// Under the prefix key gate (Gated) the CPU backward's chunk step (linear_backward_causal_gated.cuh
// has the formulas) maps onto the same products: A and dA are weighted elementwise by
// W_ij = exp(a_j - u_i) / ell_i after their mma (exact for any spread of logits), the carried
// state's rows by cn_i, and the state and its gradient cross a chunk by mass ratios: the state's
// keys by exp(a_j - m_end) (phi(k) reweighted in place), the gradient's query rows by
// beta_i = mass_start / mass_i. A state is kept relative to its running max with its mass; its
// gradient with kappa, the gradient of the log-mass. The query pass leaves each row's max and mass
// (u_i, ell_i) for the key pass, which needs no state; da_j = phi(k_j) . dphik_j + f_j kappa +
// sum_i W_ij kappa_i.

#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/causal_scan.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/linear_bwd_tiles.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/linear_rows.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

namespace lbc {
constexpr int C = 64, D = 64, X = 80;          // chunk, head dim, width of [x | z]
constexpr int ld = D + 8, ldx = X + 8;         // padded rows: conflict-free ldmatrix
constexpr int NX = X / 8, KX = X / 16;         // n-tiles and k-steps of [x | z]
constexpr int tile = C * ld, xtile = C * ldx;  // elements of a [C][ld] and a [C][ldx] tile
constexpr int threads = 128;
constexpr int SS = D * D + D;  // floats of a state slot: S row-major, then z
// Under the key gate a slot has four more: the max and mass of the slot's own keys, then (after
// the scan) the max and mass before the slot; a gradient slot has kappa at SS.
template <bool Gated>
constexpr int slot_floats = Gated ? SS + 4 : SS;

// The chunks [first, last) of state slot s of a sequence of `length` tokens; false if none.
__device__ __forceinline__ bool walk_range(int s, int walk, index_t length, index_t& first,
                                           index_t& last) {
  first = index_t(s) * walk;
  last = min((length + C - 1) / C, first + walk);
  return first < last;
}

// A global slot [S | z] into this warp's accumulators (state rows r0 ..; columns past z zero).
__device__ __forceinline__ void slot_to_acc(float (&acc)[NX][4], const float* slot, int r0) {
  for_fragment_pairs<NX>(acc, r0, 0, [&](int d, int e, float& x0, float& x1) {
    if (e < D) {
      const float2 x = *reinterpret_cast<const float2*>(slot + d * D + e);
      x0 = x.x, x1 = x.y;
    } else {
      x0 = e == D ? slot[D * D + d] : 0.f, x1 = 0.f;
    }
  });
}
__device__ __forceinline__ void acc_to_slot(float* slot, float (&acc)[NX][4], int r0) {
  for_fragment_pairs<NX>(acc, r0, 0, [&](int d, int e, float x0, float x1) {
    if (e < D)
      *reinterpret_cast<float2*>(slot + d * D + e) = make_float2(x0, x1);
    else if (e == D)
      slot[D * D + d] = x0;
  });
}

// The running sum of a walk in shared memory: element k of thread t at run[k * threads + t].
__device__ __forceinline__ void load_run(float (&acc)[NX][4], const float* run) {
#pragma unroll
  for (int k = 0; k < 4 * NX; ++k) acc[k / 4][k % 4] = run[k * threads + threadIdx.x];
}
__device__ __forceinline__ void store_run(float* run, const float (&acc)[NX][4]) {
#pragma unroll
  for (int k = 0; k < 4 * NX; ++k) run[k * threads + threadIdx.x] = acc[k / 4][k % 4];
}

// The warp's state rows into the hi and lo [D][ldx] tiles the products read (z dropped unless
// WithZ: the unnormalised query pass).
template <bool WithZ>
__device__ __forceinline__ void split_acc(split_op* hi, split_op* lo, float (&acc)[NX][4], int r0) {
  for_fragment_pairs<NX>(acc, r0, 0, [&](int d, int e, float x0, float x1) {
    if (!WithZ && e == D) x0 = 0.f;
    split2(x0, x1, *reinterpret_cast<std::uint32_t*>(hi + d * ldx + e),
           *reinterpret_cast<std::uint32_t*>(lo + d * ldx + e));
  });
}

// Row flags of the chunk: 1 for a real token of it, 0 for pads and rows past its end.
__device__ __forceinline__ void stage_valid(const linear_kernel_params& f, index_t batch,
                                            index_t t0, int rows, float* valid) {
  if (threadIdx.x < C) {
    const int j = threadIdx.x;
    valid[j] = j < rows && f.valid(batch, t0 + j) ? 1.f : 0.f;
  }
}

// phi(k) of the chunk in two parts, and [v | valid | 0] (v exact in bfloat16); 16-byte pieces
// loaded by lbm_tile_loads (zeros at pads: their k, v may be NaN).
// w: each row's weight of phi(k) (null: 1).
template <class Policy>
__device__ void stage_keys(const lbm_tile_loads<__nv_bfloat16, D, C, threads>& kn,
                           const lbm_tile_loads<__nv_bfloat16, D, C, threads>& vn,
                           const float* valid, split_op* Ph, split_op* Pl, split_op* V,
                           const float* w = nullptr) {
#pragma unroll
  for (int i = 0; i < kn.count; ++i) {
    const int j = kn.row(i), at = j * ld + 8 * kn.piece(i);
    lbm_phi8<__nv_bfloat16, Policy>(kn.raw[i], w != nullptr ? w[j] : 1.f, valid[j] != 0.f, Ph + at,
                                    Pl + at);
  }
#pragma unroll
  for (int i = 0; i < vn.count; ++i) {
    const int j = vn.row(i);
    *reinterpret_cast<uint4*>(V + j * ldx + 8 * vn.piece(i)) =
        valid[j] != 0.f ? vn.raw[i] : make_uint4(0u, 0u, 0u, 0u);
  }
  if (threadIdx.x < C) {
    const int j = threadIdx.x;
    uint4* p = reinterpret_cast<uint4*>(V + j * ldx + D);
    p[0] = make_uint4(pack2<split_op>(valid[j], 0.f), 0u, 0u, 0u);
    p[1] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// scale phi(q) of the chunk in two parts (0 at pads), from pieces loaded by lbm_tile_loads.
template <class Policy>
__device__ __forceinline__ void stage_queries(
    const lbm_tile_loads<__nv_bfloat16, D, C, threads>& qn, float scale, const float* valid,
    split_op* Rh, split_op* Rl) {
#pragma unroll
  for (int i = 0; i < qn.count; ++i) {
    const int t = qn.row(i), at = t * ld + 8 * qn.piece(i);
    lbm_phi8<__nv_bfloat16, Policy>(qn.raw[i], scale, valid[t] != 0.f, Rh + at, Rl + at);
  }
}

// x[i][j] = 0 where the causal mask drops the pair: j > i (Transposed: i < j, the warp's rows j).
template <bool Transposed>
__device__ __forceinline__ void causal_mask(float (&x)[8][4], int r0) {
  for_fragment_pairs<8>(x, r0, 0, [](int row, int col, float& x0, float& x1) {
    if (Transposed) {
      x0 = col < row ? 0.f : x0, x1 = col + 1 < row ? 0.f : x1;
    } else {
      x0 = col > row ? 0.f : x0, x1 = col + 1 > row ? 0.f : x1;
    }
  });
}

// ---- the prefix key gate -------------------------------------------------------------------

// W_ij of query row i and key j: exp(a_j - u_i) / ell_i on j <= i (il: 1 / ell_i, 0 where row i
// has seen no key and past the chunk's end; lg: the logits, -inf at pads).
__device__ __forceinline__ float gate_w(const float* lg, const float* u, const float* il, int i,
                                        int j) {
  // Formed for every pair and selected (a branch a pair cost more than the exp); a masked pair's
  // exp may be inf or NaN, and is dropped.
  const float li = il[i], w = shifted_exp(lg[j], u[i]) * li;
  return j <= i && li > 0.f ? w : 0.f;
}

// x[i][j] *= W_ij in place of the causal mask (Transposed: the warp's rows are keys j and its
// columns queries i; with Kappa, wk[half] += W_ij kappa_i over the lane's columns).
template <bool Transposed, bool Kappa = false>
__device__ __forceinline__ void gate_weights(float (&x)[8][4], int r0, const float* lg,
                                             const float* u, const float* il,
                                             const float* kap = nullptr, float* wk = nullptr) {
  for_fragment_pairs_at<8>(x, r0, 0, [&](int row, int col, float& x0, float& x1, int, int half) {
    const float w0 = Transposed ? gate_w(lg, u, il, col, row) : gate_w(lg, u, il, row, col);
    const float w1 = Transposed ? gate_w(lg, u, il, col + 1, row) : gate_w(lg, u, il, row, col + 1);
    x0 *= w0, x1 *= w1;
    if constexpr (Kappa) wk[half] += w0 * kap[col] + w1 * kap[col + 1];
  });
}

// Row i of the warp's accumulators times s[i].
template <int NT>
__device__ __forceinline__ void scale_rows(float (&x)[NT][4], int r0, const float* s) {
  for_fragment_pairs<NT>(x, r0, 0,
                         [&](int i, int, float& x0, float& x1) { x0 *= s[i], x1 *= s[i]; });
}

// Row j of a two-part [C][Ld] tile (its first Cols columns) times w[j], in place; a thread takes
// half a row.
template <int Ld, int Cols>
__device__ __forceinline__ void weigh_rows(split_op* hi, split_op* lo, const float* w) {
  static_assert(threads == 2 * C && Cols % 4 == 0, "half a row a thread, in pairs");
  const int j = threadIdx.x / 2, e0 = (threadIdx.x % 2) * (Cols / 2);
  const float s = w[j];
#pragma unroll 4
  for (int e = e0; e < e0 + Cols / 2; e += 2) {
    std::uint32_t& x = *reinterpret_cast<std::uint32_t*>(hi + j * Ld + e);
    std::uint32_t& y = *reinterpret_cast<std::uint32_t*>(lo + j * Ld + e);
    const float2 a = unpack2<split_op>(x), b = unpack2<split_op>(y);
    split2(s * (a.x + b.x), s * (a.y + b.y), x, y);
  }
}

// Every accumulator times s.
template <int NT>
__device__ __forceinline__ void scale_all(float (&x)[NT][4], float s) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int k = 0; k < 4; ++k) x[nt][k] *= s;
}

// Where (u_i, ell_i) of token t of KV head h sit in the query pass's buffer of row maxima and
// masses, and the pair.
__device__ __forceinline__ index_t mass_at(const linear_kernel_params& f, index_t batch, index_t t,
                                           int h) {
  return 2 * ((batch * f.tokens + t) * f.kv_heads + h);
}
__device__ __forceinline__ float2 row_mass(const float* mass, const linear_kernel_params& f,
                                           index_t batch, index_t t, int h) {
  return *reinterpret_cast<const float2*>(mass + mass_at(f, batch, t, h));
}

// dx = mul * acc * phi'(x) of the warp's rows r0 .. (tokens t0 + row of head hh; 0 at pads) into
// out: the chunk's dq (x = q, mul = scale) or dk (x = k, mul = 1). The inputs are loaded in one
// round trip (lbm_fragment_pairs).
template <class Policy, class Dev>
__device__ __forceinline__ void store_phi_grad(float (&acc)[8][4], const void* x, const index_t* xs,
                                               void* out, const index_t* os, index_t batch,
                                               index_t t0, int rows, int hh, int r0,
                                               const float* valid, float mul) {
  std::uint32_t raw[8][2];
  lbm_fragment_pairs<Dev>(raw, x, xs, batch, t0, rows, hh, r0);
  // The two rows' output addresses formed once (see lbm_fragment_pairs).
  const int g = (threadIdx.x % 32) >> 2;
  Dev* const at = static_cast<Dev*>(out) + batch * os[0] + hh * os[2] + 2 * (threadIdx.x % 4);
  Dev* const out_row[2] = {at + (t0 + r0 + g) * os[1], at + (t0 + r0 + g + 8) * os[1]};
  for_fragment_pairs_at<8>(acc, r0, 0, [&](int i, int, float x0, float x1, int nt, int half) {
    if (i >= rows) return;
    const float2 v = unpack2<Dev>(raw[nt][half]);
    const bool ok = valid[i] != 0.f;
    const float y0 =
        ok ? mul * x0 * fast_phi_derivative<Policy::phi>(v.x, fast_feature_map<Policy::phi>(v.x))
           : 0.f;
    const float y1 =
        ok ? mul * x1 * fast_phi_derivative<Policy::phi>(v.y, fast_feature_map<Policy::phi>(v.y))
           : 0.f;
    *reinterpret_cast<std::uint32_t*>(out_row[half] + 8 * nt) = pack2<Dev>(y0, y1);
  });
}
// The query and key kernels' shared memory: phi(k) and R = scale phi(q) ([C][ld], two parts
// each), [v | valid] ([C][ldx]), the carried state or its gradient ([D][ldx], two parts; [S | z]
// or [dS | dz]), [g | delta] ([C][ldx], two parts), the chunk's valid flags [C], the running sum
// in float (4 NX floats a thread), then each kernel's own gate rows.
struct walk_smem {
  split_op *Ph, *Pl, *Rh, *Rl, *V, *Xh, *Xl, *Gh, *Gl;
  float *valid, *run, *rows;
  __device__ explicit walk_smem(unsigned char* raw)
      : Ph(reinterpret_cast<split_op*>(raw)),
        Pl(Ph + tile),
        Rh(Pl + tile),
        Rl(Rh + tile),
        V(Rl + tile),
        Xh(V + xtile),
        Xl(Xh + xtile),
        Gh(Xl + xtile),
        Gl(Gh + xtile),
        valid(reinterpret_cast<float*>(Gl + xtile)),
        run(valid + C),
        rows(run + 4 * NX * threads) {}
};

}  // namespace lbc

// CTA (slot s, KV head h, sequence n): the slot's own [S | z], summed over its chunks (under the
// key gate relative to the running max of its logits, with that max and the mass).
template <class Policy>
__global__ void __launch_bounds__(lbc::threads)
    linear_bwd_chunk_sums_mma_kernel(const linear_backward_params bp, const int* slot_offsets,
                                     const int walk, float* state) {
  using namespace lbc;
  constexpr bool gated = Policy::gate != key_gate::off;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* Ph = reinterpret_cast<split_op*>(smem_raw);  // [C][ld] phi(k), two parts
  split_op* Pl = Ph + tile;
  split_op* V = Pl + tile;                             // [C][ldx] v | valid
  float* valid = reinterpret_cast<float*>(V + xtile);  // [C]
  float* gr = valid + C;                               // gated: [5][C] + 2 gate rows
  const causal_chunk_rows rs{valid, gr, gr + C, gr + 2 * C, gr + 3 * C, gr + 4 * C, gr + 5 * C};
  const linear_kernel_params& f = bp.f;
  const int s = blockIdx.x, h = blockIdx.y, n = blockIdx.z, r0 = 16 * (threadIdx.x / 32);
  index_t batch, start, length, first, last;
  f.sequence(n, batch, start, length);
  if (!walk_range(s, walk, length, first, last)) return;
  lbm_tile_loads<__nv_bfloat16, D, C, threads> kn, vn;  // the next chunk's, a chunk ahead
  kn.fetch(f, f.k, f.k_stride, batch, start, first * C, min(length, first * C + C), h);
  vn.fetch(f, f.v, f.v_stride, batch, start, first * C, min(length, first * C + C), h);
  float acc[NX][4] = {};
  float m = -INFINITY, ell = 0.f;  // gated: max and mass of the slot's keys so far
  for (index_t c = first; c < last; ++c) {
    const index_t c0 = c * C, c1 = min(length, c0 + C);
    if (c > first) __syncthreads();  // the chunk before is multiplied
    if constexpr (gated)
      causal_chunk_gates<true>(f, batch, start + c0, int(c1 - c0), h, rs, m, ell);
    else
      stage_valid(f, batch, start + c0, int(c1 - c0), valid);
    __syncthreads();
    stage_keys<Policy>(kn, vn, valid, Ph, Pl, V, gated ? rs.wk : nullptr);
    if (c + 1 < last) {
      kn.fetch(f, f.k, f.k_stride, batch, start, c1, min(length, c1 + C), h);
      vn.fetch(f, f.v, f.v_stride, batch, start, c1, min(length, c1 + C), h);
    }
    if constexpr (gated) {  // the sum so far moves to the chunk's max
      scale_all(acc, rescale_factor(m, rs.next[0]));
      m = rs.next[0], ell = rs.next[1];
    }
    __syncthreads();
    warp_mma<ldx, true, false, NX>(acc, a_from_tile_t<ld, true>{Ph, Pl, r0}, V, nullptr);
  }
  float* out = state + (index_t(slot_offsets[n] + s) * f.kv_heads + h) * slot_floats<gated>;
  acc_to_slot(out, acc, r0);
  if (gated && threadIdx.x == 0) out[SS] = m, out[SS + 1] = ell;
}

// CTA (slot s, KV head h, sequence n): dq, 1 / den and delta of every query head of h's group
// over the slot's chunks, and the slot's R^T [g | delta] to dstate (state: the state before each
// slot). Gated: the rows are weighted as the header says; delta_buf holds kappa_i where there is
// no normaliser (delta = 0 there); the slot's sum is of beta_i [g | delta] with beta_i the mass
// before the slot over row i's, and sum_i beta_i kappa_i goes to its kappa; mass_buf gets every
// row's (u_i, ell_i).
template <class Policy>
__global__ void __launch_bounds__(lbc::threads)
    linear_bwd_causal_query_mma_kernel(const linear_backward_params bp, const int* slot_offsets,
                                       const int walk, const float* state, float* dstate,
                                       float* inv_buf, float* delta_buf, float* mass_buf) {
  using namespace lbc;
  using Dev = __nv_bfloat16;
  constexpr bool normalize = Policy::normalize;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr int SSn = slot_floats<gated>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const walk_smem sm(smem_raw);  // the carried state: [S | z]
  split_op *const Ph = sm.Ph, *const Pl = sm.Pl, *const Rh = sm.Rh, *const Rl = sm.Rl;
  split_op *const V = sm.V, *const Sh = sm.Xh, *const Sl = sm.Xl, *const Gh = sm.Gh,
                  *const Gl = sm.Gl;
  float *const valid = sm.valid, *const run = sm.run;
  // Gated: the chunk's gate rows (causal_chunk_gates; mass and carry become 1 / ell_i and cn_i),
  // then 4 floats of reduction.
  float* gr = sm.rows;
  const causal_chunk_rows rs{valid, gr, gr + C, gr + 2 * C, gr + 3 * C, gr + 4 * C, gr + 5 * C};
  const linear_kernel_params& f = bp.f;
  const int s = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int r0 = 16 * (threadIdx.x / 32);
  index_t batch, start, length, first, last;
  f.sequence(n, batch, start, length);
  if (!walk_range(s, walk, length, first, last)) return;
  const index_t slot = index_t(slot_offsets[n] + s) * f.kv_heads + h;
  const int hq0 = h * f.group, hq1 = hq0 + f.group;
  // Gated: the running max and mass (from the slot's), and the slot's own start.
  float m = 0.f, ell = 1.f, m_slot = 0.f, ell_slot = 1.f;
  if constexpr (gated) {
    m = m_slot = state[slot * SSn + SS + 2];
    ell = ell_slot = state[slot * SSn + SS + 3];
  }

  lbm_tile_loads<Dev, D, C, threads> kn, vn, qn;  // in flight while the state is staged
  {
    const index_t c0 = first * C, c1 = min(length, c0 + C);
    kn.fetch(f, f.k, f.k_stride, batch, start, c0, c1, h);
    vn.fetch(f, f.v, f.v_stride, batch, start, c0, c1, h);
    qn.fetch(f, f.q, f.q_stride, batch, start, c0, c1, hq0);
    float acc[NX][4];
    slot_to_acc(acc, state + slot * SSn, r0);
    store_run(run, acc);
    split_acc<normalize>(Sh, Sl, acc, r0);
  }

  float ds[NX][4] = {};  // the slot's R^T [g | delta], state rows r0 ..
  float kap_sum = 0.f;   // gated: this thread's part of the slot's sum of beta_i kappa_i
  for (index_t c = first; c < last; ++c) {
    const index_t c0 = c * C, c1 = min(length, c0 + C);
    const int rows = int(c1 - c0);
    if (c > first) __syncthreads();  // the chunk before has carried the state
    if constexpr (gated) {
      causal_chunk_gates<true>(f, batch, start + c0, rows, h, rs, m, ell);
      if (threadIdx.x < 32)  // the lanes that wrote the rows
        for (int i = threadIdx.x; i < C; i += 32) {
          const float l = rs.mass[i], il = l > 0.f ? 1.f / l : 0.f;
          if (i < rows)
            *reinterpret_cast<float2*>(mass_buf + mass_at(f, batch, start + c0 + i, h)) =
                make_float2(rs.run_max[i], l);
          rs.mass[i] = il, rs.carry[i] *= il;
        }
    } else {
      stage_valid(f, batch, start + c0, rows, valid);
    }
    __syncthreads();
    stage_keys<Policy>(kn, vn, valid, Ph, Pl, V);

    for (int hq = hq0; hq < hq1; ++hq) {
      stage_queries<Policy>(qn, f.scale, valid, Rh, Rl);
      if (hq + 1 < hq1)
        qn.fetch(f, f.q, f.q_stride, batch, start, c0, c1, hq + 1);
      else if (c + 1 < last)
        qn.fetch(f, f.q, f.q_stride, batch, start, c1, min(length, c1 + C), hq0);
      __syncthreads();

      // A = R phi(K)^T on j <= i (gated: times W); [num | den] = R [S | z] (gated: times cn) +
      // A [V | 1].
      const a_from_tile<ld, true> ra{Rh, Rl, r0};
      float A[8][4] = {};
      warp_mma<ld, false, true, 8>(A, ra, Ph, Pl);
      if constexpr (gated)
        gate_weights<false>(A, r0, rs.logit, rs.run_max, rs.mass);
      else
        lbc::causal_mask<false>(A, r0);
      float N[NX][4] = {};
      warp_mma<ldx, true, true, NX>(N, ra, Sh, Sl);
      if constexpr (gated) scale_rows(N, r0, rs.carry);
      warp_mma<ldx, true, false, NX>(N, a_from_regs<true>{A, 1.f}, V, nullptr);

      // g = do / den, delta = -(do . num) / den^2 on the accumulator rows (a row in one quad);
      // gated, kappa_i = eps delta (without the normaliser -do . num) and a row that has seen no
      // key passes nothing.
      const int lane = threadIdx.x % 32, gi = lane >> 2, c2 = 2 * (lane & 3);
      std::uint32_t dout[8][2];
      lbm_fragment_pairs<Dev>(dout, bp.dout, bp.dout_stride, batch, start + c0, rows, hq, r0);
      float G[NX][4] = {};
      float inv[2], dot[2] = {0.f, 0.f};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + gi + 8 * half;
        const bool ok = valid[i] != 0.f;
        const float den = __shfl_sync(0xffffffffu, N[NX - 2][2 * half], lane & ~3) + f.eps;
        inv[half] = normalize ? (gated && !(rs.mass[i] > 0.f) ? 0.f : 1.f / den) : 1.f;
        if (!ok) continue;  // g = delta = 0
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 o = unpack2<Dev>(dout[nt][half]);
          dot[half] += o.x * N[nt][2 * half] + o.y * N[nt][2 * half + 1];
          G[nt][2 * half] = o.x * inv[half], G[nt][2 * half + 1] = o.y * inv[half];
        }
      }
      float beta[2] = {1.f, 1.f};  // gated: the mass before the slot over row i's
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = r0 + gi + 8 * half;
        const float sum = quad_sum(dot[half]);
        const bool ok = valid[i] != 0.f;
        const float delta = normalize && ok ? -sum * inv[half] * inv[half] : 0.f;
        if (c2 == 0) G[NX - 2][2 * half] = delta;  // column D
        float kappa = 0.f;
        if constexpr (gated) {
          kappa = normalize ? f.eps * delta : ok ? -sum : 0.f;
          beta[half] = shifted_exp(m_slot, rs.run_max[i]) * ell_slot * rs.mass[i];
          if (c2 == 0) kap_sum += beta[half] * kappa;
        }
        if (i < rows && c2 == 0) {
          const index_t row = (batch * f.tokens + start + c0 + i) * f.q_heads + hq;
          inv_buf[row] = inv[half], delta_buf[row] = gated && !normalize ? kappa : delta;
        }
      }
      for_fragment_pairs_at<NX>(G, r0, 0, [&](int i, int e, float x0, float x1, int, int half) {
        const float b = gated ? beta[half] : 1.f;
        split2(b * x0, b * x1, *reinterpret_cast<std::uint32_t*>(Gh + i * ldx + e),
               *reinterpret_cast<std::uint32_t*>(Gl + i * ldx + e));
      });

      // dA = [g | delta] [V | 1]^T on j <= i (gated: times W); dq = scale phi'(q) ([g | delta]
      // [S | z]^T (gated: times cn) + dA P).
      float dA[8][4] = {};
      warp_mma<ldx, false, false, 8, KX>(dA, a_from_regs<true>{G, 1.f}, V, nullptr);
      if constexpr (gated)
        gate_weights<false>(dA, r0, rs.logit, rs.run_max, rs.mass);
      else
        lbc::causal_mask<false>(dA, r0);
      float Q[8][4] = {};
      warp_mma<ldx, false, true, 8, KX>(Q, a_from_regs<true>{G, 1.f}, Sh, Sl);
      if constexpr (gated) scale_rows(Q, r0, rs.carry);
      warp_mma<ld, true, true, 8>(Q, a_from_regs<true>{dA, 1.f}, Ph, Pl);
      store_phi_grad<Policy, Dev>(Q, f.q, f.q_stride, bp.dq, bp.dq_stride, batch, start + c0, rows,
                                  hq, r0, valid, f.scale);
      __syncthreads();  // [g | delta] is staged

      // The chunk's R^T [g | delta] (sums over its query rows).
      warp_mma<ldx, true, true, NX>(ds, a_from_tile_t<ld, true>{Rh, Rl, r0}, Gh, Gl);
      __syncthreads();  // R, [g | delta] and the state tiles are free
    }
    if (c + 1 < last) {  // the state past the chunk: [S | z] += phi(K)^T [V | 1]
      // (the next chunk's keys asked for here: held over the products, they would spill)
      kn.fetch(f, f.k, f.k_stride, batch, start, c1, min(length, c1 + C), h);
      vn.fetch(f, f.v, f.v_stride, batch, start, c1, min(length, c1 + C), h);
      float acc[NX][4];
      load_run(acc, run);
      if constexpr (gated) {  // to the max after the chunk; its keys weighted exp(a_j - m')
        scale_all(acc, rescale_factor(m, rs.next[0]));
        m = rs.next[0], ell = rs.next[1];
        weigh_rows<ld, D>(Ph, Pl, rs.wk);
        __syncthreads();
      }
      warp_mma<ldx, true, false, NX>(acc, a_from_tile_t<ld, true>{Ph, Pl, r0}, V, nullptr);
      store_run(run, acc);
      split_acc<normalize>(Sh, Sl, acc, r0);
    }
  }
  acc_to_slot(dstate + slot * SSn, ds, r0);
  if constexpr (gated) {
    kap_sum = block_reduce<false>(kap_sum, gr + 5 * C + 2);
    if (threadIdx.x == 0) dstate[slot * SSn + SS] = kap_sum;
  }
}

// CTA (slot s, KV head h, sequence n): dk and dv of the slot's keys, last chunk first (dstate: the
// gradient of the state after each slot; inv_buf, delta_buf: the query kernel's 1 / den and delta).
// Gated: da too (to da_heads where a shared gate sums the heads' after), from the query kernel's
// rows' (u_i, ell_i) in mass_buf and kappa after each slot in dstate.
template <class Policy>
__global__ void __launch_bounds__(lbc::threads)
    linear_bwd_causal_key_mma_kernel(const linear_backward_params bp, const int* slot_offsets,
                                     const int walk, const float* dstate, const float* inv_buf,
                                     const float* delta_buf, const float* mass_buf,
                                     float* da_heads) {
  using namespace lbc;
  using Dev = __nv_bfloat16;
  constexpr bool normalize = Policy::normalize;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr int SSn = slot_floats<gated>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const walk_smem sm(smem_raw);  // the carried gradient: [dS | dz]
  split_op *const Ph = sm.Ph, *const Pl = sm.Pl, *const Rh = sm.Rh, *const Rl = sm.Rl;
  split_op *const V = sm.V, *const dSh = sm.Xh, *const dSl = sm.Xl, *const Gh = sm.Gh,
                  *const Gl = sm.Gl;
  float *const valid = sm.valid, *const run = sm.run;
  // Gated: the chunk's logits, u_i, 1 / ell_i, beta_i and one head's kappa_i; 4 floats of
  // reduction.
  float* lg = sm.rows;
  float *u = lg + C, *il = lg + 2 * C, *beta = lg + 3 * C, *kap = lg + 4 * C, *red = lg + 5 * C;
  const linear_kernel_params& f = bp.f;
  const int s = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int r0 = 16 * (threadIdx.x / 32);
  index_t batch, start, length, first, last;
  f.sequence(n, batch, start, length);
  if (!walk_range(s, walk, length, first, last)) return;
  const int hq0 = h * f.group, hq1 = hq0 + f.group;
  const index_t slot = index_t(slot_offsets[n] + s) * f.kv_heads + h;
  float kappa = gated ? dstate[slot * SSn + SS] : 0.f;  // after the chunk

  lbm_tile_loads<Dev, D, C, threads> kn, vn, qn;  // in flight while the state is staged
  {
    const index_t c0 = (last - 1) * C, c1 = min(length, c0 + C);
    kn.fetch(f, f.k, f.k_stride, batch, start, c0, c1, h);
    vn.fetch(f, f.v, f.v_stride, batch, start, c0, c1, h);
    qn.fetch(f, f.q, f.q_stride, batch, start, c0, c1, hq0);
    float acc[NX][4];
    slot_to_acc(acc, dstate + slot * SSn, r0);
    store_run(run, acc);
    split_acc<true>(dSh, dSl, acc, r0);
  }

  for (index_t walked = last - 1; walked >= first; --walked) {
    const index_t c = lbm_opaque(walked), c0 = c * C, c1 = min(length, c0 + C);
    const int rows = int(c1 - c0);
    if (c + 1 < last) __syncthreads();  // the chunk after is done and dS carried past it
    // Gated: the masses before and after the chunk, rho their ratio; f_j = exp(a_j - m_end) /
    // ell_end is the weight of key j in the state after it.
    float m0 = 0.f, ell0 = 1.f, m1 = 0.f, inv1 = 0.f, rho = 1.f;
    if constexpr (gated) {
      if (c0 > 0) {
        const float2 x = row_mass(mass_buf, f, batch, start + c0 - 1, h);
        m0 = x.x, ell0 = x.y;
      } else {
        state_in_mass<Policy>(f, n, h, m0, ell0);
      }
      const float2 x = row_mass(mass_buf, f, batch, start + c1 - 1, h);
      m1 = x.x, inv1 = x.y > 0.f ? 1.f / x.y : 0.f;
      rho = shifted_exp(m0, m1) * ell0 * inv1;
      if (threadIdx.x < C) {
        const int j = threadIdx.x;
        const bool ok = j < rows && f.valid(batch, start + c0 + j);
        valid[j] = ok ? 1.f : 0.f;
        lg[j] = ok ? f.logit(batch, start + c0 + j, h) : -INFINITY;
        const float2 y =
            j < rows ? row_mass(mass_buf, f, batch, start + c0 + j, h) : make_float2(0.f, 0.f);
        u[j] = y.x, il[j] = y.y > 0.f ? 1.f / y.y : 0.f;
        beta[j] = shifted_exp(m0, y.x) * ell0 * il[j];
      }
    } else {
      stage_valid(f, batch, start + c0, rows, valid);
    }
    __syncthreads();
    stage_keys<Policy>(kn, vn, valid, Ph, Pl, V);
    __syncthreads();

    // e = [V | 1] [dS | dz]^T, dv = phi(K) dS (gated: both times f_j), then the chunk's own query
    // rows.
    const a_from_tile<ld, true> pa{Ph, Pl, r0};
    float E[8][4] = {}, DV[8][4] = {};
    warp_mma<ldx, false, true, 8, KX>(E, a_from_tile<ldx, false>{V, nullptr, r0}, dSh, dSl);
    warp_mma<ldx, true, true, 8>(DV, pa, dSh, dSl);
    float fw[2] = {0.f, 0.f}, wk[2] = {0.f, 0.f}, kap_sum = 0.f;
    if constexpr (gated) {
      const int g = (threadIdx.x % 32) >> 2;
      fw[0] = shifted_exp(lg[r0 + g], m1) * inv1, fw[1] = shifted_exp(lg[r0 + g + 8], m1) * inv1;
      for_fragment_pairs_at<8>(E, r0, 0, [&](int, int, float& x0, float& x1, int, int half) {
        x0 *= fw[half], x1 *= fw[half];
      });
      for_fragment_pairs_at<8>(DV, r0, 0, [&](int, int, float& x0, float& x1, int, int half) {
        x0 *= fw[half], x1 *= fw[half];
      });
    }
    for (int hq = hq0; hq < hq1; ++hq) {
      stage_queries<Policy>(qn, f.scale, valid, Rh, Rl);
      if (hq + 1 < hq1)
        qn.fetch(f, f.q, f.q_stride, batch, start, c0, c1, hq + 1);
      else if (c > first)
        qn.fetch(f, f.q, f.q_stride, batch, start, c0 - C, c0, hq0);
      // [g | delta | 0] of the chunk's rows, two parts (0 past the end; g = delta = 0 at pads):
      // g = do / den as the query kernel made it, do in 16-byte pieces, every load issued before
      // the first split. Gated, kappa_i of the rows.
      {
        lbm_tile_loads<Dev, D, C, threads> dn;
        dn.fetch(f, bp.dout, bp.dout_stride, batch, start, c0, c1, hq);
        float w[dn.count];  // 1 / den of each piece's row
#pragma unroll
        for (int r = 0; r < dn.count; ++r) {
          const int i = dn.row(r);
          w[r] = i < rows && valid[i] != 0.f
                     ? inv_buf[(batch * f.tokens + start + c0 + i) * f.q_heads + hq]
                     : 0.f;
        }
        // Columns D .. X - 1: delta, then zeros; two 8-wide pieces a row.
        const int zi = threadIdx.x / 2, zp = threadIdx.x % 2;
        static_assert(threads == 2 * C && X - D == 16, "one zero piece a thread");
        float delta = zp == 0 && zi < rows && valid[zi] != 0.f
                          ? delta_buf[(batch * f.tokens + start + c0 + zi) * f.q_heads + hq]
                          : 0.f;
        if constexpr (gated) {
          // delta_buf holds kappa_i where there is no normaliser (and delta is 0).
          const float k = normalize ? f.eps * delta : delta;
          if (zp == 0) kap[zi] = k, kap_sum += beta[zi] * k;
          if (!normalize) delta = 0.f;
        }
#pragma unroll
        for (int r = 0; r < dn.count; ++r) {
          uint4 hi, lo;
          lbm_split8<Dev>(dn.raw[r], hi, lo, w[r]);
          const int at = dn.row(r) * ldx + 8 * dn.piece(r);
          *reinterpret_cast<uint4*>(Gh + at) = hi, *reinterpret_cast<uint4*>(Gl + at) = lo;
        }
        std::uint32_t dh, dl;
        split2(delta, 0.f, dh, dl);
        const int at = zi * ldx + D + 8 * zp;
        *reinterpret_cast<uint4*>(Gh + at) = make_uint4(dh, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(Gl + at) = make_uint4(dl, 0u, 0u, 0u);
      }
      __syncthreads();

      // A^T = P R^T and dA^T = [V | 1] [g | delta]^T on i >= j (gated: times W^T); dv += A^T g,
      // e += dA^T R (one score tile live at a time).
      {
        float At[8][4] = {};
        warp_mma<ld, false, true, 8>(At, pa, Rh, Rl);
        if constexpr (gated)
          gate_weights<true, true>(At, r0, lg, u, il, kap, wk);
        else
          lbc::causal_mask<true>(At, r0);
        warp_mma<ldx, true, true, 8>(DV, a_from_regs<true>{At, 1.f}, Gh, Gl);
      }
      {
        float dAt[8][4] = {};
        warp_mma<ldx, false, true, 8, KX>(dAt, a_from_tile<ldx, false>{V, nullptr, r0}, Gh, Gl);
        if constexpr (gated)
          gate_weights<true>(dAt, r0, lg, u, il);
        else
          lbc::causal_mask<true>(dAt, r0);
        warp_mma<ld, true, true, 8>(E, a_from_regs<true>{dAt, 1.f}, Rh, Rl);
      }
      if (c > first) {          // the gradient of the state before the chunk: += R^T [g | delta]
        if constexpr (gated) {  // (gated: rho times the one after it, and beta_i [g | delta])
          __syncthreads();      // every warp's products with [g | delta] are done
          weigh_rows<ldx, X>(Gh, Gl, beta);
          __syncthreads();
        }
        float acc[NX][4];
        load_run(acc, run);
        if (gated && hq == hq0) scale_all(acc, rho);
        warp_mma<ldx, true, true, NX>(acc, a_from_tile_t<ld, true>{Rh, Rl, r0}, Gh, Gl);
        store_run(run, acc);
      }
      __syncthreads();  // R and [g | delta] are free for the next head
    }

    store_phi_grad<Policy, Dev>(E, f.k, f.k_stride, bp.dk, bp.dk_stride, batch, start + c0, rows, h,
                                r0, valid, 1.f);
    for_fragment_pairs<8>(DV, r0, 0, [&](int j, int e, float x0, float x1) {
      if (j >= rows) return;
      const bool ok = valid[j] != 0.f;
      lbm_store2<Dev>(bp.dv, bp.dv_stride, batch, start + c0 + j, h, e, ok ? x0 : 0.f,
                      ok ? x1 : 0.f);
    });
    if constexpr (gated) {
      // da_j = phi(k_j) . dphik_j + f_j kappa + sum_i W_ij kappa_i (the last over the heads).
      float pe[2] = {0.f, 0.f};
      for_fragment_pairs_at<8>(E, r0, 0, [&](int j, int d, float x0, float x1, int, int half) {
        const float2 ph =
            unpack2<split_op>(*reinterpret_cast<const std::uint32_t*>(Ph + j * ld + d));
        const float2 pl =
            unpack2<split_op>(*reinterpret_cast<const std::uint32_t*>(Pl + j * ld + d));
        pe[half] += (ph.x + pl.x) * x0 + (ph.y + pl.y) * x1;
      });
      const int lane = threadIdx.x % 32, g = lane >> 2;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float da = quad_sum(pe[half]) + fw[half] * kappa + quad_sum(wk[half]);
        const int j = r0 + g + 8 * half;
        if ((lane & 3) == 0 && j < rows) {
          const float y = valid[j] != 0.f ? da : 0.f;
          if (da_heads != nullptr)
            da_heads[(index_t(h) * bp.batch + batch) * f.tokens + start + c0 + j] = y;
          else
            bp.da[batch * bp.da_stride[0] + (start + c0 + j) * bp.da_stride[1] +
                  (f.gate_heads == 1 ? 0 : h) * bp.da_stride[2]] = y;
        }
      }
      // kappa before the chunk (the sum over every thread's rows: the block agrees on it).
      if (c > first) kappa = rho * kappa + block_reduce<false>(kap_sum, red);
    }
    if (c > first) {  // every warp is past its products with dS (the head loop's last barrier)
      // (the chunk before's keys asked for here: held over the products, they would spill)
      kn.fetch(f, f.k, f.k_stride, batch, start, c0 - C, c0, h);
      vn.fetch(f, f.v, f.v_stride, batch, start, c0 - C, c0, h);
      float acc[NX][4];
      load_run(acc, run);
      split_acc<true>(dSh, dSl, acc, r0);
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
