#pragma once
// Tile-level pieces of the bidirectional linear-attention forward on tensor cores, shared by the
// two-pass kernels (kernels/sm80_linear.cuh) and the one-cluster kernel
// (kernels/sm90_linear_cluster.cuh): phi and the gate activation on packed pairs, the staged
// state, the gate statistics, the merge of a head's partial states (combine_head,
// finish_partial), the D = Dv = 64 reduce loop (reduce_fast_tiles) and read (fast_read).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attnmix/cuda/arch/mma.cuh"
#include "attnmix/cuda/collective/fast_math.cuh"
#include "attnmix/cuda/collective/linear_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Packed pairs of T: the feature map and the gate activation on two elements at once with the
// 16-bit ALU and the 16-bit approximate ex2 and tanh (sm_90 for bfloat16). Their results are
// rounded to T, as the operands of the products and the output are anyway; the exp argument
// is rounded to T before ex2, which moves exp(x) by under |x| 2^-8 relatively, where exp(x) <= 1
// is the small branch of elu+1.
template <class T>
using pair_t = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
template <class T>
__device__ __forceinline__ pair_t<T> as_pair(std::uint32_t x) {
  pair_t<T> y;
  memcpy(&y, &x, 4);
  return y;
}
template <class T>
__device__ __forceinline__ std::uint32_t as_bits(pair_t<T> x) {
  std::uint32_t y;
  memcpy(&y, &x, 4);
  return y;
}
template <class T>
__device__ __forceinline__ pair_t<T> pair_splat(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat162_rn(x);
  } else {
    return __float2half2_rn(x);
  }
}
// Below sm_90 the bfloat16 pairs go through float (the bf16x2 forms do not exist there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define ATTNMIX_BF16X2_SFU 0
#else
#define ATTNMIX_BF16X2_SFU 1
#endif
// exp2 or tanh of a pair, on the SFU's packed forms.
enum class pair_fn { ex2, tanh };
template <pair_fn F, class T>
__device__ __forceinline__ pair_t<T> pair_sfu(pair_t<T> x) {
  std::uint32_t y;
  const std::uint32_t b = as_bits<T>(x);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#if ATTNMIX_BF16X2_SFU
    if constexpr (F == pair_fn::ex2)
      asm("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(b));
    else
      asm("tanh.approx.bf16x2 %0, %1;" : "=r"(y) : "r"(b));
#else
    const float2 f = __bfloat1622float2(x);
    y = F == pair_fn::ex2 ? as_bits<T>(__floats2bfloat162_rn(exp2f(f.x), exp2f(f.y)))
                          : as_bits<T>(__floats2bfloat162_rn(tanhf(f.x), tanhf(f.y)));
#endif
  } else if constexpr (F == pair_fn::ex2) {
    asm("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(b));
  } else {
    asm("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(b));
  }
  return as_pair<T>(y);
}
#undef ATTNMIX_BF16X2_SFU
// Whether the feature map and the gate activation have a packed form.
template <class Policy>
constexpr bool packed_phi = Policy::phi == feature_map::elu_plus_one;
template <class Policy>
constexpr bool packed_gate =
    Policy::activation == gate_activation::silu || Policy::activation == gate_activation::sigmoid;
// elu+1 of a pair: max(x, 0) + exp(min(x, 0)).
template <class T>
__device__ __forceinline__ pair_t<T> pair_elu1(pair_t<T> x) {
  const pair_t<T> zero = pair_splat<T>(0.f);
  const pair_t<T> e =
      pair_sfu<pair_fn::ex2, T>(__hmul2(__hmin2(x, zero), pair_splat<T>(1.4426950408889634f)));
  return __hadd2(__hmax2(x, zero), e);
}
// SiLU or sigmoid of a pair through tanh: sigmoid(g) = (1 + tanh(g / 2)) / 2, silu = g sigmoid(g).
template <class T, gate_activation G>
__device__ __forceinline__ pair_t<T> pair_gate(pair_t<T> g) {
  const pair_t<T> half = pair_splat<T>(0.5f);
  const pair_t<T> h = __hmul2(g, half), t = pair_sfu<pair_fn::tanh, T>(h);
  if constexpr (G == gate_activation::silu) {
    return __hfma2(h, t, h);
  } else {
    return __hfma2(t, half, half);
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

// w phi(k) for 8 staged keys, zero when w == 0 (pads and rows past the end are zero-filled, so
// that no NaN reaches the products).
template <class T, class Policy>
__device__ __forceinline__ uint4 convert_keys8(uint4 raw, float w) {
  const std::uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  std::uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (packed_phi<Policy>) {
      o[i] = as_bits<T>(__hmul2(pair_elu1<T>(as_pair<T>(in[i])), pair_splat<T>(w)));
    } else {
      const float2 f = unpack2<T>(in[i]);
      o[i] = w != 0.f ? pack2<T>(w * fast_feature_map<Policy::phi>(f.x),
                                 w * fast_feature_map<Policy::phi>(f.y))
                      : 0u;
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- reduce --------------------------------------------------------------------------------
// CTA (KV head h, block p, sequence n), 256 threads; the heads of one block are neighbours in
// the grid, so that CTAs running together read whole [H, D] rows. Wide: D or Dv above 64 (a warp
// owns up to 16 column tiles of S_p). The tiles of K and V stream through a ring of Stages
// shared-memory buffers by cp.async, Stages - 1 tiles in flight while one is multiplied.

// The read kernel's staged state, permuted so that a lane's A fragments are whole 16-byte
// pieces of its query row and its accumulator columns whole pieces of its output row: lane
// (g, c) of a warp holds elements [c D/4, (c + 1) D/4) of rows g and g + 8. Row state_row(d) of
// the staged S holds S[d, :]; column state_col(e) holds S[:, e] (state_col is the same map on
// the value side). A lane's pair i (elements c D/4 + 2i, + 1) is the A register of k-step i / 2,
// low (even i) or high (odd i) half of the 16 k-slots.
// (Unsigned arithmetic: the indices are never negative, and the divisions become shifts.)
__host__ __device__ inline int state_row(int d, int D) {
  const unsigned w = unsigned(D) / 4, c = unsigned(d) / w, r = unsigned(d) % w;
  return int((r / 4) * 16 + ((r % 4) / 2) * 8 + 2 * c + r % 2);
}
__host__ __device__ inline int state_col(int e, int Dv) {
  const unsigned w = unsigned(Dv) / 4, c = unsigned(e) / w, r = unsigned(e) % w;
  return int((r / 2) * 8 + 2 * c + r % 2);
}
// The staged state of one head in the input type: [D][Dv + 24] (scale * S permuted, then
// scale * z repeated in columns Dv .. Dv + 15, then padding that keeps ldmatrix free of bank
// conflicts), then one float that undoes half's power-of-two scaling.
// z[d] of a 16-byte aligned staged state st (16-bit T), given as `pair` (the element twice): the 16
// columns from Dv of row state_row(d), two 16-byte stores (Dv and the stride are multiples of 8).
template <class T>
__device__ __forceinline__ void stage_state_z(T* st, int D, int Dv, int d, std::uint32_t pair) {
  uint4* row = reinterpret_cast<uint4*>(st + state_row(d, D) * staged_stride(Dv) + Dv);
  row[0] = row[1] = make_uint4(pair, pair, pair, pair);
}
// Element idx of [S | z] (S row-major, then z) as y, into its place in a 16-byte aligned staged
// state st (16-bit T): S[d, e] at (state_row(d), state_col(e)), z[d] by stage_state_z.
template <class T>
__device__ __forceinline__ void stage_state_element(T* st, int D, int Dv, int idx, T y) {
  static_assert(sizeof(T) == 2, "a 16-bit staged state");
  if (idx < D * Dv) {
    st[state_row(idx / Dv, D) * staged_stride(Dv) + state_col(idx % Dv, Dv)] = y;
    return;
  }
  std::uint16_t bits;
  memcpy(&bits, &y, sizeof bits);
  stage_state_z(st, D, Dv, idx - D * Dv, bits * 0x10001u);
}
// Elements 4 i .. 4 i + 3 of [S | z] times mul into the staged state st, as stage_state_element
// places them: the form for dims known at compile time and a thread holding whole float4s. Four
// elements of S lie in one row, in two pairs of neighbouring columns (two 32-bit stores); four of
// z are four rows (two 16-byte stores each). Index arithmetic dominates the element-wise form.
template <class T, int D, int Dv>
__device__ __forceinline__ void stage_state4(T* st, unsigned i, float4 x, float mul) {
  static_assert(sizeof(T) == 2 && D % 4 == 0 && Dv % 16 == 0, "a 16-bit staged state");
  constexpr int ss = staged_stride(Dv);
  if (4 * i < unsigned(D * Dv)) {
    const unsigned d = 4 * i / Dv, e = 4 * i % Dv;
    T* row = st + state_row(int(d), D) * ss;
    *reinterpret_cast<std::uint32_t*>(row + state_col(int(e), Dv)) = pack2<T>(x.x * mul, x.y * mul);
    *reinterpret_cast<std::uint32_t*>(row + state_col(int(e + 2), Dv)) =
        pack2<T>(x.z * mul, x.w * mul);
    return;
  }
  const float z[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    stage_state_z(st, D, Dv, int(4 * i - D * Dv + k), pack2<T>(z[k] * mul, z[k] * mul));
}

// Token t's logit, or 1 / 0 for a valid / pad token without a gate; 0 past t1.
template <bool Gated>
__device__ __forceinline__ float token_logit(const linear_kernel_params& p, index_t batch,
                                             index_t start, int h, index_t t, index_t t1) {
  if (t >= t1) return 0.f;
  if (Gated) return p.logit(batch, start + t, h);
  return p.valid(batch, start + t) ? 1.f : 0.f;
}

// A reduce block's gate statistics over tokens [t0, t1), with all its threads: the largest logit
// M and the mass ell = sum exp(logit - M); without a gate M = 0 and ell counts the valid tokens.
// One pass with four logits in flight a thread: each thread keeps a running max and the mass
// under it (rescaled when the max grows), and the block merges them. The block's first tiles
// wait for these statistics, so their latency is the kernel's ramp.
template <bool Gated>
__device__ void block_gate_stats(const linear_kernel_params& p, index_t batch, index_t start, int h,
                                 index_t t0, index_t t1, float* scratch, float& M, float& ell) {
  if (!Gated) {
    float sum = 0.f;
    for (index_t t = t0 + threadIdx.x; t < t1; t += blockDim.x)
      sum += p.valid(batch, start + t) ? 1.f : 0.f;
    M = 0.f;
    ell = block_reduce<false>(sum, scratch);
    return;
  }
  constexpr int unroll = 4;
  float m = -INFINITY, s = 0.f;
  for (index_t t = t0 + threadIdx.x; t < t1; t += unroll * blockDim.x) {
    float x[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      const index_t tu = t + u * blockDim.x;
      x[u] = tu < t1 ? p.logit(batch, start + tu, h) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      if (x[u] > m) {
        s = s * __expf(m - x[u]) + 1.f;  // exp(-inf) = 0 for the first valid logit
        m = x[u];
      } else {
        s += shifted_exp(x[u], m);
      }
    }
  }
  M = block_reduce<true>(m, scratch);
  ell = block_reduce<false>(s > 0.f ? s * __expf(m - M) : 0.f, scratch);
}

// The factor that takes a merged state into the staged input type: the query's scale, and for half
// also a power of two that keeps the largest |scale x| under 1 (vmax: this thread's largest |x|;
// every thread of the CTA calls it). unmul receives the power of two that the read undoes.
template <class T>
__device__ float staged_scale(float vmax, float scale, float* scratch, float& unmul) {
  unmul = 1.f;
  if constexpr (std::is_same_v<T, __half>) {
    const float mx = block_reduce<true>(vmax * scale, scratch);
    if (mx > 0.f) {
      int ex;
      frexpf(mx, &ex);
      unmul = ldexpf(1.f, ex);
      return scale * ldexpf(1.f, -ex);
    }
  }
  return scale;
}

// Merges the `partials` partial states of head (n, h) with a log-sum-exp over the block maxima,
// as linear_combine_kernel does, with one CTA of 256 threads: the float state, the caller's
// state_out and, when `staged` is given, the staged state of the read kernel.
template <class T, class Policy>
__device__ void combine_head(const linear_kernel_params& p, const float* part, index_t partials,
                             float* state, unsigned char* staged, int n, int h, float* scratch,
                             float* alpha) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const int D = p.head_dim, Dv = p.value_dim, tid = threadIdx.x;
  const index_t stride = partial_floats(D, Dv);
  float M = 0.f, ell = 0.f;
  if (gated) partial_gate_merge(part + D * Dv + D, partials, stride, scratch, M, ell);
  const float inv = gated ? (ell > 0.f ? 1.f / ell : 0.f) : 1.f;
  for (index_t q = tid; q < partials; q += blockDim.x) {
    const float l = __ldcg(part + q * stride + D * Dv + D + 1);
    alpha[q] = gated ? (l > 0.f ? __expf(__ldcg(part + q * stride + D * Dv + D) - M) : 0.f) : 1.f;
  }
  __syncthreads();
  float* out = state + (index_t(n) * p.kv_heads + h) * (index_t(D) * Dv + D);
  float vmax = 0.f;
  const int pairs = (D * Dv + D) / 2;
  for (int i = tid; i < pairs; i += blockDim.x) {
    float2 sum = make_float2(0.f, 0.f);
#pragma unroll 8
    for (index_t q = 0; q < partials; ++q) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part + q * stride) + i);
      sum.x += alpha[q] * x.x, sum.y += alpha[q] * x.y;
    }
    sum.x *= inv, sum.y *= inv;
    reinterpret_cast<float2*>(out)[i] = sum;
    vmax = fmaxf(vmax, fmaxf(fabsf(sum.x), fabsf(sum.y)));
    store_state_out(p, n, h, 2 * i, sum.x);
    store_state_out(p, n, h, 2 * i + 1, sum.y);
  }
  if (gated && tid == 0) store_lse_out(p, n, h, M, ell);
  if (staged == nullptr) return;
  // The staged state: scale * S (the query's scale moves onto the state), in the input type;
  // half keeps it under 1 by a power of two, undone by the read kernel.
  float unmul;
  const float mul = staged_scale<T>(vmax, p.scale, scratch, unmul);
  // This CTA's stores of the float state are visible to all its threads (half's block_reduce
  // has synchronised already).
  if constexpr (!std::is_same_v<T, __half>) __syncthreads();
  T* st = reinterpret_cast<T*>(staged + (index_t(n) * p.kv_heads + h) * staged_state_bytes(D, Dv));
  const int ss = staged_stride(Dv);
  for (int idx = tid; idx < D * Dv + D; idx += blockDim.x)
    stage_state_element(st, D, Dv, idx, from_float<T>(out[idx] * mul));
  if (tid == 0) *reinterpret_cast<float*>(st + D * ss) = unmul;
}

// The end of a reduce CTA, after its partial state `out` (S_p, then z_p): its block max and mass;
// then, with the fused merge (done != nullptr), the last CTA of the head to finish merges the
// head's partial states (a threadfence reduction).
template <class T, class Policy>
__device__ void finish_partial(const linear_kernel_params& p, float* out, float M, float ell,
                               const float* partial, index_t partials, unsigned* done, float* state,
                               unsigned char* staged, int n, int h, float* scratch) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const int D = p.head_dim, Dv = p.value_dim;
  if (threadIdx.x == 0) {
    out[D * Dv + D] = gated ? M : 0.f;
    out[D * Dv + D + 1] = ell;
  }
  if (done == nullptr) return;
  __shared__ float alpha[linear_fused_partials];
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done + n * p.kv_heads + h, 1u) == unsigned(partials - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  combine_head<T, Policy>(
      p, partial + (index_t(n) * p.kv_heads + h) * partials * partial_floats(D, Dv), partials,
      state, staged, n, h, scratch, alpha);
}

// ---- reduce, D = Dv = 64 -----------------------------------------------------------------------
// The bidirectional reduce pass for D = Dv = 64: warp w owns rows 16 (w % 4) .. + 15 of S_p and
// the k-steps 2 (w / 4), + 1 of every 64-token tile, so that each key is feature-mapped once,
// on the A fragments in registers (pairs of T, times the token weights), and a tile needs one
// barrier. The two token halves are added in shared memory at the end. Same grid, ring of
// tiles, partial layout and fused combine as linear_reduce_mma_kernel. Its loop
// (reduce_fast_tiles) is also the first phase of linear_cluster_fast_kernel.

// The partial state [S_p | z_p] of tokens [t0, t1) of KV head h (a sequence at batch, start)
// with the CTA's 256 threads: the tiles stream through a ring of Stages stages at `smem`, which
// then holds the two token halves. Returns the block's gate statistics in M, ell and hands the
// partial to sink(i, x), x = elements 4 i .. 4 i + 3, each i to one thread.
template <class T, class Policy, int Stages, class Sink>
__device__ __forceinline__ void reduce_fast_tiles(const linear_kernel_params& p, index_t batch,
                                                  index_t start, int h, index_t t0, index_t t1,
                                                  unsigned char* smem, float* scratch, float& M,
                                                  float& ell, Sink&& sink) {
  constexpr int D = 64, Dv = 64, TT = linear_mma_tokens, threads = linear_mma_reduce_threads;
  constexpr int ks = D + 8, vs = Dv + 8;
  constexpr int stage_elems = TT * (ks + vs), chunks = TT * D / 8 / threads;
  constexpr bool gated = Policy::gate != key_gate::off;
  __shared__ __align__(16) std::uint16_t weight_bits[2][TT];
  T(*weight)[TT] = reinterpret_cast<T(*)[TT]>(weight_bits);  // token weights, double-buffered
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // The loop is bound by its instruction issue (four warps a scheduler), so the tiles' addresses
  // walk by increments: K and V row pointers a tile at a time, 32-bit shared-memory addresses,
  // and row counts relative to the block's end. (The same walk for the logits measured slower in
  // the gated kernel; they keep token_logit.)
  constexpr std::uint32_t stage_bytes = stage_elems * 2, v_bytes = TT * ks * 2;
  const index_t ks1 = p.k_stride[1], vs1 = p.v_stride[1], ms1 = p.mask_stride[1];
  const int r0 = tid / 8, col = (tid % 8) * 8;  // chunk c: row r0 + 32 c, 16 bytes at col
  const index_t row0 = start + t0 + r0;         // this thread's first row in the batch row
  const T* k = static_cast<const T*>(p.k) + batch * p.k_stride[0] + h * p.k_stride[2] + col;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_stride[0] + h * p.v_stride[2] + col;
  const T* kr = k + row0 * ks1;  // chunk 0 of the next tile to issue
  const T* vr = v + row0 * vs1;
  const std::uint8_t* mr =
      p.mask != nullptr ? p.mask + batch * p.mask_stride[0] + row0 * ms1 : nullptr;
  int ahead = int(t1 - t0) - r0;  // rows of chunk 0 from the next tile to issue to the end
  const std::uint32_t ring = smem_address(smem);
  const std::uint32_t kdst = ring + std::uint32_t(r0 * ks + col) * 2;
  // The next tile into the stage at byte offset st; rows past the end and pad tokens are
  // zero-filled.
  auto issue = [&](std::uint32_t st) {
    const std::uint32_t dst = kdst + st;
#pragma unroll
    for (int c = 0; c < chunks; ++c) {
      bool in = 32 * c < ahead;
      if (mr != nullptr) in = in && mr[32 * c * ms1] != 0;
      cp_async_16(dst + 32 * c * ks * 2, in ? kr + 32 * c * ks1 : k, in);
      cp_async_16(dst + v_bytes + 32 * c * vs * 2, in ? vr + 32 * c * vs1 : v, in);
    }
    cp_async_commit();
    kr += TT * ks1, vr += TT * vs1, ahead -= TT;
    if (mr != nullptr) mr += TT * ms1;
  };
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) issue(s * stage_bytes);

  block_gate_stats<gated>(p, batch, start, h, t0, t1, scratch, M, ell);
  index_t lbase = t0;  // the tile of the next logit
  auto logit = [&] {
    const float x = tid < TT ? token_logit<gated>(p, batch, start, h, lbase + tid, t1) : 0.f;
    lbase += TT;
    return x;
  };
  float next_logit = logit();

  const int wm = warp % 4, wt = warp / 4, g = lane / 4, c2 = 2 * (lane % 4);
  // This lane's ldmatrix addresses in stage 0: A rows of K, B rows of V.
  const std::uint32_t a_at =
      ring + std::uint32_t((lane % 8 + (lane / 16) * 8) * ks + wm * 16 + ((lane / 8) % 2) * 8) * 2;
  const std::uint32_t b_at =
      ring + v_bytes + std::uint32_t((lane % 8 + ((lane / 8) % 2) * 8) * vs + (lane / 16) * 8) * 2;
  float acc[8][4] = {};
  float zacc[4] = {};
  const std::uint32_t ones[2] = {pack2<T>(1.f, 1.f), pack2<T>(1.f, 1.f)};
  std::uint32_t st = 0;  // byte offset of the stage in use
  int wb = 0;
  for (int left = int(t1 - t0); left > 0; left -= TT) {
    cp_async_wait<Stages - 2>();
    if (tid < TT)
      weight[wb][tid] =
          from_float<T>(tid < left ? (gated ? shifted_exp(next_logit, M) : next_logit) : 0.f);
    // This tile has landed; every warp is done with the previous tile (its stage is free) and
    // with the weights of two tiles ago.
    __syncthreads();
    issue(st == 0 ? (Stages - 1) * stage_bytes : st - stage_bytes);
    next_logit = logit();
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int kk = 2 * wt + h2;
      std::uint32_t a[4];
      // A = (w phi(K))^T: rows d, columns tokens; a0, a1 hold tokens c2, c2 + 1 of the k-step,
      // a2, a3 tokens c2 + 8, c2 + 9.
      ldmatrix_x4_trans(a, a_at + st + kk * 16 * ks * 2);
      const pair_t<T> w_lo = *reinterpret_cast<const pair_t<T>*>(&weight[wb][kk * 16 + c2]);
      const pair_t<T> w_hi = *reinterpret_cast<const pair_t<T>*>(&weight[wb][kk * 16 + c2 + 8]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pair_t<T> x = as_pair<T>(a[i]);
        if constexpr (packed_phi<Policy>) {
          x = pair_elu1<T>(x);
        } else {
          const float2 f = unpack2<T>(a[i]);
          x = as_pair<T>(
              pack2<T>(fast_feature_map<Policy::phi>(f.x), fast_feature_map<Policy::phi>(f.y)));
        }
        a[i] = as_bits<T>(__hmul2(x, i < 2 ? w_lo : w_hi));
      }
      const std::uint32_t brow = b_at + st + kk * 16 * vs * 2;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, brow + j * 32);
        const std::uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(acc[2 * j], a, b0);
        mma_16816<T>(acc[2 * j + 1], a, b1);
      }
      mma_16816<T>(zacc, a, ones);
    }
    st = st + stage_bytes == Stages * stage_bytes ? 0 : st + stage_bytes;
    wb ^= 1;
  }
  cp_async_wait<0>();
  __syncthreads();                              // the ring is free: it takes the two token halves
  float* red = reinterpret_cast<float*>(smem);  // [2][D * Dv + D]
  float* mine = red + wt * (D * Dv + D);
  const int d = wm * 16 + g;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int e = j * 8 + c2;
    *reinterpret_cast<float2*>(mine + d * Dv + e) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(mine + (d + 8) * Dv + e) = make_float2(acc[j][2], acc[j][3]);
  }
  if (lane % 4 == 0) mine[D * Dv + d] = zacc[0], mine[D * Dv + d + 8] = zacc[2];
  __syncthreads();
  for (int i = tid; i < (D * Dv + D) / 4; i += threads) {
    const float4 x = reinterpret_cast<const float4*>(red)[i];
    const float4 y = reinterpret_cast<const float4*>(red + D * Dv + D)[i];
    sink(i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
  }
}

