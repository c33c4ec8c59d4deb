#pragma once
// The query kernel of the PaTH / PaTH-FoX backward on tensor cores (mma.sync m16n8k16, float
// accumulation) for half and bfloat16 inputs at D = Dv = 64: the work, grid, scratch and sums of
// path_backward_query_tiled_kernel (path_backward_tiled.cuh), whose chunk kernel then runs with
// the transitions' gradients folded in. Per query chunk: the diagonal tile, the forward's
// right-to-left walk through the earlier chunks (keeping each chunk's scan state and e = dZ K~),
// the left-to-right adjoint through the chunk products, and the chunk's own transform back to dq.
//
// An earlier chunk's product P = I - W^T U is applied as the dense D x D N = W^T U
// (path_backward_transitions_kernel makes it once): one product a step where the rank-C form
// takes two, and the adjoint sums dP = r^T rbar over the query rows (one product) where dW and dU
// would take four; path_backward_fold_transitions_kernel turns dP into dW = -U dP^T and
// dU = -W dP once per chunk.
//
// A CTA has 8 warps; warp w owns query rows 16 (w % 4) .. + 15 and columns 32 (w / 4) .. + 31 of
// every [64 x 64] result, and keeps that part of the running query r, its adjoint rbar, the
// scores and dP in registers (float). The operands of every product are read from shared memory:
// r, rbar, P and dZ are stored there (split) as they change, so the two warps of a row block read
// whole rows. The products that sum over the chunk's query rows (what keys and transitions
// receive: dv, dK~, dP, and the diagonal tile's dk, dM, dW and dU) are added to the slice's float
// sums, one thread an element, in a fixed order (the same bits on every run), as reductions that
// no thread waits for. In both walks, the next step's keys, v and transition are copied
// (cp.async) into a second buffer or a staging tile while a step computes.
// Operands are bfloat16 in two parts (collective/split_mma.cuh); inputs in bfloat16 take one, half
// inputs two (11 bits do not fit one bfloat16).

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/collective/split_tiles.cuh"
#include "attnmix/cuda/collective/tril_inverse.cuh"
#include "attnmix/cuda/kernels/path_backward_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

namespace path_bwd_mma {

using L = path_bwd_mma_layout;
constexpr int C = L::C, ld = L::ld;

// The CTA's tile staging (collective/split_tiles.cuh).
static_assert(C == split_tile::C && ld == split_tile::ld && L::threads == split_tile::threads,
              "the backward's tiles are split_tile's");
using tile_regs = split_tile::regs;
using split_tile::for_tile_pairs;
using split_tile::load_tile;
using split_tile::stage;
using split_tile::store_split;
using split_tile::store_tile;

// x = the slices' sum, in slice order, of the tile at base[at(r, c)] of slice 0, each slice's
// copy `stride` elements further: slice 0's loads in flight together, then one slice at a time.
template <class F>
__device__ __forceinline__ void load_slice_sum(tile_regs& x, const float* base, index_t stride,
                                               int slices, F&& at, int rows, int cols) {
  load_tile(
      x, [&](int r, int c) { return base[at(r, c)]; }, rows, cols);
  for (int sl = 1; sl < slices; ++sl) {
    tile_regs y;
    load_tile(
        y, [&](int r, int c) { return base[sl * stride + at(r, c)]; }, rows, cols);
#pragma unroll
    for (int k = 0; k < C * 32 / L::threads; ++k) x[k][0] += y[k][0], x[k][1] += y[k][1];
  }
}

// dst[r][c] += sign * acc for the rows r < rows of a warp's part (dst rows of ldd floats), as
// reductions that nothing waits for. Each element of a sum has one thread of the grid adding to
// it (a slice's sums are its CTA's; a warp's part is the same at every step), so the bits are
// those of a load, add and store in program order.
__device__ __forceinline__ void add_rows(float (&acc)[4][4], float* dst, int ldd, int r0, int c0,
                                         int rows, float sign) {
  for_fragment_at<4>(acc, dst, r0, c0, ldd, [&](int r, float* p, float x0, float x1) {
    if (r < rows) red_add2(p, sign * x0, sign * x1);
  });
}

// A warp's part into rows of a split tile kept in global memory for 16-byte copies: row r holds
// hi (C elements) then lo (C elements), the 256 bytes of a float row.
__device__ __forceinline__ void save_split_rows(float (&acc)[4][4], split_op* dst, int r0, int c0) {
  for_fragment_at<4>(acc, dst, r0, c0, 2 * C, [&](int, split_op* p, float x0, float x1) {
    std::uint32_t h, l;
    split2(x0, x1, h, l);
    *reinterpret_cast<std::uint32_t*>(p) = h;
    *reinterpret_cast<std::uint32_t*>(p + C) = l;
  });
}

// A warp's part to / from float rows (rows r < rows; others read as 0).
__device__ __forceinline__ void save_rows(float (&acc)[4][4], float* dst, int ldd, int r0, int c0,
                                          int rows) {
  for_fragment_at<4>(acc, dst, r0, c0, ldd, [&](int r, float* p, float x0, float x1) {
    if (r < rows) *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
  });
}
__device__ __forceinline__ void load_rows(float (&acc)[4][4], const float* src, int ldd, int r0,
                                          int c0, int rows) {
  for_fragment_at<4>(acc, src, r0, c0, ldd, [&](int r, const float* p, float& x0, float& x1) {
    float2 v = make_float2(0.f, 0.f);
    if (r < rows) v = *reinterpret_cast<const float2*>(p);
    x0 = v.x, x1 = v.y;
  });
}

// Asks L2 for the Rows x Cols elements of a tile from base (row stride `stride` elements): the
// tiles of the next step, fetched while this one computes (a CTA streams far more than L2 holds).
// A row may straddle one line more than its bytes fill, so each row asks for its last byte too.
// Shapes are compile-time, and a thread asks for one line at most: this runs a few times a step,
// where a general loop cost ~100 instructions a call (a fifth of a walk step's).
template <int Rows, int Cols, class E>
__device__ __forceinline__ void prefetch_rows(const E* base, index_t stride) {
  constexpr int bytes = Cols * int(sizeof(E)), lines = (bytes + 127) / 128 + 1;
  static_assert(Rows * lines <= L::threads, "a line a thread");
  const int i = threadIdx.x;
  if (i < Rows * lines) {
    const int r = i / lines, l = i - r * lines;
    const int at = l * 128 < bytes ? l * 128 : bytes - 1;  // the row's last byte: its last line
    prefetch_l2(reinterpret_cast<const char*>(base + r * stride) + at);
  }
}
// The same for a tile of Rows dense rows (stride Cols): one span of lines.
template <int Rows, int Cols, class E>
__device__ __forceinline__ void prefetch_dense(const E* base) {
  constexpr int bytes = Rows * Cols * int(sizeof(E)), lines = (bytes + 127) / 128 + 1;
  static_assert(lines <= L::threads, "a line a thread");
  const int l = threadIdx.x;
  if (l < lines)
    prefetch_l2(reinterpret_cast<const char*>(base) + (l * 128 < bytes ? l * 128 : bytes - 1));
}

__device__ __forceinline__ void zero(float (&acc)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// The split tiles (hi, lo) of slot s in dynamic shared memory, and this warp's part of a
// [64 x 64] result: rows m0 .., columns n0 .. (warp w: m0 = 16 (w % 4), n0 = 32 (w / 4)).
struct cta_tiles {
  split_op* base;
  int m0, n0;
  __device__ explicit cta_tiles(unsigned char* raw)
      : base(reinterpret_cast<split_op*>(raw)),
        m0(16 * (int(threadIdx.x) / 32 % 4)),
        n0(32 * (int(threadIdx.x) / 32 / 4)) {}
  __device__ split_op* hi(int s) const { return base + 2 * s * L::tile; }
  __device__ split_op* lo(int s) const { return base + (2 * s + 1) * L::tile; }
};

}  // namespace path_bwd_mma

// The chunk transitions' own work, a CTA a chunk (the chunk kernel's grid), for the chunks the
// query kernel walks through (full, after the first, not the last of their sequence): before it,
// N = W^T U; after it, the slices' dP (summed in slice order) folded into slice 0's dW -= U dP^T
// and dU -= W dP. Three split [64 x 64] tiles of shared memory (path_bwd_mma_layout::fold_smem).
struct path_transition_chunk {
  bool active = false;
  index_t row0 = 0, ws1 = 0;
  const float *W = nullptr, *U = nullptr;

