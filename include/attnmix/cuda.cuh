#pragma once
// attnmix with its CUDA backend. Include from translation units compiled by nvcc and link
// attnmix::cuda. The kinds the CUDA backend implements are those with
// is_implemented_v<Kind, backend::cuda>; call them through the same front doors as the CPU
// path, with device-memory views and attnmix::backend::cuda{stream}. attnmix::device_stack
// runs a host stack's weights on the GPU.
//
// The backend by level (include/attnmix/cuda/): the front doors' specialisations (softmax.cuh,
// fox.cuh, path.cuh, bla.cuh, gbla.cuh, linear_causal.cuh) call launch/ (host launchers), which
// ask plan/ (pure host functions of the problem and the device's properties) which kernels/ to
// run; kernels are built from arch/ (PTX primitives); runtime/ holds errors, the device query,
// memory and scratch; dispatch.cuh turns run-time choices into template arguments.

#if !defined(__CUDACC__)
#error \
    "attnmix/cuda.cuh must be compiled by a CUDA compiler (nvcc); use attnmix/attnmix.hpp otherwise"
#endif

#include "attnmix/attnmix.hpp"
#include "attnmix/cuda/runtime.cuh"

#include "attnmix/cuda/bla.cuh"
#include "attnmix/cuda/fox.cuh"
#include "attnmix/cuda/gbla.cuh"
#include "attnmix/cuda/linear_causal.cuh"
#include "attnmix/cuda/path.cuh"
#include "attnmix/cuda/softmax.cuh"

#include "attnmix/cuda/layers.cuh"
#include "attnmix/cuda/stack.cuh"
#include "attnmix/cuda/path_backward.cuh"
