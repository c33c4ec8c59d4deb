#pragma once
// Softmax-family kernel for Hopper (wgmma, sm_90a), FlashAttention-3 style. A persistent CTA
// per SM walks work items, each Br = 64 * WGs query rows of one (sequence, query head):
// - a producer warpgroup (its registers handed to the others with setmaxnreg) streams Q and
//   Bc-key tiles of K and V into shared memory with cp.async, a ring of Stages buffers handed over
//   through mbarriers (full: loaded; empty: every consumer thread is done with it), so that the
//   warpgroups drift apart and keep the tensor cores busy between them;
// - each consumer warpgroup owns 64 rows: S = Q K^T with both operands in shared memory, the
//   online softmax (base 2) in registers, O += P V with P straight from the S accumulators; the
//   product P V of one tile runs while the softmax of the next is computed.
// Inputs are __half or __nv_bfloat16; D, Dv are 64 or 128.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attnmix/cuda/arch/mbarrier.cuh"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/arch/wgmma.cuh"
#include "attnmix/cuda/collective/attention_tiles.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int D, int Dv, int WGs, int Bc, int Stages>
struct wgmma_tile {
  static_assert((D == 64 || D == 128) && (Dv == 64 || Dv == 128), "head dims 64 or 128");
  static_assert(Bc == 64 || Bc == 128, "a key tile is one wgmma N (64 or 128)");
  static_assert(Stages >= 2, "at least double buffering");
  // WGs consumer warpgroups and a producer warpgroup, which gives most of its registers to the
  // consumers. With 3 consumers it keeps the minimum (24, its address arithmetic spills a little):
  // at 56 the consumers' 152 made ptxas serialise their wgmma, 4-5 % slower on an H200.
  static constexpr int threads = 128 * (WGs + 1);
  static constexpr int producer_registers = WGs >= 3 ? 24 : 56;
  static constexpr int consumer_registers =
      std::min(240, claimable_registers(threads, WGs, producer_registers));  // 160 or 224
  static constexpr int br = 64 * WGs;
  static constexpr int bc = Bc;
  // Shared memory in elements: Q, then Stages K tiles, then Stages V tiles (each a multiple of
  // 1024 bytes, so every atom stays aligned), then the gate terms of each stage's keys (floats)
  // and the full and empty barriers of each stage.
  static constexpr int q_elems = br * D, k_elems = Bc * D, v_elems = Bc * Dv;
  static constexpr int gate_offset = 2 * (q_elems + Stages * (k_elems + v_elems));  // bytes
  static constexpr int barrier_offset = gate_offset + 4 * Stages * Bc;
  // Barriers: full and empty per stage, then q_full and q_empty; then three ints of the work queue.
  static constexpr int queue_offset = barrier_offset + 16 * (Stages + 1);
  static constexpr int smem_bytes = queue_offset + 16 + 1024;  // + alignment slack
};

