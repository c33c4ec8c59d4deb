#pragma once
// PaTH forward for Hopper (wgmma, sm_90a), half / bfloat16 inputs, D = Dv = 64. The loop of
// path_mma.cuh (spec/path_fox.md §1.5, §1.7, BT = BS = C) on the softmax kernel's structure.
// Persistent: a CTA an SM takes work items from a device-wide counter, each two neighbouring
// 64-row query chunks of one (sequence, query head), lo + 1 and lo, heaviest first. A consumer
// warpgroup walks each chunk, right to left, with its running query r in float accumulators; a
// producer warpgroup streams the key chunks both need -- K~, V, E and the gate of chunk top - t
// in stage t of a ring (cp.async, mbarriers) -- and, one item ahead, each consumer's queries,
// diagonal K and M, -W and U, so that an item starts without a trip to global memory. Sharing the
// stream halves what each query row pulls from L2 (24 KB a key chunk). The forget gate is a bias
// the scores start from (store_gate_bias). At D = C the chunk's transition I - W^T U is no dearer
// stored dense than as its two factors, and one product instead of two: the preparation writes
// E = -W^T U, and per key chunk
//   S = r K~^T, then r <- r + r E together with O += P V of the previous chunk (on the tensor
//   cores while the softmax of S runs).
// On the diagonal, X = tril(-Q W^T), S = Q K^T + X M and r <- r + X U. Precision: scores and P V
// take r rounded to T; the transition takes r and E in half (E from -W and U in half, summed in
// float: the operands path_mma.cuh's X = -r W^T, r + X U take, without rounding X); r accumulates
// in float.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmix/cuda/arch/mbarrier.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/arch/wgmma.cuh"
#include "attnmix/cuda/collective/attention_tiles.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"

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
      claimable_registers(threads, consumers, producer_registers);  // 224
  // Shared memory, in 8 KB tiles of C x 64 16-bit elements: per stage K~, V (in T) and E (in
  // half); then each consumer's diagonal K (T), M (half), queries (T), -W and U (half); then the
  // gate of each stage's chunk (3 C floats: the bias of store_gate_bias, then the terms); the full
  // and empty barrier of each stage and the item's pair; the queue.
  static constexpr int tile_elems = C * 64, tile_bytes = 2 * tile_elems;
  static constexpr int diagonal_offset = 3 * Stages * tile_bytes;
  static constexpr int gate_offset = diagonal_offset + 5 * consumers * tile_bytes;
  static constexpr int gate_floats = 3 * C;  // a stage's
  static constexpr int barrier_offset = gate_offset + 4 * Stages * gate_floats;
  static constexpr int queue_offset = barrier_offset + 16 * (Stages + 1);
  static constexpr int smem_bytes = queue_offset + 16 + 1024;  // + alignment slack
};

// The forget gate enters the scores through the wgmma accumulators. For each key column the
// producer stores its bias b_j = -(gate term of j) / scale, in score units, each pair of
// neighbouring columns twice, (b0, b1, b0, b1): the layout of a thread's accumulators for its two
// rows at those columns. S then starts from the bias instead of zero, and the softmax sees
// s * scale = scores * scale - gate_col with no further work a score. (The scale is positive:
// the host sends other scales to the portable kernel.)
__device__ __forceinline__ void store_gate_bias(float* pairs, int col, float bias) {
  float* at = pairs + 4 * (col / 2) + col % 2;
  at[0] = bias, at[2] = bias;
}

// This thread's accumulators of a 64 x N score tile set to the bias of their columns (c2: the
// thread's first column).
template <int N>
__device__ __forceinline__ void load_gate_bias(float (&s)[N / 2], const float* pairs, int c2) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const float4 b = *reinterpret_cast<const float4*>(pairs + 16 * j + 2 * c2);
    s[4 * j] = b.x, s[4 * j + 1] = b.y, s[4 * j + 2] = b.z, s[4 * j + 3] = b.w;
  }
}

// Work item n of pairs * q_heads * sequences, pairs fastest and counted from the last (the
// heaviest first, a few heads at a time): query chunks lo + 1 (when the sequence has it) and lo.
struct path_item {
  index_t batch, start, length, lo, top;  // stage t of the item holds key chunk top - t
  int hq, h;
  bool pair;        // whether chunk lo + 1 exists (the second consumer works)
  const double* G;  // the gate cumsum of this (sequence, head), or nullptr
  double g_ref;     // G at lo's first token: gate terms are relative to it

