#pragma once
// Tensor-core kernels of bidirectional linear attention (bla, gbla) for half and bfloat16
// inputs, spec gbla §3.2: both products on mma.sync m16n8k16 with float accumulation.
//   reduce: S_p = (w phi(K))^T V and z_p = (w phi(K))^T 1 per block of tokens, the gate weight
//           w = exp(a - M_p) (0 at pads) and phi applied while K is staged to shared memory in
//           the input type; the next tile's 16-byte loads are in flight during the products.
//           It writes the partial layout of linear_reduce_kernel, so the combine kernel and the
//           causal prefix kernel read it unchanged. Bidirectional calls merge the partials in
//           the last CTA of each head (combine_head) when a head has few blocks. D = Dv = 64
//           has its own kernel (linear_reduce_fast_kernel: phi on the A fragments in registers).
//   read:   Num | den = phi(Q) [S | z] with S and z staged once per CTA in the input type (half
//           scales them by a power of two to stay in range); the normaliser and the gated
//           RMSNorm run on the accumulator fragments (a row lives in one quad of lanes).
//           D = Dv = 64 has its own kernel (linear_read_fast_kernel: warps load their query and
//           gate rows straight into registers against a permuted staged state, no barrier).
//   one kernel: D = Dv = 64 on compute capability 9.0 and later: sm90_linear_cluster.cuh.
// phi (elu+1) and the gate activation (SiLU, sigmoid) run on packed pairs of the input type.
// Needs 16-byte aligned k, v, q rows, 4-byte aligned out and gate rows (16-byte for the D = 64
// read kernel) and the dims that linear_mma_dims accepts; other cases take the kernels of
// linear_kernels.cuh.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attnmix/cuda/arch/dependent_launch.cuh"
#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/linear_tiles.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

