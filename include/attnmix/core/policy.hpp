#pragma once
// Policies: one struct of named compile-time knobs per kind, with defaults. Override a knob by
// deriving and redeclaring it:
//   struct my_sa : attnmix::softmax_policy { static constexpr auto mask =
//   attnmix::mask_type::bidirectional; };
// Runtime values (lengths, scale, window, cu_seqlens) live in the params structs instead.

#include "attnmix/config.hpp"
#include "attnmix/core/tags.hpp"

namespace attnmix {

enum class mask_type {
  causal,         // query i sees keys j <= i
  bidirectional,  // query i sees every key of its sequence
};

// Where a forget-gate bias G_i - G_j enters the logits.
enum class gate_scaling {
  after_scale,   // s * q.k + (G_i - G_j)       FoX (fla parallel_attn, the FoX paper)
  before_scale,  // s * (l_ij + G_i - G_j)      PaTH-FoX (fla path_attn)
};

inline const char* to_string(mask_type m) {
  return m == mask_type::causal ? "causal" : "bidirectional";
}

struct softmax_policy {
  static constexpr mask_type mask = mask_type::causal;
  static constexpr index_t block_q = 64;   // CPU: query rows per tile
  static constexpr index_t block_k = 128;  // CPU: key columns per tile
};

struct fox_policy : softmax_policy {
  static constexpr gate_scaling gate = gate_scaling::after_scale;
};

struct path_policy : softmax_policy {
  static constexpr index_t chunk = 64;  // positions per UT-transform chunk
  static constexpr gate_scaling gate = gate_scaling::before_scale;  // used by kind::path_fox
};

struct path_fox_policy : path_policy {};

// Override one knob.
template <class Base, mask_type M>
struct with_mask : Base {
  static constexpr mask_type mask = M;
};
template <class Base, gate_scaling S>
struct with_gate_scaling : Base {
  static constexpr gate_scaling gate = S;
};

using bidirectional_softmax_policy = with_mask<softmax_policy, mask_type::bidirectional>;

template <class Kind>
struct default_policy;
template <>
struct default_policy<kind::softmax> {
  using type = softmax_policy;
};
template <>
struct default_policy<kind::fox> {
  using type = fox_policy;
};
template <>
struct default_policy<kind::path> {
  using type = path_policy;
};
template <>
struct default_policy<kind::path_fox> {
  using type = path_fox_policy;
};
template <class Kind>
using default_policy_t = typename default_policy<Kind>::type;

}  // namespace attnmix