  __device__ bool decode(const path_kernel_params& p, int n, int pairs) {
    constexpr int C = path_chunk;
    const int head_seq = n / pairs;
    hq = head_seq % p.a.q_heads, h = hq / p.a.group;
    p.a.sequence(head_seq / p.a.q_heads, batch, start, length);
    lo = 2 * static_cast<index_t>(pairs - 1 - n % pairs);
    if (lo * C >= length) return false;
    pair = (lo + 1) * C < length;
    top = pair ? lo + 1 : lo;
    G = p.a.gate_cumsum != nullptr
            ? p.a.gate_cumsum + (batch * p.a.tokens + start) * p.a.q_heads + hq
            : nullptr;
    g_ref = G != nullptr ? G[lo * C * p.a.q_heads] : 0.0;
    return true;
  }
  __device__ int rows(index_t c) const {  // of chunk c
    return length - c * path_chunk < path_chunk ? static_cast<int>(length - c * path_chunk)
                                                : path_chunk;
  }
};

template <class T, int D, int Dv, int Stages>
__global__ void __launch_bounds__(384, 1)
    path_wgmma_kernel(const path_kernel_params p, const int pairs, const int items) {
  using tile = path_wgmma_tile<D, Dv, Stages>;
  constexpr int C = path_chunk, tile_n = tile::tile_elems;  // elements a tile
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of the address: atoms must start 1024-byte aligned.
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* sk = reinterpret_cast<T*>(base);
  T* sv = sk + Stages * tile_n;
  __half* se = reinterpret_cast<__half*>(sv + Stages * tile_n);
  T* sk_diag = reinterpret_cast<T*>(base + tile::diagonal_offset);    // [consumer]
  __half* sm_diag = reinterpret_cast<__half*>(sk_diag + 2 * tile_n);  // [consumer]
  T* sq = reinterpret_cast<T*>(sm_diag + 2 * tile_n);                 // [consumer]
  __half* sw_diag = reinterpret_cast<__half*>(sq + 2 * tile_n);       // [consumer]
  __half* su_diag = sw_diag + 2 * tile_n;                             // [consumer]
  float* gate = reinterpret_cast<float*>(base + tile::gate_offset);   // tile::gate_floats a stage
  // Per stage: full (loaded) and empty (every consumer thread is done with it: each arrives, so
  // that each one's reads are ordered before the producer's next writes); for the item's
  // queries, diagonal K, M, -W and U the same pair.
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(base + tile::barrier_offset);
  std::uint64_t* empty = full + Stages;
  std::uint64_t* item_full = empty + Stages;
  std::uint64_t* item_empty = item_full + 1;
  int* next_item = reinterpret_cast<int*>(base + tile::queue_offset);  // 2 slots, producer only
  int* item_slot = next_item + 2;  // the item whose queries are loaded, or -1: no more

  // Warp-uniform as far as the compiler knows (wgmma under a divergent branch is serialised).
  const int lane = threadIdx.x % 32, warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int wg = warp / 4;

  if (threadIdx.x == 0) {
    for (int b = 0; b < Stages; ++b) mbarrier_init(full + b, 256), mbarrier_init(empty + b, 256);
    mbarrier_init(item_full, 256), mbarrier_init(item_empty, 256);
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the warps meet only at mbarriers

  if (wg == tile::consumers) {
    release_registers<tile::producer_registers>();
    // Producer. Each thread arrives twice on a full barrier: at once (its gate stores) and when
    // its copies have landed. Chunk top's K~ is nobody's: it is the top consumer's diagonal.
    const int thread = threadIdx.x - 128 * tile::consumers;
    // Stages and items so far. Stage counts are unsigned: a stage's buffer and parity are then a
    // mask and a shift.
    unsigned counted = 0;
    int loaded = 0;
    work_queue queue(p.a.work_counter, next_item, thread);
    auto publish = [&](int n) {  // hand item n (or -1: no more) to the consumers
      publish_work_item(item_slot, n, item_full, thread);
      ++loaded;
    };
    for (int n = blockIdx.x; n < items; n = queue.next()) {
      path_item it{};
      if (!it.decode(p, n, pairs)) continue;
      const index_t ks = p.a.k_stride[1], vs = p.a.v_stride[1], qs = p.a.q_stride[1];
      const T* k = static_cast<const T*>(p.a.k) + it.batch * p.a.k_stride[0] + it.start * ks +
                   it.h * p.a.k_stride[2];
      const T* v = static_cast<const T*>(p.a.v) + it.batch * p.a.v_stride[0] + it.start * vs +
                   it.h * p.a.v_stride[2];
      const T* q = static_cast<const T*>(p.a.q) + it.batch * p.a.q_stride[0] + it.start * qs +
                   it.hq * p.a.q_stride[2];
      const index_t row = p.row(it.batch, it.h, it.start);  // of the chunk data
      const T* kt = static_cast<const T*>(p.kt) + row * D;
      const __half* wh = static_cast<const __half*>(p.wh) + row * D;
      const __half* u = static_cast<const __half*>(p.u) + row * D;
      const __half* mm = static_cast<const __half*>(p.m) + row * C;
      const __half* e = static_cast<const __half*>(p.e) + row * D;
      // The consumers' queries, diagonal K, M, -W and U, once they are done with the previous
      // item's.
      if (loaded > 0) mbarrier_wait(item_empty, (loaded - 1) & 1);
      for (int w = 0; w < (it.pair ? 2 : 1); ++w) {
        const index_t d0 = (it.top - w) * C;
        const int n_rows = it.rows(it.top - w);
        load_tile<C, D>(sq + w * tile_n, q + d0 * qs, qs, n_rows, q, thread);
        load_tile<C, D>(sk_diag + w * tile_n, k + d0 * ks, ks, n_rows, k, thread);
        load_tile<C, C>(sm_diag + w * tile_n, mm + d0 * C, C, n_rows, mm, thread);
        load_tile<C, D>(sw_diag + w * tile_n, wh + d0 * D, D, n_rows, wh, thread);
        load_tile<C, D>(su_diag + w * tile_n, u + d0 * D, D, n_rows, u, thread);
      }
      publish(n);
      for (int t = 0; t <= it.top; ++t, ++counted) {
        const unsigned buf = counted % Stages;
        const index_t j0 = (it.top - t) * C;
        gate_fetch g;
        if (it.G != nullptr && thread < C) g.load(p.a, it.G, j0 + thread, it.length);
        if (counted >= Stages) mbarrier_wait(empty + buf, (counted / Stages - 1) & 1);
        const int rows = it.rows(it.top - t);
        if (t > 0) load_tile<C, D>(sk + buf * tile_n, kt + j0 * D, D, rows, kt, thread);
        load_tile<C, Dv>(sv + buf * tile_n, v + j0 * vs, vs, rows, v, thread);
        // E: for the chunks some consumer passes (neither top, a diagonal only, nor chunk 0);
        // those are full.
        if (t > 0 && t < it.top) load_tile<C, D>(se + buf * tile_n, e + j0 * D, D, C, e, thread);
        if (it.G != nullptr && thread < C) {
          float* stage_gate = gate + buf * tile::gate_floats;
          store_gate_bias(stage_gate, thread, g.bias(p.a, it.g_ref));
          stage_gate[2 * C + thread] = g.term(p.a, it.g_ref);
        }
        mbarrier_arrive(full + buf);
        mbarrier_arrive_on_copies(full + buf);
      }
    }
    if (loaded > 0) mbarrier_wait(item_empty, (loaded - 1) & 1);
    publish(-1);
    return;
  }
  claim_registers<tile::consumer_registers>();

  const int g = lane / 4, c2 = 2 * (lane % 4);
  const int row0 = (warp % 4) * 16 + g;  // this thread's rows of its chunk: row0, row0 + 8
  // Descriptors, formed once; the rest is adding offsets in their 16-byte units. K~ and W are
  // K-major (D contiguous): k-step kk is 16 columns at byte 32 kk of a 128-byte row, 8-row groups
  // 1024 bytes apart. V, E, U and M are MN-major (their rows are the reduction index): k-step kc
  // is 16 rows, 2048 bytes further. A stage's tile is 8 KB further.
  const std::uint64_t k_desc = wgmma_desc(sk, 16, 1024), v_desc = wgmma_desc(sv, C * 128, 1024),
                      e_desc = wgmma_desc(se, C * 128, 1024),
                      kd_desc = wgmma_desc(sk_diag + wg * tile_n, 16, 1024),
                      md_desc = wgmma_desc(sm_diag + wg * tile_n, C * 128, 1024),
                      wd_desc = wgmma_desc(sw_diag + wg * tile_n, 16, 1024),
                      ud_desc = wgmma_desc(su_diag + wg * tile_n, C * 128, 1024);
  auto k_major = [](std::uint64_t desc, unsigned buf, int kk) {
    return wgmma_desc_add(desc, buf * (tile::tile_bytes >> 4) + 2 * kk);
  };
  auto mn_major = [](std::uint64_t desc, unsigned buf, int kc) {
    return wgmma_desc_add(desc, buf * (tile::tile_bytes >> 4) + 128 * kc);
  };

  path_item it{};
  // The running query r (the accumulator layout, d[4 j + 2 h + e] = (row0 + 8 h, 8 j + c2 + e)).
  float r[D / 2], o[Dv / 2];
  float m[2], l[2];                // m: row maxima of the logits (base 2)
  float gate_row[2] = {0.f, 0.f};  // the rows' own gate terms, for the log-sum-exp
  float s[C / 2], x[C / 2];
  std::uint32_t rh[D / 16][4], rb[D / 16][4];  // r in half (transition) and in T (scores)
  std::uint32_t(&rt)[D / 16][4] = std::is_same_v<T, __half> ? rh : rb;
  std::uint32_t xn[C / 16][4], pf[C / 16][4];  // X (= -Q W^T on the diagonal) in half; P in T
  auto query_fragments = [&] {
    to_fragments<__half>(rh, r);
    if constexpr (!std::is_same_v<T, __half>) to_fragments<T>(rb, r);
  };

  // The scores' accumulators before the products of stage buf: the gate bias of its chunk, or
  // nothing (S then starts from zero).
  const bool gated = p.a.gate_cumsum != nullptr;
  auto start_scores = [&](unsigned buf) {
    if (gated) load_gate_bias<C>(s, gate + buf * tile::gate_floats, c2);
  };
  // Online softmax (base 2) of the scores s: s becomes P, the running maxima and sums advance,
  // and `rescale` says by how much O shrinks. On the diagonal, keys after the row are masked;
  // every row keeps its own key there, so its maximum is finite from the start.
  // Keys before a row's last hard reset (lo_row, sequence-local) are masked too; j0 is the key
  // chunk's first token.
  index_t lo_row[2] = {0, 0};
  auto softmax = [&](bool diagonal, float(&rescale)[2], index_t j0) {
    if (diagonal)
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (8 * j + c2 + e % 2 > row0 + 8 * (e / 2)) s[4 * j + e] = -INFINITY;
    if (j0 < lo_row[1])  // lo_row[1] >= lo_row[0]: a row's last reset only moves forward
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j0 + 8 * j + c2 + e % 2 < lo_row[e / 2]) s[4 * j + e] = -INFINITY;
    // The columns' gate is in s already, and the rows' is left out: a row's constant changes
    // neither P nor the sums; it is added to m for the log-sum-exp at the end.
    online_softmax<C>(s, false, nullptr, gate_row, p.a.scale_log2, m, l, rescale);
  };

  // The key chunk in stage st (counted across items), after the item's first; the last one
  // (chunk 0) needs no transition. The lambda is inlined with a constant `transition`, so no wgmma
  // sits under a run-time branch (the compiler would serialise them all).
  auto key_chunk = [&](unsigned st, bool transition, index_t j0) {
    const unsigned buf = st % Stages, prev = (st - 1) % Stages;
    float rescale[2];
    mbarrier_wait(full + buf, (st / Stages) & 1);
    fence_proxy_async();
    if (transition)
      query_fragments();
    else
      to_fragments<T>(rt, r);
    start_scores(buf);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_rs<T, 0>(s, rt[kk], k_major(k_desc, buf, kk), kk > 0 || gated);
    wgmma_commit();
    if (transition)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<__half, 1>(r, rh[kk], mn_major(e_desc, buf, kk));
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<T, 1>(o, pf[kc], mn_major(v_desc, prev, kc));
    wgmma_commit();
    wgmma_wait<1>();  // S is in; r <- r + r E and P V may still run
    wgmma_fence_operand(s);
    softmax(false, rescale, j0);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    wgmma_fence_operand(pf);
    wgmma_fence_operand(rt);
    if (transition) {
      wgmma_fence_operand(r);
      wgmma_fence_operand(rh);
    }
    mbarrier_arrive(empty + prev);  // done with stage st - 1
#pragma unroll
    for (int i = 0; i < Dv / 2; ++i) o[i] *= rescale[(i / 2) % 2];
    to_fragments<T>(pf, s);
  };
  unsigned counted = 0;  // stages of the items before
  for (int done = 0;; ++done) {
    mbarrier_wait(item_full, done & 1);
    const int n_item = *static_cast<volatile int*>(item_slot);
    if (n_item < 0) break;
    it.decode(p, n_item, pairs);
    const index_t top = it.top;
    if (wg == 1 && !it.pair) {  // no second chunk: hand every stage back as it arrives
      mbarrier_arrive(item_empty);
      for (int t = 0; t <= top; ++t) {
        const unsigned st = counted + t;
        mbarrier_wait(full + st % Stages, (st / Stages) & 1);
        mbarrier_arrive(empty + st % Stages);
      }
      counted += static_cast<unsigned>(top) + 1;
      continue;
    }
    // This consumer's query chunk c; its diagonal is the item's stage t0. The lower consumer hands
    // stage 0 (the chunk above its queries) back once it has arrived.
    const int t0 = wg;
    const index_t c = top - t0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const index_t i = min(c * C + row0 + 8 * hh, it.length - 1);
      lo_row[hh] = p.a.reset_lo((it.batch * p.a.tokens + it.start + i) * p.a.q_heads + it.hq);
    }
    if (t0 == 1) {
      mbarrier_wait(full + counted % Stages, (counted / Stages) & 1);
      mbarrier_arrive(empty + counted % Stages);
    }
    {
      const T* q = sq + wg * tile_n;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          const T* qe = q + sw128_layout<C>::offset(row0 + 8 * hh, j) + c2;
          r[4 * j + 2 * hh] = to_float(qe[0]), r[4 * j + 2 * hh + 1] = to_float(qe[1]);
        }
    }