  __device__ explicit path_transition_chunk(const path_kernel_params& kp) {
    constexpr int C = path_bwd_mma_layout::C;
    index_t batch, start, length;
    kp.a.sequence(blockIdx.z, batch, start, length);
    const index_t c0 = static_cast<index_t>(blockIdx.x) * C;
    if (c0 == 0 || c0 + C >= length) return;
    active = true;
    const index_t t0 = start + c0;
    row0 = kp.row(batch, blockIdx.y, t0);
    U = static_cast<const float*>(kp.u) + row0 * C;
    W = kp.w + batch * kp.w_stride[0] + t0 * kp.w_stride[1] + blockIdx.y * kp.w_stride[2];
    ws1 = kp.w_stride[1];
  }
};

template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads)
    path_backward_transitions_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, ld = L::ld;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const path_transition_chunk ch(p.kp);
  if (!ch.active) return;
  const pm::cta_tiles t(smem_raw);
  const int m0 = t.m0, n0 = t.n0;
  split_op *wh = t.hi(0), *wl = t.lo(0), *uh = t.hi(1), *ul = t.lo(1);
  {  // both tiles' loads in flight before the first store
    pm::tile_regs xw, xu;
    pm::load_tile(
        xw, [&](int r, int c) { return ch.W[r * ch.ws1 + c]; }, C, C);
    pm::load_tile(
        xu, [&](int r, int c) { return ch.U[r * C + c]; }, C, C);
    pm::store_tile<true>(xw, wh, wl);
    pm::store_tile<true>(xu, uh, ul);
  }
  __syncthreads();
  float acc[4][4];
  pm::zero(acc);
  warp_mma<ld, true, true, 4>(acc, a_from_tile_t<ld, true>{wh, wl, m0}, uh, ul, n0);  // W^T U
  pm::save_rows(acc, p.trans + ch.row0 * C, C, m0, n0, C);
}

template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads)
    path_backward_fold_transitions_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, ld = L::ld;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const path_transition_chunk ch(p.kp);
  if (!ch.active) return;
  const pm::cta_tiles t(smem_raw);
  const int m0 = t.m0, n0 = t.n0;
  const auto hi = [&](int s) {
    return t.hi(s);
  };
  const auto lo = [&](int s) {
    return t.lo(s);
  };
  const float* dP = p.dtrans + ch.row0 * C;  // one copy on tensor cores
  {  // the three tiles' loads in flight before the first store
    pm::tile_regs xp, xu, xw;
    pm::load_tile(
        xp, [&](int r, int c) { return dP[r * C + c]; }, C, C);
    pm::load_tile(
        xu, [&](int r, int c) { return ch.U[r * C + c]; }, C, C);
    pm::load_tile(
        xw, [&](int r, int c) { return ch.W[r * ch.ws1 + c]; }, C, C);
    pm::store_tile<true>(xp, hi(0), lo(0));
    pm::store_tile<true>(xu, hi(1), lo(1));
    pm::store_tile<true>(xw, hi(2), lo(2));
  }
  __syncthreads();
  float acc[4][4];
  pm::zero(acc);
  warp_mma<ld, false, true, 4>(acc, a_from_tile<ld, true>{hi(1), lo(1), m0}, hi(0), lo(0), n0);
  pm::add_rows(acc, p.dws + ch.row0 * C, C, m0, n0, C, -1.f);  // dW -= U dP^T
  pm::zero(acc);
  warp_mma<ld, true, true, 4>(acc, a_from_tile<ld, true>{hi(2), lo(2), m0}, hi(0), lo(0), n0);
  pm::add_rows(acc, p.dus + ch.row0 * C, C, m0, n0, C, -1.f);  // dU -= W dP
}

// A super-chunk s of a sequence: chunks S s .. S s + S - 1 (S = path_bwd_mma_layout::super),
// CTA (s, KV head, sequence). The query kernel walks through it at once when a chunk follows it
// (then its chunks are all full): P_c = I - N_c, and, for the walk's order (r <- r P_c after
// chunk c is scored, from the last chunk down), A_j = P_(S s + S - 1) ... P_(S s + j + 1) takes the
// super-chunk's top state to chunk S s + j's (A_(S - 1) = I) and Pi = A_0 P_(S s) through the
// whole super-chunk (needed for s > 0 only).
struct path_super_chunk {
  static constexpr int C = path_bwd_mma_layout::C, S = path_bwd_mma_layout::super;
  bool active = false, has_pi = false;
  index_t row0 = 0;  // row of the super-chunk's first token
  index_t pi0 = 0;   // row of its Pi, dPi (path_super_pi_row)
  __device__ explicit path_super_chunk(const path_kernel_params& kp) {
    index_t batch, start, length;
    kp.a.sequence(blockIdx.z, batch, start, length);
    const index_t chunks = (length + C - 1) / C, s = blockIdx.x;
    if (S * s + S >= chunks) return;
    active = true, has_pi = s > 0;
    const index_t seq0 = kp.row(batch, blockIdx.y, start);
    row0 = seq0 + S * s * C, pi0 = path_super_pi_row(row0);
  }
};

namespace path_bwd_mma {

// A_(j - 1) = A_j - A_j N (A_j in float registers and split in slot a; N split in slot n).
template <class Hi, class Lo>
__device__ __forceinline__ void step_product(float (&acc)[4][4], Hi hi, Lo lo, int a, int n, int m0,
                                             int n0) {
  warp_mma<L::ld, true, true, 4>(acc, a_from_tile<L::ld, true, true>{hi(a), lo(a), m0}, hi(n),
                                 lo(n), n0);
}

__device__ __forceinline__ void identity(float (&acc)[4][4], int m0, int n0) {
  for_fragment_pairs<4>(acc, m0, n0, [](int r, int c, float& x0, float& x1) {
    x0 = r == c ? 1.f : 0.f;
    x1 = r == c + 1 ? 1.f : 0.f;
  });
}

}  // namespace path_bwd_mma

// Before the query kernel: K^ = K~ A_j^T of each chunk of a super-chunk the query kernel walks
// through at once (split, rows as save_split_rows writes them), and its I - Pi. Three split tiles
// (fold_smem).
template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads)
    path_backward_super_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, ld = L::ld, S = L::super;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const path_super_chunk sc(p.kp);
  if (!sc.active) return;
  const pm::cta_tiles t(smem_raw);
  const int m0 = t.m0, n0 = t.n0;
  const auto hi = [&](int s) {
    return t.hi(s);
  };
  const auto lo = [&](int s) {
    return t.lo(s);
  };
  enum { sa, sn, sk };
  const float* KT = static_cast<const float*>(p.kp.kt) + sc.row0 * C;
  const float* NN = p.trans + sc.row0 * C;
  split_op* KH = reinterpret_cast<split_op*>(p.khat + sc.row0 * C);  // rows of 2 C
  // The last chunk's keys are at the end already.
  for (int i = threadIdx.x; i < C * C / 2; i += L::threads) {
    const int r = (S - 1) * C + i / (C / 2), c = 2 * (i % (C / 2));
    const float2 x = *reinterpret_cast<const float2*>(KT + r * C + c);
    split2(x.x, x.y, *reinterpret_cast<std::uint32_t*>(KH + r * 2 * C + c),
           *reinterpret_cast<std::uint32_t*>(KH + r * 2 * C + C + c));
  }
  float a[4][4];
  pm::identity(a, m0, n0);
  pm::store_split(a, hi(sa), lo(sa), m0, n0, C);
  for (int j = S - 2; j >= (sc.has_pi ? -1 : 0); --j) {
    const int c = j + 1;  // A_j = A_(j + 1) P_c
    pm::stage<true>(
        hi(sn), lo(sn), [&](int r, int col) { return NN[(c * C + r) * C + col]; }, C, C);
    __syncthreads();  // A_(j + 1), N whole
    pm::step_product(a, hi, lo, sa, sn, m0, n0);
    __syncthreads();  // A_(j + 1) read
    if (j >= 0) {
      pm::store_split(a, hi(sa), lo(sa), m0, n0, C);
      pm::stage<true>(
          hi(sk), lo(sk), [&](int r, int col) { return KT[(j * C + r) * C + col]; }, C, C);
      __syncthreads();
      float kh[4][4];
      pm::zero(kh);
      warp_mma<ld, false, true, 4>(kh, a_from_tile<ld, true>{hi(sk), lo(sk), m0}, hi(sa), lo(sa),
                                   n0);
      pm::save_split_rows(kh, KH + j * C * 2 * C, m0, n0);
    } else {  // Pi = A_0 P_(S s): store I - Pi
      float id[4][4];
      pm::identity(id, m0, n0);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[i][e] = id[i][e] - a[i][e];
      pm::save_rows(a, p.pis + sc.pi0 * C, C, m0, n0, C);
    }
  }
}

