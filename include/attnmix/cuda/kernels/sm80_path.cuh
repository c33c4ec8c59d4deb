#pragma once
// PaTH forward on tensor cores (mma.sync m16n8k16, sm_80+), for half / bfloat16 inputs with
// D, Dv in {64, 128}. One CTA of 4 warps owns one 64-row query chunk of one (sequence, query
// head); each warp keeps 16 rows of the running query r in float accumulators. Per key chunk,
// right to left (spec/path_fox.md §1.5, §1.7 with BT = BS = C):
//   S = r K~^T (the diagonal chunk: S = tril(Q K^T - tril(Q W^T) M)), online softmax, O += P V;
//   X = r W^T, r <- r - X U   (the chunk's transition, skipped after chunk 0; the chunk data
//   holds -W, so the kernel forms -X and adds).
// Scores and P V take r rounded to T; the transition takes r, W and U in half (10 mantissa bits;
// fla makes the same choice) and accumulates into r in float. K~/V/W/U tiles stream through
// double-buffered, swizzled shared memory with cp.async.

#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/attention_tiles.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int D, int Dv>
struct path_mma_tile {
  static constexpr int C = path_chunk, warps = 4, threads = 32 * warps;
  // One pipeline stage: K (or K~), V, W, U of a chunk; plus M of the diagonal chunk.
  static constexpr int k_elems = C * D, v_elems = C * Dv, w_elems = C * D, u_elems = C * D;
  static constexpr int stage_elems = k_elems + v_elems + w_elems + u_elems;
  static constexpr int smem_bytes = 2 * (2 * stage_elems + C * C);
};