// One k-step of [Num | den] += phi(Q) [S | z] against the staged state sS (row stride ss, z in
// columns Dv ..): the column tiles of acc below nt, and zacc, from A fragment `a` of k-step kk.
template <class T, int NT>
__device__ __forceinline__ void state_kstep(float (&acc)[NT][4], float (&zacc)[4],
                                            const std::uint32_t (&a)[4], const T* sS, int ss,
                                            int kk, int nt, int Dv, int lane) {
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

// ---- read, one head dim ------------------------------------------------------------------------
// The read pass for D and Dv fixed at compile time (multiples of 32, at most 128), 256 threads.
// Every warp works alone on 16-row groups of the CTA's rows (w, w + 8, ...): lane (g, c) loads
// elements [c D/4, (c + 1) D/4) of query rows g and g + 8 with 16-byte loads straight into
// registers (the next group's are in flight while this one is computed), applies phi there and
// uses them as its A fragments against the permuted staged state (state_row, state_col), so
// that its accumulators are elements [c Dv/4, (c + 1) Dv/4) of output rows g and g + 8: the
// gate is read and the output written with 16-byte accesses too. Only the state (and the norm
// weight) sits in shared memory; no barrier after it is staged.

// One CTA's share of the read: `rows` query rows from token `first` of batch row `batch`, for
// query heads first_head .. first_head + heads - 1. Its items are (head, 16-row group), head-major;
// warp w takes items w, w + 8, ... prime() starts the loads of a warp's first item, which need
// neither the state nor the norm weight; run() does the rest.
template <class T, class Policy, int D, int Dv>
struct fast_read {
  static_assert(D % 32 == 0 && Dv % 32 == 0 && D <= 128 && Dv <= 128, "fast_read");
  static constexpr int QV = D / 32, GV = Dv / 32, NT = Dv / 8, KK = D / 16, ss = Dv + 24;
  static constexpr int warps = linear_fast_threads / 32;
  static constexpr bool normed = Policy::norm == gated_norm::per_head;

  const linear_kernel_params& p;
  index_t batch, first;
  int rows, groups, items, g, c;
  // Lane (g, c)'s piece of row g of the range, for the first query head, in q, gate and out: an
  // item adds its head and row offsets to these (no 64-bit products of the batch and the range's
  // start an item).
  const T* q_at;
  const T* gate_at;
  T* out_at;
  // The next item's query rows g and g + 8 (zeros past the end), whether they are real tokens,
  // and the current item's gate rows (zeros for pads and past the end).
  uint4 qn[2][QV], gv[2][normed ? GV : 1];
  bool okn[2] = {false, false};

  // An item: query head `head` of the range's heads, 16-row group `group`.
  struct item {
    int head, group;
  };

  __device__ fast_read(const linear_kernel_params& params, index_t batch_row, index_t first_token,
                       index_t row_count, int first_head, int heads)
      : p(params), batch(batch_row), first(first_token), rows(int(row_count)) {
    groups = (rows + 15) / 16;
    items = heads * groups;
    g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
    auto at = [&](auto* x, const index_t(&s)[3], int width) {
      return x + batch * s[0] + (first + g) * s[1] + first_head * s[2] + c * (width / 4);
    };
    q_at = at(static_cast<const T*>(p.q), p.q_stride, D);
    gate_at = normed ? at(static_cast<const T*>(p.gate), p.gate_stride, Dv) : nullptr;
    out_at = at(static_cast<T*>(p.out), p.out_stride, Dv);
  }
  __device__ item first_item(int warp) const { return {warp / groups, warp % groups}; }
  // The item `warps` items after x, head-major.
  __device__ item next_item(item x) const {
    x.group += warps;
    if (x.group >= groups) {
      const int w = x.group / groups;
      x.head += w, x.group -= w * groups;
    }
    return x;
  }
  // Row g + 8 half of item x's group, from the range's first row.
  __device__ int row_index(item x, int half) const { return x.group * 16 + g + 8 * half; }
  // The lane's piece of that row in the tensor at `at` (strides s). A row beyond the range (in
  // false) gives the lane's row of the first group instead: the callers do not read it.
  template <class X>
  __device__ X* row(X* at, const index_t (&s)[3], item x, int half, bool in) const {
    return at + (in ? index_t(x.group * 16 + 8 * half) * s[1] : 0) + index_t(x.head) * s[2];
  }
  __device__ void load_q(item x) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row_index(x, half);
      const bool in = i < rows;
      okn[half] = in && p.valid(batch, first + i);
      const uint4* src = reinterpret_cast<const uint4*>(row(q_at, p.q_stride, x, half, in));
#pragma unroll
      for (int u = 0; u < QV; ++u) qn[half][u] = in ? __ldcs(src + u) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __device__ void load_gate(item x, const bool (&ok)[2]) {
    if constexpr (normed) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint4* src =
            reinterpret_cast<const uint4*>(row(gate_at, p.gate_stride, x, half, ok[half]));
#pragma unroll
        for (int u = 0; u < GV; ++u)
          gv[half][u] = ok[half] ? __ldcs(src + u) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
  __device__ void prime(int warp) {
    if (warp < items) {
      const item x = first_item(warp);
      load_q(x), load_gate(x, okn);
    }
  }

  // The items of warp `warp` against the staged state sS (undone by unmul) and the norm weights
  // sgamma [heads][Dv].
  __device__ void run(int warp, const T* sS, const float* sgamma, float unmul) {
    const int lane = threadIdx.x % 32;
    item x = first_item(warp);
    for (int it = warp; it < items; it += warps) {
      uint4 qv[2][QV];
      bool ok[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        ok[half] = okn[half];
#pragma unroll
        for (int u = 0; u < QV; ++u) qv[half][u] = qn[half][u];
      }
      const item xn = next_item(x);
      if (it != warp) load_gate(x, ok);
      if (it + warps < items) load_q(xn);

      // phi(q) as A fragments; pads (their q may be NaN) are zero rows.
      std::uint32_t af[2][D / 8];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int u = 0; u < QV; ++u) {
          const std::uint32_t w[4] = {qv[half][u].x, qv[half][u].y, qv[half][u].z, qv[half][u].w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            std::uint32_t x;
            if constexpr (packed_phi<Policy>) {
              x = as_bits<T>(pair_elu1<T>(as_pair<T>(w[k])));
            } else {
              const float2 f = unpack2<T>(w[k]);
              x = pack2<T>(fast_feature_map<Policy::phi>(f.x), fast_feature_map<Policy::phi>(f.y));
            }
            af[half][4 * u + k] = ok[half] ? x : 0u;
          }
        }
      }
      float acc[NT][4] = {};
      float zacc[4] = {};
#pragma unroll
      for (int kk = 0; kk < KK; ++kk) {
        const std::uint32_t a[4] = {af[0][2 * kk], af[1][2 * kk], af[0][2 * kk + 1],
                                    af[1][2 * kk + 1]};
        state_kstep<T>(acc, zacc, a, sS, ss, kk, NT, Dv, lane);
      }
      epilogue(x, acc, zacc, ok, sgamma + x.head * Dv, unmul);
      x = xn;
    }
  }

  // Half 0 is row g, half 1 row g + 8; accumulator pair j of a half is elements c Dv/4 + 2j, + 1
  // of its row. Num / den, then the gated RMSNorm, folded into one factor per row: o = acc * s
  // with s = unmul / den, rms(o) = s rms(acc).
  __device__ void epilogue(item x, const float (&acc)[NT][4], const float (&zacc)[4],
                           const bool (&ok)[2], const float* gamma, float unmul) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row_index(x, half);
      float s = unmul;
      if (Policy::normalize) s = unmul * __frcp_rn(zacc[2 * half] * unmul + p.eps);
      float o[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) o[j][0] = acc[j][2 * half], o[j][1] = acc[j][2 * half + 1];
      std::uint32_t res[NT];
      if constexpr (normed) {
        // The gate activation in pairs of T (packed_gate) or in float.
        float act[NT][2];
        std::uint32_t act2[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const std::uint32_t w = j % 4 == 0   ? gv[half][j / 4].x
                                  : j % 4 == 1 ? gv[half][j / 4].y
                                  : j % 4 == 2 ? gv[half][j / 4].z
                                               : gv[half][j / 4].w;
          if constexpr (packed_gate<Policy>) {
            act2[j] = as_bits<T>(pair_gate<T, Policy::activation>(as_pair<T>(w)));
            if (Policy::order == norm_gate_order::gate_then_norm) {
              const float2 a = unpack2<T>(act2[j]);
              act[j][0] = a.x, act[j][1] = a.y;
            }
          } else {
            const float2 gf = unpack2<T>(w);
            act[j][0] = fast_gate_activation<Policy::activation>(gf.x);
            act[j][1] = fast_gate_activation<Policy::activation>(gf.y);
          }
          if (Policy::order == norm_gate_order::gate_then_norm)
            o[j][0] *= act[j][0], o[j][1] *= act[j][1];
        }
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) sq += o[j][0] * o[j][0] + o[j][1] * o[j][1];
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        const float f = s * rsqrtf(s * s * sq * (1.f / Dv) + p.norm_eps);
        const float4* gam = reinterpret_cast<const float4*>(gamma + c * (Dv / 4));
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          const float4 gm = gam[j / 2];
          float y[4] = {o[j][0] * f * gm.x, o[j][1] * f * gm.y, o[j + 1][0] * f * gm.z,
                        o[j + 1][1] * f * gm.w};
          if (Policy::order == norm_gate_order::norm_then_gate && !packed_gate<Policy>)
            y[0] *= act[j][0], y[1] *= act[j][1], y[2] *= act[j + 1][0], y[3] *= act[j + 1][1];
          res[j] = pack2<T>(y[0], y[1]), res[j + 1] = pack2<T>(y[2], y[3]);
          if (Policy::order == norm_gate_order::norm_then_gate && packed_gate<Policy>) {
            res[j] = as_bits<T>(__hmul2(as_pair<T>(res[j]), as_pair<T>(act2[j])));
            res[j + 1] = as_bits<T>(__hmul2(as_pair<T>(res[j + 1]), as_pair<T>(act2[j + 1])));
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) res[j] = pack2<T>(o[j][0] * s, o[j][1] * s);
      }
      if (i < rows && (ok[half] || Policy::zero_pad_rows)) {
        uint4* dst = reinterpret_cast<uint4*>(row(out_at, p.out_stride, x, half, true));
#pragma unroll
        for (int u = 0; u < GV; ++u)
          __stcs(dst + u,
                 ok[half] ? make_uint4(res[4 * u], res[4 * u + 1], res[4 * u + 2], res[4 * u + 3])
                          : make_uint4(0u, 0u, 0u, 0u));
      }
    }
  }
};

// The norm weights of query heads hq0 .. hq0 + heads - 1 into sgamma [heads][Dv] (ones without
// a weight), with all the CTA's threads.
template <class Policy>
__device__ void stage_gamma(const linear_kernel_params& p, int hq0, int heads, int Dv,
                            float* sgamma) {
  if constexpr (Policy::norm == gated_norm::per_head) {
    for (int e = threadIdx.x; e < heads * Dv; e += blockDim.x) {
      const int hq = hq0 + e / Dv;
      const float* gamma = p.gamma == nullptr
                               ? nullptr
                               : p.gamma + (Policy::weight == norm_weight::per_head ? hq * Dv : 0);
      sgamma[e] = gamma != nullptr ? gamma[e % Dv] : 1.f;
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