// After the query kernel: the slices' dK^ and dPi of a super-chunk back to its chunks, into slice
// 0's dK~ (dK~ += dK^ A_j) and dP of each chunk transition (before their fold): with
// U_0 = dPi and U_(j + 1) = dA_j, dP_(S s + j) += A_j^T U_j and
// dA_j = U_j P_(S s + j)^T + dK^_j^T K~_j. S + 4 split tiles (super_smem).
template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads, 1)  // super_smem: one an SM
    path_backward_super_fold_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, ld = L::ld, S = L::super;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const path_super_chunk sc(p.kp);
  if (!sc.active) return;
  const pm::cta_tiles t(smem_raw);
  const int m0 = t.m0, n0 = t.n0;
  const auto hi = [&](int s) {
    return t.hi(s);
  };
  const auto lo = [&](int s) {
    return t.lo(s);
  };
  enum { sn = S, sk, sdk, su };  // A_j in slot j
  const float* KT = static_cast<const float*>(p.kp.kt) + sc.row0 * C;
  const float* NN = p.trans + sc.row0 * C;
  const float* dKH = p.dkhat + sc.row0 * C;
  float* dKT = p.dkt + sc.row0 * C;     // slice 0
  float* dTR = p.dtrans + sc.row0 * C;  // slice 0
  const auto stage_n = [&](int c) {
    pm::stage<true>(
        hi(sn), lo(sn), [&](int r, int col) { return NN[(c * C + r) * C + col]; }, C, C);
  };
  // A_3 .. A_0.
  float a[4][4];
  pm::identity(a, m0, n0);
  pm::store_split(a, hi(S - 1), lo(S - 1), m0, n0, C);
  for (int j = S - 2; j >= 0; --j) {
    stage_n(j + 1);
    __syncthreads();
    pm::step_product(a, hi, lo, j + 1, sn, m0, n0);
    pm::store_split(a, hi(j), lo(j), m0, n0, C);
    __syncthreads();  // N read
  }
  // U_0 = dPi (the slices' sums), 0 without.
  float u[4][4];
  for_fragment_pairs<4>(u, m0, n0, [&](int r, int c, float& x0, float& x1) {
    x0 = x1 = 0.f;
    if (!sc.has_pi) return;
    for (int sl = 0; sl < p.slices; ++sl) {
      const float* at = p.dpis + sl * p.slice_pi + sc.pi0 * C + r * C + c;
      x0 += at[0], x1 += at[1];
    }
  });
  pm::store_split(u, hi(su), lo(su), m0, n0, C);
  for (int j = 0; j < S; ++j) {
    {  // N, K~ and dK^ (the slices' sums, in slice order), their loads in flight together
      pm::tile_regs xn, xk, xd;
      if (j < S - 1)
        pm::load_tile(
            xn, [&](int r, int col) { return NN[(j * C + r) * C + col]; }, C, C);
      pm::load_tile(
          xk, [&](int r, int col) { return KT[(j * C + r) * C + col]; }, C, C);
      pm::load_slice_sum(
          xd, dKH, p.slice_d, p.slices, [&](int r, int col) { return (j * C + r) * C + col; }, C,
          C);
      if (j < S - 1) pm::store_tile<true>(xn, hi(sn), lo(sn));
      pm::store_tile<true>(xk, hi(sk), lo(sk));
      pm::store_tile<true>(xd, hi(sdk), lo(sdk));
    }
    __syncthreads();
    float acc[4][4];
    if (j > 0 || sc.has_pi) {  // dP += A_j^T U_j
      pm::zero(acc);
      warp_mma<ld, true, true, 4>(acc, a_from_tile_t<ld, true>{hi(j), lo(j), m0}, hi(su), lo(su),
                                  n0);
      pm::add_rows(acc, dTR + j * C * C, C, m0, n0, C, 1.f);
    }
    pm::zero(acc);  // dK~ += dK^ A_j
    warp_mma<ld, true, true, 4>(acc, a_from_tile<ld, true>{hi(sdk), lo(sdk), m0}, hi(j), lo(j), n0);
    pm::add_rows(acc, dKT + j * C * C, C, m0, n0, C, 1.f);
    if (j == S - 1) break;
    // dA_j = U_j - U_j N^T + dK^^T K~
    warp_mma<ld, false, true, 4>(u, a_from_tile<ld, true, true>{hi(su), lo(su), m0}, hi(sn), lo(sn),
                                 n0);
    warp_mma<ld, true, true, 4>(u, a_from_tile_t<ld, true>{hi(sdk), lo(sdk), m0}, hi(sk), lo(sk),
                                n0);
    __syncthreads();  // U_j, N, K~, dK^ read
    pm::store_split(u, hi(su), lo(su), m0, n0, C);
  }
}

