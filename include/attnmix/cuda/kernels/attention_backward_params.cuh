#pragma once
// The parameters of the softmax-family backward kernels (attention_backward_simt.cuh,
// sm80_attention_backward.cuh, attention_backward_mma.cuh).

#include <cstdint>

#include "attnmix/cuda/kernels/attention_params.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

struct attention_backward_params {
  // q, k, v, out (as the forward's, out read only), sequences, heads, dims, window, causal.
  // Its lse, gate_cumsum and scale fields are unused.
  attention_kernel_params f;
  const float* lse;  // natural-log log-sum-exp of each row
  index_t lse_stride[3];
  const void* dout;
  index_t dout_stride[3];
  void *dq, *dk, *dv;
  index_t dq_stride[3], dk_stride[3], dv_stride[3];
  float scale;   // the softmax scale (natural log)
  float* delta;  // [B*T*HQ] scratch, laid out like g
  // FoX (gate_coef == 0 and pointers nullptr without a gate):
  double gate_coef;     // factor of G_i - G_j in the logits
  const float* g;       // the log forget gate [B, T, HQ]
  index_t g_stride[3];  // batch, token, head
  float* dg;
  index_t dg_stride[3];
  double* G;      // [B*T*HQ] scratch: cumsum of g per sequence, restarting at 0 at a hard reset
  int* reset;     // [B*T*HQ] scratch: sequence-local position of the last reset at or before t
  float* colsum;  // [B*T*HQ] scratch: sum_i dS_ij of key j (per query head)
  float* rowsum;  // [B*T*HQ] scratch: sum_j dS_ij of query i
  // dQ inside the dk/dv kernel (attention_backward_mma.cuh, Fused), else nullptr: the float sums
  // ([HQ, B*T, D], heads outermost, so that a tile's rows are one span; dq_rows = B*T) and the
  // turn of each (sequence, query head, 64-row tile): the key blocks that have added to it, which
  // they do in order (dq_tiles tiles a head).
  float* dq_acc;
  int* dq_turn;
  index_t dq_tiles, dq_rows;

  __host__ __device__ bool gated() const { return G != nullptr; }
  // Index of (sequence token t, query head hq) in the [B*T*HQ] scratch arrays.
  __device__ index_t at(index_t batch, index_t start, index_t t, int hq) const {
    return (batch * f.tokens + start + t) * f.q_heads + hq;
  }
  // Row of (sequence token t, query head hq) in dq_acc.
  __device__ index_t dq_at(index_t batch, index_t start, index_t t, int hq) const {
    return hq * dq_rows + batch * f.tokens + start + t;
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
