#pragma once
// The compile-time shapes of the kernels (chunk and tile sizes, threads, shared-memory formulas)
// that the host plans size grids and scratch with. Pure C++ (no CUDA header), so that
// cuda/plan/ compiles with a host compiler and is unit-tested without a GPU; the kernels include
// it too, so that both sides read one definition.

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- softmax family ------------------------------------------------------------------------
// The gate cumsum (gate_cumsum.cuh) runs in parts of gate_part tokens, a warp 32 of them.
constexpr int gate_part = 256, gate_warps = gate_part / 32;

// ---- PaTH ----------------------------------------------------------------------------------
constexpr int path_chunk = 64;  // positions of a chunk (the UT transform's C)
// The PaTH-FoX backward's gate scans: warps a CTA, one a (sequence, query head).
constexpr int path_gate_warps = 4;
// A device decoding cache defers the transitions (kernels/path_decode.cuh): a slot's keys older
// than its last flush (every path_decode_flush steps) are read as they were then, the recent ones
// live in float in a ring of path_decode_recent keys (two flush periods: the step that flushes
// appends its key where the keys it flushes are not).
constexpr int path_decode_flush = 64, path_decode_recent = 2 * path_decode_flush;
// Keys [0, F) of a slot holding L tokens before a step are as of the last flush; [F, L) recent.
inline ATTNMIX_HOST_DEVICE index_t path_decode_flushed(index_t L) {
  return L == 0 ? 0 : (L - 1) / path_decode_flush * path_decode_flush;
}
// Whether the step with L tokens held flushes (stores keys [0, L) carried through its transition).
inline ATTNMIX_HOST_DEVICE bool path_decode_flushes(index_t L) {
  return L > 0 && L % path_decode_flush == 0;
}
// Whether the step with L tokens held starts the transition product M anew (after a flush or a
// prefill; for a slot with no flushed keys M is unused, so starting anew is harmless).
inline ATTNMIX_HOST_DEVICE bool path_decode_fresh_transitions(index_t L) {
  return L == 0 || (L - 1) % path_decode_flush == 0;
}
// The flush kernel's shared memory: M^T and a pass's keys (128 threads, a thread an element).
inline int path_decode_flush_smem(int D) {
  return 4 * (D * D + 128);
}

// ---- linear attention, CUDA cores (linear_simt.cuh, linear_causal.cuh) ---------------------
// The state of a block of tokens: S_p (D x Dv), z_p (D), and for the key gate the block max
// M_p and mass ell_p = sum exp(a_j - M_p). Workspace layout per (n, h, p):
// [S_p: D*Dv][z_p: D][M_p][ell_p].
inline ATTNMIX_HOST_DEVICE index_t partial_floats(int D, int Dv) {
  return index_t(D) * Dv + D + 2;
}

// linear_combine_kernel: elements of [S | z] a CTA merges.
constexpr int linear_combine_slice = 1024;

// ---- linear-attention backward on CUDA cores (linear_backward_simt.cuh,
// linear_backward_causal.cuh) Threads of every backward kernel, and the most state elements (D * Dv
// + D) a kernel holds in registers: ceil((128 * 128 + 128) / 256) a thread.
constexpr int linear_bwd_threads = 256;
constexpr index_t linear_bwd_max_dim = 128;
// The scans of the causal backward: threads a CTA (one state element each) and slots loaded
// ahead of their stores.
constexpr int linear_bwd_scan_threads = 128, linear_bwd_scan_batch = 16;
constexpr int linear_bwd_state_regs =
    int((linear_bwd_max_dim * linear_bwd_max_dim + linear_bwd_max_dim + linear_bwd_threads - 1) /
        linear_bwd_threads);
// Rows of a tile (query or key rows staged in shared memory at once).
constexpr index_t linear_bwd_tile = 8;

