#pragma once
// The plan of a linear-attention backward (bla, gbla, linear_causal): which kernels (CUDA cores,
// or tensor cores at D = Dv = 64: the bidirectional passes with 16-bit inputs, the causal chunk
// sums, query and key passes with bfloat16 inputs), how the
// tokens are split among CTAs, the tiles, every grid and the scratch layout. Pure C++:
// unit-tested without a GPU (tests/plan/).
//
// Bidirectional: gate statistics -> reduce (partial states of `parts` token ranges a sequence)
//   -> combine -> pass A over query rows (dq, the gated norm's backward, partial dS, dz) ->
//   combine -> <dS, S> + <dz, z> -> pass B over keys (dk, dv, da) -> folds (dgamma, a shared
//   gate's da over the heads). With `saved` the reduce and its combine are skipped.
// Causal: state slots of `super` chunks of `chunk` tokens (one chunk on CUDA cores): each slot's
//   own sum P^T V -> an exclusive scan over the slots -> the query pass (dq, 1 / den, delta,
//   the slot's sum R^T g with g = do / den) -> a reverse scan (the gradient of the state after each
//   slot) -> the key pass (dk, dv; g again from do and 1 / den: a float a row where g took Dv). A
//   tensor-core CTA walks the chunks of its slot with the running state (forward) or its gradient
//   (backward) in shared memory, so the slots and scans move 1 / super of the bytes of a slot a
//   chunk. Under the prefix key gate the same passes run on tensor cores (slots carry their max
//   and mass; the scans merge them); elsewhere one CTA a (KV head, sequence) walks its chunks on
//   CUDA cores.
// Every sum over tokens, chunks or parts runs in an order fixed by the problem alone.

#include <algorithm>
#include <cstddef>

#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/scratch.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Bidirectional: at most this many token ranges a sequence, each at least this many tokens, and
// CTAs a multiprocessor to aim for.
constexpr index_t linear_bwd_max_parts = 64, linear_bwd_min_part = 256;
constexpr int linear_bwd_ctas_per_sm = 4, linear_bwd_mma_ctas_per_sm = 16;

// What the plan reads of a call.
struct linear_backward_shape {
  bool causal = false;
  bool gated = false, normed = false;   // Policy: a key gate, a gated norm
  bool shared_gate_sum = false;         // key_gate::shared with H > 1: da summed over heads
  bool saved = false;                   // bidirectional: the forward's state is given
  index_t batch = 0, tokens = 0;        // of the views
  index_t head_dim = 0, value_dim = 0;  // D, Dv
  index_t max_len = 0;                  // longest sequence
  index_t sequences = 0, kv_heads = 0, q_heads = 0, gate_heads = 0;
  index_t total_slots = 0;        // causal slots: sum over sequences of ceil(len / slot tokens)
  int force_super = 0;            // causal tensor cores: chunks a slot, 0 = the plan picks
  std::size_t offsets_bytes = 0;  // the cu_seqlens copy (0 for a dense batch)
  // Bidirectional on tensor cores (sm80_linear_backward.cuh, D = Dv = 64): 16-bit inputs on sm_80+,
  // q, k, v rows 16-byte aligned and the other activations' rows 4-byte aligned; and not forced to
  // the CUDA-core kernels.
  bool mma_inputs = false;
  bool half_inputs = false;  // v is kept in two bfloat16 parts
  bool force_simt = false;
};

// Byte offsets of the scratch parts (each 256-byte aligned) and the total.
struct linear_backward_scratch {
  std::size_t offsets = 0, slot_offsets = 0, stats = 0, state = 0, partial = 0, dstate = 0, jac = 0,
              dgamma = 0, da_heads = 0, inv_den = 0, delta = 0, gated_states = 0, mass = 0,
              gate_totals = 0, gate_parts = 0, bytes = 0;
};