template <class T, class Policy, bool Wide>
__global__ void __launch_bounds__(linear_mma_reduce_threads, Wide ? 1 : linear_mma_reduce_ctas)
    linear_reduce_mma_kernel(const linear_kernel_params p, index_t block_tokens, float* partial,
                             index_t partials, unsigned* done, float* state,
                             unsigned char* staged) {
  constexpr int TT = linear_mma_tokens, threads = linear_mma_reduce_threads;
  constexpr int NT = Wide ? 16 : 4, max_chunks = TT * (Wide ? 128 : 64) / 8 / threads;
  constexpr int Stages = linear_mma_stages<Wide>;
  constexpr bool gated = Policy::gate != key_gate::off;
  extern __shared__ __align__(16) unsigned char linear_smem[];
  __shared__ float weight[TT];
  __shared__ float scratch[8];
  const int D = p.head_dim, Dv = p.value_dim, ks = D + 8, vs = Dv + 8;
  const int stage_elems = TT * (ks + vs);
  // Stage s: [TT][ks] keys (raw, then w * phi(k)), then [TT][vs] values.
  T* ring = reinterpret_cast<T*>(linear_smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const int h = blockIdx.x, blk = blockIdx.y, n = blockIdx.z;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = blk * block_tokens, t1 = min(t0 + block_tokens, length);
  float* out = partial + ((index_t(n) * p.kv_heads + h) * partials + blk) * partial_floats(D, Dv);

  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + start * p.k_stride[1] +
               h * p.k_stride[2];
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + start * p.v_stride[1] +
               h * p.v_stride[2];
  // Chunk c of a thread is 16 bytes of row r0 + c * step at column col (threads is a multiple
  // of the chunks a row), so that no division is left in the loop.
  const int kc = D / 8, vc = Dv / 8;
  const int kr0 = tid / kc, kcol = (tid % kc) * 8, kstep = threads / kc;
  const int vr0 = tid / vc, vcol = (tid % vc) * 8, vstep = threads / vc;
  // Tile at `base` into stage `st`; rows past the end are zero-filled. Always one commit group.
  auto issue = [&](index_t base, int st) {
    T* sk = ring + st * stage_elems;
    T* sv = sk + TT * ks;
    const index_t rows = base < t1 ? min(index_t(TT), t1 - base) : 0;
#pragma unroll
    for (int c = 0; c < max_chunks; ++c) {
      const int rk = kr0 + c * kstep, rv = vr0 + c * vstep;
      // Pad tokens are zero-filled too: their k and v may hold anything, NaN included.
      if (rk < TT) {
        const bool in = rk < rows && p.valid(batch, start + base + rk);
        cp_async_16(sk + rk * ks + kcol, in ? k + (base + rk) * p.k_stride[1] + kcol : k, in);
      }
      if (rv < TT) {
        const bool in = rv < rows && p.valid(batch, start + base + rv);
        cp_async_16(sv + rv * vs + vcol, in ? v + (base + rv) * p.v_stride[1] + vcol : v, in);
      }
    }
    cp_async_commit();
  };
  // Keys and values are in flight while the gate's block max and mass are found.
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) issue(t0 + s * TT, s);

  float M = 0.f, ell = 0.f;
  block_gate_stats<gated>(p, batch, start, h, t0, t1, scratch, M, ell);
  // Token (tile base + tid)'s logit, or 1 / 0 for valid / pad without a gate; one tile ahead.
  auto logit = [&](index_t base) {
    return tid < TT ? token_logit<gated>(p, batch, start, h, base + tid, t1) : 0.f;
  };
  float next_logit = logit(t0);

  const int warps_m = D / 16, warp_m = warp % warps_m, warp_n = warp / warps_m;
  const int nt = Dv / 8 / (8 / warps_m), n0 = warp_n * nt * 8;
  float acc[NT][4] = {};
  float zacc[4] = {};
  const std::uint32_t ones[2] = {pack2<T>(1.f, 1.f), pack2<T>(1.f, 1.f)};

  int st = 0;
  for (index_t base = t0; base < t1; base += TT) {
    const int rows = static_cast<int>(min(index_t(TT), t1 - base));
    T* sk = ring + st * stage_elems;
    T* sv = sk + TT * ks;
    cp_async_wait<Stages - 2>();
    if (tid < TT)
      weight[tid] = tid < rows ? (gated ? shifted_exp(next_logit, M) : next_logit) : 0.f;
    __syncthreads();  // this tile has landed; the previous tile's products are done
#pragma unroll
    for (int c = 0; c < max_chunks; ++c) {
      const int rk = kr0 + c * kstep;
      if (rk < TT) {
        uint4* x = reinterpret_cast<uint4*>(sk + rk * ks + kcol);
        *x = convert_keys8<T, Policy>(*x, weight[rk]);
      }
    }
    __syncthreads();
    // The stage the previous tile used is free: the tile Stages - 1 ahead goes there.
    issue(base + (Stages - 1) * TT, st == 0 ? Stages - 1 : st - 1);
    next_logit = logit(base + TT);
#pragma unroll
    for (int kk = 0; kk < TT / 16; ++kk) {
      std::uint32_t a[4];
      // A = (w phi(K))^T: rows d, columns tokens, read transposed from sk[token][d].
      ldmatrix_x4_trans(
          a, sk + (kk * 16 + lane % 8 + (lane / 16) * 8) * ks + warp_m * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        if (2 * j < nt) {
          std::uint32_t b[4];
          ldmatrix_x4_trans(b, sv + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * vs + n0 + j * 16 +
                                   (lane / 16) * 8);
          const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816<T>(acc[2 * j], a, b0);
          mma_16816<T>(acc[2 * j + 1], a, b1);
        }
      }
      if (warp_n == 0) mma_16816<T>(zacc, a, ones);
    }
    st = st + 1 == Stages ? 0 : st + 1;
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the CTA ends

  const int g = lane / 4, c2 = 2 * (lane % 4), d = warp_m * 16 + g;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j < nt) {
      const int e = n0 + j * 8 + c2;
      *reinterpret_cast<float2*>(out + d * Dv + e) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(out + (d + 8) * Dv + e) = make_float2(acc[j][2], acc[j][3]);
    }
  }
  if (warp_n == 0 && lane % 4 == 0) {
    out[D * Dv + d] = zacc[0];
    out[D * Dv + d + 8] = zacc[2];
  }
  finish_partial<T, Policy>(p, out, M, ell, partial, partials, done, state, staged, n, h, scratch);
}

