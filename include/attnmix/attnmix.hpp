#pragma once
// attnmix: attention primitives (softmax, FoX, PaTH, BLA, GBLA, causal linear attention) with
// an Eigen CPU backend. Include <attnmix/cuda.cuh> from nvcc-compiled code for the CUDA backend.

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/fwd.hpp"
#include "attnmix/core/host_tensor.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/core/validate.hpp"
#include "attnmix/math/feature_map.hpp"

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/attention/linear_args.hpp"
#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/attention/linear_attention_backward.hpp"
#include "attnmix/attention/path_cache.hpp"

#include "attnmix/cpu/bla.hpp"
#include "attnmix/cpu/fox.hpp"
#include "attnmix/cpu/gbla.hpp"
#include "attnmix/cpu/layer_ops.hpp"
#include "attnmix/cpu/linear_causal.hpp"
#include "attnmix/cpu/path.hpp"
#include "attnmix/cpu/softmax.hpp"

// Layers and hybrid stacks (CPU). Weights in and out: <attnmix/io/safetensors.hpp>, which
// needs nlohmann-json, so it is not part of this umbrella.
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/cross_attention_layer.hpp"
#include "attnmix/layers/linear_layer.hpp"
#include "attnmix/layers/mlp.hpp"
#include "attnmix/layers/path_layer.hpp"
#include "attnmix/stack/decoder.hpp"
#include "attnmix/stack/stack.hpp"