struct linear_backward_plan {
  index_t state_size = 0;  // D * Dv + D (causal slots under the key gate: + 4)
  // Bidirectional.
  index_t parts = 1, part_tokens = 1;
  // Causal: tokens a chunk, chunks a state slot, the largest chunk count of a sequence.
  index_t chunk = 64, super = 1, max_chunks = 0;
  index_t tile = linear_bwd_tile;
  // The reduce (causal: chunk sums), query and key passes on tensor cores (threads a CTA; the
  // bidirectional key pass has its own, and its own token ranges: key_grid, key_part_tokens).
  bool mma = false;
  int mma_threads = 0, key_threads = 0;
  index_t key_part_tokens = 1;
  int pass_a_smem = 0, pass_b_smem = 0, reduce_smem = 0, causal_q_smem = 0, causal_k_smem = 0;
  // Causal under the prefix key gate: chunks between checkpoints, floats of a (sequence, head)'s
  // scratch, the kernel's shared memory (grid: chunk_grid, a CTA per (head, sequence)).
  index_t gated_K = 1, gated_task_floats = 0;
  int gated_smem = 0;
  // combine_grid: a thread per state element of each (head, sequence) (the combines, the saved
  // state's load); jac_grid: a CTA per (head, sequence).
  launch_grid stats_grid, reduce_grid, combine_grid, jac_grid, pass_grid, key_grid, chunk_grid,
      scan_grid;
  linear_backward_scratch scratch;
};

// The causal chunk for head dims D, Dv: the longest of 64, 32, 16, 8 whose passes fit the
// shared memory a kernel may opt in to.
inline index_t linear_bwd_causal_chunk(index_t D, index_t Dv, const device_properties& props) {
  const std::size_t limit = std::max(props.smem_per_block_optin, props.smem_per_block);
  for (index_t c : {index_t(64), index_t(32), index_t(16)}) {
    const std::size_t q = std::size_t(linear_bwd_causal_q_floats(c, linear_bwd_tile, D, Dv)) * 4;
    const std::size_t k = std::size_t(linear_bwd_causal_k_floats(c, linear_bwd_tile, D, Dv)) * 4;
    if (std::max(q, k) <= limit) return c;
  }
  return 8;
}

// Causal: the chunk, whether the tensor-core passes run, and the chunks of a state slot (the
// tokens of a slot are chunk * super: the launcher counts the slots of its sequences with them
// before planning the rest). `slots`: whether the slot passes run at all (not under the key gate
// on CUDA cores).
struct linear_bwd_causal_layout {
  index_t chunk = 64, super = 1;
  bool mma = false;
  index_t slot_tokens() const { return chunk * super; }
  bool slots(const linear_backward_shape& s) const { return !s.gated || mma; }
};

inline linear_bwd_causal_layout causal_layout(const linear_backward_shape& s,
                                              const device_properties& props) {
  linear_bwd_causal_layout l;
  l.chunk = linear_bwd_causal_chunk(s.head_dim, s.value_dim, props);
  // Tensor cores for bfloat16 at D = Dv = 64 with 64-token chunks.
  l.mma = s.mma_inputs && !s.half_inputs && !s.force_simt && s.head_dim == 64 &&
          s.value_dim == 64 && l.chunk == 64 &&
          std::size_t(linear_bwd_causal_mma_smem) <=
              std::max(props.smem_per_block_optin, props.smem_per_block);
  if (!l.mma) return l;
  if (s.force_super > 0) {
    l.super = s.force_super;
    return l;
  }
  // The longest walk that still gives every SM two CTAs.
  const index_t chunks = (s.max_len + l.chunk - 1) / l.chunk;
  const index_t want = 2 * index_t(props.sms);
  for (l.super = linear_bwd_causal_max_super; l.super > 1; l.super /= 2)
    if ((chunks + l.super - 1) / l.super * s.kv_heads * s.sequences >= want) break;
  return l;
}

