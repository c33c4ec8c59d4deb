#pragma once
// Policies of the linear-attention kinds (kind::bla, kind::gbla, kind::linear_causal). One
// struct of named knobs; override one by deriving, e.g.
//   struct no_norm_gbla : attnmix::gbla_policy {
//     static constexpr auto norm = attnmix::gated_norm::off;
//   };
// The defaults are the [choice]s of spec gbla.md §1-4; each alternative it names is a knob.
// Runtime values (scale, eps, cu_seqlens) live in linear_attention_params.

#include "attnmix/config.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {

// Sequence-level key gate: w_j = softmax_j(a_j) over the valid keys of a sequence (a prefix
// softmax for causal kinds), multiplied into the key features of both S and z.
enum class key_gate {
  off,
  shared,    // a: [B, T, 1], one logit per token for every head (the paper's "scalar per position")
  per_head,  // a: [B, T, H], one logit per token and KV head (fla's a_proj)
};

// Gated RMSNorm epilogue: y = RMSNorm(o) * gamma * act(gate).
enum class gated_norm {
  off,         // y = o
  per_head,    // statistics over the Dv values of one query head (fla FusedRMSNormGated)
  full_width,  // statistics over all HQ * Dv values of a token (Mamba2 style)
};

enum class norm_gate_order {
  norm_then_gate,  // RMSNorm(o) * gamma * act(g)   (fla; the default)
  gate_then_norm,  // RMSNorm(o * act(g)) * gamma   (Mamba2 norm_before_gate = false)
};

enum class norm_weight {
  shared,    // gamma: [Dv], shared by every head (fla)
  per_head,  // gamma: [HQ * Dv], head-major
};

// How a causal kind walks the sequence.
enum class causal_form {
  chunked,    // chunks of Policy::chunk tokens: one carried state plus a masked chunk x chunk
              // product per chunk (training, prefill)
  recurrent,  // token by token (decoding, streaming)
};

struct linear_policy {
  static constexpr feature_map phi = feature_map::elu_plus_one;
  // Divide by phi(q).z + eps. Off: o = S^T phi(q) (fla's stock linear attention).
  static constexpr bool normalize = true;
  static constexpr key_gate gate = key_gate::off;
  static constexpr gated_norm norm = gated_norm::off;
  static constexpr norm_gate_order order = norm_gate_order::norm_then_gate;
  static constexpr gate_activation activation = gate_activation::silu;
  static constexpr norm_weight weight = norm_weight::shared;
  // Pad query rows (mask 0) are written as zeros; false leaves them untouched.
  static constexpr bool zero_pad_rows = true;
  // Causal kinds only.
  static constexpr causal_form form = causal_form::chunked;
  static constexpr index_t chunk = 64;
  // CPU: tokens per block in the reduce and read passes of the bidirectional kinds.
  static constexpr index_t block = 256;
};

// Bidirectional linear attention: no key gate, no gated norm.
struct bla_policy : linear_policy {};

// GBLA core: BLA plus a shared key gate and the per-head gated RMSNorm (SiLU, gamma [Dv]).
struct gbla_policy : linear_policy {
  static constexpr key_gate gate = key_gate::shared;
  static constexpr gated_norm norm = gated_norm::per_head;
};

// Causal linear attention, chunked; gate and norm off.
struct linear_causal_policy : linear_policy {};

// Override one knob.
template <class Base, feature_map F>
struct with_feature_map : Base {
  static constexpr feature_map phi = F;
};
template <class Base, bool On>
struct with_normalize : Base {
  static constexpr bool normalize = On;
};
template <class Base, key_gate G>
struct with_key_gate : Base {
  static constexpr key_gate gate = G;
};
template <class Base, gated_norm N>
struct with_gated_norm : Base {
  static constexpr gated_norm norm = N;
};
template <class Base, causal_form F>
struct with_causal_form : Base {
  static constexpr causal_form form = F;
};
template <class Base, index_t C>
struct with_chunk : Base {
  static constexpr index_t chunk = C;
};

template <>
struct default_policy<kind::bla> {
  using type = bla_policy;
};
template <>
struct default_policy<kind::gbla> {
  using type = gbla_policy;
};
template <>
struct default_policy<kind::linear_causal> {
  using type = linear_causal_policy;
};

// Which kinds linear_attention() takes, and whether they are causal.
template <class Kind>
struct linear_kind_traits {
  static constexpr bool linear_family = false;
  static constexpr bool causal = false;
};
template <>
struct linear_kind_traits<kind::bla> {
  static constexpr bool linear_family = true;
  static constexpr bool causal = false;
};
template <>
struct linear_kind_traits<kind::gbla> {
  static constexpr bool linear_family = true;
  static constexpr bool causal = false;
};
template <>
struct linear_kind_traits<kind::linear_causal> {
  static constexpr bool linear_family = true;
  static constexpr bool causal = true;
};

}  // namespace attnmix
