#pragma once
// Arguments of the linear-attention call (bla, gbla, linear_causal).

#include <cstdint>
#include <optional>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {

// The state of one linear-attention prefix, per sequence n (N = B for a dense batch, the
// number of cu_seqlens segments for a packed one) and KV head h. With w_j the (prefix)
// softmax weights of the key gate (w_j = 1 without it) and p_j = w_j phi(k_j):
//   S[n,h] = sum_j p_j v_j^T   [D, Dv]      z[n,h] = sum_j p_j   [D]
//   lse[n,h] = log sum_j exp(a_j)            (key gate only; -inf for an empty prefix)
// A fresh state is S = 0, z = 0 (and lse = -inf), which is what an absent state_in means.
template <class A>
struct linear_state {
  view4<A> S{};             // [N, H, D, Dv]
  view3<A> z{};             // [N, H, D]
  tensor_view<A, 2> lse{};  // [N, H]
};

// Tensors. Activations of type T; gate logits, norm weights and states in accum_t<T>.
// Absent optional views are left default-constructed.
template <class T>
struct linear_attention_args {
  using accum = accum_t<T>;
  view4<const T> q{};  // [B, T, HQ, D]
  view4<const T> k{};  // [B, T, H, D]    HQ % H == 0; query head hq reads KV head hq / (HQ/H)
  view4<const T> v{};  // [B, T, H, Dv]
  view4<T> out{};      // [B, T, HQ, Dv]
  // Optional validity mask [B, T]: nonzero = real token. Pad keys leave S and z alone; pad
  // query rows are written as zeros (Policy::zero_pad_rows).
  tensor_view<const std::uint8_t, 2> mask{};
  view3<const accum> a{};  // key-gate logits [B, T, Hg]: Hg = 1 (key_gate::shared), H (per_head)
  view4<const T> gate{};   // gated norm: output-gate pre-activation [B, T, HQ, Dv]
  view1<const accum>
      gamma{};  // gated norm weight: [Dv] (norm_weight::shared) or [HQ*Dv]; absent: 1
  linear_state<const accum> state_in{};  // linear_causal only: the state before token 0
  linear_state<accum> state_out{};       // the state after the last token (any subset of S, z, lse)
};

// Tensors of the linear-attention backward (linear_attention_backward). The forward's inputs
// and the gradient of its output in; the gradient of every differentiable input out. The
// backward recomputes what it needs of the forward (it is O(T D Dv)); a bidirectional kind may
// be handed the forward's state_out as `saved` (S, z, and lse under a key gate) to skip that.
// A causal kind takes the gradient of the forward's final state (dstate_out, any subset; absent
// parts are 0) and writes that of its initial state (dstate_in, any subset of what state_in gave).
// Gradients have the shape of what they differentiate; those of k, v and a sum over the query
// heads of a group, dgamma over every token (and head, with norm_weight::shared). Pad tokens
// (mask 0) get zero gradients.
template <class T>
struct linear_attention_grad_args {
  using accum = accum_t<T>;
  view4<const T> q{};                         // [B, T, HQ, D]
  view4<const T> k{};                         // [B, T, H, D]
  view4<const T> v{};                         // [B, T, H, Dv]
  tensor_view<const std::uint8_t, 2> mask{};  // [B, T]
  view3<const accum> a{};                     // [B, T, Hg]
  view4<const T> gate{};                      // [B, T, HQ, Dv]
  view1<const accum> gamma{};                 // [Dv] or [HQ * Dv]
  linear_state<const accum> state_in{};       // linear_causal only
  linear_state<const accum> saved{};          // bidirectional kinds: the forward's state_out
  view4<const T> dout{};                      // d loss / d out [B, T, HQ, Dv]
  linear_state<const accum> dstate_out{};     // linear_causal only
  view4<T> dq{};                              // [B, T, HQ, D]
  view4<T> dk{};                              // [B, T, H, D]
  view4<T> dv{};                              // [B, T, H, Dv]
  view3<accum> da{};                          // key gate [B, T, Hg]
  view4<T> dgate{};                           // gated norm [B, T, HQ, Dv]
  view1<accum> dgamma{};                      // gated norm, when gamma is given
  linear_state<accum> dstate_in{};            // linear_causal, when state_in is given
};

// Runtime values.
struct linear_attention_params {
  // Multiplies phi(q) (after the feature map). Default: 1 with the normaliser on (where it
  // cancels but for eps), 1/sqrt(D) with it off (fla's convention).
  std::optional<double> scale;
  double eps = 1e-6;                     // added to the denominator phi(q).z
  double norm_eps = 1e-5;                // added to the mean square of the gated RMSNorm
  view1<const std::int32_t> cu_seqlens;  // packed batch: B == 1, [N+1] sequence offsets
};

// Sizes resolved and checked by the front door, handed to every backend.
struct linear_attention_problem {
  index_t batch, tokens, q_heads, kv_heads, gate_heads, head_dim, value_dim;
  double scale, eps, norm_eps;
  const std::int32_t* cu_seqlens;  // host copy of the offsets, or nullptr for a dense batch
  index_t num_sequences;

  index_t group() const { return q_heads / kv_heads; }
  sequence seq(index_t n) const { return sequence_at(cu_seqlens, tokens, n); }
};

}  // namespace attnmix