// A fragment (16 x 16, columns 16 kk ... 16 kk + 15) of a 16-row float accumulator tile, in U.
template <class U, int N>
__device__ __forceinline__ void a_fragment(std::uint32_t (&a)[4], const float (&acc)[N][4],
                                           int kk) {
  a[0] = pack2<U>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2<U>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2<U>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2<U>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// acc[16 x 8 N] += A[16 x 16 Kd] B^T with B row-major [8 N][16 Kd] in swizzled shared memory
// (B's rows are the output columns: keys, or W's rows). A from a float tile (converted to U).
template <class U, int Kd, int N, int Na>
__device__ __forceinline__ void mma_abt(float (&acc)[N][4], const float (&a_src)[Na][4],
                                        const U* sb, int lane) {
#pragma unroll
  for (int kk = 0; kk < Kd / 16; ++kk) {
    std::uint32_t a[4];
    a_fragment<U>(a, a_src, kk);
#pragma unroll
    for (int nn = 0; nn < N / 2; ++nn) {
      std::uint32_t b[4];
      ldmatrix_x4(b,
                  sb + swizzle<Kd>(nn * 16 + lane % 8 + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
      const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_16816<U>(acc[2 * nn], a, b0);
      mma_16816<U>(acc[2 * nn + 1], a, b1);
    }
  }
}

// acc[16 x 8 N] += A[16 x 64] B with B row-major [64][8 N] in swizzled shared memory (B's
// rows are the reduction index: keys). A from a float tile of 64 columns (converted to U).
template <class U, int N>
__device__ __forceinline__ void mma_ab(float (&acc)[N][4], const float (&a_src)[8][4], const U* sb,
                                       int lane) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) {
    std::uint32_t a[4];
    a_fragment<U>(a, a_src, kc);
#pragma unroll
    for (int nn = 0; nn < N / 2; ++nn) {
      std::uint32_t b[4];
      ldmatrix_x4_trans(
          b, sb + swizzle<8 * N>(kc * 16 + lane % 8 + ((lane / 8) % 2) * 8, nn * 2 + lane / 16));
      const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_16816<U>(acc[2 * nn], a, b0);
      mma_16816<U>(acc[2 * nn + 1], a, b1);
    }
  }
}

template <class T, int D, int Dv>
// (Asking for three blocks per SM instead of two measured slower: register spills.)
__global__ void __launch_bounds__(128) path_forward_mma_kernel(const path_kernel_params p) {
  using tile = path_mma_tile<D, Dv>;
  constexpr int C = path_chunk;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sk = reinterpret_cast<T*>(smem_raw);                          // [2][C][D]
  T* sv = sk + 2 * tile::k_elems;                                  // [2][C][Dv]
  __half* sw = reinterpret_cast<__half*>(sv + 2 * tile::v_elems);  // [2][C][D]
  __half* su = sw + 2 * tile::w_elems;                             // [2][C][D]
  __half* sm = su + 2 * tile::u_elems;                             // [C][C]
  __shared__ float gate_col[C];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, c2 = 2 * (lane % 4);
  const int hq = blockIdx.y, h = hq / p.a.group;
  index_t batch, start, length, ci, c0;
  int n;
  if (!p.query_chunk(batch, start, length, ci, c0, n)) return;

  const T* k = static_cast<const T*>(p.a.k) + batch * p.a.k_stride[0] + start * p.a.k_stride[1] +
               h * p.a.k_stride[2];
  const T* v = static_cast<const T*>(p.a.v) + batch * p.a.v_stride[0] + start * p.a.v_stride[1] +
               h * p.a.v_stride[2];
  const index_t base = p.row(batch, h, start);
  const T* kt = static_cast<const T*>(p.kt) + base * D;
  const __half* wh = static_cast<const __half*>(p.wh) + base * D;
  const __half* u = static_cast<const __half*>(p.u) + base * D;
  const __half* mm = static_cast<const __half*>(p.m) + (base + c0) * C;

  // Stage loads. Chunk cj's rows [0, rows) are valid (only the diagonal chunk may be partial).
  const tile_loader<C, D, tile::threads> k_loader(p.a.k_stride[1]), kt_loader(D), w_loader(D);
  const tile_loader<C, Dv, tile::threads> v_loader(p.a.v_stride[1]);
  auto load_stage = [&](index_t cj, int buf) {
    const index_t j0 = cj * C;
    const index_t rows = cj == ci ? n : C;
    if (cj == ci)
      k_loader.load(sk + buf * tile::k_elems, k + j0 * p.a.k_stride[1], rows, k);
    else
      kt_loader.load(sk + buf * tile::k_elems, kt + j0 * D, rows, kt);
    v_loader.load(sv + buf * tile::v_elems, v + j0 * p.a.v_stride[1], rows, v);
    w_loader.load(sw + buf * tile::w_elems, wh + j0 * D, rows, wh);
    w_loader.load(su + buf * tile::u_elems, u + j0 * D, rows, u);
  };
  load_stage(ci, 0);
  {
    const tile_loader<C, C, tile::threads> m_loader(C);
    m_loader.load(sm, mm, n, mm);
  }
  cp_async_commit();

  // This thread's rows (within the chunk): r0 = warp * 16 + g and r0 + 8.
  const int r0 = warp * 16 + g;
  float r[D / 8][4];
  {
    const T* q = static_cast<const T*>(p.a.q) + batch * p.a.q_stride[0] +
                 (start + c0) * p.a.q_stride[1] + hq * p.a.q_stride[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = r0 + 8 * hh;
      const T* qr = q + row * p.a.q_stride[1];
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        r[nt][2 * hh] = row < n ? to_float(qr[nt * 8 + c2]) : 0.f;
        r[nt][2 * hh + 1] = row < n ? to_float(qr[nt * 8 + c2 + 1]) : 0.f;
      }
    }
  }

  const double* G = p.a.gate_cumsum != nullptr
                        ? p.a.gate_cumsum + (batch * p.a.tokens + start) * p.a.q_heads + hq
                        : nullptr;
  const double g_ref = G != nullptr ? G[c0 * p.a.q_heads] : 0.0;
  float gate_row[2] = {0.f, 0.f};
  if (G != nullptr)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const index_t i = c0 + (r0 + 8 * hh < n ? r0 + 8 * hh : n - 1);
      gate_row[hh] = p.a.gate_coef_log2 * static_cast<float>(G[i * p.a.q_heads] - g_ref);
    }
  // Keys before a row's last hard reset have weight 0.
  index_t lo_row[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const index_t i = c0 + (r0 + 8 * hh < n ? r0 + 8 * hh : n - 1);
    lo_row[hh] = p.a.reset_lo((batch * p.a.tokens + start + i) * p.a.q_heads + hq);
  }

  float o[Dv / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (index_t it = 0; it <= ci; ++it) {
    const index_t cj = ci - it;
    const int buf = static_cast<int>(it % 2);
    if (cj > 0) load_stage(cj - 1, buf ^ 1);
    cp_async_commit();
    const index_t j0 = cj * C;
    if (G != nullptr && threadIdx.x < C) {
      const index_t j = j0 + threadIdx.x < length ? j0 + threadIdx.x : length - 1;
      gate_col[threadIdx.x] = p.a.gate_coef_log2 * static_cast<float>(G[j * p.a.q_heads] - g_ref);
    }
    cp_async_wait<1>();
    __syncthreads();
    const T* skb = sk + buf * tile::k_elems;
    const T* svb = sv + buf * tile::v_elems;
    const __half* swb = sw + buf * tile::w_elems;
    const __half* sub = su + buf * tile::u_elems;
    const bool diagonal = it == 0;

    // X = -r W^T (the chunk data holds -W), needed by the transition (and, on the diagonal, by
    // the scores).
    float x[C / 8][4] = {};
    if (cj > 0 || diagonal) {
      mma_abt<__half, D>(x, r, swb, lane);
      if (diagonal)  // tril: only transitions up to the query's own position
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (nt * 8 + c2 + e % 2 > r0 + 8 * (e / 2)) x[nt][e] = 0.f;
    }

    float s[C / 8][4] = {};
    mma_abt<T, D>(s, r, skb, lane);
    if (diagonal) mma_ab<__half>(s, x, sm, lane);  // - tril(Q W^T) M

#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float z = s[nt][e] * p.a.scale_log2;
        if (G != nullptr) z += gate_row[e / 2] - gate_col[nt * 8 + c2 + e % 2];
        if ((diagonal && nt * 8 + c2 + e % 2 > r0 + 8 * (e / 2)) ||
            j0 + nt * 8 + c2 + e % 2 < lo_row[e / 2])
          z = -INFINITY;
        s[nt][e] = z;
      }

      // Online softmax (each row's maximum is finite: the diagonal chunk is folded first).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = m_run[hh];
#pragma unroll
      for (int nt = 0; nt < C / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float alpha = fast_exp2(m_run[hh] - mx);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < C / 8; ++nt) {
        s[nt][2 * hh] = fast_exp2(s[nt][2 * hh] - mx);
        s[nt][2 * hh + 1] = fast_exp2(s[nt][2 * hh + 1] - mx);
        sum += s[nt][2 * hh] + s[nt][2 * hh + 1];
      }
      l_run[hh] = l_run[hh] * alpha + sum;
      m_run[hh] = mx;
#pragma unroll
      for (int nt = 0; nt < Dv / 8; ++nt) o[nt][2 * hh] *= alpha, o[nt][2 * hh + 1] *= alpha;
    }
    mma_ab<T>(o, s, svb, lane);  // O += P V

    if (cj > 0 || diagonal) mma_ab<__half>(r, x, sub, lane);  // r <- r - X U
    __syncthreads();  // the next iteration's prefetch overwrites this buffer
  }

  T* out = static_cast<T*>(p.a.out) + batch * p.a.out_stride[0] + (start + c0) * p.a.out_stride[1] +
           hq * p.a.out_stride[2];
  float* lse = p.a.lse != nullptr ? p.a.lse + batch * p.a.lse_stride[0] +
                                        (start + c0) * p.a.lse_stride[1] + hq * p.a.lse_stride[2]
                                  : nullptr;
  store_output_rows<T, Dv>(out, p.a.out_stride[1], lse, p.a.lse_stride[1], r0, n, &o[0][0], m_run,
                           l_run);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
