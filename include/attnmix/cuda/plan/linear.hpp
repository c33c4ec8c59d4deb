#pragma once
// The plan of a linear-attention call (bla, gbla, linear_causal): which of the kernels run, how
// the tokens are split among CTAs, every grid, and the scratch layout. Pure C++: unit-tested
// without a GPU (tests/plan/).
//
// Bidirectional (bla, gbla): reduce (partial states of token blocks) -> combine (unless the
// reduce kernel merges them itself: fused) -> read; or, for D = Dv = 64 on a device with clusters,
// one clustered kernel that does all three. Causal (linear_causal): the chunked scan, a CTA a
// segment of a sequence; with several segments the reduce and a prefix kernel first give each
// segment the state carried into it; the scan runs on tensor cores (sm80_mma) for bfloat16 at
// D = Dv = 64 with 16-byte q, k, v rows, else on CUDA cores (simt).
//   reduce: sm80_fast (16-bit, D = Dv = 64, bidirectional), sm80_mma(_wide) (16-bit, aligned
//           k/v rows, linear_mma_dims), else simt with 1, 2 or 4 tiles a thread;
//   read:   sm90_cluster, sm80_fast (D = Dv = 64, 16-byte out rows), sm80_mma(_wide) (16-byte
//           q rows, 4-byte out and gate rows), else simt with 1, 2 or 4 value chunks.

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

// Threads of the CUDA-core kernels.
constexpr int linear_reduce_threads = 256, linear_combine_threads = 256;
constexpr int linear_prefix_threads = 256, linear_read_threads = 128;
// Sizing targets (measured on an H200): the CUDA-core reduce fills the GPU `4` CTAs an SM over,
// the tensor-core reduce of wide dims `8`; the tensor-core read runs about two waves of 3 CTAs
// an SM, the one-head-dim read two waves of 2.
constexpr int linear_simt_reduce_per_sm = 4, linear_mma_reduce_per_sm = 8;
constexpr int linear_mma_read_ctas = 3, linear_fast_read_ctas = 2, linear_read_waves = 2;

enum class linear_reduce_variant { none, simt, sm80_mma, sm80_mma_wide, sm80_fast };
enum class linear_read_variant { none, simt, sm80_mma, sm80_mma_wide, sm80_fast, sm90_cluster };
enum class linear_causal_variant { none, simt, sm80_mma };

// What the plan reads of a call (the launcher fills it from the validated problem and views).
struct linear_shape {
  bool causal = false;         // kind::linear_causal
  bool sixteen_bit = false;    // half or bfloat16 inputs
  bool bf16 = false;           // bfloat16 inputs
  bool per_head_norm = false;  // Policy::norm == gated_norm::per_head (the read stages the gate)
  index_t head_dim = 0, value_dim = 0;
  index_t max_len = 0;  // longest sequence
  index_t sequences = 0, kv_heads = 0, q_heads = 0;
  bool kv_vectors = false;     // D, Dv multiples of a 16-byte vector; k, v rows 16-byte aligned
  bool q_vectors = false;      // D a multiple of a 16-byte vector; q rows 16-byte aligned
  bool out_pairs = false;      // out rows 2-element aligned
  bool out_vectors = false;    // out rows 16-byte aligned
  bool gate_vectors = false;   // gate rows 16-byte aligned
  int causal_ctas_per_sm = 0;  // causal: CTAs of the chunked kernel an SM holds (occupancy query)
  std::size_t offsets_bytes = 0;  // the cu_seqlens copy (0 for a dense batch)

  index_t group() const { return q_heads / kv_heads; }
};

// Byte offsets of the parts of the scratch, each 256-byte aligned but the last two, and the
// total: the cu_seqlens copy, the partial states, the merged (or carried-in) states, the staged
// state of the fused fast read, the fused reduce's done counters.
struct linear_scratch_layout {
  std::size_t partial = 0, state = 0, staged = 0, done = 0, bytes = 0;
  std::size_t partial_bytes = 0, state_bytes = 0, staged_bytes = 0, done_bytes = 0;
};

