#pragma once
// The prefill key cache on tensor cores (mma.sync m16n8k16, float accumulation) from the
// tensor-core forward's chunk data (K~ in T = half or bfloat16, U in half; D = 64): what
// path_key_cache_kernel (path_simt.cuh) computes, with the same outputs. One 256-thread CTA a
// (KV head, sequence) walks the chunks from the last, keeping S = P_last ... P_{c+1} (D x D, float)
// in registers, warp w its rows 16 (w % 4) .., columns 32 (w / 4) .., and split in shared memory
// for the products. Chunk c:
//   kappa = K~_c S^T                  its keys carried through every later transition
//   S <- S - (S W_c^T) U_c            S P_c, P_c = I - W_c^T U_c
// The next chunk's K~, W and U are loaded into registers while a chunk computes. Operands are
// bfloat16 in two parts (collective/split_mma.cuh): S and W to about 16 bits, K~ in half and U
// exactly; S stays in float between the steps, so the walk's error does not grow with its length
// beyond the products' own.

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/split_mma.cuh"
#include "attnmix/cuda/collective/split_tiles.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct path_key_cache_mma_layout {
  enum slot : int { k, w, u, s, y, slots };
  static constexpr int smem = 2 * split_tile::elements * 2 * slots;  // bytes
};

// out, out_s*, slot_of, recent, transitions: as path_key_cache_kernel's (key_cache_rows).
template <class T, class Out>
__global__ void __launch_bounds__(split_tile::threads)
    path_key_cache_mma_kernel(const path_kernel_params p, Out* out, index_t out_s0, index_t out_s1,
                              index_t out_s2, const std::int32_t* slot_of, float* recent,
                              float* transitions) {
  namespace st = split_tile;
  using Lay = path_key_cache_mma_layout;
  constexpr int C = st::C, D = C, ld = st::ld;
  static_assert(C == path_chunk, "a tile is a chunk");
  constexpr bool k_lo = std::is_same_v<T, __half>;  // half K~: two bfloat16 parts
  extern __shared__ __align__(16) unsigned char smem_raw[];
  split_op* tiles = reinterpret_cast<split_op*>(smem_raw);
  const auto hi = [&](int s) {
    return tiles + 2 * s * st::elements;
  };
  const auto lo = [&](int s) {
    return tiles + (2 * s + 1) * st::elements;
  };

  const int h = blockIdx.x, warp = threadIdx.x / 32, m0 = 16 * (warp % 4), n0 = 32 * (warp / 4);
  index_t batch, start, length;
  p.a.sequence(blockIdx.y, batch, start, length);
  if (length == 0) return;
  const T* kt = static_cast<const T*>(p.kt) + p.row(batch, h, start) * D;
  const __half* u = static_cast<const __half*>(p.u) + p.row(batch, h, start) * D;
  const float* w = p.w + batch * p.w_stride[0] + start * p.w_stride[1] + h * p.w_stride[2];
  const index_t ws1 = p.w_stride[1];
  const key_cache_rows<Out> rows(p, out, out_s0, out_s1, out_s2, slot_of, recent, transitions, h,
                                 batch, start, length);

  float s[4][4];  // this warp's part of S, from I
  for_fragment_pairs<4>(s, m0, n0, [](int r, int c, float& x0, float& x1) {
    x0 = r == c ? 1.f : 0.f;
    x1 = r == c + 1 ? 1.f : 0.f;
  });
  st::store_split(s, hi(Lay::s), lo(Lay::s), m0, n0);

  st::regs xk, xw, xu;  // the chunk's tiles, loaded a step ahead
  const auto load_chunk = [&](index_t j0, int rows) {
    st::load_tile(
        xk, [&](int r, int c) { return to_float(kt[(j0 + r) * D + c]); }, rows, D);
    st::load_tile(
        xw, [&](int r, int c) { return w[(j0 + r) * ws1 + c]; }, rows, D);
    st::load_tile(
        xu, [&](int r, int c) { return to_float(u[(j0 + r) * D + c]); }, rows, D);
  };
  const auto rows_of = [&](index_t ci) {
    return length - ci * C < C ? static_cast<int>(length - ci * C) : C;
  };
  const index_t last = (length + C - 1) / C - 1;
  load_chunk(last * C, rows_of(last));

  for (index_t ci = last; ci >= 0; --ci) {
    const index_t j0 = ci * C;
    const int n = rows_of(ci);
    __syncthreads();  // the step before is done with the chunk's tiles; S is whole
    st::store_tile<k_lo>(xk, hi(Lay::k), lo(Lay::k));
    st::store_tile<true>(xw, hi(Lay::w), lo(Lay::w));
    st::store_tile<true>(xu, hi(Lay::u), lo(Lay::u));
    if (ci > 0) load_chunk(j0 - C, C);
    __syncthreads();

    float acc[4][4] = {};  // kappa = K~ S^T: rows are keys, columns D
    warp_mma<ld, false, true, 4>(acc, a_from_tile<ld, k_lo>{hi(Lay::k), lo(Lay::k), m0}, hi(Lay::s),
                                 lo(Lay::s), n0);
    for_fragment_pairs<4>(acc, m0, n0, [&](int b, int i, float x0, float x1) {
      if (b >= n) return;
      rows.put(j0 + b, i, x0);
      rows.put(j0 + b, i + 1, x1);
    });
    if (ci == 0) break;

    float y[4][4] = {};  // Y = S W^T: rows D, columns the chunk's tokens
    warp_mma<ld, false, true, 4>(y, a_from_tile<ld, true>{hi(Lay::s), lo(Lay::s), m0}, hi(Lay::w),
                                 lo(Lay::w), n0);
    st::store_split(y, hi(Lay::y), lo(Lay::y), m0, n0);
    __syncthreads();  // Y whole; S's tile read
    warp_mma<ld, true, true, 4>(s, a_from_tile<ld, true, true>{hi(Lay::y), lo(Lay::y), m0},
                                hi(Lay::u), lo(Lay::u), n0);  // S -= Y U
    st::store_split(s, hi(Lay::s), lo(Lay::s), m0, n0);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