// The bidirectional reduce pass for D = Dv = 64 (collective/linear_tiles.cuh's
// reduce_fast_tiles): same grid, ring of tiles, partial layout and fused combine as
// linear_reduce_mma_kernel.
template <class T, class Policy>
__global__ void __launch_bounds__(linear_mma_reduce_threads, linear_mma_reduce_ctas)
    linear_reduce_fast_kernel(const linear_kernel_params p, index_t block_tokens, float* partial,
                              index_t partials, unsigned* done, float* state,
                              unsigned char* staged) {
  constexpr int D = 64, Dv = 64;
  extern __shared__ __align__(16) unsigned char linear_smem[];
  __shared__ float scratch[8];
  const int h = blockIdx.x, blk = blockIdx.y, n = blockIdx.z;
  allow_dependents();  // one wave: the read kernel's CTAs take the SMs as this kernel's leave
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t t0 = blk * block_tokens, t1 = min(t0 + block_tokens, length);
  float* out = partial + ((index_t(n) * p.kv_heads + h) * partials + blk) * partial_floats(D, Dv);
  float M = 0.f, ell = 0.f;
  // The partial is not 16-byte aligned in global memory (partial_floats has a 2-float tail).
  reduce_fast_tiles<T, Policy, linear_mma_stages<false>>(
      p, batch, start, h, t0, t1, linear_smem, scratch, M, ell, [&](int i, float4 x) {
        out[4 * i] = x.x, out[4 * i + 1] = x.y, out[4 * i + 2] = x.z, out[4 * i + 3] = x.w;
      });
  finish_partial<T, Policy>(p, out, M, ell, partial, partials, done, state, staged, n, h, scratch);
}

// ---- read ----------------------------------------------------------------------------------
// CTA (query head hq, `tiles` consecutive 64-row query tiles, sequence n), 128 threads; warp w
// owns rows 16w .. 16w + 15 of a tile. Wide: D or Dv above 64. The query rows (and the gate rows
// with the gated norm) stream through a ring of 3 shared-memory stages by cp.async, two tiles
// in flight while one is multiplied and written.