// The chunk kernel on tensor cores: path_backward_chunk_tiled_kernel's algebra, a CTA a chunk,
// back through K~ = K - M^T W and the UT transform [U, M] = (I + L)^-1 diag(beta) [W, stril(W K^T)]
// with L = stril(diag(beta) W W^T), to dk, dw and dbeta. Every [64 x 64 x 64] product on mma.sync
// from split tiles; the solve with (I + L)^T as the product with A^T, A = (I + L)^-1 formed as the
// forward's preparation forms it (collective/tril_inverse.cuh). Warp w owns rows 16 (w % 4) ..,
// columns 32 (w / 4) .. of each product, and keeps its part of dW in registers.
template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads, 1)
    path_backward_chunk_mma_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, D = C, ld = L::ld, lf = L::lf;
  constexpr bool in_lo = std::is_same_v<T, __half>;
  using part = float[4][4];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* tiles = reinterpret_cast<split_op*>(smem_raw);
  const auto hi = [&](int s) {
    return tiles + 2 * s * L::tile;
  };
  const auto lo = [&](int s) {
    return tiles + (2 * s + 1) * L::tile;
  };
  enum { sw, sk, su, sm, sg, sx };  // W, K, U then Lsym, M then dM', dK~ then dU', dM'
  float* fdU = reinterpret_cast<float*>(tiles + 2 * L::chunk_slots * L::tile);  // [C][lf]
  float* fdM = fdU + C * lf;
  float* fww = fdM + C * lf;  // W W^T, then -beta_a lbar
  float* fxk = fww + C * lf;  // stril(W K^T)
  float* sb = fxk + C * lf;   // beta [C]
  float* rowsum = sb + C;     // [2][C]

  const path_kernel_params& kp = p.kp;
  const int h = blockIdx.y;
  index_t batch, start, length;
  kp.a.sequence(blockIdx.z, batch, start, length);
  const index_t c0 = static_cast<index_t>(blockIdx.x) * C;
  if (c0 >= length) return;
  const int n = length - c0 < C ? static_cast<int>(length - c0) : C;
  const index_t t0 = start + c0, row0 = kp.row(batch, h, t0);
  const float* UU = static_cast<const float*>(kp.u) + row0 * D;
  const float* MM = static_cast<const float*>(kp.m) + row0 * C;
  const float* W = kp.w + batch * kp.w_stride[0] + t0 * kp.w_stride[1] + h * kp.w_stride[2];
  const index_t ws1 = kp.w_stride[1];
  const T* K = static_cast<const T*>(kp.a.k) + batch * kp.a.k_stride[0] + t0 * kp.a.k_stride[1] +
               h * kp.a.k_stride[2];
  const index_t ks1 = kp.a.k_stride[1];
  const int warp = threadIdx.x / 32, half = warp / 4, m0 = 16 * (warp % 4), n0 = 32 * half;
  const auto rows_of = [&](int s) {
    return a_from_tile<ld, true>{hi(s), lo(s), m0};
  };
  const auto neg_rows_of = [&](int s) {
    return a_from_tile<ld, true, true>{hi(s), lo(s), m0};
  };
  // The tensor-core kernels keep one copy of dK~, dW and dU (slice 0's). Every global read below
  // is issued from an unrolled loop without a loop over slices inside, so that a thread's reads
  // of a tile are in flight together (one CTA an SM: nothing else hides their latency).

  {  // dv: the slices' sums in slice order
    pm::tile_regs x;
    pm::load_slice_sum(
        x, p.dvs, p.slice_dv, p.slices, [&](int r, int c) { return (row0 + r) * C + c; }, n, C);
    pm::for_tile_pairs(x, [&](int a, int e, float x0, float x1) {
      if (a >= n) return;
      T* at = static_cast<T*>(p.dv) + batch * p.dv_stride[0] + (t0 + a) * p.dv_stride[1] +
              h * p.dv_stride[2] + e;
      at[0] = from_float<T>(x0);
      at[1] = from_float<T>(x1);
    });
  }
  // The chunk's tiles in three batches of loads, each batch's loads in flight together before
  // its stores.
  {
    pm::tile_regs x0, x1, x2;
    pm::load_tile(
        x0, [&](int r, int c) { return W[r * ws1 + c]; }, n, D);
    pm::load_tile(
        x1, [&](int r, int c) { return to_float(K[r * ks1 + c]); }, n, D);
    pm::load_tile(
        x2, [&](int r, int c) { return UU[r * D + c]; }, n, D);
    pm::store_tile<true>(x0, hi(sw), lo(sw));
    pm::store_tile<in_lo>(x1, hi(sk), lo(sk));
    pm::store_tile<true>(x2, hi(su), lo(su));
    pm::load_tile(
        x0, [&](int r, int c) { return c < r ? MM[r * C + c] : 0.f; }, n, C);
    pm::load_tile(
        x1, [&](int r, int c) { return p.dkt[(row0 + r) * D + c]; }, n, D);
    pm::load_tile(
        x2, [&](int r, int c) { return p.dus[(row0 + r) * D + c]; }, n, D);
    pm::store_tile<true>(x0, hi(sm), lo(sm));
    pm::store_tile<true>(x1, hi(sg), lo(sg));
    pm::for_tile_pairs(x2, [&](int a, int c, float y0, float y1) {  // lf is odd: one at a time
      fdU[a * lf + c] = y0, fdU[a * lf + c + 1] = y1;
    });
  }
  part dw;
  {
    pm::tile_regs xm;
    pm::load_tile(
        xm, [&](int r, int c) { return c < r ? p.dm[(row0 + r) * C + c] : 0.f; }, n, C);
    for_fragment_pairs<4>(dw, m0, n0, [&](int a, int c, float& x0, float& x1) {
      x0 = a < n ? p.dws[(row0 + a) * D + c] : 0.f;
      x1 = a < n ? p.dws[(row0 + a) * D + c + 1] : 0.f;
    });
    const float beta = threadIdx.x < n
                           ? kp.beta[batch * kp.beta_stride[0] +
                                     (t0 + threadIdx.x) * kp.beta_stride[1] + h * kp.beta_stride[2]]
                           : 0.f;
    pm::for_tile_pairs(xm, [&](int a, int c, float y0, float y1) {
      fdM[a * lf + c] = y0, fdM[a * lf + c + 1] = y1;
    });
    if (threadIdx.x < C) sb[threadIdx.x] = beta;
  }
  __syncthreads();

  // K~ = K - M^T W: dM -= stril(W dK~^T), dW -= M dK~; the Gram products W W^T, stril(W K^T).
  {
    part x;
    pm::zero(x);
    warp_mma<ld, false, true, 4>(x, rows_of(sw), hi(sg), lo(sg), n0);
    for_fragment_pairs<4>(x, m0, n0, [&](int a, int c, float x0, float x1) {
      if (c < a) fdM[a * lf + c] -= x0;
      if (c + 1 < a) fdM[a * lf + c + 1] -= x1;
    });
    warp_mma<ld, true, true, 4>(dw, neg_rows_of(sm), hi(sg), lo(sg), n0);
    pm::zero(x);
    warp_mma<ld, false, true, 4>(x, rows_of(sw), hi(sw), lo(sw), n0);
    const auto keep = [&](float* dst) {  // lf is odd: one float at a time
      for_fragment_pairs<4>(x, m0, n0, [&](int a, int c, float x0, float x1) {
        dst[a * lf + c] = x0;
        dst[a * lf + c + 1] = x1;
      });
    };
    keep(fww);
    pm::zero(x);
    warp_mma<ld, false, in_lo, 4>(x, rows_of(sw), hi(sk), lo(sk), n0);
    for_fragment_pairs<4>(x, m0, n0, [&](int a, int c, float& x0, float& x1) {
      if (c >= a) x0 = 0.f;
      if (c + 1 >= a) x1 = 0.f;
    });
    keep(fxk);
  }
  __syncthreads();

  // [dU, dM] <- A^T [dU, dM] with A = (I + L)^-1, L = stril(diag(beta) W W^T): the solve with
  // (I + L)^T as a product (tf32 in three passes). A is formed in float in slot sx's space (free
  // until dM' is staged); rows past n have W = 0, so L = 0 and A = I there.
  {
    constexpr int lda = C + 8;
    static_assert(C * lda * 4 <= 2 * L::tile * 2, "A fits a split slot");
    float* sa = reinterpret_cast<float*>(hi(sx));
    for (int i = threadIdx.x; i < C * C; i += L::threads) {
      const int a = i / C, b = i % C;
      sa[a * lda + b] = b < a ? sb[a] * fww[a * lf + b] : 0.f;
    }
    __syncthreads();
    invert_unit_lower_64<lda>(sa);
    // Warp w: rows 16 (w % 4) .. of the result, the 64 columns of dU (w < 4) or dM.
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, rb = warp % 4;
    float* gx = half ? fdM : fdU;
    float acc[8][4] = {};
    mma_inverse_t<lda, lf>(acc, sa, gx, rb, lane);
    __syncthreads();  // [dU, dM] read
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float* at = gx + (16 * rb + g + 8 * hh) * lf + 8 * nt + 2 * t;  // lf is odd: one at a time
        at[0] = acc[nt][2 * hh], at[1] = acc[nt][2 * hh + 1];
      }
  }
  __syncthreads();

  // Lbar = stril(dU U^T + dM M^T); dbeta = dU . w + dM . xk - Lbar . ww (rows).
  pm::stage<true>(
      hi(sg), lo(sg), [&](int r, int c) { return fdU[r * lf + c]; }, C, D);
  pm::stage<true>(
      hi(sx), lo(sx), [&](int r, int c) { return fdM[r * lf + c]; }, C, C);
  __syncthreads();
  part lb;
  pm::zero(lb);
  warp_mma<ld, false, true, 4>(lb, rows_of(sg), hi(su), lo(su), n0);
  warp_mma<ld, false, true, 4>(lb, rows_of(sx), hi(sm), lo(sm), n0);
  {
    const int lane = threadIdx.x % 32, g = lane >> 2;
    float rs[2] = {0.f, 0.f};
    for_fragment_pairs<4>(lb, m0, n0, [&](int a, int c, float& x0, float& x1) {
      if (!(c < a && a < n)) x0 = 0.f;
      if (!(c + 1 < a && a < n)) x1 = 0.f;
      rs[a - m0 - g == 0 ? 0 : 1] += x0 * fww[a * lf + c] + x1 * fww[a * lf + c + 1];
    });
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      rs[0] += __shfl_xor_sync(0xffffffffu, rs[0], o);
      rs[1] += __shfl_xor_sync(0xffffffffu, rs[1], o);
    }
    if ((lane & 3) == 0) rowsum[half * C + m0 + g] = rs[0], rowsum[half * C + m0 + g + 8] = rs[1];
  }
  __syncthreads();  // Lbar . ww summed; ww, M, U read
  {                 // four threads a row, each a quarter of the columns, summed across the quad
    static_assert(L::threads == 4 * C && D == C, "a quad of threads a row");
    const int a = threadIdx.x / 4, d0 = 16 * (threadIdx.x % 4);
    float acc = 0.f;
    if (a < n) {
#pragma unroll
      for (int d = d0; d < d0 + 16; ++d)
        acc += fdU[a * lf + d] * W[a * ws1 + d] + (d < a ? fdM[a * lf + d] * fxk[a * lf + d] : 0.f);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (a < n && d0 == 0)
      p.dbeta[batch * p.dbeta_stride[0] + (t0 + a) * p.dbeta_stride[1] + h * p.dbeta_stride[2]] =
          acc - (rowsum[a] + rowsum[C + a]);
  }
  // -beta_a Lbar into ww's tile; dM beta_a (strictly lower) into M's slot; dW += beta dU.
  for_fragment_pairs<4>(lb, m0, n0, [&](int a, int c, float x0, float x1) {
    fww[a * lf + c] = -sb[a] * x0;
    fww[a * lf + c + 1] = -sb[a] * x1;
  });
  pm::stage<true>(
      hi(sm), lo(sm), [&](int r, int c) { return c < r ? sb[r] * fdM[r * lf + c] : 0.f; }, C, C);
  for_fragment_pairs<4>(dw, m0, n0, [&](int a, int c, float& x0, float& x1) {
    x0 += sb[a] * fdU[a * lf + c];
    x1 += sb[a] * fdU[a * lf + c + 1];
  });
  __syncthreads();
  pm::stage<true>(
      hi(su), lo(su), [&](int r, int c) { return fww[r * lf + c] + fww[c * lf + r]; }, C, C);
  __syncthreads();

  // dW += (Lbar + Lbar^T) W + dM K; dK = dk_diag + dK~ + dM^T W.
  warp_mma<ld, true, true, 4>(dw, rows_of(su), hi(sw), lo(sw), n0);
  warp_mma<ld, true, in_lo, 4>(dw, rows_of(sm), hi(sk), lo(sk), n0);
  part dk;
  pm::zero(dk);
  warp_mma<ld, true, true, 4>(dk, a_from_tile_t<ld, true>{hi(sm), lo(sm), m0}, hi(sw), lo(sw), n0);
  for_fragment_pairs<4>(dw, m0, n0, [&](int a, int c, float x0, float x1) {
    if (a >= n) return;
    float* at = p.dw + batch * p.dw_stride[0] + (t0 + a) * p.dw_stride[1] + h * p.dw_stride[2] + c;
    at[0] = x0, at[1] = x1;
  });
  for_fragment_pairs<4>(dk, m0, n0, [&](int a, int c, float x0, float x1) {
    if (a >= n) return;
    const index_t r = (row0 + a) * D + c;
    T* at = static_cast<T*>(p.dk) + batch * p.dk_stride[0] + (t0 + a) * p.dk_stride[1] +
            h * p.dk_stride[2] + c;
    at[0] = from_float<T>(p.dk_diag[r] + p.dkt[r] + x0);
    at[1] = from_float<T>(p.dk_diag[r + 1] + p.dkt[r + 1] + x1);
  });
}

