#pragma once
// The SA rows of the PaTH paper's experiments: causal softmax attention with RoPE (theta 10000),
// as a stack layer of its own (train_flipflop, state_tracking).

#include "attnmix/attnmix.hpp"

struct causal_sa_rope_policy : attnmix::layers::causal_sa_layer_policy {
  static constexpr bool rope = true;
  static constexpr const char* name = "sa_rope";
};
template <class T, class Backend = attnmix::backend::cpu>
using sa_rope_mixer = attnmix::layers::attention_layer<T, causal_sa_rope_policy, Backend>;
using sa_rope = attnmix::layer::custom<attnmix::kind::softmax, sa_rope_mixer>;
