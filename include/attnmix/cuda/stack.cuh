#pragma once
// attnmix::device_stack: a host stack on the GPU, the same attnmix::basic_stack type with
// backend::cuda and a device compute type D (float, half or bfloat16).
//
//   attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>> enc(cfg);
//   attnmix::layers::randomize_parameters(enc, seed);          // or attnmix::io::load(enc, file)
//   attnmix::device_stack<decltype(enc), attnmix::bfloat16> gpu(enc);  // copies the weights once
//   gpu.forward(x, out, {mask}, attnmix::backend::cuda{stream});       // device [B, T, D] views
//
// The host stack stays the owner of the weights (loading, saving, initialising); a device stack
// is a snapshot of them, rounded to D for the projections and kept in float for norms, conv taps
// and biases. The residual stream is float; what the blocks read and write between steps is D.
// A causal device stack generates on the GPU: make_cache gives every layer's cache in device
// memory (PaTH caches in float or bfloat16), prefill and decode fill it:
//   auto cache = gpu.make_cache(sequences, capacity);
//   gpu.prefill(prompts, out, cache, {}, cu_seqlens, be);   // device views; cu_seqlens on the host
//   gpu.decode(next_tokens, out, cache, be);                // [N, 1, D], a token a sequence

#include "attnmix/cuda/layers.cuh"
#include "attnmix/stack/stack.hpp"

namespace attnmix {

// Stack (a host stack type) on the GPU in D.
template <class Stack, class D = float>
using device_stack = stack_on<Stack, backend::cuda, D>;

}  // namespace attnmix
