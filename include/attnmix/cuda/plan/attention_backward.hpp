#pragma once
// The plan of a softmax-family backward (softmax, FoX): its kernels' tiles, grids, shared memory
// and the scratch of the call. Pure C++: unit-tested without a GPU (tests/plan/).
//
// FlashAttention-2's split, without atomics: a preprocess kernel (delta_i = dout_i . out_i), a
// kernel a key tile (dk, dv, and with a gate the column sums of dS) and a kernel a query tile
// (dq, and with a gate the row sums of dS), then with a gate the reverse cumsum of dG into dg.
// Every output element is written by one thread in a fixed order of sums: the same bits on every
// run.
//
//   sm90_wgmma: Hopper, not portable, where sm80_mma_v2 applies: its kernels with the products on
//             wgmma (a warpgroup a CTA, 64-row streamed tiles in 128-byte-swizzled atoms).
//   sm90_wgmma_fused: (forced only) sm90_wgmma's dk/dv kernel also adds each row tile's
//             dQ = dS K to one float sum in the order of the key blocks, then a kernel rounds it:
//             five products where the two kernels take seven, the same bits on every run. Slower
//             (H100, causal, D = 64: backward 10.7 ms at (32, 2048, 32) against 6.06): the turns,
//             the adds and 2 CTAs an SM cost more than the two products save.
//   sm80_mma_v2: half and bfloat16, D = Dv in {64, 128}, 16-byte aligned rows of q, k, v, dout
//             (4-byte of dq, dk, dv): FlashAttention-2's kernels, with the accumulators (dk and
//             dv of 64 keys, dq of 64 rows) in registers across the whole loop, 16-bit tiles
//             streamed through double-buffered swizzled shared memory with cp.async and read with
//             ldmatrix, and P and dS taken from the score accumulators as 16-bit operands.
//   sm80_mma: half and bfloat16 with D and Dv multiples of 32 up to 128: the products of a tile
//             pair on tensor cores (mma.sync), the rest as simt's.
//   simt:     CUDA cores, float accumulation, any dtype and head dims up to 256; tiles of 32 (16
//             for head dims over 128) staged in shared memory as float; the one that takes keys
//             of other lengths than the queries (for now).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attnmix/attention/args.hpp"
#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/attention_backward_shapes.hpp"
#include "attnmix/cuda/plan/attention.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/scratch.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

enum class attention_backward_variant { sm90_wgmma_fused, sm90_wgmma, sm80_mma_v2, sm80_mma, simt };

// What the plan reads of a call (the launcher fills it from the validated problem).
struct attention_backward_shape {
  index_t head_dim = 0, value_dim = 0;
  index_t max_len = 0;  // longest sequence
  index_t q_heads = 0, kv_heads = 0;
  index_t sequences = 0;
  bool sixteen_bit = false;  // half or bfloat16 inputs
  bool portable = false;     // backend::cuda::portable (every variant is portable today)
  bool aligned = false;      // q, k, v, dout rows 16-byte aligned, dq, dk, dv rows 4-byte
  // A variant to take where it applies (tests run every variant on the same inputs); none: the
  // plan's own choice.
  bool forced = false;
  attention_backward_variant force = attention_backward_variant::simt;
  // Keys of other lengths than the queries (softmax): the simt kernels, over key tiles of the
  // longest key sequence.
  bool keys_differ = false;
  index_t max_key_len = 0;
};

// Head dims the tensor-core backward tiles: multiples of 32 (its 8 warps take 8-column tiles
// four at a time) up to 128 (32-row tiles).
inline bool backward_tensor_core_dims(index_t D, index_t Dv) {
  return D % 32 == 0 && Dv % 32 == 0 && D >= 32 && Dv >= 32 && D <= 128 && Dv <= 128;
}

// Where the v2 tensor-core kernels apply: 16-bit aligned inputs, D = Dv in {64, 128}.
inline bool backward_v2_applies(const attention_backward_shape& s) {
  return s.sixteen_bit && s.aligned && s.head_dim == s.value_dim &&
         (s.head_dim == 64 || s.head_dim == 128);
}

struct attention_backward_plan {
  attention_backward_variant variant = attention_backward_variant::simt;
  int chunks = 0;          // 32-wide chunks of the widest head dim (2, 4 or 8)
  int tile = 0;            // keys of a dk/dv CTA and rows of a dq CTA
  int threads = 0;         // of a dk/dv or dq CTA
  int smem_bytes = 0;      // dynamic shared memory of the dk/dv and dq kernels
  bool fits = false;       // smem_bytes within what the device lets a block opt in to
  launch_grid preprocess;  // a warp a (token, query head): (token groups, query heads, sequences)
  launch_grid dkdv;        // (key tiles, KV heads, sequences)
  launch_grid dq;          // (query tiles, query heads, sequences)
  launch_grid gate;        // (32 query heads, sequences)
  index_t dq_tiles = 0;    // sm90_wgmma_fused: 64-row tiles of the longest sequence (no dq grid)
};

