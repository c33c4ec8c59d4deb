#pragma once
// Mixer layers with every optional switch on, shared by the layer, stack and GPU stack tests.

#include "attnmix/attnmix.hpp"

namespace attnmix_test {
namespace custom_layers {

namespace L = attnmix::layers;

// Causal SA with RoPE, qk-norm and the output gate.
struct rope_sa_policy : L::causal_sa_layer_policy {
  static constexpr bool rope = true;
  static constexpr bool qk_norm = true;
  static constexpr bool output_gate = true;
  static constexpr const char* name = "rope_sa";
};
// FoX with qk-norm (fla's GroupNorm) and the output gate.
struct gated_fox_policy : L::fox_layer_policy {
  static constexpr bool qk_norm = true;
  static constexpr bool output_gate = true;
  static constexpr const char* name = "gated_fox";
};
// A causal linear layer with every GBLA addition: conv state, key-gate lse and norm.
struct causal_gbla_policy : L::gbla_layer_policy {
  using kind = attnmix::kind::linear_causal;
  using core = attnmix::with_gated_norm<
      attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::per_head>,
      attnmix::gated_norm::per_head>;
  static constexpr const char* name = "causal_gbla";
};
// PaTH-FoX with fla's use_qk_norm.
struct normed_path_fox_policy : L::path_fox_layer_policy {
  static constexpr bool qk_norm = true;
  static constexpr const char* name = "normed_path_fox";
};

template <class T, class Backend = attnmix::backend::cpu>
using rope_sa_layer = L::attention_layer<T, rope_sa_policy, Backend>;
template <class T, class Backend = attnmix::backend::cpu>
using gated_fox_layer = L::attention_layer<T, gated_fox_policy, Backend>;
template <class T, class Backend = attnmix::backend::cpu>
using causal_gbla_layer = L::linear_layer<T, causal_gbla_policy, Backend>;
template <class T, class Backend = attnmix::backend::cpu>
using normed_path_fox_layer = L::path_layer<T, normed_path_fox_policy, Backend>;

using rope_sa = attnmix::layer::custom<attnmix::kind::softmax, rope_sa_layer>;
using gated_fox = attnmix::layer::custom<attnmix::kind::fox, gated_fox_layer>;
using causal_gbla = attnmix::layer::custom<attnmix::kind::linear_causal, causal_gbla_layer>;
using normed_path_fox = attnmix::layer::custom<attnmix::kind::path_fox, normed_path_fox_layer>;

}  // namespace custom_layers
}  // namespace attnmix_test
