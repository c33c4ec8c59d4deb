#pragma once
// The plan of a softmax-family forward (softmax, FoX): which kernel, its tiles and its grid, and
// the scratch of the call. Pure C++: unit-tested without a GPU (tests/plan/).
//
//   sm90_wgmma: Hopper, 16-bit inputs, aligned rows, D, Dv in {64, 128}, positive scale, not
//               backend::cuda::portable; persistent, one CTA an SM over the row tiles.
//   sm80_mma:   the same inputs elsewhere (or when portable is asked): a CTA a 64-row tile.
//   simt:       float, other head dims or unaligned views: a warp a query row.

#include <algorithm>
#include <cstddef>

#include "attnmix/attention/args.hpp"
#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/scratch.hpp"
#include "attnmix/cuda/plan/split_decode.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// The tile knobs of the tensor-core kernels, read by the launchers as template arguments.
// mma.sync: one 16-row tile per warp (two, m_tiles = 2, measured the same on an H200 at D = 64
// and need 255 registers).
constexpr int attention_mma_warps = 4, attention_mma_m_tiles = 1, attention_mma_key_tile = 64;
constexpr int attention_mma_rows = 16 * attention_mma_m_tiles * attention_mma_warps;
constexpr int attention_mma_threads = 32 * attention_mma_warps;
// wgmma: 128-key tiles, 3 stages. At D = Dv = 64 three consumer warpgroups hide more latency
// than two (measured 1-12 % faster on an H200); larger dims need the registers of two.
constexpr int attention_wgmma_key_tile = 128, attention_wgmma_stages = 3;
constexpr int attention_wgmma_consumers(int D, int Dv) {
  return D == 64 && Dv == 64 ? 3 : 2;
}
// CUDA cores: a warp a query row, 4 rows a CTA.
constexpr int attention_simt_rows = 4, attention_simt_threads = 128;

// Whether calls that qualify take the decoding kernel (attention_decode.cuh) instead of the
// forward kernels (on: a 12-layer SA + RoPE model's decoding step measured 7 % faster with it on
// an H100, 4.03 against 4.32 ms at 32 x 4096 cached tokens); off is for comparisons.
inline bool& attention_decode_splits() {
  static bool on = true;
  return on;
}

enum class attention_variant { sm90_wgmma, sm80_mma, simt, decode };

// What the plan reads of a call (the launcher fills it from the validated problem and views).
struct attention_shape {
  index_t head_dim = 0, value_dim = 0;
  index_t max_len = 0;  // longest sequence
  index_t q_heads = 0;
  index_t sequences = 0;
  bool sixteen_bit = false;    // half or bfloat16 inputs
  bool aligned = false;        // q, k, v rows 16-byte aligned, out rows 4-byte aligned
  bool positive_scale = true;  // the wgmma kernels fold the scale into the exponent
  bool portable = false;       // backend::cuda::portable
  // Decoding: one query a row against keys of their own, D and Dv multiples of 8 up to 128,
  // k and v rows in 8-element vectors, a group of at most 32 query heads with a gate; the most
  // keys a row sees, and the query heads a key/value head.
  bool decode = false;
  index_t decode_keys = 0, group = 1;
};

struct attention_plan {
  attention_variant variant = attention_variant::simt;
  int head_dim = 0, value_dim = 0;   // the tensor-core kernel's compile-time dims
  int consumers = 0;                 // wgmma: consumer warpgroups
  int rows = 0;                      // query rows of a work item
  int simt_chunks = 0;               // simt: 32-wide chunks of the widest head dim (2, 4 or 8)
  index_t row_tiles = 0, items = 0;  // tensor cores: row tiles a sequence, and work items
  launch_grid grid;
  bool reset_work_counter = false;  // the persistent kernel takes items from a counter
  // decode: the split blocks (plan/split_decode.hpp) and the kernel's dynamic shared memory
  // (above the default limit for wide groups).
  split_decode_plan split;
  int smem = 0;
  bool raise_smem_limit = false;
};

// Whether a call may take the Hopper (wgmma) softmax-family and PaTH kernels: on Hopper, unless
// the portable kernels were asked for, and with a positive scale (those kernels take a row's
// maximum over the raw scores and fold the scale into the exponent; PaTH's gate bias is the gate
// over the scale).
inline bool hopper_kernels_apply(bool portable, bool positive_scale, const device_properties& d) {
  return !portable && d.hopper() && positive_scale;
}

inline bool tensor_core_dims(index_t D, index_t Dv) {
  return (D == 64 || D == 128) && (Dv == 64 || Dv == 128);
}