struct linear_plan {
  // How the tokens are split: causal segments, and the reduce's blocks of tokens.
  index_t segments = 1, segment_tokens = 1;
  index_t partials = 1, block_tokens = 1;
  bool fused = false;  // the reduce kernel merges the partial states (no combine kernel)
  bool kv_vectors = false, q_vectors = false;

  linear_reduce_variant reduce = linear_reduce_variant::none;
  int reduce_blocks = 0;  // simt: 4x4 tiles a thread (1, 2 or 4)
  int reduce_smem = 0;
  launch_grid reduce_grid;

  bool combine = false;
  launch_grid combine_grid;

  bool prefix = false;  // causal, several segments
  launch_grid prefix_grid;
  linear_causal_variant causal = linear_causal_variant::none;
  int causal_chunks = 0;  // causal simt: 32-wide value chunks of the row epilogue (1, 2 or 4)
  int causal_smem = 0;
  launch_grid causal_grid;

  linear_read_variant read = linear_read_variant::none;
  int read_chunks = 0;  // simt: 32-wide value chunks (1, 2 or 4)
  int read_smem = 0;
  index_t read_per_cta = 0;    // sm80_fast: 16-row groups a CTA; sm80_mma: 64-row tiles a CTA
  index_t cluster_tokens = 0;  // sm90_cluster: tokens a CTA
  unsigned cluster = 0;        // sm90_cluster: CTAs a cluster (grid.x)
  launch_grid read_grid;

  linear_scratch_layout scratch;
};

// 32-wide chunks covering a value row of Dv <= 128 (the row epilogues hold that many values a
// lane).
inline int linear_value_chunks(index_t Dv) {
  return Dv <= 32 ? 1 : Dv <= 64 ? 2 : 4;
}

namespace linear_plan_detail {
inline index_t ceil_div(index_t a, index_t b) {
  return (a + b - 1) / b;
}
}  // namespace linear_plan_detail

