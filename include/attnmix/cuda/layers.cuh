#pragma once
// The layers on the GPU. A layer is written once (layers/*.hpp) over layers::ops<Backend>; this
// header brings the CUDA operations (cuda/layer_ops.cuh) and the CUDA attention kinds, so that
// attention_layer<D, Policy, backend::cuda> and the others run there (D: float, half or
// bfloat16). A device layer is made from a host one by copying its weights once:
//   attnmix::layers::linear_layer<attnmix::bfloat16, P, attnmix::backend::cuda> gpu(host_layer);
// Projections are rounded to D; norm weights, conv taps and biases stay in float. A causal
// device layer's make_cache gives a cache in device memory, which its prefill and decode fill.

#include "attnmix/cuda/bla.cuh"
#include "attnmix/cuda/fox.cuh"
#include "attnmix/cuda/gbla.cuh"
#include "attnmix/cuda/layer_ops.cuh"
#include "attnmix/cuda/linear_causal.cuh"
#include "attnmix/cuda/path.cuh"
#include "attnmix/cuda/softmax.cuh"
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/linear_layer.hpp"
#include "attnmix/layers/mlp.hpp"
#include "attnmix/layers/path_layer.hpp"
