#pragma once
// attnmix with its CUDA backend. Include from translation units compiled by nvcc and link
// attnmix::cuda. The kinds the CUDA backend implements are those with
// is_implemented_v<Kind, backend::cuda>.

#if !defined(__CUDACC__)
#error "attnmix/cuda.cuh must be compiled by a CUDA compiler (nvcc); use attnmix/attnmix.hpp otherwise"
#endif

#include "attnmix/attnmix.hpp"
#include "attnmix/cuda/runtime.cuh"
