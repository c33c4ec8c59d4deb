#pragma once
// Tensor-core kernels of bidirectional linear attention (bla, gbla) for half and bfloat16
// inputs, spec gbla §3.2: both products on mma.sync m16n8k16 with float accumulation.
//   reduce: S_p = (w phi(K))^T V and z_p = (w phi(K))^T 1 per block of tokens, the gate weight
//           w = exp(a - M_p) (0 at pads) and phi applied while K is staged to shared memory in
//           the input type; the next tile's 16-byte loads are in flight during the products.
//           It writes the partial layout of linear_reduce_kernel, so the combine kernel and the
//           causal prefix kernel read it unchanged.
//   read:   Num | den = phi(Q) [S | z] with S and z staged once per CTA in the input type (half
//           scales them by a power of two to stay in range); the normaliser and the gated
//           RMSNorm run on the accumulator fragments (a row lives in one quad of lanes).
// Needs 16-byte aligned k, v, q rows, 4-byte aligned out and gate rows and the dims that
// linear_mma_dims accepts; other cases take the kernels of linear_kernels.cuh.

#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/detail/linear_kernels.cuh"
#include "attnmix/cuda/detail/mma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr int linear_mma_tokens = 64;  // reduce: tokens staged per tile
constexpr int linear_mma_reduce_threads = 256;
constexpr int linear_mma_rows = 64;  // read: query rows per tile, 16 a warp
constexpr int linear_mma_read_threads = 128;

// The reduce kernel's 8 warps split S_p (D x Dv) into D / 16 row tiles times 8 / (D / 16)
// column ranges of an even number of 8-wide column tiles.
inline bool linear_mma_dims(index_t D, index_t Dv) {
  if (D % 16 != 0 || Dv % 16 != 0 || D < 16 || D > 128 || Dv > 128) return false;
  const index_t warps_n = 8 / (D / 16);
  return 8 % (D / 16) == 0 && Dv % (16 * warps_n) == 0;
}
// The kernels' register arrays: sized for D, Dv <= 64 or for <= 128.
inline bool linear_mma_wide(index_t D, index_t Dv) {
  return D > 64 || Dv > 64;
}

