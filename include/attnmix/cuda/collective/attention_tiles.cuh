#pragma once
// Tile-level pieces of the softmax-family and PaTH forward kernels (sm80_attention.cuh,
// sm90_attention.cuh, sm80_path.cuh, sm90_path.cuh): swizzled cp.async tile loads, the online
// softmax of a wgmma score tile, and the epilogue that normalises and stores output rows.

#include <cmath>
#include <cstdint>

#include "attnmix/config.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/arch/types.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Copies rows [0, Rows) of a row-major tile into swizzled shared memory with cp.async; rows
// >= valid are zero-filled. Each thread's (row, chunk) pairs are fixed, so their offsets are
// computed once per kernel rather than once per tile.
template <int Rows, int Cols, int Threads>
struct tile_loader {
  static constexpr int chunks = Cols / 8;
  static constexpr int per_thread = (Rows * chunks + Threads - 1) / Threads;
  static_assert(Rows * chunks % Threads == 0, "tile chunks must divide evenly among threads");
  int row[per_thread], smem_offset[per_thread];
  index_t gmem_offset[per_thread];

  __device__ tile_loader(index_t row_stride) {
#pragma unroll
    for (int k = 0; k < per_thread; ++k) {
      const int idx = threadIdx.x + k * Threads, r = idx / chunks, c = idx % chunks;
      row[k] = r;
      smem_offset[k] = swizzle<Cols>(r, c);
      gmem_offset[k] = r * row_stride + c * 8;
    }
  }
  // `safe` is any readable address, used for the zero-filled rows.
  template <class T>
  __device__ __forceinline__ void load(T* smem, const T* gmem, index_t valid, const T* safe) const {
#pragma unroll
    for (int k = 0; k < per_thread; ++k) {
      const bool ok = row[k] < valid;
      cp_async_16(smem + smem_offset[k], ok ? gmem + gmem_offset[k] : safe, ok);
    }
  }
};

// Epilogue of the tensor-core kernels, whose O accumulators share one layout: o[4 j + 2 h + e]
// is row r0 + 8 h, column 8 j + c + e (c = 2 (lane % 4)), and a row's partial sums l live in
// the quad of lanes that share it. Stores this thread's two rows of the tile at `out` (rows >=
// `rows` are not stored), normalised, and with `lse` (row 0's, or nullptr) the log-sum-exp from
// the base-2 maxima m.
template <class T, int Dv>
__device__ __forceinline__ void store_output_rows(T* out, index_t out_stride, float* lse,
                                                  index_t lse_stride, int r0, index_t rows,
                                                  const float* o, const float (&m)[2],
                                                  const float (&l)[2]) {
  const int lane = threadIdx.x % 32, c = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = r0 + 8 * h;
    if (r >= rows) continue;
    const float inv = 1.f / sum;
    T* orow = out + r * out_stride;
#pragma unroll
    for (int j = 0; j < Dv / 8; ++j)
      *reinterpret_cast<std::uint32_t*>(orow + 8 * j + c) =
          pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    if (lse != nullptr && lane % 4 == 0)
      lse[r * lse_stride] = (m[h] + log2f(sum)) * 0.6931471805599453f;
  }
}

// One step of the online softmax (base 2) of a 64 x N score tile in the wgmma accumulator
// layout (s[4 j + 2 h + e]: row row0 + 8 h, column 8 j + c2 + e; a row lives in a quad of lanes):
// s becomes P, the row maxima m (of the logits) and this thread's partial row sums l advance,
// and rescale[h] says by how much O shrinks. One FFMA and one exp2 a score: without a gate the
// maximum is taken over the raw scores (scale > 0) and the scale is folded into the exponent;
// with one, over s * scale - gate_col (neg_gate: -gate_col at this thread's first column), the
// row's gate term added to the maximum (gate_row is read only then). A row that has seen no
// visible key keeps zeros.
template <int N>
__device__ __forceinline__ void online_softmax(float (&s)[N / 2], bool gated, const float* neg_gate,
                                               const float (&gate_row)[2], float scale_log2,
                                               float (&m)[2], float (&l)[2], float (&rescale)[2]) {
  if (gated) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float2 gc = *reinterpret_cast<const float2*>(neg_gate + 8 * j);  // both rows' columns
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[4 * j + 2 * h] = fmaf(s[4 * j + 2 * h], scale_log2, gc.x);
        s[4 * j + 2 * h + 1] = fmaf(s[4 * j + 2 * h + 1], scale_log2, gc.y);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // Maxima and sums in 4 independent chains: with few warps an SM, latency rules.
    float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
      part[j % 4] = fmaxf(part[j % 4], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float tile_max =
        mx == -INFINITY ? -INFINITY : (gated ? mx + gate_row[h] : mx * scale_log2);
    const float m_new = fmaxf(m[h], tile_max);
    // exp2(logit - m_new) = exp2(s * mul + add); no visible key yet: keep zeros.
    const float mul = gated ? 1.f : scale_log2;
    const float add = m_new == -INFINITY ? 0.f : (gated ? gate_row[h] : 0.f) - m_new;
    rescale[h] = fast_exp2(m[h] - (m_new == -INFINITY ? 0.f : m_new));
#pragma unroll
    for (int i = 0; i < 4; ++i) part[i] = 0.f;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = fast_exp2(fmaf(x, mul, add));
        part[j % 4] += x;
      }
    // Per-thread partial sums; the quad is summed at the end.
    l[h] = l[h] * rescale[h] + ((part[0] + part[1]) + (part[2] + part[3]));
    m[h] = m_new;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
