#pragma once
// Tile staging of the tensor-core linear-attention backward kernels
// (kernels/sm80_linear_backward.cuh, kernels/sm80_linear_backward_causal.cuh): 16-byte pieces of
// activation rows loaded a tile ahead, the feature map applied while they are split into two
// bfloat16 parts, pairs of activations read and written in the accumulators' layout, and a quad's
// sum (one row of an accumulator).

#include <cstdint>

#include "attnmix/core/linear_policy.hpp"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

using lbm_op = split_op;

// The gated norm's gate activation and its derivative.
template <class Policy>
__device__ __forceinline__ void lbm_gate(float g, float& act, float& dact) {
  const float s = __fdividef(1.f, 1.f + __expf(-g));  // 0 once exp(-g) passes 2^126
  if constexpr (Policy::activation == gate_activation::silu) {
    act = g * s;
    dact = s + act * (1.f - s);
  } else {
    act = s;
    dact = s * (1.f - s);
  }
}

// 16-byte piece (eight elements) ch of token t's row of an activation, or zeros.
template <class Dev>
__device__ __forceinline__ uint4 lbm_load8(const void* base, const index_t* st, index_t b,
                                           index_t t, int h, int ch, bool ok) {
  if (!ok) return make_uint4(0u, 0u, 0u, 0u);
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const Dev*>(base) + b * st[0] +
                                              t * st[1] + h * st[2] + 8 * ch));
}

// mul phi(x) of eight raw elements as bfloat16 operands, in two parts (or zeros when !ok:
// selected, not branched on, so that the warp's lanes stay together).
template <class Dev, class Policy>
__device__ __forceinline__ void lbm_phi8(uint4 raw, float mul, bool ok, lbm_op* hi, lbm_op* lo) {
  const std::uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  std::uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack2<Dev>(in[i]);
    split2(mul * fast_feature_map<Policy::phi>(x.x), mul * fast_feature_map<Policy::phi>(x.y), h[i],
           l[i]);
    h[i] = ok ? h[i] : 0u, l[i] = ok ? l[i] : 0u;
  }
  *reinterpret_cast<uint4*>(hi) = make_uint4(h[0], h[1], h[2], h[3]);
  if (lo != nullptr) *reinterpret_cast<uint4*>(lo) = make_uint4(l[0], l[1], l[2], l[3]);
}

// mul times eight raw elements as high and low bfloat16 parts (exact for half at mul = 1: 11 bits
// in 8 + 8).
template <class Dev>
__device__ __forceinline__ void lbm_split8(uint4 raw, uint4& hi, uint4& lo, float mul = 1.f) {
  const std::uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  std::uint32_t h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack2<Dev>(in[i]);
    split2(x.x * mul, x.y * mul, h[i], l[i]);
  }
  hi = make_uint4(h[0], h[1], h[2], h[3]);
  lo = make_uint4(l[0], l[1], l[2], l[3]);
}
// The raw 16-byte pieces of an activation's tile (Rows tokens, Cols elements a row) that this
// thread stages: piece i is e = threadIdx.x + i * Threads, row e / (Cols / 8). They are loaded
// a tile ahead, so that the loads are in flight while the tile before is multiplied (the passes
// are bound by memory latency otherwise). Pads and rows past `end` load zeros.
template <class Dev, int Cols, int Rows, int Threads>
struct lbm_tile_loads {
  static constexpr int per_row = Cols / 8, count = Rows * per_row / Threads;
  static_assert(Rows * per_row % Threads == 0, "whole pieces a thread");
  uint4 raw[count];
  __device__ static int row(int i) { return (int(threadIdx.x) + i * Threads) / per_row; }
  __device__ static int piece(int i) { return (int(threadIdx.x) + i * Threads) % per_row; }
  __device__ void fetch(const linear_kernel_params& f, const void* x, const index_t* st,
                        index_t batch, index_t start, index_t base, index_t end, int h) {
#pragma unroll
    for (int i = 0; i < count; ++i) {
      const index_t t = base + row(i);
      raw[i] = lbm_load8<Dev>(x, st, batch, start + t, h, piece(i),
                              t < end && f.valid(batch, start + t));
    }
  }
};