template <class T, class Policy, bool Wide>
__global__ void __launch_bounds__(linear_mma_read_threads)
    linear_read_mma_kernel(const linear_kernel_params p, const float* state, int tiles) {
  constexpr int R = linear_mma_rows, threads = linear_mma_read_threads;
  constexpr int Stages = linear_mma_read_stages;
  constexpr int NT = Wide ? 16 : 8, max_chunks = R * (Wide ? 128 : 64) / 8 / threads;
  constexpr bool normed = Policy::norm == gated_norm::per_head;
  extern __shared__ __align__(16) unsigned char linear_smem[];
  __shared__ float row_valid[2][R];
  __shared__ float scratch[8];
  const int D = p.head_dim, Dv = p.value_dim, ss = Dv + 24, qs = D + 8, gs = Dv + 8;
  const int stage_elems = R * (qs + (normed ? gs : 0));
  T* sS = reinterpret_cast<T*>(linear_smem);  // [D][ss]: S, then z in columns Dv .. Dv + 15
  T* ring = sS + D * ss;  // stage: [R][qs] q (raw, then scale * phi(q)), [R][gs] gate (raw)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int hq = blockIdx.x, n = blockIdx.z, h = hq / p.group;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t row0 = index_t(blockIdx.y) * tiles * R;
  if (row0 >= length) return;
  const index_t row_end = min(length, row0 + index_t(tiles) * R);

  const T* q = static_cast<const T*>(p.q) + batch * p.q_stride[0] + start * p.q_stride[1] +
               hq * p.q_stride[2];
  const T* gate = normed ? static_cast<const T*>(p.gate) + batch * p.gate_stride[0] +
                               start * p.gate_stride[1] + hq * p.gate_stride[2]
                         : nullptr;
  const int qc = D / 8, gc = Dv / 8;  // as in the reduce kernel: no division in the loop
  const int qr0 = tid / qc, qcol = (tid % qc) * 8, qstep = threads / qc;
  const int gr0 = tid / gc, gcol = (tid % gc) * 8, gstep = threads / gc;
  // Tile at i0 into stage st; rows past this CTA's range are zero-filled. One commit group.
  auto issue = [&](index_t i0, int st) {
    T* sq = ring + st * stage_elems;
    const index_t rows = i0 < row_end ? min(index_t(R), row_end - i0) : 0;
#pragma unroll
    for (int c = 0; c < max_chunks; ++c) {
      const int r = qr0 + c * qstep;
      if (r < R)
        cp_async_16(sq + r * qs + qcol, r < rows ? q + (i0 + r) * p.q_stride[1] + qcol : q,
                    r < rows);
    }
    if constexpr (normed) {
      T* sg = sq + R * qs;
#pragma unroll
      for (int c = 0; c < max_chunks; ++c) {
        const int r = gr0 + c * gstep;
        if (r < R)
          cp_async_16(sg + r * gs + gcol,
                      r < rows ? gate + (i0 + r) * p.gate_stride[1] + gcol : gate, r < rows);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) issue(row0 + s * R, s);
  auto row_ok = [&](index_t i) {
    return tid < R && i + tid < length && p.valid(batch, start + i + tid) ? 1.f : 0.f;
  };
  float next_valid = row_ok(row0);

  // S and z in the input type; half keeps them under 1 by a power of two (undone on Num, den).
  const float* st = state + (index_t(n) * p.kv_heads + h) * (index_t(D) * Dv + D);
  float mul = 1.f;
  if constexpr (std::is_same_v<T, __half>) {
    float mx = 0.f;
    for (int idx = tid; idx < D * Dv + D; idx += threads) mx = fmaxf(mx, fabsf(st[idx]));
    mx = block_reduce<true>(mx, scratch);
    if (mx > 0.f) {
      int ex;
      frexpf(mx, &ex);
      mul = ldexpf(1.f, -ex);
    }
  }
  const float unmul = 1.f / mul;
  for (int idx = tid; idx < D * Dv; idx += threads)
    sS[(idx / Dv) * ss + idx % Dv] = from_float<T>(st[idx] * mul);
  for (int idx = tid; idx < D * 16; idx += threads)
    sS[(idx / 16) * ss + Dv + idx % 16] = from_float<T>(st[D * Dv + idx / 16] * mul);

  const int g = lane / 4, c2 = 2 * (lane % 4), nt = Dv / 8;
  // This lane's columns of the norm weight, the same in every row.
  float gam[normed ? NT : 1][2];
  if constexpr (normed) {
    const float* gamma = p.gamma == nullptr
                             ? nullptr
                             : p.gamma + (Policy::weight == norm_weight::per_head ? hq * Dv : 0);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        gam[j][i] = gamma != nullptr && j < nt ? gamma[j * 8 + c2 + i] : 1.f;
  }
  int stage = 0;
  for (int tile = 0; tile < tiles; ++tile) {
    const index_t i0 = row0 + index_t(tile) * R;
    if (i0 >= length) break;
    T* sq = ring + stage * stage_elems;
    const T* sg = sq + R * qs;
    float* valid_rows = row_valid[tile % 2];
    cp_async_wait<Stages - 2>();
    if (tid < R) valid_rows[tid] = next_valid;
    __syncthreads();  // this tile has landed; the previous tile is done with its stage
#pragma unroll
    for (int c = 0; c < max_chunks; ++c) {
      const int r = qr0 + c * qstep;
      if (r < R) {
        uint4* x = reinterpret_cast<uint4*>(sq + r * qs + qcol);
        *x = convert8<T, Policy, true>(*x, valid_rows[r] != 0.f ? p.scale : 0.f);
      }
    }
    __syncthreads();
    issue(i0 + (Stages - 1) * R, stage == 0 ? Stages - 1 : stage - 1);
    next_valid = row_ok(i0 + R);

    float acc[NT][4] = {};
    float zacc[4] = {};
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, sq + (warp * 16 + lane % 16) * qs + kk * 16 + (lane / 16) * 8);
      state_kstep<T>(acc, zacc, a, sS, ss, kk, nt, Dv, lane);
    }

    // Epilogue on the fragments: half 0 is row g, half 1 row g + 8 of the warp's 16.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * 16 + g + 8 * half;
      const bool in_range = i0 + r < length, valid = in_range && valid_rows[r] != 0.f;
      const index_t t = start + i0 + r;
      const float inv = Policy::normalize ? 1.f / (zacc[2 * half] * unmul + p.eps) : 1.f;
      float o[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] = j < nt ? acc[j][2 * half] * unmul * inv : 0.f;
        o[j][1] = j < nt ? acc[j][2 * half + 1] * unmul * inv : 0.f;
      }
      if constexpr (normed) {
        float act[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          float2 gv = make_float2(0.f, 0.f);
          if (j < nt && valid)
            gv = unpack2<T>(*reinterpret_cast<const std::uint32_t*>(sg + r * gs + j * 8 + c2));
          act[j][0] = fast_gate_activation<Policy::activation>(gv.x);
          act[j][1] = fast_gate_activation<Policy::activation>(gv.y);
          if (Policy::order == norm_gate_order::gate_then_norm)
            o[j][0] *= act[j][0], o[j][1] *= act[j][1];
        }
        float sq_sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) sq_sum += o[j][0] * o[j][0] + o[j][1] * o[j][1];
        sq_sum += __shfl_xor_sync(0xffffffffu, sq_sum, 1);
        sq_sum += __shfl_xor_sync(0xffffffffu, sq_sum, 2);
        const float rstd = rsqrtf(sq_sum / Dv + p.norm_eps);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            o[j][i] *= rstd;
            if (Policy::order == norm_gate_order::norm_then_gate) o[j][i] *= act[j][i];
            o[j][i] *= gam[j][i];
          }
        }
      }
      if (in_range && (valid || Policy::zero_pad_rows)) {
        T* op = static_cast<T*>(p.out) + batch * p.out_stride[0] + t * p.out_stride[1] +
                hq * p.out_stride[2];
#pragma unroll
        for (int j = 0; j < NT; ++j)
          if (j < nt)
            *reinterpret_cast<std::uint32_t*>(op + j * 8 + c2) =
                valid ? pack2<T>(o[j][0], o[j][1]) : 0u;
      }
    }
    stage = stage + 1 == Stages ? 0 : stage + 1;
  }
  cp_async_wait<0>();  // nothing may land in shared memory after the CTA ends
}