template <class T>
__global__ void __launch_bounds__(path_bwd_mma_layout::threads, 1)
    path_backward_query_mma_kernel(const path_backward_params p) {
  namespace pm = path_bwd_mma;
  using L = path_bwd_mma_layout;
  constexpr int C = L::C, D = C, Dv = C, ld = L::ld;
  constexpr bool in_lo = std::is_same_v<T, __half>;  // half inputs: two bfloat16 parts
  using part = float[4][4];                          // a warp's 16 x 32 part of a tile
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* tiles = reinterpret_cast<split_op*>(smem_raw);
  const auto hi = [&](int s) {
    return tiles + 2 * s * L::tile;
  };
  const auto lo = [&](int s) {
    return tiles + (2 * s + 1) * L::tile;
  };
  // [4][C]: the four row blocks' column sums of dZ
  float* colsum = reinterpret_cast<float*>(tiles + 2 * L::slots * L::tile);
  float* lse_s = colsum + 4 * C;
  float* delta_s = lse_s + C;
  float* gi_s = delta_s + C;
  int* reset_s = reinterpret_cast<int*>(gi_s + C);
  float* gj_s = reinterpret_cast<float*>(reset_s + C);  // [2][C]: the keys' gate terms, two buffers
  float* rowsum = gj_s + 2 * C;      // [2][C]: the two column halves' row sums of dZ
  float* stage_tr = rowsum + 2 * C;  // [D][D]: the own walk's and adjoint's next transition

  const path_kernel_params& kp = p.kp;
  const int warp = threadIdx.x / 32, half = warp / 4, m0 = 16 * (warp % 4), n0 = 32 * half;
  const int h = blockIdx.y, group = kp.a.group;
  const path_backward_cta<T> cta(p);
  if (!cta.active) return;
  const float scale = p.scale;
  const index_t HQ = kp.a.q_heads;

  // Tiles of a chunk starting at token j0 with `rows` rows: this thread's elements loaded
  // (pm::load_tile), later stored split into their slot (pm::store_tile).
  const auto load_w = [&](pm::tile_regs& x, index_t j0, int rows) {
    pm::load_tile(
        x, [&](int r, int c) { return cta.W[(j0 + r) * cta.ws1 + c]; }, rows, D);
  };
  const auto load_u = [&](pm::tile_regs& x, index_t j0, int rows) {
    pm::load_tile(
        x, [&](int r, int c) { return cta.UU[(j0 + r) * D + c]; }, rows, D);
  };
  const auto load_v = [&](pm::tile_regs& x, index_t j0, int rows) {
    pm::load_tile(
        x, [&](int r, int c) { return to_float(cta.V[(j0 + r) * cta.vs1 + c]); }, rows, Dv);
  };
  const auto stage_v = [&](index_t j0, int rows) {
    pm::tile_regs x;
    load_v(x, j0, rows);
    pm::store_tile<in_lo>(x, hi(L::v), lo(L::v));
  };
  // What the walk's and the adjoint's step at chunk j0 read: asked of L2 a step ahead.
  const auto prefetch_walk = [&](index_t j0) {
    pm::prefetch_dense<C, D>(cta.KT + j0 * D);
    pm::prefetch_rows<C, Dv>(cta.V + j0 * cta.vs1, cta.vs1);
    pm::prefetch_dense<D, D>(cta.NN + j0 * D);
    pm::prefetch_dense<C, Dv>(cta.dvs + j0 * Dv);
    pm::prefetch_dense<C, D>(cta.dkt + j0 * D);
  };
  // Operands: rows m0 .. of a slot (Neg: negated).
  const auto rows_of = [&](int s) {
    return a_from_tile<ld, true>{hi(s), lo(s), m0};
  };
  const auto neg_rows_of = [&](int s) {
    return a_from_tile<ld, true, true>{hi(s), lo(s), m0};
  };
  const a_from_tile<ld, in_lo> doa{hi(L::dout), lo(L::dout), m0};

  for (int hq = h * group; hq < (h + 1) * group; ++hq) {
    const path_backward_query_rows<T> qr(p, cta, hq);

    for (index_t ci = cta.lo; ci < cta.hi; ++ci) {
      const index_t c0 = ci * C;
      const int n = cta.length - c0 < C ? static_cast<int>(cta.length - c0) : C;
      const double g_ref = qr.G != nullptr ? qr.G[c0 * HQ] : 0.0;

      // The keys' gate terms of the chunk starting at j0.
      const auto stage_gate = [&](index_t j0, int cols) {
        if (qr.G == nullptr) return;
        for (int j = threadIdx.x; j < C; j += L::threads)
          gj_s[j] = j < cols ? static_cast<float>(p.coef * (qr.G[(j0 + j) * HQ] - g_ref)) : 0.f;
      };
      // This thread's rows m0 + g and m0 + g + 8 (set once the chunk's row arrays are whole):
      // the exponent's row term (gate - lse), delta, and the first key token each row sees (its
      // hard reset; rows past n see none). Kept in registers: the walk reads them every step.
      float row_base[2] = {0.f, 0.f}, row_delta[2] = {0.f, 0.f};
      index_t row_first[2] = {0, 0};
      // p and dZ of a warp's part of a tile in place of its scores s and dP; diag: causal. The
      // hardware exp: its error (a few float ulps) is far below the 16-bit operands' rounding.
      const auto softmax_bwd = [&](part& s, part& dp, index_t j0, int cols, bool diag,
                                   const float* gj) {
        const int lane = threadIdx.x % 32, g = lane >> 2, c2 = n0 + 2 * (lane & 3);
        int first[2];  // the first column each row sees
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const index_t d = row_first[i] - j0;
          first[i] = d <= 0 ? 0 : d >= C ? C : static_cast<int>(d);
        }
        float2 gk[4];  // the keys' gate terms of this thread's columns
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          gk[nt] = qr.G != nullptr ? *reinterpret_cast<const float2*>(gj + 8 * nt + c2)
                                   : make_float2(0.f, 0.f);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = e >> 1, a = m0 + g + 8 * i, j = 8 * nt + c2 + (e & 1);
            const bool in = j >= first[i] && j < cols && (!diag || j <= a);
            const float z = s[nt][e] + row_base[i] - ((e & 1) ? gk[nt].y : gk[nt].x);
            const float pv = in ? fast_exp(z) : 0.f;
            dp[nt][e] = pv * (dp[nt][e] - row_delta[i]);
            s[nt][e] = pv;
          }
      };
      // dG: each warp leaves its part's row sums and column sums in shared memory (before a
      // barrier); then thread t adds row t's sum and takes key t's, in that order (the
      // diagonal tile's keys are its rows), as reductions (thread t is the only one that adds
      // to these elements of dG).
      const auto gate_parts = [&](part& dz) {
        if (qr.dG == nullptr) return;
        const int lane = threadIdx.x % 32, g = lane >> 2;
        float rs[2] = {0.f, 0.f}, cs[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          rs[0] += dz[nt][0] + dz[nt][1];
          rs[1] += dz[nt][2] + dz[nt][3];
          cs[nt][0] = dz[nt][0] + dz[nt][2];
          cs[nt][1] = dz[nt][1] + dz[nt][3];
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
          rs[0] += __shfl_xor_sync(0xffffffffu, rs[0], o);
          rs[1] += __shfl_xor_sync(0xffffffffu, rs[1], o);
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            cs[nt][0] += __shfl_xor_sync(0xffffffffu, cs[nt][0], o);
            cs[nt][1] += __shfl_xor_sync(0xffffffffu, cs[nt][1], o);
          }
        if ((lane & 3) == 0)
          rowsum[half * C + m0 + g] = rs[0], rowsum[half * C + m0 + g + 8] = rs[1];
        if (g == 0)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            float* at = colsum + (m0 / 16) * C + n0 + 8 * nt + 2 * lane;
            at[0] = cs[nt][0], at[1] = cs[nt][1];
          }
      };
      const auto gate_sums = [&](index_t j0, int cols) {
        if (qr.dG == nullptr) return;
        const int t = threadIdx.x;
        if (t < n)
          red_add(qr.dG + (c0 + t) * HQ, p.coef * static_cast<double>(rowsum[t] + rowsum[C + t]));
        if (t < cols) {
          const float cs = colsum[t] + colsum[C + t] + colsum[2 * C + t] + colsum[3 * C + t];
          red_add(qr.dG + (j0 + t) * HQ, -(p.coef * static_cast<double>(cs)));
        }
      };
      const auto tril_mask = [&](part& x) {  // keep (a, c) for c <= a < n
        for_fragment_pairs<4>(x, m0, n0, [&](int a, int c, float& x0, float& x1) {
          if (!(a < n && c <= a)) x0 = 0.f;
          if (!(a < n && c + 1 <= a)) x1 = 0.f;
        });
      };
      // A sum over the chunk's query rows: acc = op(A)^T B over this warp's part, added to dst.
      const auto cross = [&](int a_slot, const split_op* bh, const split_op* bl, auto b_lo,
                             float* dst, int ldd, int rows, float sign) {
        part acc;
        pm::zero(acc);
        warp_mma<ld, true, decltype(b_lo)::value, 4>(
            acc, a_from_tile_t<ld, true>{hi(a_slot), lo(a_slot), m0}, bh, bl, n0);
        pm::add_rows(acc, dst, ldd, m0, n0, rows, sign);
      };
      using split_b = std::true_type;
      using in_b = std::integral_constant<bool, in_lo>;

      __syncthreads();  // the chunk before is done with every tile
      qr.row_terms(p, cta, hq, c0, n, g_ref, lse_s, delta_s, gi_s, reset_s);
      {  // the chunk's tiles, in two batches of loads
        pm::tile_regs x0, x1, x2, x3;
        pm::load_tile(
            x0, [&](int r, int c) { return scale * to_float(qr.Q[(c0 + r) * qr.qs1 + c]); }, n, D);
        pm::load_tile(
            x1, [&](int r, int c) { return to_float(qr.dO[(c0 + r) * qr.dos1 + c]); }, n, Dv);
        pm::load_tile(
            x2, [&](int r, int c) { return to_float(cta.K[(c0 + r) * cta.ks1 + c]); }, n, D);
        load_v(x3, c0, n);
        pm::store_tile<true>(x0, hi(L::q), lo(L::q));
        pm::store_tile<in_lo>(x1, hi(L::dout), lo(L::dout));
        pm::store_tile<in_lo>(x2, hi(L::k), lo(L::k));
        pm::store_tile<in_lo>(x3, hi(L::v), lo(L::v));
        load_w(x0, c0, n);
        load_u(x1, c0, n);
        pm::load_tile(
            x2, [&](int r, int c) { return cta.MM[(c0 + r) * C + c]; }, n, n);
        pm::store_tile<true>(x0, hi(L::w), lo(L::w));
        pm::store_tile<true>(x1, hi(L::u), lo(L::u));
        pm::store_tile<true>(x2, hi(L::m), lo(L::m));
      }
      stage_gate(c0, n);
      if (ci > 0) prefetch_walk(c0 - C);
      __syncthreads();
      {
        const int g = (threadIdx.x % 32) >> 2;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int a = m0 + g + 8 * i;
          row_base[i] = gi_s[a] - lse_s[a];
          row_delta[i] = delta_s[a];
          row_first[i] = a < n ? index_t(reset_s[a]) : cta.length;  // past every key
        }
      }

      // ---- 1. the diagonal tile: z = tril(Qs K^T - tril(Qs W^T) M) (+ gate) ----
      part dq;
      {
        part x, s, dp;
        pm::zero(x);
        warp_mma<ld, false, true, 4>(x, rows_of(L::q), hi(L::w), lo(L::w), n0);
        tril_mask(x);
        pm::store_split(x, hi(L::x), lo(L::x), m0, n0, n);
        pm::zero(s);
        warp_mma<ld, false, in_lo, 4>(s, rows_of(L::q), hi(L::k), lo(L::k), n0);
        pm::zero(dp);
        warp_mma<ld, false, in_lo, 4>(dp, doa, hi(L::v), lo(L::v), n0);
        __syncthreads();  // X whole
        warp_mma<ld, true, true, 4>(s, neg_rows_of(L::x), hi(L::m), lo(L::m), n0);
        softmax_bwd(s, dp, c0, n, true, gj_s);
        pm::store_split(s, hi(L::e1), lo(L::e1), m0, n0, n);
        pm::store_split(dp, hi(L::e2), lo(L::e2), m0, n0, n);
        gate_parts(dp);
        __syncthreads();  // P, dZ whole
        gate_sums(c0, n);
        // dQs = dZ K; dX = -tril(dZ M^T) (into e3)
        pm::zero(dq);
        warp_mma<ld, true, in_lo, 4>(dq, rows_of(L::e2), hi(L::k), lo(L::k), n0);
        pm::zero(x);
        warp_mma<ld, false, true, 4>(x, neg_rows_of(L::e2), hi(L::m), lo(L::m), n0);
        tril_mask(x);
        pm::store_split(x, hi(L::e3), lo(L::e3), m0, n0, n);
        cross(L::e1, hi(L::dout), lo(L::dout), in_b{}, cta.dvs + c0 * Dv, Dv, n,
              1.f);                                                                 // dv += P^T dO
        cross(L::e2, hi(L::q), lo(L::q), split_b{}, cta.dkd + c0 * D, D, n, 1.f);   // dk += dZ^T Qs
        cross(L::x, hi(L::e2), lo(L::e2), split_b{}, cta.dm + c0 * C, C, n, -1.f);  // dM -= X^T dZ
        __syncthreads();                                                            // dX whole
        warp_mma<ld, true, true, 4>(dq, rows_of(L::e3), hi(L::w), lo(L::w), n0);    // dQs += dX W
        cross(L::e3, hi(L::q), lo(L::q), split_b{}, cta.dws + c0 * D, D, n, 1.f);   // dW += dX^T Qs
      }
      // dQs waits in the scan states' rows of this chunk, which the walk never writes.
      pm::save_rows(dq, cta.states + c0 * D, D, m0, n0, n);

      if (ci > 0) {
        // ---- 2. the forward's walk: the chunks of the query's own super-chunk one at a time,
        // keeping each one's scan state r and e = dZ K~; then each earlier super-chunk at once,
        // its keys as K^ (at the super-chunk's end) against its top state, kept with
        // e = sum dZ K^ at its first chunk's rows; then r <- r Pi ----
        constexpr index_t SC = L::super;
        const index_t own0 = (ci / SC) * SC;  // the own super-chunk's first chunk
        // v rows that take 16-byte copies (bfloat16) are copied into one of two buffers.
        const bool async_v = !in_lo && p.v_vectors;
        const auto vbuf = [&](int b) {
          return async_v && b ? lo(L::v) : hi(L::v);
        };
        const auto copy_v = [&](split_op* dst, index_t j0) {  // cp.async, not committed
          const T* src = cta.V + j0 * cta.vs1;
#pragma unroll
          for (int m = 0; m < C * 8 / L::threads; ++m) {
            const int i = int(threadIdx.x) + m * L::threads, rr = i >> 3, piece = i & 7;
            cp_async_16(dst + rr * ld + 8 * piece, src + rr * cta.vs1 + 8 * piece, true);
          }
        };
        part r;
        for_fragment_pairs<4>(r, m0, n0, [&](int a, int c, float& x0, float& x1) {
          x0 = a < n ? scale * to_float(qr.Q[(c0 + a) * qr.qs1 + c]) : 0.f;
          x1 = a < n ? scale * to_float(qr.Q[(c0 + a) * qr.qs1 + c + 1]) : 0.f;
        });
        warp_mma<ld, true, true, 4>(r, neg_rows_of(L::x), hi(L::u), lo(L::u), n0);
        __syncthreads();  // dX (e3) read
        pm::store_split(r, hi(L::e3), lo(L::e3), m0, n0, n);
        // P and dZ of the keys in slot ks (v's first part at vh, their gate terms at gj) against
        // r (e3); then dv += P^T dO and dkeys += dZ^T r.
        const auto scores = [&](index_t j0, int ks, const split_op* vh, const float* gj) {
          part s, dp;
          pm::zero(s);
          warp_mma<ld, false, true, 4>(s, rows_of(L::e3), hi(ks), lo(ks), n0);
          pm::zero(dp);
          warp_mma<ld, false, in_lo, 4>(dp, doa, vh, lo(L::v), n0);
          softmax_bwd(s, dp, j0, C, false, gj);
          pm::store_split(s, hi(L::e1), lo(L::e1), m0, n0, n);
          pm::store_split(dp, hi(L::e2), lo(L::e2), m0, n0, n);
          gate_parts(dp);
          __syncthreads();  // P, dZ whole
          gate_sums(j0, C);
        };
        const auto key_sums = [&](index_t j0, float* dkeys) {
          cross(L::e1, hi(L::dout), lo(L::dout), in_b{}, cta.dvs + j0 * Dv, Dv, C, 1.f);
          cross(L::e2, hi(L::e3), lo(L::e3), split_b{}, dkeys + j0 * D, D, C, 1.f);
        };
        const auto prefetch_next = [&](index_t j0) {  // the walk's step after chunk j0's
          if (j0 == 0) return;
          if (j0 / C - 1 >= own0) return prefetch_walk(j0 - C);
          pm::prefetch_dense<C, D>(cta.KH + (j0 - C) * D);
          pm::prefetch_rows<C, Dv>(cta.V + (j0 - C) * cta.vs1, cta.vs1);
          pm::prefetch_dense<C, Dv>(cta.dvs + (j0 - C) * Dv);
          pm::prefetch_dense<C, D>(cta.dKH + (j0 - C) * D);
        };
        // Step t + 1's K~ and N (float) are copied into staging while step t computes -- K~
        // into slot m's space (the diagonal tile's only), N into its own tile after the slots --
        // and split into slots k and w when the step starts; v with 16-byte rows (bfloat16)
        // straight into buffer t % 2 (the first or second part of slot v; one part suffices).
        float* const stage_kt = reinterpret_cast<float*>(hi(L::m));
        const auto issue_own = [&](index_t cj) {
          const float* ks = cta.KT + cj * C * D;
          const float* ns = cta.NN + cj * C * D;
#pragma unroll
          for (int m = 0; m < C * D / 4 / L::threads; ++m) {  // rows are contiguous
            const int i = 4 * (int(threadIdx.x) + m * L::threads);
            cp_async_16(stage_kt + i, ks + i, true);
            if (cj > 0) cp_async_16(stage_tr + i, ns + i, true);
          }
          if (async_v) copy_v(vbuf(int((ci - 1 - cj) & 1)), cj * C);
          cp_async_commit();
        };
        const auto unstage = [&](const float* src, int slot) {
          pm::tile_regs x;
          pm::for_tile_pairs(x, [&](int rr, int c, float& x0, float& x1) {
            const float2 v = *reinterpret_cast<const float2*>(src + rr * D + c);
            x0 = v.x, x1 = v.y;
          });
          pm::store_tile<true>(x, hi(slot), lo(slot));
        };
        if (ci - 1 >= own0) issue_own(ci - 1);
        for (index_t cj = ci - 1; cj >= own0; --cj) {
          const index_t j0 = cj * C;  // earlier chunks are full
          const int b = int((ci - 1 - cj) & 1);
          cp_async_wait<0>();
          __syncthreads();  // this step's copies whole; the step before is done with k, v, w
          unstage(stage_kt, L::k);
          if (cj > 0) unstage(stage_tr, L::w);
          if (!async_v) stage_v(j0, C);
          stage_gate(j0, C);
          prefetch_next(j0);
          pm::save_rows(r, cta.states + j0 * D, D, m0, n0, n);
          __syncthreads();  // slots k, v, w whole; the staging free
          if (cj > own0) issue_own(cj - 1);
          scores(j0, L::k, async_v ? vbuf(b) : hi(L::v), gj_s);
          {  // e = dZ K~
            part e;
            pm::zero(e);
            warp_mma<ld, true, true, 4>(e, rows_of(L::e2), hi(L::k), lo(L::k), n0);
            pm::save_rows(e, cta.es + j0 * D, D, m0, n0, n);
          }
          key_sums(j0, cta.dkt);
          if (cj > 0) {  // r <- r P_cj = r - r N
            warp_mma<ld, true, true, 4>(r, neg_rows_of(L::e3), hi(L::w), lo(L::w), n0);
            __syncthreads();  // r (e3) read
            pm::store_split(r, hi(L::e3), lo(L::e3), m0, n0, n);
          }
        }
        // The earlier super-chunks, a step a chunk from own0 - 1 down to 0. Step t's K^ (kept
        // split in global memory) and, where v rows take 16-byte copies (bfloat16), its v are
        // copied into buffer t % 2 while step t - 1 computes: K^ into slot k or m (M is the
        // diagonal tile's only), v into the first or second part of slot v (one part suffices);
        // its gate terms wait in a register, then in gate buffer t % 2.
        const split_op* KHs = reinterpret_cast<const split_op*>(cta.KH);  // rows of 2 D
        const auto kslot = [](int b) {
          return b ? int(L::m) : int(L::k);
        };
        const auto issue = [&](index_t j0, int b) {
          // Unrolled with fixed trip counts: a thread's copies differ by constant offsets.
          const split_op* src = KHs + j0 * 2 * D;
#pragma unroll
          for (int m = 0; m < C * 16 / L::threads; ++m) {  // 8 pieces of hi, 8 of lo
            const int i = int(threadIdx.x) + m * L::threads, rr = i >> 4, piece = i & 15;
            split_op* dst = (piece < 8 ? hi(kslot(b)) : lo(kslot(b))) + rr * ld + 8 * (piece & 7);
            cp_async_16(dst, src + rr * 2 * D + 8 * piece, true);
          }
          if (async_v) copy_v(vbuf(b), j0);
          cp_async_commit();
        };
        // Key threadIdx.x's gate (threads < C) read a step ahead; its term formed when stored,
        // so that no thread waits for the read.
        const auto gate_raw = [&](index_t j0) {
          return qr.G != nullptr && threadIdx.x < C ? qr.G[(j0 + threadIdx.x) * HQ] : 0.0;
        };
        const auto gate_term = [&](double g) {
          return static_cast<float>(p.coef * (g - g_ref));
        };
        if (own0 > 0) {
          __syncthreads();  // the own super-chunk's walk is done with slots k, v and the gate
          issue((own0 - 1) * C, 0);
          if (threadIdx.x < C) gj_s[threadIdx.x] = gate_term(gate_raw((own0 - 1) * C));
        }
        part e;
        for (index_t cj = own0 - 1; cj >= 0; --cj) {
          const index_t j0 = cj * C, sg = cj / SC, s0 = sg * SC * C;
          const int b = int((own0 - 1 - cj) & 1);
          if (cj == (sg + 1) * SC - 1) {  // the super-chunk's first step
            pm::save_rows(r, cta.states + s0 * D, D, m0, n0, n);
            pm::zero(e);
          }
          // One barrier a step: after it this step's copies are whole and step t - 1 is done
          // with buffer 1 - b and slot w, so the next step's copies may start.
          cp_async_wait<0>();
          __syncthreads();
          if (cj > 0) issue(j0 - C, 1 - b);
          const double g_next = cj > 0 ? gate_raw(j0 - C) : 0.0;
          if (sg > 0 && cj == (sg + 1) * SC - 1)  // I - Pi, read at the super-chunk's last step
            pm::stage<true>(
                hi(L::w), lo(L::w),
                [&](int rr, int c) { return cta.PIS[cta.pi_at(sg) + rr * D + c]; }, D, D);
          if (cj >= 2) {  // asked of L2: the copies of the step after next, this one's sums
            pm::prefetch_dense<C, D>(cta.KH + (j0 - 2 * C) * D);
            if (async_v) pm::prefetch_rows<C, Dv>(cta.V + (j0 - 2 * C) * cta.vs1, cta.vs1);
          }
          if (cj >= 1) {
            if (!async_v) pm::prefetch_rows<C, Dv>(cta.V + (j0 - C) * cta.vs1, cta.vs1);
            pm::prefetch_dense<C, Dv>(cta.dvs + (j0 - C) * Dv);
            pm::prefetch_dense<C, D>(cta.dKH + (j0 - C) * D);
          }
          if (!async_v) {  // v staged here: a second barrier
            stage_v(j0, C);
            __syncthreads();
          }
          scores(j0, kslot(b), vbuf(b), gj_s + b * C);
          warp_mma<ld, true, true, 4>(e, rows_of(L::e2), hi(kslot(b)), lo(kslot(b)),
                                      n0);  // e += dZ K^
          key_sums(j0, cta.dKH);
          if (threadIdx.x < C) gj_s[(1 - b) * C + threadIdx.x] = gate_term(g_next);
          if (cj == sg * SC) {  // the super-chunk's last step
            pm::save_rows(e, cta.es + s0 * D, D, m0, n0, n);
            if (sg > 0) {  // r <- r Pi = r - r (I - Pi)
              warp_mma<ld, true, true, 4>(r, neg_rows_of(L::e3), hi(L::w), lo(L::w), n0);
              __syncthreads();  // r (e3) read
              pm::store_split(r, hi(L::e3), lo(L::e3), m0, n0, n);
            }
          }
        }
        cp_async_wait<0>();

        // ---- 3. the adjoint: rbar_cj = e_cj + rbar_(cj-1) P_cj^T with P = I - N, and the
        // transition's gradient dP += r^T rbar (dW and dU follow from it once per chunk); the
        // same a super-chunk at once with Pi ----
        part rbar;
        pm::load_rows(rbar, cta.es, D, m0, n0, n);
        __syncthreads();  // the walk's dZ (e2) read
        pm::store_split(rbar, hi(L::e2), lo(L::e2), m0, n0, n);
        // The steps: the super-chunks 1 .. own0 / SC - 1 at once (their I - Pi), then the chunks
        // of the own super-chunk (chunk 0 has no transition). Step t + 1's transition (I - its
        // product, D x D), scan state and e are copied (cp.async, float) into staging while step
        // t computes: into the N staging tile and the spaces of slots m and k (the walks' keys),
        // the latter two with rows padded by 4 floats (a warp reads 8 rows at once).
        constexpr int lds = D + 4;
        static_assert(C * lds * 4 <= 2 * L::tile * 2, "a padded float tile fits a split slot");
        const index_t super_steps = own0 / SC > 1 ? own0 / SC - 1 : 0;
        const index_t first_cj = own0 > 1 ? own0 : 1;
        const index_t steps = super_steps + (ci > first_cj ? ci - first_cj : 0);
        const auto step_at = [&](index_t t, index_t& j0, const float*& trans, float*& dtrans) {
          if (t < super_steps) {
            const index_t at = cta.pi_at(t + 1);
            j0 = (t + 1) * SC * C, trans = cta.PIS + at, dtrans = cta.dPI + at;
          } else {
            j0 = (first_cj + t - super_steps) * C;
            trans = cta.NN + j0 * D, dtrans = cta.dP + j0 * D;
          }
        };
        float* const stage_st = reinterpret_cast<float*>(hi(L::m));
        float* const stage_e = reinterpret_cast<float*>(hi(L::k));
        const auto issue_adjoint = [&](index_t t) {
          index_t j0;
          const float* trans;
          float* dtrans;
          step_at(t, j0, trans, dtrans);
          const float* st = cta.states + j0 * D;
          const float* es = cta.es + j0 * D;
#pragma unroll
          for (int m = 0; m < C * D / 4 / L::threads; ++m) {  // rows are contiguous
            const int i = 4 * (int(threadIdx.x) + m * L::threads);
            const int at = i / D * lds + i % D;
            cp_async_16(stage_tr + i, trans + i, true);
            cp_async_16(stage_st + at, st + i, true);
            cp_async_16(stage_e + at, es + i, true);
          }
          cp_async_commit();
        };
        if (steps > 0) issue_adjoint(0);
        for (index_t t = 0; t < steps; ++t) {
          index_t j0;
          const float* trans;
          float* dtrans;
          step_at(t, j0, trans, dtrans);
          cp_async_wait<0>();
          __syncthreads();  // the copies whole; the step before is done with slots w and e3
          {
            part rr, e;
            unstage(stage_tr, L::w);
            pm::load_rows(rr, stage_st, lds, m0, n0, n);
            pm::load_rows(e, stage_e, lds, m0, n0, n);
            pm::store_split(rr, hi(L::e3), lo(L::e3), m0, n0, n);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) rbar[i][jj] += e[i][jj];
          }
          __syncthreads();  // slots w, e3 whole; the staging free
          if (t + 1 < steps) issue_adjoint(t + 1);
          cross(L::e3, hi(L::e2), lo(L::e2), split_b{}, dtrans, D, D, 1.f);
          warp_mma<ld, false, true, 4>(rbar, neg_rows_of(L::e2), hi(L::w), lo(L::w), n0);
          __syncthreads();  // rbar (e2) read
          pm::store_split(rbar, hi(L::e2), lo(L::e2), m0, n0, n);
        }

        // ---- the chunk's own transform, Q~ = Qs - tril(Qs W^T) U: dQs += rbar,
        // dX = -tril(rbar U^T), dU -= X^T rbar; then dQs += dX W and dW += dX^T Qs ----
        __syncthreads();
        {
          pm::tile_regs x;  // the walk left U and X of this chunk in place
          load_w(x, c0, n);
          pm::store_tile<true>(x, hi(L::w), lo(L::w));
        }
        __syncthreads();
        pm::load_rows(dq, cta.states + c0 * D, D, m0, n0, n);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) dq[i][jj] += rbar[i][jj];
        {
          part x;
          pm::zero(x);
          warp_mma<ld, false, true, 4>(x, neg_rows_of(L::e2), hi(L::u), lo(L::u), n0);
          tril_mask(x);
          pm::store_split(x, hi(L::e1), lo(L::e1), m0, n0, n);
        }
        __syncthreads();  // dX whole
        warp_mma<ld, true, true, 4>(dq, rows_of(L::e1), hi(L::w), lo(L::w), n0);
        cross(L::x, hi(L::e2), lo(L::e2), split_b{}, cta.dus + c0 * D, D, n,
              -1.f);                                                               // dU -= X^T rbar
        cross(L::e1, hi(L::q), lo(L::q), split_b{}, cta.dws + c0 * D, D, n, 1.f);  // dW += dX^T Qs
      } else {
        pm::load_rows(dq, cta.states + c0 * D, D, m0, n0, n);
      }
      for_fragment_pairs<4>(dq, m0, n0, [&](int a, int c, float x0, float x1) {
        if (a >= n) return;
        T* at = static_cast<T*>(p.dq) + cta.batch * p.dq_stride[0] +
                (cta.start + c0 + a) * p.dq_stride[1] + hq * p.dq_stride[2] + c;
        at[0] = from_float<T>(scale * x0);
        at[1] = from_float<T>(scale * x1);
      });
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
