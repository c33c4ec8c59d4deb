#pragma once
// Arguments of the softmax-family attention call (softmax, fox, path, path_fox).

#include <cmath>
#include <cstdint>
#include <optional>

#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {

// Tensors. Inputs of type T; gates, Householder parameters and statistics in accum_t<T>
// (float, or double when T is double). Absent optional views are left default-constructed.
// Softmax and FoX (on backends with takes_key_lengths) take keys of other lengths than the
// queries: k and v of Tk tokens, or packed with their own offsets, or read from the slots of a
// cache (attention_params), the last query of a sequence aligned with its last key
// ("bottom-right"): decoding and chunked prefill against a cache. The shapes below are those of
// equal lengths, T = Tk; with key_slots, k, v and g have S rows (the cache's slots), not B.
template <class T>
struct attention_args {
  view4<const T> q{};  // [B, T, HQ, D]
  view4<const T> k{};  // [B, Tk, H, D]   HQ % H == 0; query head hq reads KV head hq / (HQ/H)
  view4<const T> v{};  // [B, Tk, H, Dv]
  view4<T> out{};      // [B, T, HQ, Dv]
  view3<const accum_t<T>> g{};     // fox, path_fox: log forget gate (<= 0) of each key [B, Tk, HQ]
  view4<const accum_t<T>> w{};     // path, path_fox: Householder directions [B, T, H, D]
  view3<const accum_t<T>> beta{};  // path, path_fox: Householder strengths in [0, 2] [B, T, H]
  view3<accum_t<T>> lse{};  // optional output: natural-log log-sum-exp of each row [B, T, HQ]
};

// Tensors of the softmax-family backward (attention_backward). The forward's inputs, its output
// and log-sum-exp, and the gradient of the output in; the gradient of every differentiable input
// out. Gradients have the shape of what they differentiate; those of k, v, w and beta sum over
// the query heads of a group. g, w and beta (and dg, dw, dbeta) as the kind needs them.
template <class T>
struct attention_grad_args {
  view4<const T> q{};              // [B, T, HQ, D]
  view4<const T> k{};              // [B, T, H, D]
  view4<const T> v{};              // [B, T, H, Dv]
  view3<const accum_t<T>> g{};     // fox, path_fox [B, T, HQ]
  view4<const accum_t<T>> w{};     // path, path_fox [B, T, H, D]
  view3<const accum_t<T>> beta{};  // path, path_fox [B, T, H]
  view4<const T> out{};            // the forward's output [B, T, HQ, Dv]
  view3<const accum_t<T>> lse{};   // the forward's lse [B, T, HQ]
  view4<const T> dout{};           // d loss / d out [B, T, HQ, Dv]
  view4<T> dq{};                   // [B, T, HQ, D]
  view4<T> dk{};                   // [B, T, H, D]
  view4<T> dv{};                   // [B, T, H, Dv]
  view3<accum_t<T>> dg{};          // fox, path_fox [B, T, HQ]
  view4<accum_t<T>> dw{};          // path, path_fox [B, T, H, D]
  view3<accum_t<T>> dbeta{};       // path, path_fox [B, T, H]
};

// Runtime values.
struct attention_params {
  std::optional<double> scale;  // softmax scale; default 1/sqrt(D)
  index_t window = 0;  // > 0: causal query i sees keys i-window < j <= i (|i-j| < window if
                       // bidirectional); 0: no window
  view1<const std::int32_t> cu_seqlens;  // packed batch: B == 1, [N+1] sequence offsets
  // Packed keys of other lengths than the queries: [N+1] offsets into k and v (with cu_seqlens
  // for the queries). Absent: the keys' offsets are cu_seqlens.
  view1<const std::int32_t> cu_seqlens_k;
  // Keys held in a cache (decoding): sequence n reads only the first key_lengths[n] tokens of its
  // key sequence [N], and, in a dense batch, row key_slots[n] of k, v and g [N] (default: row n).
  view1<const std::int32_t> key_lengths;
  view1<const std::int32_t> key_slots;
};

// One sequence of a (dense or packed) batch: tokens [start, start + length) of batch row `batch`.
struct sequence {
  index_t batch, start, length;
};

// Sequence n of a dense batch of rows of `tokens` (cu_seqlens == nullptr) or of a packed one.
inline sequence sequence_at(const std::int32_t* cu_seqlens, index_t tokens, index_t n) {
  if (cu_seqlens == nullptr) return {n, 0, tokens};
  return {0, cu_seqlens[n], index_t{cu_seqlens[n + 1]} - cu_seqlens[n]};
}

// Sizes resolved and checked by the front door, handed to every backend. Query i of a
// sequence sits at key position i + key_offset(n): with keys of the queries' lengths (the only
// problems a backend without takes_key_lengths gets) key_tokens == tokens, key_batch == batch,
// cu_seqlens_k == cu_seqlens, no key_lengths or key_slots, and the offset is 0.
struct attention_problem {
  index_t batch, tokens, q_heads, kv_heads, head_dim, value_dim;
  double scale;
  index_t window;
  const std::int32_t* cu_seqlens;  // host copy of the offsets, or nullptr for a dense batch
  index_t num_sequences;
  index_t key_tokens;                // Tk
  const std::int32_t* cu_seqlens_k;  // the keys' offsets (== cu_seqlens when they match)
  index_t key_batch;                 // rows of k, v and g: the slots with key_slots, else batch
  const std::int32_t* key_lengths;   // [N] keys each sequence reads, or nullptr (all of them)
  const std::int32_t* key_slots;     // [N] the row of k each sequence reads, or nullptr (its own)

  index_t group() const { return q_heads / kv_heads; }
  sequence seq(index_t n) const { return sequence_at(cu_seqlens, tokens, n); }
  sequence key_seq(index_t n) const {
    sequence s = sequence_at(cu_seqlens_k, key_tokens, n);
    if (key_slots != nullptr) s.batch = key_slots[n];
    if (key_lengths != nullptr) s.length = key_lengths[n];
    return s;
  }
  index_t key_offset(index_t n) const { return key_seq(n).length - seq(n).length; }
  bool keys_match_queries() const {
    return key_tokens == tokens && cu_seqlens_k == cu_seqlens && key_lengths == nullptr &&
           key_slots == nullptr;
  }
};

}  // namespace attnmix