template <class T, class Policy, int D, int Dv>
__global__ void __launch_bounds__(linear_fast_threads, 2)
    linear_read_fast_kernel(const linear_kernel_params p, const float* state,
                            const unsigned char* staged, int groups) {
  using reader_t = fast_read<T, Policy, D, Dv>;
  constexpr int ss = reader_t::ss;
  __shared__ __align__(16) T sS[D * ss];
  __shared__ __align__(16) float sgamma[reader_t::normed ? Dv : 1];
  __shared__ float scratch[8];
  const int tid = threadIdx.x, warp = tid / 32;
  const int hq = blockIdx.x, n = blockIdx.z, h = hq / p.group;
  index_t batch, start, length;
  p.sequence(n, batch, start, length);
  const index_t row0 = index_t(blockIdx.y) * groups * 16;
  if (row0 >= length) return;
  reader_t reader(p, batch, start + row0, min(index_t(groups) * 16, length - row0), hq, 1);
  // In flight while the state is staged: the first group's queries and gate.
  reader.prime(warp);
  stage_gamma<Policy>(p, hq, 1, Dv, sgamma);
  // All of the above are inputs; the state is the reduce pass's (launched dependent on it).
  grid_dependency_wait();

  // The staged state (a copy of what the reduce kernel's last CTA wrote, or converted here from
  // the float state).
  float unmul = 1.f;
  if (staged != nullptr) {
    const unsigned char* src = staged + (index_t(n) * p.kv_heads + h) * staged_state_bytes(D, Dv);
    for (int i = tid; i < D * ss / 8; i += linear_fast_threads)
      reinterpret_cast<uint4*>(sS)[i] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
    unmul = __ldcg(reinterpret_cast<const float*>(src + D * ss * 2));
  } else {
    const float* st = state + (index_t(n) * p.kv_heads + h) * (index_t(D) * Dv + D);
    float mx = 0.f;
    if constexpr (std::is_same_v<T, __half>)
      for (int idx = tid; idx < D * Dv + D; idx += linear_fast_threads)
        mx = fmaxf(mx, fabsf(st[idx]));
    const float mul = staged_scale<T>(mx, p.scale, scratch, unmul);
    for (int idx = tid; idx < D * Dv + D; idx += linear_fast_threads)
      stage_state_element(sS, D, Dv, idx, from_float<T>(st[idx] * mul));
  }
  __syncthreads();
  reader.run(warp, sS, sgamma, unmul);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
