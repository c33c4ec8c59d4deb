#pragma once
// What every CUDA softmax-family kernel reads: pointers, strides (elements) and masking.

#include <cstdint>

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct attention_kernel_params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // nullptr: not requested
  index_t q_stride[3], k_stride[3], v_stride[3], out_stride[3],
      lse_stride[3];               // batch, token, head
  const std::int32_t* cu_seqlens;  // device copy, or nullptr for a dense batch
  index_t tokens;                  // T of the dense layout
  int q_heads, group, head_dim, value_dim;
  float scale_log2;  // softmax scale * log2(e): the kernels work in base 2
  index_t window;    // 0: none
  bool causal;
  // [B, T, HQ] inclusive cumsum of g per sequence, a hard reset (g = -inf) summed as 0, or
  // nullptr; and each token's last reset at or before it (sequence-local, 0 where none).
  const double* gate_cumsum;
  const int* gate_reset;
  float gate_coef_log2;  // factor of (G_i - G_j), times log2(e)
  float gate_bias_coef;  // -gate_coef / scale: the gate in score units (Hopper PaTH)
  int* work_counter;     // zeroed device int: the work queue of the persistent kernels
  // Keys (k, v and g) in a layout of their own (keys_differ; else the queries'): their offsets
  // (device copy) or Tk of the dense layout, and with a cache each sequence's slot (the row of k
  // it reads) and key count (device copies, or nullptr). Query i of a sequence of Lq queries and
  // Lk keys is at key position i + Lk - Lq.
  bool keys_differ;
  const std::int32_t* cu_seqlens_k;
  index_t key_tokens;
  const std::int32_t* key_slots;
  const std::int32_t* key_lengths;

  // Sequence n: batch row, first token, length.
  __device__ void sequence(int n, index_t& batch, index_t& start, index_t& length) const {
    if (cu_seqlens == nullptr) {
      batch = n, start = 0, length = tokens;
    } else {
      batch = 0, start = cu_seqlens[n], length = cu_seqlens[n + 1] - start;
    }
  }
  // Row r of the keys' layout (a packed sequence, or a row of k): what the gate cumsum scans.
  __device__ void key_row(int r, index_t& batch, index_t& start, index_t& length) const {
    if (!keys_differ) return sequence(r, batch, start, length);
    if (cu_seqlens_k == nullptr) {
      batch = r, start = 0, length = key_tokens;
    } else {
      batch = 0, start = cu_seqlens_k[r], length = cu_seqlens_k[r + 1] - start;
    }
  }
  // Sequence n's keys: the row of k, the first key, how many it reads.
  __device__ void key_sequence(int n, index_t& batch, index_t& start, index_t& length) const {
    key_row(n, batch, start, length);
    if (key_slots != nullptr) batch = key_slots[n];
    if (key_lengths != nullptr) length = key_lengths[n];
  }
  // Tokens of a row of the keys' dense layout (the gate cumsum's row stride).
  __device__ index_t key_layout_tokens() const { return keys_differ ? key_tokens : tokens; }

  // The first key query i (at `row`: (batch * tokens + start + i) * q_heads + head) may see after
  // the hard resets of its gate: keys before its last reset have weight exp(-inf) = 0.
  __device__ index_t reset_lo(index_t row) const {
    return gate_reset == nullptr ? 0 : gate_reset[row];
  }

  // Keys query i may see, [lo, hi] (inclusive), in a sequence of `length` queries and as many
  // keys, or of `keys` keys (query i at key position i + keys - length).
  __device__ void key_range(index_t i, index_t length, index_t& lo, index_t& hi) const {
    key_range(i, length, length, lo, hi);
  }
  __device__ void key_range(index_t i, index_t length, index_t keys, index_t& lo,
                            index_t& hi) const {
    const index_t at = i + keys - length;
    lo = window > 0 ? (at - window + 1 > 0 ? at - window + 1 : 0) : 0;
    hi = causal ? at : (window > 0 && at + window - 1 < keys - 1 ? at + window - 1 : keys - 1);
  }
};

