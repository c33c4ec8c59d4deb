#pragma once
// PaTH forward for Hopper (wgmma, sm_90a), half / bfloat16 inputs, D = Dv = 64. The loop of
// path_mma.cuh (spec/path_fox.md §1.5, §1.7, BT = BS = C) on the softmax kernel's structure. A CTA
// owns two neighbouring 64-row query chunks of one (sequence, query head), lo + 1 and lo; a
// consumer warpgroup walks each, right to left, with its running query r in float accumulators,
// and a producer warpgroup streams the key chunks both need -- K~, V, W and U of chunk top - t in
// stage t of a ring (cp.async, mbarriers), plus each consumer's diagonal K and M once. Sharing the
// stream halves what each query row pulls from L2 (32 KB a key chunk; 1-8 % faster than a CTA a
// query chunk, two CTAs an SM, on an H200). Per key chunk:
//   S = r K~^T and X = -r W^T (issued together, while P V of the previous chunk still runs; the
//   chunk data holds -W), r <- r + X U (on the tensor cores while the softmax of S runs), then
//   O += P V with the next chunk's products.
// On the diagonal, S = Q K^T + tril(X) M and the mask is causal. Precision as in
// path_mma.cuh: scores and P V take r rounded to T, the transition takes r, W and U in half, and r
// accumulates in float.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/detail/attention_mma.cuh"
#include "attnmix/cuda/detail/mbarrier.cuh"
#include "attnmix/cuda/detail/path_kernels.cuh"
#include "attnmix/cuda/detail/types.cuh"
#include "attnmix/cuda/detail/wgmma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int D, int Dv, int Stages>
struct path_wgmma_tile {
  static_assert(D == 64 && Dv == 64, "the registers and stages of D = Dv = 64 only");
  static constexpr int C = path_chunk, consumers = 2, threads = 128 * (consumers + 1);
  // The consumers take what the producer gives back (below 56 its address arithmetic spills).
  static constexpr int producer_registers = 56;
  static constexpr int consumer_registers =
      (65536 - 128 * producer_registers) / (128 * consumers) / 8 * 8;
  // Shared memory, in 8 KB tiles of C x 64 16-bit elements: per stage K~, V (in T), W and U (in
  // half); then each consumer's diagonal K (T) and M (half); then the gate terms of each stage
  // (floats) and the full and empty barrier of each stage.
  static constexpr int tile_elems = C * 64, tile_bytes = 2 * tile_elems;
  static constexpr int diagonal_offset = 4 * Stages * tile_bytes;
  static constexpr int gate_offset = diagonal_offset + 2 * consumers * tile_bytes;
  static constexpr int barrier_offset = gate_offset + 4 * Stages * C;
  static constexpr int smem_bytes = barrier_offset + 16 * Stages + 1024;  // + alignment slack
};

