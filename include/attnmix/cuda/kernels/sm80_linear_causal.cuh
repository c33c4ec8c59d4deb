#pragma once
// Tensor-core kernel of causal linear attention (kind::linear_causal) for bfloat16 inputs at
// D = Dv = 64: the chunked scan of linear_causal.cuh (same grid, segments, prefix states and
// results) with every product on mma.sync m16n8k16, bfloat16 operands and float accumulation.
//
// The value side is extended by a column: V_ext = [V | 1 | 0] (80 wide) and the state
// S_ext = [S | z | 0], so that one product gives a row's numerator and its denominator,
//   [num | den] = carry_i (R S_ext) + A V_ext,   A = (R K^T) o mask o exp(a_j - u_i),
// and one product carries the state past the chunk, S_ext <- cs S_ext + K^T (w o V_ext).
// Four warps: warp w owns query rows 16 w .. 16 w + 15 of the chunk (A and [num | den] in
// registers) and rows 16 w .. of the state, which it keeps in float registers for the whole
// walk; a bfloat16 copy in shared memory is the B operand of R S_ext.
// Operands are rounded to bfloat16 once, as in any bfloat16 matrix product with float
// accumulation: phi(q) scale, phi(k), the weighted scores and the carried state; v is exact.

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/causal_scan.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

namespace causal_mma {
constexpr int C = causal_chunk, D = 64, X = 80;      // chunk, head dim, extended value width
constexpr int ld = D + 8, ldx = X + 8, ldn = D + 4;  // padded rows: conflict-free ldmatrix
constexpr int NX = X / 8;                            // n-tiles of the extended value side

// Eight 16-bit elements to mul * f(x) in bfloat16, zeros where !ok (pads, rows past the end:
// their loads were skipped).
template <class F>
__device__ __forceinline__ uint4 convert8(const uint4& in, bool ok, float mul, F&& f) {
  uint4 out = make_uint4(0u, 0u, 0u, 0u);
  if (!ok) return out;
  const std::uint32_t* x = reinterpret_cast<const std::uint32_t*>(&in);
  std::uint32_t* y = reinterpret_cast<std::uint32_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = unpack2<__nv_bfloat16>(x[i]);
    y[i] = pack2<__nv_bfloat16>(mul * f(v.x), mul * f(v.y));
  }
  return out;
}

// A [C, 64] block of 16-bit rows (row stride `stride` elements) into registers: thread t loads
// 16-byte pieces t, t + 128, ... (row idx / 8, piece idx % 8); rows with valid == 0 are skipped.
__device__ __forceinline__ void load_rows(uint4 (&buf)[4], const __nv_bfloat16* src, index_t stride,
                                          const float* valid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = threadIdx.x + i * causal_mma_threads, j = idx / 8;
    buf[i] = valid[j] != 0.f ? *reinterpret_cast<const uint4*>(src + j * stride + (idx % 8) * 8)
                             : make_uint4(0u, 0u, 0u, 0u);
  }
}
}  // namespace causal_mma