template <class T>
__device__ __forceinline__ float2 unpack2(std::uint32_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

// The feature map and the gate activation of math/feature_map.hpp with the hardware exp and
// reciprocal: the 16-bit kernels are bound by these per-element instructions, and their error
// (a few float ulps) is far below the operands' rounding.
template <feature_map F>
__device__ __forceinline__ float fast_feature_map(float x) {
  if constexpr (F == feature_map::elu_plus_one) {
    return x > 0.f ? x + 1.f : __expf(x);
  } else if constexpr (F == feature_map::sigmoid) {
    return __fdividef(1.f, 1.f + __expf(-x));
  } else {
    return apply_feature_map<F>(x);
  }
}
template <gate_activation G>
__device__ __forceinline__ float fast_gate_activation(float g) {
  // exp(-g) = inf for g < -88 gives g * 0 = -0 and 1 * 0 = 0, the limits.
  if constexpr (G == gate_activation::silu) {
    return __fdividef(g, 1.f + __expf(-g));
  } else {
    return __fdividef(1.f, 1.f + __expf(-g));
  }
}

// Converts 8 staged elements: mul * phi(x) (Keys) or x, zeros when mul == 0 (pads, rows past
// the end: their values may be NaN or garbage).
template <class T, class Policy, bool Keys>
__device__ __forceinline__ uint4 convert8(uint4 raw, float mul) {
  const std::uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  std::uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = unpack2<T>(in[i]);
    if (Keys) {
      f.x = mul * fast_feature_map<Policy::phi>(f.x);
      f.y = mul * fast_feature_map<Policy::phi>(f.y);
    }
    o[i] = mul != 0.f ? pack2<T>(f.x, f.y) : 0u;
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- reduce --------------------------------------------------------------------------------
// CTA (KV head h, block p, sequence n), 256 threads; the heads of one block are neighbours in
// the grid, so that CTAs running together read whole [H, D] rows. Wide: D or Dv above 64 (a warp
// owns up to 16 column tiles of S_p). The tiles of K and V stream through a ring of Stages
// shared-memory buffers by cp.async, Stages - 1 tiles in flight while one is multiplied.
template <bool Wide>
constexpr int linear_mma_stages = Wide ? 3 : 4;

inline int linear_mma_reduce_smem(index_t D, index_t Dv) {
  const int stages = D > 64 || Dv > 64 ? linear_mma_stages<true> : linear_mma_stages<false>;
  return int(stages * linear_mma_tokens * (D + 8 + Dv + 8) * 2);
}

template <class T, class Policy, bool Wide>
__global__ void __launch_bounds__(linear_mma_reduce_threads, Wide ? 1 : 2)
    linear_reduce_mma_kernel(const linear_kernel_params p, index_t block_tokens, float* partial,
                             index_t partials) {
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
      if (rk < TT)
        cp_async_16(sk + rk * ks + kcol, rk < rows ? k + (base + rk) * p.k_stride[1] + kcol : k,
                    rk < rows);
      if (rv < TT)
        cp_async_16(sv + rv * vs + vcol, rv < rows ? v + (base + rv) * p.v_stride[1] + vcol : v,
                    rv < rows);
    }
    cp_async_commit();
  };
  // Keys and values are in flight while the gate's block max and mass are found.
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) issue(t0 + s * TT, s);

  float M = 0.f, ell = 0.f;
  if (gated) {
    float mx = -INFINITY;
    for (index_t t = t0 + tid; t < t1; t += threads) mx = fmaxf(mx, p.logit(batch, start + t, h));
    M = block_reduce<true>(mx, scratch);
    float sum = 0.f;
    for (index_t t = t0 + tid; t < t1; t += threads)
      sum += shifted_exp(p.logit(batch, start + t, h), M);
    ell = block_reduce<false>(sum, scratch);
  } else {
    float sum = 0.f;
    for (index_t t = t0 + tid; t < t1; t += threads) sum += p.valid(batch, start + t) ? 1.f : 0.f;
    ell = block_reduce<false>(sum, scratch);
  }
  // Token (tile base + tid)'s logit, or 1 / 0 for valid / pad without a gate; one tile ahead.
  auto logit = [&](index_t base) {
    float x = 0.f;
    if (tid < TT && base + tid < t1) {
      if (gated)
        x = p.logit(batch, start + base + tid, h);
      else
        x = p.valid(batch, start + base + tid) ? 1.f : 0.f;
    }
    return x;
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
    // Pad tokens (weight 0) become zeros: their k and v may hold anything, NaN included.
#pragma unroll
    for (int c = 0; c < max_chunks; ++c) {
      const int rk = kr0 + c * kstep, rv = vr0 + c * vstep;
      if (rk < TT) {
        uint4* x = reinterpret_cast<uint4*>(sk + rk * ks + kcol);
        *x = convert8<T, Policy, true>(*x, weight[rk]);
      }
      if (rv < TT && weight[rv] == 0.f)
        *reinterpret_cast<uint4*>(sv + rv * vs + vcol) = make_uint4(0u, 0u, 0u, 0u);
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
  if (tid == 0) {
    out[D * Dv + D] = gated ? M : 0.f;
    out[D * Dv + D + 1] = ell;
  }
}

// ---- read ----------------------------------------------------------------------------------
// CTA (query head hq, `tiles` consecutive 64-row query tiles, sequence n), 128 threads; warp w
// owns rows 16w .. 16w + 15 of a tile. Wide: D or Dv above 64. The query rows (and the gate rows
// with the gated norm) stream through a ring of 3 shared-memory stages by cp.async, two tiles
// in flight while one is multiplied and written.
constexpr int linear_mma_read_stages = 3;

inline int linear_mma_read_smem(index_t D, index_t Dv, bool gate) {
  return int(
      (D * (Dv + 24) + linear_mma_read_stages * linear_mma_rows * (D + 8 + (gate ? Dv + 8 : 0))) *
      2);
}

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
      const T* brow = sS + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ss + (lane / 16) * 8;
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        if (2 * j < nt) {
          std::uint32_t b[4];
          ldmatrix_x4_trans(b, brow + j * 16);
          const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_16816<T>(acc[2 * j], a, b0);
          mma_16816<T>(acc[2 * j + 1], a, b1);
        }
      }
      std::uint32_t b[4];
      ldmatrix_x4_trans(b, brow + Dv);
      const std::uint32_t b0[2] = {b[0], b[1]};
      mma_16816<T>(zacc, a, b0);
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

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