// The gate term of position i of a sequence of `length` (clamped to it): the kernel's coefficient
// times G_i - g_ref, with G the gate cumsum of the (sequence, head) and g_ref a G of the work
// item's, so that the floats stay small. In two steps for the producers: `load` reads G_i before
// the producer waits for a free stage and `term` forms the term after, so that the read (often a
// trip to DRAM) runs during the wait instead of holding the stage back.
struct gate_fetch {
  double g = 0.0;
  __device__ void load(const attention_kernel_params& p, const double* G, index_t i,
                       index_t length) {
    g = G[(i < length ? i : length - 1) * p.q_heads];
  }
  __device__ float term(const attention_kernel_params& p, double g_ref) const {
    return p.gate_coef_log2 * static_cast<float>(g - g_ref);
  }
  // Minus the term over the scale: the bias of a key column's scores (store_gate_bias).
  __device__ float bias(const attention_kernel_params& p, double g_ref) const {
    return p.gate_bias_coef * static_cast<float>(g - g_ref);
  }
};

__device__ __forceinline__ float gate_term(const attention_kernel_params& p, const double* G,
                                           double g_ref, index_t i, index_t length) {
  gate_fetch f;
  f.load(p, G, i, length);
  return f.term(p, g_ref);
}

// One unit of work: a tile of Br query rows of one (sequence, query head), and the key tiles
// its rows may see. Keys are counted in the sequence's key positions (query i at i + offset).
struct attention_work {
  index_t batch, start, length, i0, rows, j_lo, j_hi, lo_last, hi_first;
  index_t kbatch, kstart, klength, offset;  // the keys' row of k, first token, count; Lk - Lq
  int hq, hkv, key_tiles;
  const double* G;  // the gate cumsum of this (sequence, head) over its keys, or nullptr
  const int* R;     // its keys' last hard resets, or nullptr
  double g_ref;     // G at i0: gate terms are taken relative to it, so that floats stay small

  // The key position of row i (the last row's for rows past the sequence).
  __device__ index_t key_position(index_t i) const {
    return (i < length ? i : length - 1) + offset;
  }

  // Keys row i of the item sees: the call's range, cut at the row's last hard reset.
  __device__ void key_range(const attention_kernel_params& p, index_t i, index_t& lo,
                            index_t& hi) const {
    p.key_range(i, length, klength, lo, hi);
    if (R != nullptr) {
      const index_t r = R[key_position(i) * p.q_heads];
      lo = lo > r ? lo : r;
    }
  }

  // Item n of row_tiles * q_heads * sequences, row tiles fastest (the CTAs that run together
  // share one head's K and V in L2), a head's heaviest (last) causal tiles first. False when
  // the sequence has no such tile.
  template <int Br, int Bc>
  __device__ bool decode(const attention_kernel_params& p, int n, int row_tiles) {
    const int head_seq = n / row_tiles, slot = n % row_tiles;
    hq = head_seq % p.q_heads;
    hkv = hq / p.group;
    const int seq = head_seq / p.q_heads;
    p.sequence(seq, batch, start, length);
    const index_t index = p.causal ? row_tiles - 1 - slot : slot;
    if (index >= (length + Br - 1) / Br) return false;
    p.key_sequence(seq, kbatch, kstart, klength);
    offset = klength - length;
    i0 = index * Br;
    rows = length - i0 < Br ? length - i0 : Br;
    const index_t keys_at = (kbatch * p.key_layout_tokens() + kstart) * p.q_heads + hq;
    G = p.gate_cumsum != nullptr ? p.gate_cumsum + keys_at : nullptr;
    R = p.gate_reset != nullptr ? p.gate_reset + keys_at : nullptr;
    // Keys any row of this tile may see; rows in between see subsets (a row's last reset only
    // moves forward, so the first row's is the tile's least).
    key_range(p, i0 + rows - 1, lo_last, j_hi);
    key_range(p, i0, j_lo, hi_first);
    key_tiles = static_cast<int>((j_hi - j_lo + Bc) / Bc);
    g_ref = G != nullptr ? G[key_position(i0) * p.q_heads] : 0.0;
    return true;
  }
  // The gate term of row i (at its key position).
  __device__ float gate(const attention_kernel_params& p, index_t i) const {
    return gate_term(p, G, g_ref, key_position(i), klength);
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