// CTA (segment, KV head h, sequence n), causal_mma_threads threads; the arguments as for
// linear_causal_kernel.
template <class T, class Policy>
__global__ void __launch_bounds__(causal_mma_threads, 3)
    linear_causal_mma_kernel(const linear_kernel_params p, index_t segment_tokens,
                             const float* prefix, index_t segments) {
  using namespace causal_mma;
  static_assert(std::is_same_v<T, __nv_bfloat16>, "bfloat16 inputs");
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr int warps = causal_mma_threads / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* sK = reinterpret_cast<split_op*>(smem_raw);  // [C][ld]  phi(k); 0 at pads
  split_op* sR = sK + C * ld;                            // [C][ld]  scale phi(q); 0 at pads
  split_op* sV = sR + C * ld;                            // [C][ldx] [v | valid | 0]
  split_op* sVw = sV + C * ldx;                          // [C][ldx] w o [v | 1 | 0] (gated)
  split_op* sS = sVw + C * ldx;                          // [D][ldx] bfloat16 S_ext
  float* num = reinterpret_cast<float*>(sS + D * ldx);   // [C][ldn] numerators
  float* den = num + C * ldn;                            // [C]
  float* rowf = den + C;
  const causal_chunk_rows rs{rowf,         rowf + C,     rowf + 2 * C, rowf + 3 * C,
                             rowf + 4 * C, rowf + 5 * C, rowf + 6 * C};

  const int seg = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int warp = threadIdx.x / 32, r0 = 16 * warp;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = seg * segment_tokens, t1 = min(t0 + segment_tokens, length);
  const bool last = seg + 1 == segments;
  if (t0 >= t1 && !last) return;

  // The state carried in, staged through `num` as [d][ldn] with z in column D.
  float m, ell;
  {
    const float* st =
        prefix != nullptr
            ? prefix + ((index_t(n) * p.kv_heads + h) * segments + seg) * partial_floats(D, D)
            : nullptr;
    for (int idx = threadIdx.x; idx < D * D + D; idx += causal_mma_threads) {
      const float x = st != nullptr ? st[idx] : state_in_value(p, n, h, idx);
      num[idx < D * D ? (idx / D) * ldn + idx % D : (idx - D * D) * ldn + D] = x;
    }
    if (st != nullptr)
      m = st[D * D + D], ell = st[D * D + D + 1];
    else
      state_in_mass<Policy>(p, n, h, m, ell);
  }
  __syncthreads();
  float S[NX][4];
  for_fragment_pairs<NX>(S, r0, 0, [&](int d, int e, float& x0, float& x1) {
    x0 = e <= D ? num[d * ldn + e] : 0.f;
    x1 = e + 1 < D ? num[d * ldn + e + 1] : 0.f;
  });
  const auto store_state_copy = [&] {
    for_fragment_pairs<NX>(S, r0, 0, [&](int d, int e, float x0, float x1) {
      *reinterpret_cast<std::uint32_t*>(sS + d * ldx + e) = pack2<split_op>(x0, x1);
    });
  };
  store_state_copy();

  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + start * p.k_stride[1] +
               h * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + start * p.v_stride[1] +
               h * p.v_stride[2];
  const auto phi = [](float x) {
    return fast_feature_map<Policy::phi>(x);
  };
  const auto id = [](float x) {
    return x;
  };
  for (index_t c0 = t0; c0 < t1; c0 += C) {
    const int rows = static_cast<int>(min(index_t(C), t1 - c0));
    __syncthreads();  // the previous chunk is done with every buffer
    causal_chunk_gates<gated>(p, batch, start + c0, rows, h, rs, m, ell);
    uint4 kb[4], vb[4];
    load_rows(kb, k + c0 * p.k_stride[1], p.k_stride[1], rs.valid);
    load_rows(vb, v + c0 * p.v_stride[1], p.v_stride[1], rs.valid);
    __syncthreads();  // the gate's weights are ready
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = threadIdx.x + i * causal_mma_threads, j = idx / 8, c = (idx % 8) * 8;
      const bool ok = rs.valid[j] != 0.f;
      *reinterpret_cast<uint4*>(sK + j * ld + c) = convert8(kb[i], ok, 1.f, phi);
      *reinterpret_cast<uint4*>(sV + j * ldx + c) = convert8(vb[i], ok, 1.f, id);
      if (gated) *reinterpret_cast<uint4*>(sVw + j * ldx + c) = convert8(vb[i], ok, rs.wk[j], id);
    }
    if (threadIdx.x < C) {  // the extension columns D .. X - 1
      const int j = threadIdx.x;
      for (int c = D; c < X; c += 2) {
        *reinterpret_cast<std::uint32_t*>(sV + j * ldx + c) =
            pack2<split_op>(c == D ? rs.valid[j] : 0.f, 0.f);
        if (gated)
          *reinterpret_cast<std::uint32_t*>(sVw + j * ldx + c) =
              pack2<split_op>(c == D ? rs.wk[j] : 0.f, 0.f);
      }
    }

    for (int g = 0; g < p.group; ++g) {
      const int hq = h * p.group + g;
      const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] +
                   (start + c0) * p.q_stride[1] + hq * p.q_stride[2];
      uint4 qb[4];
      load_rows(qb, q, p.q_stride[1], rs.valid);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int idx = threadIdx.x + i * causal_mma_threads, j = idx / 8, c = (idx % 8) * 8;
        *reinterpret_cast<uint4*>(sR + j * ld + c) =
            convert8(qb[i], rs.valid[j] != 0.f, p.scale, phi);
      }
      __syncthreads();

      // A = R K^T on the warp's rows, masked to j <= i and weighted by exp(a_j - u_i).
      float A[8][4] = {};
      warp_mma<ld, false, false, 8>(A, a_from_tile<ld, false>{sR, nullptr, r0}, sK, nullptr);
      for_fragment_pairs<8>(A, r0, 0, [&](int i, int j, float& x0, float& x1) {
        if constexpr (gated) {
          x0 *= j <= i ? shifted_exp(rs.logit[j], rs.run_max[i]) : 0.f;
          x1 *= j + 1 <= i ? shifted_exp(rs.logit[j + 1], rs.run_max[i]) : 0.f;
        } else {
          x0 = j <= i ? x0 : 0.f;
          x1 = j + 1 <= i ? x1 : 0.f;
        }
      });
      // [num | den] = carry (R S_ext) + A V_ext.
      float N[NX][4] = {};
      warp_mma<ldx, true, false, NX>(N, a_from_tile<ld, false>{sR, nullptr, r0}, sS, nullptr);
      if constexpr (gated)
        for_fragment_pairs<NX>(N, r0, 0, [&](int i, int, float& x0, float& x1) {
          x0 *= rs.carry[i], x1 *= rs.carry[i];
        });
      warp_mma<ldx, true, false, NX>(N, a_from_regs<false>{A, 1.f}, sV, nullptr);
      for_fragment_pairs<NX>(N, r0, 0, [&](int i, int e, float x0, float x1) {
        if (e < D)
          *reinterpret_cast<float2*>(num + i * ldn + e) = make_float2(x0, x1);
        else if (e == D)
          den[i] = x0 + (gated ? p.eps * rs.mass[i] : p.eps);
      });
      __syncthreads();
      for (int row = warp; row < rows; row += warps)
        causal_write_row<T, Policy, 2>(p, batch, start + c0 + row, hq, num + row * ldn, den[row],
                                       rs, row);
    }

    // S_ext <- cs S_ext + K^T (w o V_ext): every warp is past its last read of sS.
    const float m_new = gated ? rs.next[0] : 0.f, ell_new = gated ? rs.next[1] : 1.f;
    if constexpr (gated) {
      const float cs = rescale_factor(m, m_new);
#pragma unroll
      for (int nt = 0; nt < NX; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) S[nt][i] *= cs;
    }
    warp_mma<ldx, true, false, NX>(S, a_from_tile_t<ld, false>{sK, nullptr, r0}, gated ? sVw : sV,
                                   nullptr);
    store_state_copy();
    m = m_new, ell = ell_new;
  }

  if (!last) return;
  const float inv = gated && ell > 0.f ? 1.f / ell : 1.f;
  for_fragment_pairs<NX>(S, r0, 0, [&](int d, int e, float x0, float x1) {
    if (e < D) {
      store_state_out(p, n, h, d * D + e, x0 * inv);
      store_state_out(p, n, h, d * D + e + 1, x1 * inv);
    } else if (e == D) {
      store_state_out(p, n, h, D * D + d, x0 * inv);
    }
  });
  // ell = 0 only at m = -inf (no state, nothing seen), so -inf is what the sequence had.
  if (gated && threadIdx.x == 0) store_lse_out(p, n, h, m, ell);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