// Shared-memory floats of each kernel (the launcher and the kernels use the same arithmetic).
constexpr index_t linear_bwd_reduce_floats(index_t tile, index_t D, index_t Dv) {
  return tile * (D + Dv + 1);
}
// Pass A: q, r, x (tile x D), do, o, dgamma terms (tile x Dv), den, delta (tile).
constexpr index_t linear_bwd_pass_a_floats(index_t tile, index_t D, index_t Dv) {
  return tile * (3 * D + 3 * Dv + 2);
}
// Pass B: k, p, e (tile x D), v (tile x Dv), w (tile).
constexpr index_t linear_bwd_pass_b_floats(index_t tile, index_t D, index_t Dv) {
  return tile * (3 * D + Dv + 1);
}
// Causal query pass: chunk keys P, V; a tile's q, r, dr (tile x D), do, g, num (tile x Dv),
// scores A and dscore (tile x chunk), den and delta (tile).
constexpr index_t linear_bwd_causal_q_floats(index_t chunk, index_t tile, index_t D, index_t Dv) {
  return chunk * (D + Dv) + tile * (3 * D + 3 * Dv + 2 * chunk + 2);
}
// Causal key pass: chunk keys P, V and their gradients E, DV; a tile's r (tile x D), g (tile x
// Dv), A and dscore (tile x chunk), delta (tile).
constexpr index_t linear_bwd_causal_k_floats(index_t chunk, index_t tile, index_t D, index_t Dv) {
  return chunk * (2 * D + 2 * Dv) + tile * (D + Dv + 2 * chunk + 1);
}

// ---- linear-attention backward on tensor cores (sm80_linear_backward.cuh) -----------------
// The head dims its kernels take (at 128 the query pass's tiles in two parts would not fit).
constexpr bool linear_bwd_mma_dims(index_t D, index_t Dv) {
  return D == 64 && Dv == 64;
}

// Tile shapes and shared-memory strides (elements; each row a multiple of 16 bytes, and an odd
// number of 16-byte units, so that ldmatrix's eight rows hit distinct banks).
template <int D, int Dv>
struct linear_bwd_mma_layout {
  static constexpr int warps = D / 16, threads = 32 * warps, rows = 16 * warps;
  static constexpr int ld_d = D + 8;      // [rows][D] tiles
  static constexpr int ld_v = Dv + 24;    // [*][Dv | z | 15 zeros] tiles and states
  static constexpr int ntv = Dv / 8 + 1;  // n-tiles of [x | z]
  // CTAs a multiprocessor each pass is compiled for (its registers: 65536 / (threads ctas)).
  static constexpr int reduce_ctas = 4, query_ctas = 3, key_ctas = 2;
  // Shared bytes of each kernel (16-bit elements, then the floats and flags). A state in two
  // parts (high and low); half inputs keep v in two bfloat16 parts as well (SplitV).
  static constexpr int state_elems = D * ld_v, d_tile = rows * ld_d, v_tile = rows * ld_v;
  static constexpr int query_smem =
      2 * (2 * state_elems + 3 * d_tile + 2 * v_tile) + 4 * (warps * Dv + D + rows + Dv);
  // The key pass: key_warps warps, each walking its own slabs of 16 tokens with the raw k and v
  // of two slabs in its own two stages ([16][ld_d] then [16][key_ld_v]); dS in two parts
  // [D][key_ld_v], each warp's result rows, dz in float, then the gate statistics and jac.
  static constexpr int key_warps = 8, key_threads = 32 * key_warps, key_ld_v = Dv + 8;
  static constexpr int key_ld_o = (D > Dv ? D : Dv) + 8;  // a warp's 16 result rows (dv, dk)
  static constexpr int key_stage = 16 * (ld_d + key_ld_v);
  static constexpr int key_smem =
      2 * (2 * D * key_ld_v + 2 * key_warps * key_stage + 16 * key_warps * key_ld_o) + 4 * (D + 4);
  static constexpr int reduce_smem(bool split_v) {
    return 2 * (2 * d_tile + (split_v ? 2 : 1) * v_tile) + 8 * rows;
  }
};

// Shared bytes of a pass at D = Dv = 64; split_v: half inputs.
enum class linear_bwd_pass { reduce, query, key };
inline int linear_bwd_mma_smem(linear_bwd_pass pass, bool split_v) {
  using L = linear_bwd_mma_layout<64, 64>;
  switch (pass) {
    case linear_bwd_pass::reduce:
      return L::reduce_smem(split_v);
    case linear_bwd_pass::query:
      return L::query_smem;
    default:
      return L::key_smem;
  }
}

