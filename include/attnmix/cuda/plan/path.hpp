#pragma once
// The plans of the PaTH / PaTH-FoX kernels: the forward (which preparation and which forward
// kernel, their grids, the chunk data's bytes) and a decoding step (splits of the cache, shared
// memory, grids, scratch). Pure C++: unit-tested without a GPU (tests/plan/).
//
//   forward sm90_wgmma: Hopper, 16-bit inputs, D = Dv = 64, aligned rows (q 16-byte), positive
//                       scale, not portable; tensor-core preparation with the dense transitions E.
//   forward sm80_mma:   16-bit inputs, D, Dv in {64, 128}, aligned rows; tensor-core preparation.
//   forward simt:       float, other dims or unaligned views; preparation on CUDA cores in float.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attnmix/attention/args.hpp"
#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/cuda/plan/attention.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/scratch.hpp"
#include "attnmix/cuda/plan/split_decode.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

enum class path_variant { sm90_wgmma, sm80_mma, simt };

constexpr int path_prepare_threads = 256, path_simt_threads = 256;

struct path_shape {
  index_t batch = 0, tokens = 0;
  index_t head_dim = 0, value_dim = 0;
  index_t max_len = 0;  // longest sequence
  index_t q_heads = 0, kv_heads = 0;
  index_t sequences = 0;
  bool sixteen_bit = false;  // half or bfloat16 inputs
  bool aligned = false;      // q rows 4-byte, k and v rows 16-byte, out rows 4-byte aligned
  bool q_vectors = false;    // q rows 16-byte aligned (the Hopper kernel stages them so)
  bool positive_scale = true;
  bool portable = false;  // backend::cuda::portable
};

// The per-chunk data of one call (K~, U, M, optionally W in half and the dense transitions E),
// each part 256-byte aligned: offsets and total in bytes.
struct path_chunk_layout {
  std::size_t kt = 0, u = 0, m = 0, wh = 0, e = 0, bytes = 0;
  bool half_w = false, dense = false;
};

// kt_bytes / tu_bytes: element sizes of K~ and of U, M (2 for the tensor-core forward, 4 for
// float); W and E are stored in half (2 bytes).
inline path_chunk_layout plan_path_chunks(const path_shape& s, std::size_t kt_bytes,
                                          std::size_t tu_bytes, bool half_w, bool dense) {
  constexpr std::size_t half_bytes = sizeof(std::uint16_t);
  const auto rows = static_cast<std::size_t>(s.batch * s.kv_heads * s.tokens);
  const auto D = static_cast<std::size_t>(s.head_dim);
  path_chunk_layout c;
  c.half_w = half_w, c.dense = dense;
  std::size_t at = 0;
  c.kt = at, at += padded_bytes(rows * D * kt_bytes);
  c.u = at, at += padded_bytes(rows * D * tu_bytes);
  c.m = at, at += padded_bytes(rows * path_chunk * tu_bytes);
  if (half_w) c.wh = at, at += padded_bytes(rows * D * half_bytes);
  if (dense) c.e = at, at += padded_bytes(rows * D * half_bytes);
  c.bytes = at;
  return c;
}

struct path_plan {
  path_variant variant = path_variant::simt;
  int head_dim = 0, value_dim = 0;  // tensor cores: the forward's compile-time dims
  int prepare_dim = 0;              // the preparation's compile-time D bound (64 or 128)
  int simt_dim = 0;                 // simt: the forward's compile-time bound of D, Dv (64 or 128)
  launch_grid prepare_grid;         // (chunk, KV head, sequence)
  launch_grid grid;                 // the forward
  index_t pairs = 0, items = 0;     // sm90_wgmma: pairs of chunks a sequence, work items
  bool reset_work_counter = false;
  path_chunk_layout chunks;
};

inline path_plan plan_path(const path_shape& s, const device_properties& d) {
  path_plan p;
  const index_t D = s.head_dim, Dv = s.value_dim;
  const index_t chunks = (s.max_len + path_chunk - 1) / path_chunk;
  p.prepare_grid = {unsigned(chunks), unsigned(s.kv_heads), unsigned(s.sequences)};
  if (s.sixteen_bit && s.aligned && tensor_core_dims(D, Dv)) {
    const bool hopper =
        D == 64 && Dv == 64 && hopper_kernels_apply(s.portable, s.positive_scale, d) && s.q_vectors;
    p.head_dim = int(D), p.value_dim = int(Dv);
    p.prepare_dim = D == 64 ? 64 : 128;
    p.chunks = plan_path_chunks(s, 2, 2, true, hopper);
    if (hopper) {
      // Persistent, a CTA an SM over the items (pairs of query chunks, heads, sequences).
      p.variant = path_variant::sm90_wgmma;
      p.pairs = (s.max_len + 2 * path_chunk - 1) / (2 * path_chunk);
      p.items = p.pairs * s.q_heads * s.sequences;
      p.grid.x = unsigned(std::min<index_t>(p.items, d.sms));
      p.reset_work_counter = true;
    } else {
      p.variant = path_variant::sm80_mma;
      p.grid = {unsigned(chunks), unsigned(s.q_heads), unsigned(s.sequences)};
    }
    return p;
  }
  p.variant = path_variant::simt;
  p.prepare_dim = D <= 64 ? 64 : 128;
  p.simt_dim = std::max(D, Dv) <= 64 ? 64 : 128;
  p.grid = {unsigned(chunks), unsigned(s.q_heads), unsigned(s.sequences)};
  p.chunks = plan_path_chunks(s, sizeof(float), sizeof(float), false, false);
  return p;
}

// ---- one decoding step ---------------------------------------------------------------------
struct path_decode_shape {
  index_t longest = 0;  // the longest cached sequence after this step
  index_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  std::size_t row_bytes = 0;  // the step rows' {slot, length} table
};

struct path_decode_plan {
  split_decode_plan split;              // the step's blocks and their merge (plan/split_decode.hpp)
  int smem = 0;                         // dynamic shared memory of the step kernel
  bool raise_smem_limit = false;        // above the default limit: only wide GQA groups
  int flush_smem = 0;                   // dynamic shared memory of the flush kernel,
  bool raise_flush_smem_limit = false;  // above the default limit (D = 128)
  launch_grid transition_grid;          // (key/value heads, rows)
  // scratch after the split's partial states: M^T q, then the rows
  std::size_t qm_bytes = 0, bytes = 0;
};

inline path_decode_plan plan_path_decode(const path_decode_shape& s, const device_properties& d) {
  path_decode_plan p;
  p.split = plan_split_decode(s.batch, s.q_heads, s.kv_heads, s.head_dim, s.value_dim, s.longest);
  const index_t group = s.q_heads / s.kv_heads, dmax = p.split.dmax;
  p.smem = int((2 * group * dmax + group * p.split.block_keys + 4 * dmax) * 4);
  p.raise_smem_limit = std::size_t(p.smem) > d.smem_per_block;
  p.flush_smem = path_decode_flush_smem(int(s.head_dim));
  p.raise_flush_smem_limit = std::size_t(p.flush_smem) > d.smem_per_block;
  p.transition_grid = {unsigned(s.kv_heads), unsigned(s.batch)};
  p.qm_bytes = static_cast<std::size_t>(s.batch * s.q_heads * dmax) * 4;
  p.bytes = p.split.ml_bytes + p.split.o_bytes + p.qm_bytes + s.row_bytes;
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
