#pragma once
// The elementwise operations of the layers' row kernels (kernels/rows.cuh), each a struct so
// that nvcc needs no lambdas: y = Op(a, b) in float. Their derivatives are
// kernels/rows_backward.cuh's slope_of.

#include <cmath>

namespace attnmix {
namespace detail {
namespace cuda {

struct silu_times {  // SwiGLU: SiLU(gate) * up
  __device__ float operator()(float g, float u) const { return g / (1.f + __expf(-g)) * u; }
};
struct times_sigmoid {  // output gate: o * sigmoid(g)
  __device__ float operator()(float o, float g) const { return o / (1.f + __expf(-g)); }
};
struct gelu_of {  // exact (erf) GELU
  __device__ float operator()(float x, float) const {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  }
};
struct relu_of {
  __device__ float operator()(float x, float) const { return fmaxf(x, 0.f); }
};
struct log_sigmoid_of {  // min(x, 0) - log1p(exp(-|x|)): no overflow
  __device__ float operator()(float x, float) const {
    return fminf(x, 0.f) - log1pf(__expf(-fabsf(x)));
  }
};
struct two_sigmoid_of {  // PaTH's beta = 2 sigmoid(x)
  __device__ float operator()(float x, float) const { return 2.f / (1.f + __expf(-x)); }
};
struct plus {  // the residual update h + m
  __device__ float operator()(float h, float m) const { return h + m; }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