#pragma unroll
    for (int i = 0; i < Dv / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY, l[0] = l[1] = 0.f;

    // The diagonal chunk: X = tril(-Q W^T) and S = Q K^T together, then S += X M and
    // r <- r + X U. The queries, diagonal K and M are then free for the next item's.
    {
      const unsigned st = counted + t0, buf = st % Stages;
      float rescale[2];
      mbarrier_wait(full + buf, (st / Stages) & 1);
      fence_proxy_async();  // the copies came through the generic proxy, wgmma reads the async one
      if (gated) {          // the rows' own gate terms came with the stage, as its columns'
        const float* terms = gate + buf * tile::gate_floats + 2 * C;
        gate_row[0] = terms[row0], gate_row[1] = terms[row0 + 8];
      }
      query_fragments();
      start_scores(buf);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs<__half, 0>(x, rh[kk], k_major(wd_desc, 0, kk), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs<T, 0>(s, rt[kk], k_major(kd_desc, 0, kk), kk > 0 || gated);
      wgmma_commit();
      wgmma_wait<1>();  // X is in; Q K^T may still run
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
      for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<__half, 1>(s, xn[kc], mn_major(md_desc, 0, kc));
      wgmma_commit();
#pragma unroll
      for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<__half, 1>(r, xn[kc], mn_major(ud_desc, 0, kc));
      wgmma_commit();
      wgmma_wait<1>();
      wgmma_fence_operand(s);
      softmax(true, rescale, c * C);  // O is still zero
      wgmma_wait<0>();
      wgmma_fence_operand(r);
      wgmma_fence_operand(xn);
      wgmma_fence_operand(rt);
      mbarrier_arrive(item_empty);  // done with the queries, diagonal K, M, W, U
      to_fragments<T>(pf, s);
    }
    for (int t = t0 + 1; t < top; ++t) key_chunk(counted + t, true, (top - t) * C);
    if (top > t0) key_chunk(counted + static_cast<unsigned>(top), false, 0);
    const unsigned last = (counted + static_cast<unsigned>(top)) % Stages;
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < C / 16; ++kc) wgmma_rs<T, 1>(o, pf[kc], mn_major(v_desc, last, kc));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    mbarrier_arrive(empty + last);

    T* out = static_cast<T*>(p.a.out) + it.batch * p.a.out_stride[0] +
             (it.start + c * C) * p.a.out_stride[1] + it.hq * p.a.out_stride[2];
    float* lse = p.a.lse != nullptr
                     ? p.a.lse + it.batch * p.a.lse_stride[0] +
                           (it.start + c * C) * p.a.lse_stride[1] + it.hq * p.a.lse_stride[2]
                     : nullptr;
    if (gated && lse != nullptr)  // the rows' own gate terms, left out of the softmax above
      m[0] += gate_row[0], m[1] += gate_row[1];
    store_output_rows<T, Dv>(out, p.a.out_stride[1], lse, p.a.lse_stride[1], row0, it.rows(c), o, m,
                             l);
    counted += static_cast<unsigned>(top) + 1;
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