inline attention_backward_plan plan_attention_backward(const attention_backward_shape& s,
                                                       const device_properties& d) {
  attention_backward_plan p;
  const index_t widest = std::max(s.head_dim, s.value_dim);
  p.chunks = widest <= 64 ? 2 : widest <= 128 ? 4 : 8;
  // v2 where its shared memory fits (else the older tensor-core kernels, whose tiles are smaller),
  // on wgmma where the Hopper kernels may run.
  const auto fits_v2 = [&](bool wgmma) {
    return backward_v2_applies(s) && std::size_t(attention_backward_v2_smem_bytes(
                                         int(s.head_dim), wgmma)) <= d.smem_per_block_optin;
  };
  const bool v2 = fits_v2(false);
  const bool wgmma = fits_v2(true) && !s.portable && d.hopper();
  const bool fused = wgmma && std::size_t(attention_backward_fused_smem_bytes(int(s.head_dim))) <=
                                  d.smem_per_block_optin;
  const bool mma = s.sixteen_bit && backward_tensor_core_dims(s.head_dim, s.value_dim);
  if (wgmma)
    p.variant = attention_backward_variant::sm90_wgmma;
  else if (v2)
    p.variant = attention_backward_variant::sm80_mma_v2;
  else if (mma)
    p.variant = attention_backward_variant::sm80_mma;
  if (s.forced && (s.force == attention_backward_variant::simt ||
                   (s.force == attention_backward_variant::sm80_mma && mma) ||
                   (s.force == attention_backward_variant::sm80_mma_v2 && v2) ||
                   (s.force == attention_backward_variant::sm90_wgmma && wgmma) ||
                   (s.force == attention_backward_variant::sm90_wgmma_fused && fused)))
    p.variant = s.force;
  if (s.keys_differ) p.variant = attention_backward_variant::simt;
  if (p.variant == attention_backward_variant::sm90_wgmma_fused) {
    p.tile = attention_backward_v2_fixed;
    p.threads = attention_backward_v2_threads;
    p.smem_bytes = attention_backward_fused_smem_bytes(int(s.head_dim));
    p.dq_tiles = (s.max_len + p.tile - 1) / p.tile;
  } else if (p.variant == attention_backward_variant::sm90_wgmma ||
             p.variant == attention_backward_variant::sm80_mma_v2) {
    const bool on_wgmma = p.variant == attention_backward_variant::sm90_wgmma;
    p.tile = attention_backward_v2_fixed;
    p.threads = attention_backward_v2_threads;
    p.smem_bytes = attention_backward_v2_smem_bytes(int(s.head_dim), on_wgmma);
  } else {
    p.tile = attention_backward_tile(p.chunks);
    p.threads = attention_backward_threads;
    p.smem_bytes = attention_backward_smem_bytes(p.tile, int(s.head_dim), int(s.value_dim));
  }
  p.fits = std::size_t(p.smem_bytes) <= d.smem_per_block_optin;
  const auto tiles = unsigned((s.max_len + p.tile - 1) / p.tile);
  p.preprocess = {unsigned((s.max_len + attention_backward_preprocess_rows - 1) /
                           attention_backward_preprocess_rows),
                  unsigned(s.q_heads), unsigned(s.sequences)};
  const auto key_tiles = s.keys_differ ? unsigned((s.max_key_len + p.tile - 1) / p.tile) : tiles;
  p.dkdv = {key_tiles, unsigned(s.kv_heads), unsigned(s.sequences)};
  p.dq = {tiles, unsigned(s.q_heads), unsigned(s.sequences)};
  p.gate = {unsigned((s.q_heads + 31) / 32), unsigned(s.sequences), 1};
  return p;
}

// Scratch of a backward call: the cu_seqlens copy (and cu_seqlens_k's, keys of their own
// offsets); delta [B*T*HQ] (float); with a gate the
// column and row sums of dS [B*T*HQ] (float), the gate cumsum G [B*T*HQ] (double, restarting at
// hard resets) and the position of the last reset [B*T*HQ] (int32). Each part padded to 256
// bytes. Laid out like g ([B, T, HQ], heads innermost).
// The fused variant (dq_tiles > 0: 64-row tiles of the longest sequence) adds the float dQ sums
// [HQ, B*T, D] and the tiles' turns [sequences, HQ, dq_tiles] (int32), both zeroed a call.
struct attention_backward_scratch_layout {
  std::size_t keys = 0, delta = 0, colsum = 0, rowsum = 0, gate = 0, reset = 0, dq_acc = 0,
              dq_turn = 0, bytes = 0;
  std::size_t dq_acc_bytes = 0, dq_turn_bytes = 0;
  attention_backward_scratch_layout(const attention_problem& p, bool gated, index_t dq_tiles = 0) {
    const auto n = static_cast<std::size_t>(p.batch * p.tokens * p.q_heads);
    keys = p.cu_seqlens == nullptr ? 0 : cu_seqlens_scratch_bytes(p.num_sequences);
    delta = keys + key_offsets_bytes(p);
    colsum = delta + padded_bytes(n * sizeof(float));
    rowsum = colsum + (gated ? padded_bytes(n * sizeof(float)) : 0);
    gate = rowsum + (gated ? padded_bytes(n * sizeof(float)) : 0);
    reset = gate + (gated ? padded_bytes(n * sizeof(double)) : 0);
    dq_acc = reset + (gated ? padded_bytes(n * sizeof(std::int32_t)) : 0);
    if (dq_tiles > 0) {
      dq_acc_bytes = n * static_cast<std::size_t>(p.head_dim) * sizeof(float);
      dq_turn_bytes =
          static_cast<std::size_t>(p.num_sequences * p.q_heads * dq_tiles) * sizeof(std::int32_t);
    }
    dq_turn = dq_acc + padded_bytes(dq_acc_bytes);
    bytes = dq_turn + padded_bytes(dq_turn_bytes) + scratch_alignment;
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
