#pragma once
// What every CUDA softmax-family kernel reads: pointers, strides (elements) and masking.

#include <cstdint>

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct attention_kernel_params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;  // nullptr: not requested
  index_t q_stride[3], k_stride[3], v_stride[3], out_stride[3],
      lse_stride[3];               // batch, token, head
  const std::int32_t* cu_seqlens;  // device copy, or nullptr for a dense batch
  index_t tokens;                  // T of the dense layout
  int q_heads, group, head_dim, value_dim;
  float scale_log2;  // softmax scale * log2(e): the kernels work in base 2
  index_t window;    // 0: none
  bool causal;
  const double* gate_cumsum;  // [B, T, HQ] inclusive cumsum of g per sequence, or nullptr
  float gate_coef_log2;       // factor of (G_i - G_j), times log2(e)
  int* work_counter;          // zeroed device int: the work queue of the persistent kernels

  // Sequence n: batch row, first token, length.
  __device__ void sequence(int n, index_t& batch, index_t& start, index_t& length) const {
    if (cu_seqlens == nullptr) {
      batch = n, start = 0, length = tokens;
    } else {
      batch = 0, start = cu_seqlens[n], length = cu_seqlens[n + 1] - start;
    }
  }

  // Keys query i may see, [lo, hi] (inclusive), in a sequence of `length`.
  __device__ void key_range(index_t i, index_t length, index_t& lo, index_t& hi) const {
    lo = window > 0 ? (i - window + 1 > 0 ? i - window + 1 : 0) : 0;
    hi = causal ? i : (window > 0 && i + window - 1 < length - 1 ? i + window - 1 : length - 1);
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