inline linear_plan plan_linear(const linear_shape& s, const device_properties& d) {
  using linear_plan_detail::ceil_div;
  linear_plan p;
  const index_t D = s.head_dim, Dv = s.value_dim, N = s.sequences, H = s.kv_heads;
  const index_t max_len = s.max_len;
  p.kv_vectors = s.kv_vectors, p.q_vectors = s.q_vectors;

  // Causal: the sequences are cut into as many segments as fill the GPU's CTA slots once (at
  // least 4 chunks a segment), so that few long sequences still use every SM.
  p.segment_tokens = std::max<index_t>(max_len, 1);
  if (s.causal) {
    const bool mma = linear_causal_mma_applies(s.bf16, D, Dv, s.kv_vectors, s.q_vectors);
    p.causal = mma ? linear_causal_variant::sm80_mma : linear_causal_variant::simt;
    p.causal_smem =
        mma ? causal_mma_smem_bytes : causal_smem_floats(int(D), int(Dv)) * int(sizeof(float));
    const index_t slots = index_t(d.sms) * std::max(s.causal_ctas_per_sm, 1);
    const index_t min_tokens = 4 * causal_chunk;
    p.segments = std::clamp<index_t>(slots / (N * H), 1,
                                     std::max<index_t>(1, ceil_div(max_len, min_tokens)));
    p.segment_tokens = std::max<index_t>(
        causal_chunk, ceil_div(ceil_div(max_len, p.segments), causal_chunk) * causal_chunk);
    p.segments = std::max<index_t>(1, ceil_div(max_len, p.segment_tokens));
  }

  // Tensor cores for half and bfloat16 when the rows allow 16-byte loads and the dims tile.
  const bool mma_reduce = s.sixteen_bit && s.kv_vectors && linear_mma_dims(D, Dv);
  const bool mma_read =
      mma_reduce && s.q_vectors && s.out_pairs && (!s.per_head_norm || s.gate_vectors);

  // Blocks of the bidirectional reduce pass (whole 64-token tiles for the tensor-core kernel).
  // The tensor-core kernel for D, Dv <= 64 runs one wave: as many blocks as the GPU holds CTAs
  // of it at once (linear_mma_reduce_ctas an SM), so that no CTA waits for a second wave and
  // each streams a long run of tiles; the others fill the GPU several times over. The causal kind
  // reduces every segment but the last.
  const bool one_wave = mma_reduce && !linear_mma_wide(D, Dv);
  const index_t target = index_t(d.sms) * (one_wave     ? linear_mma_reduce_ctas
                                           : mma_reduce ? linear_mma_reduce_per_sm
                                                        : linear_simt_reduce_per_sm);
  const index_t round = mma_reduce ? linear_mma_tokens : 32;
  p.partials = std::clamp<index_t>(one_wave ? target / (H * N) : ceil_div(target, H * N), 1,
                                   std::max<index_t>(1, ceil_div(max_len, 64)));
  p.block_tokens = std::max<index_t>(round, ceil_div(ceil_div(max_len, p.partials), round) * round);
  p.partials = std::max<index_t>(1, ceil_div(max_len, p.block_tokens));
  if (s.causal) p.partials = p.segments - 1, p.block_tokens = p.segment_tokens;

  // The bidirectional tensor-core path merges the partial states in the reduce kernel's last CTA
  // of each head, and the read kernel of head dims 64 copies the state that CTA staged.
  p.fused = !s.causal && mma_reduce && p.partials <= linear_fused_partials;
  const bool fast_read = mma_read && linear_fast_dims(D, Dv) && s.out_vectors;
  // The D = Dv = 64 kernels on compute capability 9.0 and later: one kernel, a cluster of CTAs a
  // head (its shared memory holds the norm weights of a group of query heads).
  const bool clustered = !s.causal && fast_read && d.clusters() && max_len > 0 &&
                         s.group() <= linear_cluster_max_group;

  // Scratch: the one-kernel path needs none but the sequence offsets.
  auto& sc = p.scratch;
  if (!clustered) {
    const auto floats = [](index_t count) {
      return static_cast<std::size_t>(count) * sizeof(float);
    };
    sc.partial_bytes = padded_bytes(floats(N * H * p.partials * partial_floats(int(D), int(Dv))));
    if (s.causal)
      sc.state_bytes =
          p.segments > 1
              ? padded_bytes(floats(N * H * p.segments * partial_floats(int(D), int(Dv))))
              : 0;
    else
      sc.state_bytes = padded_bytes(floats(N * H * (D * Dv + D)));
    if (p.fused && fast_read)
      sc.staged_bytes = static_cast<std::size_t>(N * H * staged_state_bytes(int(D), int(Dv)));
    if (p.fused) sc.done_bytes = static_cast<std::size_t>(N * H) * sizeof(unsigned);
  }
  sc.partial = s.offsets_bytes;
  sc.state = sc.partial + sc.partial_bytes;
  sc.staged = sc.state + sc.state_bytes;
  sc.done = sc.staged + sc.staged_bytes;
  sc.bytes = sc.done + sc.done_bytes;

  if (clustered) {
    // As many CTAs a head (up to a cluster's linear_cluster_max) as fill the GPU's CTA slots
    // about once.
    const index_t tiles = ceil_div(max_len, linear_mma_tokens);
    const index_t slots = index_t(d.sms) * linear_cluster_ctas;
    const index_t ctas =
        std::clamp<index_t>(slots / (N * H), 1, std::min<index_t>(linear_cluster_max, tiles));
    p.cluster_tokens = ceil_div(tiles, ctas) * linear_mma_tokens;
    const index_t used = ceil_div(max_len, p.cluster_tokens);
    p.read = linear_read_variant::sm90_cluster;
    p.read_smem = linear_cluster_smem(s.group());
    p.cluster = unsigned(used);
    p.read_grid = {unsigned(used), unsigned(H), unsigned(N)};
    return p;
  }

  // The reduce pass (bidirectional, or the causal kind with several segments).
  if (!s.causal || p.segments > 1) {
    if (mma_reduce) {
      p.reduce = linear_mma_wide(D, Dv) ? linear_reduce_variant::sm80_mma_wide
                                        : linear_reduce_variant::sm80_mma;
      if (!s.causal && linear_reduce_fast_dims(D, Dv)) p.reduce = linear_reduce_variant::sm80_fast;
      p.reduce_smem = linear_mma_reduce_smem(D, Dv);
      p.reduce_grid = {unsigned(H), unsigned(p.partials), unsigned(N)};
    } else {
      p.reduce = linear_reduce_variant::simt;
      const index_t tiles = (D / 4) * (Dv / 4);
      p.reduce_blocks = tiles <= 256 ? 1 : tiles <= 512 ? 2 : 4;
      p.reduce_smem = int((32 * (D + Dv) + 32) * sizeof(float));
      p.reduce_grid = {unsigned(p.partials), unsigned(H), unsigned(N)};
    }
  }

  if (s.causal) {
    p.prefix = p.segments > 1;
    p.prefix_grid = {unsigned(H), unsigned(N)};
    p.causal_chunks = linear_value_chunks(Dv);
    p.causal_grid = {unsigned(p.segments), unsigned(H), unsigned(N)};
    return p;
  }

  p.combine = !p.fused;
  p.combine_grid = {unsigned(H), unsigned(N), unsigned(ceil_div(D * Dv + D, linear_combine_slice))};
  if (max_len == 0) return p;
  if (fast_read) {
    // 16-row groups: a warp takes about groups / (resident warps * waves) of them (at least 1, at
    // most 64), so that the state is staged rarely and the grid still balances.
    constexpr index_t warps_per_cta = linear_fast_threads / 32;
    const index_t groups = ceil_div(max_len, 16);
    const index_t warps = index_t(d.sms) * linear_fast_read_ctas * warps_per_cta;
    const index_t per_warp =
        std::max(std::clamp<index_t>(groups * s.q_heads * N / (warps * linear_read_waves), 1, 64),
                 ceil_div(groups, warps_per_cta * d.max_grid_y));
    p.read = linear_read_variant::sm80_fast;
    p.read_per_cta = per_warp * warps_per_cta;
    p.read_grid = {unsigned(s.q_heads), unsigned(ceil_div(groups, p.read_per_cta)), unsigned(N)};
  } else if (mma_read) {
    // Several query tiles a CTA (about two waves of 3 CTAs an SM), so that S is staged less often.
    const index_t tiles = ceil_div(max_len, linear_mma_rows);
    p.read =
        linear_mma_wide(D, Dv) ? linear_read_variant::sm80_mma_wide : linear_read_variant::sm80_mma;
    p.read_per_cta = std::max(
        std::clamp<index_t>(
            tiles * s.q_heads * N / (index_t(d.sms) * linear_mma_read_ctas * linear_read_waves), 1,
            16),
        ceil_div(tiles, d.max_grid_y));
    p.read_smem = linear_mma_read_smem(D, Dv, s.per_head_norm);
    p.read_grid = {unsigned(s.q_heads), unsigned(ceil_div(tiles, p.read_per_cta)), unsigned(N)};
  } else {
    p.read = linear_read_variant::simt;
    p.read_chunks = linear_value_chunks(Dv);
    p.read_smem = linear_read_smem_floats(int(D), int(Dv)) * int(sizeof(float));
    p.read_grid = {unsigned(ceil_div(max_len, linear_read_rows)), unsigned(s.q_heads), unsigned(N)};
  }
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
