#pragma once
// Forward FLOPs of one encoder block (mixer + SwiGLU MLP) over one sequence of n tokens, for the
// hybrid-against-SA-only benchmarks (as examples/hybrid_encoder.cpp counts them); a causal SA
// block's attention products cover half the n x n plane.

#include <attnmix/attnmix.hpp>

namespace attnmix_bench {

inline double block_flops(bool sa, const attnmix::layers::config& c, double n,
                          bool causal = false) {
  namespace L = attnmix::layers;
  const double D = double(c.hidden_size), I = double(L::mlp_width(c, L::mlp_kind::swiglu));
  const double inner = double(c.num_heads * c.dim()), d = double(c.dim());
  const double mlp = 6.0 * D * I * n;
  if (sa) return 2.0 * D * 4 * inner * n + (causal ? 2.0 : 4.0) * n * n * inner + mlp;
  return 8.0 * D * n + 2.0 * D * (5 * inner + 1) * n + 4.0 * n * inner * d + mlp;
}

}  // namespace attnmix_bench