// One warp's copy of 16 rows of an activation (Cols elements a row: tokens base .. base + 15 of
// the sequence from `start`, head h; 16-byte aligned rows) into a tile of row stride Ld, in
// 16-byte pieces by cp.async; rows at or past `end` (> base) are zero-filled.
template <class Dev, int Cols, int Ld>
__device__ __forceinline__ void lbm_warp_copy16(lbm_op* dst, const void* src, const index_t* st,
                                                index_t batch, index_t start, index_t base,
                                                index_t end, int h) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = lane; e < 16 * (Cols / 8); e += 32) {
    const int r = e / (Cols / 8), c = 8 * (e % (Cols / 8));
    const index_t t = start + min(base + r, end - 1);
    cp_async_16(dst + r * Ld + c,
                static_cast<const Dev*>(src) + batch * st[0] + t * st[1] + h * st[2] + c,
                base + r < end);
  }
}

// A pair of activations at (b, t, h, d..d+1) (4-byte aligned), as floats by a plain load (through
// __ldg the causal query kernel spills 100 bytes more).
template <class Dev>
__device__ __forceinline__ float2 lbm_load2(const void* base, const index_t* st, index_t b,
                                            index_t t, int h, int d) {
  return unpack2<Dev>(*reinterpret_cast<const std::uint32_t*>(
      static_cast<const Dev*>(base) + b * st[0] + t * st[1] + h * st[2] + d));
}
template <class Dev>
__device__ __forceinline__ void lbm_store2(void* base, const index_t* st, index_t b, index_t t,
                                           int h, int d, float x, float y) {
  *reinterpret_cast<std::uint32_t*>(static_cast<Dev*>(base) + b * st[0] + t * st[1] + h * st[2] +
                                    d) = pack2<Dev>(x, y);
}

// The raw pairs of a 16-bit activation at this thread's positions of a warp's 16 x 64 accumulator
// (rows r0 + g and r0 + g + 8 of a chunk that starts at token t0, columns 8 nt + 2 (lane % 4)):
// x[nt][0] for the first row, x[nt][1] for the second, through the read-only cache. Every load
// is issued before any is used (one round trip, where a load a pair in the epilogue's branches
// took sixteen); rows at or past `rows` (>= 1) read the chunk's last row, which the caller does
// not use.
template <class Dev>
__device__ __forceinline__ void lbm_fragment_pairs(std::uint32_t (&x)[8][2], const void* base,
                                                   const index_t* st, index_t b, index_t t0,
                                                   int rows, int h, int r0) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c2 = 2 * (lane & 3);
  const int i0 = min(r0 + g, rows - 1), i1 = min(r0 + g + 8, rows - 1);
  // Each row's address formed once; the pairs are compile-time offsets from it (an address a
  // pair cost ~9 instructions, a tenth of the causal query pass).
  const Dev* at = static_cast<const Dev*>(base) + b * st[0] + h * st[2] + c2;
  const auto* row0 = reinterpret_cast<const std::uint32_t*>(at + (t0 + i0) * st[1]);
  const auto* row1 = reinterpret_cast<const std::uint32_t*>(at + (t0 + i1) * st[1]);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    x[nt][0] = __ldg(row0 + 4 * nt);
    x[nt][1] = __ldg(row1 + 4 * nt);
  }
}

// x, hidden from the compiler's loop analysis. A walk's chunk index passes through it, so that
// the addresses of each chunk's rows are computed where they are used instead of carried from
// chunk to chunk as induction variables (which spilled 800 bytes a thread in the key pass).
__device__ __forceinline__ index_t lbm_opaque(index_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