inline attention_plan plan_attention(const attention_shape& s, const device_properties& d) {
  attention_plan p;
  if (s.decode && attention_decode_splits()) {
    p.variant = attention_variant::decode;
    p.split = plan_split_decode(s.sequences, s.q_heads, s.q_heads / s.group, s.head_dim,
                                s.value_dim, s.decode_keys);
    const int dmax = p.split.dmax;
    p.smem = int((s.group * dmax + s.group * p.split.block_keys + 4 * dmax) * 4);
    p.raise_smem_limit = std::size_t(p.smem) > d.smem_per_block;
    return p;
  }
  if (s.sixteen_bit && s.aligned && tensor_core_dims(s.head_dim, s.value_dim)) {
    p.head_dim = int(s.head_dim), p.value_dim = int(s.value_dim);
    if (hopper_kernels_apply(s.portable, s.positive_scale, d)) {
      p.variant = attention_variant::sm90_wgmma;
      p.consumers = attention_wgmma_consumers(p.head_dim, p.value_dim);
      p.rows = 64 * p.consumers;
      p.row_tiles = (s.max_len + p.rows - 1) / p.rows;
      p.items = p.row_tiles * s.q_heads * s.sequences;
      p.grid.x = unsigned(std::min<index_t>(p.items, d.sms));  // persistent: a CTA an SM
      p.reset_work_counter = true;
    } else {
      p.variant = attention_variant::sm80_mma;
      p.rows = attention_mma_rows;
      p.row_tiles = (s.max_len + p.rows - 1) / p.rows;
      p.items = p.row_tiles * s.q_heads * s.sequences;
      p.grid.x = unsigned(p.items);  // a 1-D grid of work items, row tiles first
    }
    return p;
  }
  p.variant = attention_variant::simt;
  const index_t widest = std::max(s.head_dim, s.value_dim);
  p.simt_chunks = widest <= 64 ? 2 : widest <= 128 ? 4 : 8;
  p.rows = attention_simt_rows;
  p.grid = {unsigned((s.max_len + attention_simt_rows - 1) / attention_simt_rows),
            unsigned(s.q_heads), unsigned(s.sequences)};
  return p;
}

// The most keys a row of a decoding call sees (attention_shape::decode_keys): its key count
// (key_lengths, else its cu_seqlens_k segment, else Tk), cut to the window.
inline index_t decode_keys(const attention_problem& p) {
  index_t most = 0;
  for (index_t n = 0; n < p.num_sequences; ++n) {
    index_t keys = p.key_tokens;
    if (p.cu_seqlens_k != nullptr) keys = p.cu_seqlens_k[n + 1] - p.cu_seqlens_k[n];
    if (p.key_lengths != nullptr) keys = p.key_lengths[n];
    most = std::max(most, p.window > 0 ? std::min(keys, p.window) : keys);
  }
  return most;
}

// The keys' layout, which the gate cumsum scans: its rows (packed sequences, or rows of k) and
// the longest (max_len: the queries' longest sequence, the answer when keys match them).
inline index_t key_layout_rows(const attention_problem& p) {
  if (p.keys_match_queries() || p.cu_seqlens_k != nullptr) return p.num_sequences;
  return p.key_batch;
}
inline index_t longest_key_row(const attention_problem& p, index_t max_len) {
  if (p.keys_match_queries()) return max_len;
  if (p.cu_seqlens_k == nullptr) return p.key_tokens;
  index_t longest = 0;
  for (index_t n = 0; n < p.num_sequences; ++n)
    longest = std::max<index_t>(longest, p.cu_seqlens_k[n + 1] - p.cu_seqlens_k[n]);
  return longest;
}

// Scratch bytes of the device copy of the keys' own offsets: 0 unless cu_seqlens_k differs from
// cu_seqlens (forward and backward).
inline std::size_t key_offsets_bytes(const attention_problem& p) {
  const bool own = p.cu_seqlens_k != nullptr && p.cu_seqlens_k != p.cu_seqlens;
  return own ? cu_seqlens_scratch_bytes(p.num_sequences) : 0;
}

// Scratch of a softmax-family call: the cu_seqlens copy; where the keys differ from the queries
// the copies of their offsets, slots and lengths; with a gate its cumsum G over the keys' layout
// (double), each key's last hard reset (int) and the parts' summaries (two doubles: the sum since
// the part's last reset, and that reset or -1); then the work counter of the persistent kernels;
// each part padded to 256 bytes.
struct attention_scratch_layout {
  std::size_t cu_k = 0, slots = 0, lengths = 0;  // offsets of the keys' arrays
  std::size_t gate = 0, reset = 0, part_sums = 0, counter = 0, bytes = 0;  // offsets, the total
  index_t gate_parts = 1;  // parts of gate_part tokens of the longest row of keys
  attention_scratch_layout(const attention_problem& p, bool gated, index_t max_len) {
    gate_parts = std::max<index_t>(1, (longest_key_row(p, max_len) + gate_part - 1) / gate_part);
    const std::size_t per_sequence =
        padded_bytes(static_cast<std::size_t>(p.num_sequences) * sizeof(std::int32_t));
    cu_k = p.cu_seqlens == nullptr ? 0 : cu_seqlens_scratch_bytes(p.num_sequences);
    slots = cu_k + key_offsets_bytes(p);
    lengths = slots + (p.key_slots != nullptr ? per_sequence : 0);
    gate = lengths + (p.key_lengths != nullptr ? per_sequence : 0);
    const std::size_t rows = static_cast<std::size_t>(p.key_batch * p.key_tokens * p.q_heads);
    reset = gate + (gated ? padded_bytes(rows * sizeof(double)) : 0);
    part_sums = reset + (gated ? padded_bytes(rows * sizeof(int)) : 0);
    counter = part_sums + (gated ? padded_bytes(static_cast<std::size_t>(key_layout_rows(p) *
                                                                         gate_parts * p.q_heads) *
                                                2 * sizeof(double))
                                 : 0);
    bytes = counter + scratch_alignment;
  }
};

// The two gate-cumsum kernels' grid: (part, 32 query heads, row of the keys' layout).
inline launch_grid gate_cumsum_grid(const attention_problem& p, index_t gate_parts) {
  return {unsigned(gate_parts), unsigned((p.q_heads + 31) / 32), unsigned(key_layout_rows(p))};
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