inline linear_backward_plan plan_linear_backward(const linear_backward_shape& s,
                                                 const device_properties& props) {
  linear_backward_plan p;
  const index_t D = s.head_dim, Dv = s.value_dim, N = s.sequences, H = s.kv_heads;
  p.state_size = D * Dv + D;
  const unsigned n_grid = unsigned(std::max<index_t>(N, 1));
  p.stats_grid = {unsigned(std::max<index_t>(s.gate_heads, 1)), n_grid, 1};
  p.combine_grid = {unsigned(H), n_grid,
                    unsigned((p.state_size + linear_bwd_threads - 1) / linear_bwd_threads)};
  p.jac_grid = {unsigned(H), n_grid, 1};
  p.scan_grid = {unsigned((p.state_size + linear_bwd_scan_threads - 1) / linear_bwd_scan_threads),
                 unsigned(H), n_grid};
  const index_t tile = p.tile;
  p.reduce_smem = int(linear_bwd_reduce_floats(tile, D, Dv) * 4);
  p.pass_a_smem = int(linear_bwd_pass_a_floats(tile, D, Dv) * 4);
  p.pass_b_smem = int(linear_bwd_pass_b_floats(tile, D, Dv) * 4);

  const std::size_t state_bytes = std::size_t(p.state_size) * sizeof(float);
  linear_backward_scratch& sc = p.scratch;
  std::size_t at = 0;
  auto take = [&](std::size_t& off, std::size_t bytes) {
    off = at;
    at += padded_bytes(bytes);
  };
  take(sc.offsets, s.offsets_bytes);
  if (!s.causal) {
    p.mma = s.mma_inputs && !s.force_simt && linear_bwd_mma_dims(D, Dv) &&
            std::size_t(std::max(linear_bwd_mma_smem(linear_bwd_pass::query, false),
                                 linear_bwd_mma_smem(linear_bwd_pass::key, s.half_inputs))) <=
                std::max(props.smem_per_block_optin, props.smem_per_block);
    if (p.mma) {
      p.mma_threads = int(2 * D);  // a warp per 16 of D
      p.key_threads = linear_bwd_mma_layout<64, 64>::key_threads;
      p.reduce_smem = linear_bwd_mma_smem(linear_bwd_pass::reduce, s.half_inputs);
      p.pass_a_smem = linear_bwd_mma_smem(linear_bwd_pass::query, s.half_inputs);
      p.pass_b_smem = linear_bwd_mma_smem(linear_bwd_pass::key, s.half_inputs);
    }
    // Enough token ranges a (sequence, head) to give every SM a few CTAs (the tensor-core
    // passes several waves of them), each of at least
    // linear_bwd_min_part tokens: the partial states stay O(T D) per head.
    const index_t pairs = std::max<index_t>(N * H, 1);
    const index_t most =
        std::max<index_t>(1, (s.max_len + linear_bwd_min_part - 1) / linear_bwd_min_part);
    // Ranges a sequence for `ctas` CTAs a multiprocessor over the (sequence, head) pairs.
    auto ranges = [&](index_t ctas) {
      const index_t want = (index_t(props.sms) * ctas + pairs - 1) / pairs;
      return std::max<index_t>(1, std::min({want, most, linear_bwd_max_parts}));
    };
    p.parts = ranges(p.mma ? linear_bwd_mma_ctas_per_sm : linear_bwd_ctas_per_sm);
    p.part_tokens = std::max<index_t>(1, (s.max_len + p.parts - 1) / p.parts);
    p.reduce_grid = {unsigned(p.parts), unsigned(H), n_grid};
    p.pass_grid = p.reduce_grid;
    // The tensor-core key pass sums nothing over tokens: fewer, longer ranges (about four waves
    // of its CTAs), so that each CTA stages dS once for many slabs of each warp's walk.
    const index_t key_parts = p.mma ? ranges(linear_bwd_mma_layout<64, 64>::key_ctas * 4) : p.parts;
    p.key_part_tokens = std::max<index_t>(1, (s.max_len + key_parts - 1) / key_parts);
    p.key_grid = {unsigned(key_parts), unsigned(H), n_grid};
    take(sc.stats, std::size_t(N * std::max<index_t>(s.gate_heads, 1)) * 2 * sizeof(float));
    take(sc.state, std::size_t(N * H) * state_bytes);
    take(sc.partial, std::size_t(N * p.parts * H) * state_bytes);
    take(sc.dstate, std::size_t(N * H) * state_bytes);
    take(sc.jac, std::size_t(N * H) * sizeof(float));
    if (s.normed) take(sc.dgamma, std::size_t(N * p.parts * s.q_heads * Dv) * sizeof(float));
    if (s.shared_gate_sum) take(sc.da_heads, std::size_t(H * s.batch * s.tokens) * sizeof(float));
  } else if (s.gated && !causal_layout(s, props).mma) {
    // The prefix key gate on CUDA cores: a CTA per (KV head, sequence) walks its chunks
    // (checkpoints every gated_K chunks, gated_K about the square root of the longest sequence's
    // chunks).
    p.chunk = linear_bwd_gated_chunk;
    p.max_chunks = (s.max_len + p.chunk - 1) / p.chunk;
    while (p.gated_K * p.gated_K < p.max_chunks) ++p.gated_K;
    p.gated_task_floats = linear_bwd_gated_task_floats(p.gated_K, D, Dv);
    p.gated_smem = int(linear_bwd_gated_smem_floats(D, Dv) * 4);
    p.chunk_grid = {unsigned(H), n_grid, 1};
    take(sc.gated_states, std::size_t(N * H * p.gated_task_floats) * sizeof(float));
    if (s.shared_gate_sum) take(sc.da_heads, std::size_t(H * s.batch * s.tokens) * sizeof(float));
  } else {
    const linear_bwd_causal_layout l = causal_layout(s, props);
    p.chunk = l.chunk, p.super = l.super, p.mma = l.mma;
    p.max_chunks = (s.max_len + p.chunk - 1) / p.chunk;
    if (p.mma) {
      const int gate = s.gated ? linear_bwd_causal_mma_gate_bytes : 0;
      p.mma_threads = linear_bwd_causal_mma_threads;
      p.reduce_smem = linear_bwd_causal_mma_sums_smem + gate;
      p.causal_q_smem = p.causal_k_smem = linear_bwd_causal_mma_smem + gate;
    } else {
      p.causal_q_smem = int(linear_bwd_causal_q_floats(p.chunk, tile, D, Dv) * 4);
      p.causal_k_smem = int(linear_bwd_causal_k_floats(p.chunk, tile, D, Dv) * 4);
    }
    const index_t max_slots = (p.max_chunks + p.super - 1) / p.super;
    p.chunk_grid = {unsigned(std::max<index_t>(max_slots, 1)), unsigned(H), n_grid};
    if (s.gated) {  // a slot's max and mass (its own, and before it)
      p.state_size = D * Dv + D + 4;
      p.scan_grid.x =
          unsigned((p.state_size + linear_bwd_scan_threads - 1) / linear_bwd_scan_threads);
    }
    const std::size_t slot_bytes = std::size_t(p.state_size) * sizeof(float);
    take(sc.slot_offsets, std::size_t(N + 1) * sizeof(int));
    take(sc.state, std::size_t(s.total_slots * H) * slot_bytes);
    take(sc.dstate, std::size_t(s.total_slots * H) * slot_bytes);
    const std::size_t rows = std::size_t(s.batch * s.tokens * s.q_heads);
    take(sc.inv_den, rows * sizeof(float));
    take(sc.delta, rows * sizeof(float));
    if (s.gated) {
      // Each token's running max and mass a KV head; a (sequence, head)'s final max and mass and
      // kappa; the scans' per-CTA sums (two per CTA).
      take(sc.mass, std::size_t(s.batch * s.tokens * H) * 2 * sizeof(float));
      take(sc.gate_totals, std::size_t(N * H) * 4 * sizeof(float));
      take(sc.gate_parts, std::size_t(N * H) * 2 * p.scan_grid.x * sizeof(float));
      if (s.shared_gate_sum) take(sc.da_heads, std::size_t(H * s.batch * s.tokens) * sizeof(float));
    }
  }
  sc.bytes = at;
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