// Persistent: a CTA an SM. Each takes item blockIdx.x first, then the next of a device-wide
// counter (p.work_counter, zeroed before the launch), so that items start in order (heaviest
// first, a few heads at a time) and the SMs finish together. The producer runs ahead across
// items: the next item's Q and first keys arrive while the consumers finish the current one.
// Key tiles are counted across items for the stages' phases.
template <class T, int D, int Dv, int WGs, int Bc, int Stages>
__global__ void __launch_bounds__(128 * (WGs + 1), 1)
    attention_wgmma_kernel(const attention_kernel_params p, const int row_tiles, const int items) {
  using tile = wgmma_tile<D, Dv, WGs, Bc, Stages>;
  constexpr int Br = tile::br;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of the address: atoms must start 1024-byte aligned.
  unsigned char* base = smem_raw + ((1024 - smem_address(smem_raw) % 1024) % 1024);
  T* sq = reinterpret_cast<T*>(base);
  T* sk = sq + tile::q_elems;
  T* sv = sk + Stages * tile::k_elems;
  float* gate_col = reinterpret_cast<float*>(base + tile::gate_offset);
  // Per stage: full (loaded) and empty (every consumer thread is done: each arrives, so that each
  // one's reads are ordered before the producer's next writes); for Q the same pair.
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(base + tile::barrier_offset);
  std::uint64_t* empty = full + Stages;
  std::uint64_t* q_full = empty + Stages;
  std::uint64_t* q_empty = q_full + 1;
  int* next_item = reinterpret_cast<int*>(base + tile::queue_offset);  // 2 slots, producer only
  int* q_item = next_item + 2;  // the item whose Q is loaded, or -1: no more

  // The warp index broadcast from lane 0, so that the compiler knows it is warp-uniform (wgmma
  // under a branch it cannot prove uniform is serialised).
  const int lane = threadIdx.x % 32, warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  const int wg = warp / 4;

  if (threadIdx.x == 0) {
    for (int b = 0; b < Stages; ++b)
      mbarrier_init(full + b, 256), mbarrier_init(empty + b, 128 * WGs);
    mbarrier_init(q_full, 256), mbarrier_init(q_empty, 128 * WGs);
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the warps meet only at mbarriers

  if (wg == WGs) {
    release_registers<tile::producer_registers>();
    // Producer (the whole warpgroup copies). Each thread arrives twice on a full barrier: at once
    // (its gate stores) and when its copies have landed.
    const int thread = threadIdx.x - 128 * WGs;
    // Key tiles and items so far (key tiles unsigned: cheaper stage arithmetic).
    unsigned counted = 0;
    int done = 0;
    work_queue queue(p.work_counter, next_item, thread);
    auto publish_q = [&](int n) {  // hand Q (of item n, or -1 at the end) to the consumers
      publish_work_item(q_item, n, q_full, thread);
      ++done;
    };
    for (int n = blockIdx.x; n < items; n = queue.next()) {
      attention_work w{};
      if (!w.decode<Br, Bc>(p, n, row_tiles)) continue;
      const T* q = static_cast<const T*>(p.q) + w.batch * p.q_stride[0] +
                   (w.start + w.i0) * p.q_stride[1] + w.hq * p.q_stride[2];
      const T* k = static_cast<const T*>(p.k) + w.kbatch * p.k_stride[0] +
                   w.kstart * p.k_stride[1] + w.hkv * p.k_stride[2];
      const T* v = static_cast<const T*>(p.v) + w.kbatch * p.v_stride[0] +
                   w.kstart * p.v_stride[1] + w.hkv * p.v_stride[2];
      if (done > 0) mbarrier_wait(q_empty, (done - 1) & 1);
      load_tile<Br, D>(sq, q, p.q_stride[1], w.rows, q, thread);
      publish_q(n);
      for (int t = 0; t < w.key_tiles; ++t, ++counted) {
        const unsigned buf = counted % Stages;
        const index_t j0 = w.j_lo + static_cast<index_t>(t) * Bc;
        gate_fetch gate;
        if (w.G != nullptr && thread < Bc) gate.load(p, w.G, j0 + thread, w.klength);
        if (counted >= Stages) mbarrier_wait(empty + buf, (counted / Stages - 1) & 1);
        load_tile<Bc, D>(sk + buf * tile::k_elems, k + j0 * p.k_stride[1], p.k_stride[1],
                         w.j_hi + 1 - j0, k, thread);
        load_tile<Bc, Dv>(sv + buf * tile::v_elems, v + j0 * p.v_stride[1], p.v_stride[1],
                          w.j_hi + 1 - j0, v, thread);
        if (w.G != nullptr && thread < Bc) gate_col[buf * Bc + thread] = -gate.term(p, w.g_ref);
        mbarrier_arrive(full + buf);
        mbarrier_arrive_on_copies(full + buf);
      }
    }
    if (done > 0) mbarrier_wait(q_empty, (done - 1) & 1);
    publish_q(-1);
    return;
  } else {
    claim_registers<tile::consumer_registers>();
  }

  const int g = lane / 4, c2 = 2 * (lane % 4);
  const int row0 = wg * 64 + (warp % 4) * 16 + g;  // this thread's rows: row0, row0 + 8

  // Operand descriptors. Q and K are K-major (D contiguous): k-step kk is 16 columns, in atom
  // kk / 4 at byte 32 * (kk % 4) of its rows; 8-row groups are 1024 bytes apart. V is MN-major
  // (Dv contiguous): k-step kc is 16 keys = 2048 bytes further, its 64-column atoms Bc rows apart.
  // The descriptors are formed once; a product adds offsets in their 16-byte units (an element is
  // 1/8 of one): a stage's tile, the atom, the k-step.
  const std::uint64_t q_desc = wgmma_desc(sq + wg * 64 * 64, 16, 1024),
                      k_desc = wgmma_desc(sk, 16, 1024), v_desc = wgmma_desc(sv, Bc * 128, 1024);
  auto issue_scores = [&](float(&s)[Bc / 2], unsigned buf) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, 0>(
          s, wgmma_desc_add(q_desc, (kk / 4) * Br * 8 + (kk % 4) * 2),
          wgmma_desc_add(k_desc, buf * (tile::k_elems / 8) + (kk / 4) * Bc * 8 + (kk % 4) * 2),
          kk > 0);
  };
  auto issue_values = [&](float(&o)[Dv / 2], std::uint32_t(&a)[Bc / 16][4], unsigned buf) {
#pragma unroll
    for (int kc = 0; kc < Bc / 16; ++kc)
      wgmma_rs<T, 1>(o, a[kc], wgmma_desc_add(v_desc, buf * (tile::v_elems / 8) + kc * 128));
  };

  unsigned counted = 0;  // key tiles of the items before
  for (int done = 0;; ++done) {
    mbarrier_wait(q_full, done & 1);
    const int n = *static_cast<volatile int*>(q_item);
    if (n < 0) break;
    attention_work w{};
    w.decode<Br, Bc>(p, n, row_tiles);
    float gate_row[2] = {};  // a logit is s * scale + gate_row - gate_col; tiles hold -gate_col
    if (w.G != nullptr)
      gate_row[0] = w.gate(p, w.i0 + row0), gate_row[1] = w.gate(p, w.i0 + row0 + 8);
    float o[Dv / 2] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // m: row maxima of the logits
    std::uint32_t a[Bc / 16][4];                             // P of the previous tile

    // Mask (only on tiles that cross an edge) and online softmax of key tile t in stage buf: s
    // becomes P, the running maxima and sums advance, and `rescale` says by how much O shrinks.
    auto softmax = [&](int t, int buf, float(&s)[Bc / 2], float(&rescale)[2]) {
      const index_t j0 = w.j_lo + static_cast<index_t>(t) * Bc;
      if (j0 + Bc - 1 > w.hi_first || j0 < w.lo_last) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          index_t lo, hi;
          w.key_range(p, w.i0 + row0 + 8 * h, lo, hi);
          // Visible columns of this tile for the row, relative to this thread's first column.
          const int first = static_cast<int>(max(min(lo - j0, index_t{Bc}), index_t{-1})) - c2;
          const int last = static_cast<int>(max(min(hi - j0, index_t{Bc}), index_t{-1})) - c2;
#pragma unroll
          for (int j = 0; j < Bc / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = 8 * j + e;
              if (col < first || col > last) s[4 * j + 2 * h + e] = -INFINITY;
            }
        }
      }
      online_softmax<Bc>(s, w.G != nullptr, gate_col + buf * Bc + c2, gate_row, p.scale_log2, m, l,
                         rescale);
    };
    // Once the last scores of an item are in, Q may be replaced by the next item's.
    auto release_q = [&](int t) {
      if (t == w.key_tiles - 1) mbarrier_arrive(q_empty);
    };

    {
      const unsigned buf = counted % Stages;
      float s[Bc / 2], rescale[2];
      mbarrier_wait(full + buf, (counted / Stages) & 1);
      // The copies came through the generic proxy; wgmma reads through the async one.
      fence_proxy_async();
      wgmma_fence();
      issue_scores(s, buf);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(s);
      release_q(0);
      softmax(0, buf, s, rescale);  // O is still zero
      to_fragments<T>(a, s);
    }
    // Iteration t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} are issued together, and the softmax
    // of S_t runs while the second product is still on the tensor cores. (No wgmma sits under a
    // branch: the compiler would serialise them all.)
    for (int t = 1; t < w.key_tiles; ++t) {
      const unsigned buf = (counted + t) % Stages, prev = (counted + t - 1) % Stages;
      float s[Bc / 2], rescale[2];
      mbarrier_wait(full + buf, ((counted + t) / Stages) & 1);
      fence_proxy_async();
      wgmma_fence();
      issue_scores(s, buf);
      wgmma_commit();
      issue_values(o, a, prev);
      wgmma_commit();
      wgmma_wait<1>();
      wgmma_fence_operand(s);
      release_q(t);
      softmax(t, buf, s, rescale);
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      wgmma_fence_operand(a);
      mbarrier_arrive(empty + prev);  // done with tile t - 1
#pragma unroll
      for (int j = 0; j < Dv / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * j + e] *= rescale[e / 2];
      to_fragments<T>(a, s);
    }
    counted += static_cast<unsigned>(w.key_tiles);
    const unsigned last = (counted - 1) % Stages;
    wgmma_fence();
    issue_values(o, a, last);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    mbarrier_arrive(empty + last);

    T* out = static_cast<T*>(p.out) + w.batch * p.out_stride[0] +
             (w.start + w.i0) * p.out_stride[1] + w.hq * p.out_stride[2];
    float* lse = p.lse != nullptr ? p.lse + w.batch * p.lse_stride[0] +
                                        (w.start + w.i0) * p.lse_stride[1] + w.hq * p.lse_stride[2]
                                  : nullptr;
    store_output_rows<T, Dv>(out, p.out_stride[1], lse, p.lse_stride[1], row0, w.rows, o, m, l);
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