template <class T, int D, int Dv, int Stages>
__global__ void __launch_bounds__(384, 1) path_wgmma_kernel(const path_kernel_params p) {
  using tile = path_wgmma_tile<D, Dv, Stages>;
  constexpr int C = path_chunk, E = tile::tile_elems;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of the address: atoms must start 1024-byte aligned.
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* sk = reinterpret_cast<T*>(base);
  T* sv = sk + Stages * E;
  __half* sw = reinterpret_cast<__half*>(sv + Stages * E);
  __half* su = sw + Stages * E;
  T* sk_diag = reinterpret_cast<T*>(base + tile::diagonal_offset);       // [consumer]
  __half* sm_diag = reinterpret_cast<__half*>(sk_diag + 2 * E);          // [consumer]
  float* gate_col = reinterpret_cast<float*>(base + tile::gate_offset);  // minus the gate terms
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(base + tile::barrier_offset);
  std::uint64_t* empty = full + Stages;

  // Warp-uniform as far as the compiler knows (wgmma under a divergent branch is serialised).
  const int lane = threadIdx.x % 32, warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int wg = warp / 4;
  const int hq = blockIdx.y, h = hq / p.a.group;
  // Query chunks lo + 1 (consumer 0; when the sequence has it) and lo (consumer 1, or consumer 0
  // alone); pairs counted from the last, so that the heaviest start first.
  index_t batch, start, length;
  p.a.sequence(blockIdx.z, batch, start, length);
  const index_t lo = 2 * (static_cast<index_t>(gridDim.x) - 1 - blockIdx.x);
  if (lo * C >= length) return;
  const bool pair = (lo + 1) * C < length;
  const index_t top = pair ? lo + 1 : lo;  // stage t holds key chunk top - t
  auto rows_of = [&](index_t c) {
    return length - c * C < C ? static_cast<int>(length - c * C) : C;
  };
  const index_t row = p.row(batch, h, start);  // of the chunk data
  const double* G = p.a.gate_cumsum != nullptr
                        ? p.a.gate_cumsum + (batch * p.a.tokens + start) * p.a.q_heads + hq
                        : nullptr;
  const double g_ref = G != nullptr ? G[lo * C * p.a.q_heads] : 0.0;
  auto gate = [&](index_t i) {  // the gate term of position i (clamped), relative to lo's first
    return p.a.gate_coef_log2 *
           static_cast<float>(G[(i < length ? i : length - 1) * p.a.q_heads] - g_ref);
  };

  if (threadIdx.x == 0)
    for (int b = 0; b < Stages; ++b)
      mbarrier_init(full + b, 256), mbarrier_init(empty + b, pair ? 8 : 4);
  __syncthreads();

  if (wg == tile::consumers) {
    release_registers<tile::producer_registers>();
    // Producer. Each thread arrives twice on a full barrier: at once (its gate stores) and when
    // its copies have landed. Chunk top's K~ is nobody's: it is the top consumer's diagonal.
    const int thread = threadIdx.x - 128 * tile::consumers;
    const T* k = static_cast<const T*>(p.a.k) + batch * p.a.k_stride[0] + start * p.a.k_stride[1] +
                 h * p.a.k_stride[2];
    const T* v = static_cast<const T*>(p.a.v) + batch * p.a.v_stride[0] + start * p.a.v_stride[1] +
                 h * p.a.v_stride[2];
    const T* kt = static_cast<const T*>(p.kt) + row * D;
    const __half* wh = static_cast<const __half*>(p.wh) + row * D;
    const __half* u = static_cast<const __half*>(p.u) + row * D;
    const __half* mm = static_cast<const __half*>(p.m) + row * C;
    for (int t = 0; t <= top; ++t) {
      const int buf = t % Stages;
      if (t >= Stages) mbarrier_wait(empty + buf, (t / Stages - 1) & 1);
      const index_t j0 = (top - t) * C;
      const int rows = rows_of(top - t);
      if (t == 0) {
        for (int w = 0; w < (pair ? 2 : 1); ++w) {
          const index_t d0 = (top - w) * C;
          const int n = rows_of(top - w);
          load_tile<C, D>(sk_diag + w * E, k + d0 * p.a.k_stride[1], p.a.k_stride[1], n, k, thread);
          load_tile<C, C>(sm_diag + w * E, mm + d0 * C, C, n, mm, thread);
        }
      } else {
        load_tile<C, D>(sk + buf * E, kt + j0 * D, D, rows, kt, thread);
      }
      load_tile<C, Dv>(sv + buf * E, v + j0 * p.a.v_stride[1], p.a.v_stride[1], rows, v, thread);
      load_tile<C, D>(sw + buf * E, wh + j0 * D, D, rows, wh, thread);
      load_tile<C, D>(su + buf * E, u + j0 * D, D, rows, u, thread);
      if (G != nullptr && thread < C) gate_col[buf * C + thread] = -gate(j0 + thread);
      mbarrier_arrive(full + buf);
      mbarrier_arrive_on_copies(full + buf);
    }
    return;
  }
  claim_registers<tile::consumer_registers>();
  if (wg == 1 && !pair) return;

  // This consumer's query chunk c (its diagonal is stage t0) and rows row0, row0 + 8 of it.
  const int t0 = wg;
  const index_t c = top - t0;
  const int n = rows_of(c);
  const int g = lane / 4, c2 = 2 * (lane % 4);
  const int row0 = (warp % 4) * 16 + g;

  // The running query r (the accumulator layout, d[4 j + 2 h + e] = (row0 + 8 h, 8 j + c2 + e)).
  float r[D / 2];
  {
    const T* q = static_cast<const T*>(p.a.q) + batch * p.a.q_stride[0] +
                 (start + c * C) * p.a.q_stride[1] + hq * p.a.q_stride[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const bool ok = row0 + 8 * hh < n;
      const T* qr = q + (ok ? row0 + 8 * hh : 0) * p.a.q_stride[1];
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        r[4 * j + 2 * hh] = ok ? to_float(qr[8 * j + c2]) : 0.f;
        r[4 * j + 2 * hh + 1] = ok ? to_float(qr[8 * j + c2 + 1]) : 0.f;
      }
    }
  }
  float gate_row[2] = {0.f, 0.f};
  if (G != nullptr) gate_row[0] = gate(c * C + row0), gate_row[1] = gate(c * C + row0 + 8);
  // Descriptors, formed once; the rest is adding offsets in their 16-byte units. K~ and W are
  // K-major (D contiguous): k-step kk is 16 columns at byte 32 kk of a 128-byte row, 8-row groups
  // 1024 bytes apart. V, U and M are MN-major (their rows are the reduction index): k-step kc is
  // 16 rows, 2048 bytes further. A stage's tile is 8 KB further.
  const std::uint64_t k_desc = wgmma_desc(sk, 16, 1024), w_desc = wgmma_desc(sw, 16, 1024),
                      v_desc = wgmma_desc(sv, C * 128, 1024),
                      u_desc = wgmma_desc(su, C * 128, 1024),
                      kd_desc = wgmma_desc(sk_diag + wg * E, 16, 1024),
                      md_desc = wgmma_desc(sm_diag + wg * E, C * 128, 1024);
  auto k_major = [](std::uint64_t desc, int buf, int kk) {
    return desc + static_cast<std::uint64_t>(buf * (tile::tile_bytes >> 4) + 2 * kk);
  };
  auto mn_major = [](std::uint64_t desc, int buf, int kc) {
    return desc + static_cast<std::uint64_t>(buf * (tile::tile_bytes >> 4) + 128 * kc);
  };

  float o[Dv / 2] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // m: row maxima of the logits (base 2)
  float s[C / 2], x[C / 2];
  std::uint32_t rh[D / 16][4], rb[D / 16][4];  // r in half (transition) and in T (scores)
  std::uint32_t(&rt)[D / 16][4] = std::is_same_v<T, __half> ? rh : rb;
  std::uint32_t xn[C / 16][4], pf[C / 16][4];  // X (= -r W^T) in half; P in T
  auto query_fragments = [&] {
    to_fragments<__half>(rh, r);
    if constexpr (!std::is_same_v<T, __half>) to_fragments<T>(rb, r);
  };

  // Online softmax (base 2) of the scores s of stage buf: s becomes P, the running maxima and
  // sums advance, and `rescale` says by how much O shrinks. On the diagonal, keys after the row
  // are masked; every row keeps its own key there, so its maximum is finite from the start.
  auto softmax = [&](int buf, bool diagonal, float(&rescale)[2]) {
    if (diagonal)
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (8 * j + c2 + e % 2 > row0 + 8 * (e / 2)) s[4 * j + e] = -INFINITY;
    if (G != nullptr) {
      const float* ngc = gate_col + buf * C + c2;
#pragma unroll
      for (int j = 0; j < C / 8; ++j) {
        const float2 gc = *reinterpret_cast<const float2*>(ngc + 8 * j);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          s[4 * j + 2 * hh] = fmaf(s[4 * j + 2 * hh], p.a.scale_log2, gc.x);
          s[4 * j + 2 * hh + 1] = fmaf(s[4 * j + 2 * hh + 1], p.a.scale_log2, gc.y);
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
        part[j % 4] = fmaxf(part[j % 4], fmaxf(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]));
      float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Without a gate the maximum is over the raw scores (scale > 0), the scale folded into the
      // exponent; with one, over s * scale - gate_col, the row's term added afterwards.
      const float m_new = fmaxf(m[hh], G != nullptr ? mx + gate_row[hh] : mx * p.a.scale_log2);
      const float mul = G != nullptr ? 1.f : p.a.scale_log2;
      const float add = (G != nullptr ? gate_row[hh] : 0.f) - m_new;
      rescale[hh] = fast_exp2(m[hh] - m_new);
#pragma unroll
      for (int i = 0; i < 4; ++i) part[i] = 0.f;
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& z = s[4 * j + 2 * hh + e];
          z = fast_exp2(fmaf(z, mul, add));
          part[j % 4] += z;
        }
      l[hh] = l[hh] * rescale[hh] + ((part[0] + part[1]) + (part[2] + part[3]));
      m[hh] = m_new;
    }
  };

  // The diagonal chunk (stage t0): X = tril(-Q W^T) first, then S = Q K^T + X M and r <- r + X U.
  // The diagonal K and M come with stage 0; the lower consumer skips stage 0's chunk (above its
  // queries).
  {
    float rescale[2];
    mbarrier_wait(full, 0);
    if (t0 == 1) {
      if (lane == 0) mbarrier_arrive(empty);
      mbarrier_wait(full + 1, 0);
    }
    fence_proxy_async();  // the copies came through the generic proxy, wgmma reads the async one
    query_fragments();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_rs<__half, 0>(x, rh[kk], k_major(w_desc, t0, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(x);
    wgmma_fence_operand(rh);
#pragma unroll
    for (int j = 0; j < C / 8; ++j)  // only transitions up to the query's own position
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * j + c2 + e % 2 > row0 + 8 * (e / 2)) x[4 * j + e] = 0.f;
    to_fragments<__half>(xn, x);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<T, 0>(s, rt[kk], k_major(kd_desc, 0, kk), kk > 0);
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<__half, 1>(s, xn[kc], mn_major(md_desc, 0, kc));
    wgmma_commit();
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<__half, 1>(r, xn[kc], mn_major(u_desc, t0, kc));
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(s);
    softmax(t0, true, rescale);  // O is still zero
    wgmma_wait<0>();
    wgmma_fence_operand(r);
    wgmma_fence_operand(xn);
    wgmma_fence_operand(rt);
    to_fragments<T>(pf, s);
  }

  // Chunk top - t from stage t % Stages; the last one (chunk 0) needs no transition. The lambda
  // is inlined with a constant `transition`, so no wgmma sits under a run-time branch (the
  // compiler would serialise them all).
  auto key_chunk = [&](int t, bool transition) {
    const int buf = t % Stages, prev = (t - 1) % Stages;
    float rescale[2];
    mbarrier_wait(full + buf, (t / Stages) & 1);
    fence_proxy_async();
    if (transition)
      query_fragments();
    else
      to_fragments<T>(rt, r);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wgmma_rs<T, 0>(s, rt[kk], k_major(k_desc, buf, kk), kk > 0);
      if (transition) wgmma_rs<__half, 0>(x, rh[kk], k_major(w_desc, buf, kk), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<T, 1>(o, pf[kc], mn_major(v_desc, prev, kc));
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(s);
    wgmma_fence_operand(rt);
    if (transition) {
      wgmma_fence_operand(x);
      wgmma_fence_operand(rh);
      to_fragments<__half>(xn, x);
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<__half, 1>(r, xn[kc], mn_major(u_desc, buf, kc));
      wgmma_commit();
    }
    softmax(buf, false, rescale);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    wgmma_fence_operand(pf);
    if (transition) {
      wgmma_fence_operand(r);
      wgmma_fence_operand(xn);
    }
    if (lane == 0) mbarrier_arrive(empty + prev);  // this warp is done with stage t - 1
#pragma unroll
    for (int i = 0; i < Dv / 2; ++i) o[i] *= rescale[(i / 2) % 2];
    to_fragments<T>(pf, s);
  };
  for (int t = t0 + 1; t < top; ++t) key_chunk(t, true);
  if (top > t0) key_chunk(top, false);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<T, 1>(o, pf[kc], mn_major(v_desc, top % Stages, kc));
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(o);

  T* out = static_cast<T*>(p.a.out) + batch * p.a.out_stride[0] +
           (start + c * C) * p.a.out_stride[1] + hq * p.a.out_stride[2];
  float* lse = p.a.lse != nullptr ? p.a.lse + batch * p.a.lse_stride[0] +
                                        (start + c * C) * p.a.lse_stride[1] + hq * p.a.lse_stride[2]
                                  : nullptr;
  store_output_rows<T, Dv>(out, p.a.out_stride[1], lse, p.a.lse_stride[1], row0, n, o, m, l);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