// The tensor-core causal backward kernels (sm80_linear_backward_causal.cuh) at D = Dv = 64 with
// 64-token chunks: 16-bit tiles [64][72] (phi(k), r: two parts each) and [64][88] (v | 1, the
// state and [g | delta] in two parts), then the chunk's row flags; the query and key passes also
// keep the running state (its gradient) of their walk in float, 40 a thread.
constexpr int linear_bwd_causal_mma_threads = 128;
constexpr int linear_bwd_causal_mma_sums_smem = (2 * 64 * 72 + 64 * 88) * 2 + 64 * 4;
constexpr int linear_bwd_causal_mma_smem =
    (4 * 64 * 72 + 5 * 64 * 88) * 2 + 64 * 4 + 40 * linear_bwd_causal_mma_threads * 4;
// Under the prefix key gate each kernel also keeps the chunk's gate rows (logits, maxima, masses,
// weights: 6 x 64 floats).
constexpr int linear_bwd_causal_mma_gate_bytes = 6 * 64 * 4;
// Chunks a CTA of the tensor-core passes walks at most (a state slot's span; fewer where that
// would leave SMs idle).
constexpr int linear_bwd_causal_max_super = 8;

// The causal backward under the prefix key gate (linear_backward_causal_gated.cuh): a CTA per
// (KV head, sequence) walks 32-token chunks; its shared memory holds the chunk's [C][D] tiles
// (phi(k), r, dr, dphik), [C][Dv] tiles (v, g, dv), three [C][C] score tiles and 11 vectors of C.
// Its scratch holds a checkpoint every K chunks (K + 1 of them), the K + 1 states of a segment
// and the running state (D Dv + D + 2 floats each), then dS | dz twice.
constexpr int linear_bwd_gated_chunk = 32, linear_bwd_gated_threads = 256;
constexpr index_t linear_bwd_gated_smem_floats(index_t D, index_t Dv) {
  constexpr index_t C = linear_bwd_gated_chunk;
  return C * (4 * (D + 1) + 3 * (Dv + 1)) + 3 * C * (C + 1) + 11 * C;  // rows padded by one
}
constexpr index_t linear_bwd_gated_task_floats(index_t K, index_t D, index_t Dv) {
  return (2 * K + 3) * (D * Dv + D + 2) + 2 * (D * Dv + D);
}

// The tensor-core PaTH / PaTH-FoX backward query kernel (kernels/sm80_path_backward.cuh) at
// D = Dv = C = 64: eleven tiles [C][ld] of 16-bit elements in two parts (slot s: hi at 2 s, lo at
// 2 s + 1), the gate's float dZ [C][C + 1], then eight vectors of C (per row: lse, delta, gate,
// last reset, two halves' row sums; per key: gate; one spare).
struct path_bwd_mma_layout {
  static constexpr int C = 64, warps = 8, threads = 32 * warps, ld = C + 8, lf = C + 1;
  static constexpr int tile = C * ld;
  enum slot : int { q, dout, k, v, w, u, m, x, e1, e2, e3, slots };
  // The query kernel: the split slots, then floats: dZ's column sums [4][C], lse, delta, the
  // queries' gate terms, resets, the keys' gate terms [2][C], dZ's row sums [2][C], and a staged
  // transition [C][C].
  static constexpr int smem = 2 * (2 * slots * tile) + 4 * (12 * C) + 4 * C * C;
  static constexpr int fold_smem = 2 * (2 * 3 * tile);  // the transitions' kernels: three tiles
  // Super-chunks: the query kernel scores the keys of earlier super-chunks transformed to their
  // super-chunk's end, and steps through a super-chunk's product at once.
  static constexpr int super = 8;  // chunks a super-chunk
  static constexpr int super_smem =
      2 * (2 * (super + 4) * tile);  // path_backward_super_fold_kernel
  // path_backward_chunk_mma_kernel: six split tiles, four float [C][lf], beta and two row sums.
  static constexpr int chunk_slots = 6;
  static constexpr int chunk_smem = 2 * (2 * chunk_slots * tile) + 4 * (4 * C * lf + 3 * C);
};

// linear_read_kernel: query rows a CTA, and its shared memory in floats.
constexpr int linear_read_rows = 64;
inline ATTNMIX_HOST_DEVICE int linear_read_smem_floats(int D, int Dv) {
  return D * Dv + D + D * linear_read_rows + linear_read_rows * Dv + 2 * linear_read_rows;
}

// linear_causal_kernel: chunk, threads, and shared memory in floats (16-byte aligned sections for
// D, Dv multiples of 4).
constexpr int causal_chunk = 64;
constexpr int causal_threads = 256;
inline ATTNMIX_HOST_DEVICE int causal_smem_floats(int D, int Dv) {
  constexpr int C = causal_chunk;
  return D * Dv + D + 2 * D * C + 2 * C * Dv + C * C + 8 * C;
}

// linear_causal_mma_kernel (sm80_linear_causal.cuh): bfloat16 tiles of 64 rows, phi(k) and
// phi(q) [64][72], [v | 1] twice and the state [64][88], then the float numerators [64][68], the
// denominators and the chunk's six per-row arrays and two scalars.
constexpr int causal_mma_threads = 128;
constexpr int causal_mma_smem_bytes =
    (2 * 64 * 72 + 3 * 64 * 88) * 2 + (64 * 68 + 64 + 6 * 64 + 2) * 4;

// Whether the tensor-core causal kernel takes a call: bfloat16 (bf16), D = Dv = 64, and k, v, q
// rows it can read with 16-byte loads.
inline bool linear_causal_mma_applies(bool bf16, index_t D, index_t Dv, bool kv_vectors,
                                      bool q_vectors) {
  return bf16 && D == 64 && Dv == 64 && kv_vectors && q_vectors;
}

// ---- linear attention, tensor cores (sm80_linear.cuh, sm90_linear_cluster.cuh) --------------
constexpr int linear_mma_tokens = 64;  // reduce: tokens staged per tile
constexpr int linear_mma_reduce_threads = 256;
constexpr int linear_mma_reduce_ctas = 3;  // CTAs an SM of the narrow reduce kernel
constexpr int linear_mma_rows = 64;        // read: query rows per tile, 16 a warp
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

// The reduce kernel's ring of tile stages.
template <bool Wide>
constexpr int linear_mma_stages = 3;

inline int linear_mma_reduce_smem(index_t D, index_t Dv) {
  const int stages = D > 64 || Dv > 64 ? linear_mma_stages<true> : linear_mma_stages<false>;
  return int(stages * linear_mma_tokens * (D + 8 + Dv + 8) * 2);
}

// Row stride of the read kernel's staged state (sm80_linear.cuh explains the layout).
constexpr ATTNMIX_HOST_DEVICE int staged_stride(int Dv) {
  return Dv + 24;
}
inline ATTNMIX_HOST_DEVICE index_t staged_state_bytes(int D, int Dv) {
  return (index_t(D) * staged_stride(Dv) * 2 + 16 + 127) / 128 * 128;
}
// The reduce kernel merges the partial states itself (the last CTA of a head to finish does it)
// when a head has at most this many blocks; more go through linear_combine_kernel.
constexpr index_t linear_fused_partials = 32;

// D = Dv = 64 has its own reduce kernel (linear_reduce_fast_kernel).
inline bool linear_reduce_fast_dims(index_t D, index_t Dv) {
  return D == 64 && Dv == 64;
}

// The read kernel's ring of query stages, and its shared memory.
constexpr int linear_mma_read_stages = 3;
inline int linear_mma_read_smem(index_t D, index_t Dv, bool gate) {
  return int(
      (D * (Dv + 24) + linear_mma_read_stages * linear_mma_rows * (D + 8 + (gate ? Dv + 8 : 0))) *
      2);
}

// The read kernel of one head dim (linear_read_fast_kernel), D = Dv = 64.
constexpr int linear_fast_threads = 256;
inline bool linear_fast_dims(index_t D, index_t Dv) {
  return D == 64 && Dv == 64;
}

// One cluster a head (linear_cluster_fast_kernel, compute capability 9.0).
constexpr int linear_cluster_ctas = 2;        // CTAs an SM: the read needs about 128 registers
constexpr int linear_cluster_max = 8;         // the portable cluster size (CUDA guarantees it)
constexpr int linear_cluster_max_group = 64;  // query heads a KV head, for the norm weights
constexpr int linear_cluster_ring =
    linear_mma_stages<false> * linear_mma_tokens * (64 + 8 + 64 + 8) * 2;

// Dynamic shared memory: the ring of tiles (later the partial state), then the group's norm
// weights.
inline int linear_cluster_smem(index_t group) {
  return linear_cluster_ring + int(group) * 64 * int(sizeof(float));
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
