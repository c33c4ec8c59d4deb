#pragma once
// The parameters of the PaTH kernels (forward, preparation, key cache, decoding, backward): the
// attention arguments, the Householder inputs w and beta, and the chunk data of
// path_simt.cuh's preparation; and where a prefill key cache's rows go.

#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct path_kernel_params {
  attention_kernel_params a;  // q, k, v, out, lse, sequences, scale, gate
  const float* w;
  const float* beta;
  index_t w_stride[3], beta_stride[3];
  int kv_heads;
  bool k_scalar;  // K rows not 16-byte aligned: the tensor-core preparation reads them elementwise
  // Chunk data ([B, H, tokens, .]); element types are the kernels' template arguments.
  void* kt;  // K~, [.., D]
  void* u;   // U,  [.., D]
  void* m;   // M,  [.., C]
  void* wh;  // -W in half (tensor-core forward only; X = -r W^T is then added), [.., D]
  void* e;   // E = -W^T U in half, the chunk's transition r <- r + r E at D = C (Hopper forward
             // only; the chunks a later chunk follows), [.., D]: its D rows in its C token rows

  __device__ index_t row(index_t batch, int h, index_t t) const {
    return (batch * kv_heads + h) * a.tokens + t;
  }

  // The chunk of a preparation block: sequence blockIdx.z, chunk blockIdx.x, its first token c0
  // and its n <= C rows. False when the sequence has no such chunk.
  __device__ bool prepare_chunk(index_t& batch, index_t& start, index_t& length, index_t& c0,
                                int& n) const {
    a.sequence(blockIdx.z, batch, start, length);
    c0 = static_cast<index_t>(blockIdx.x) * path_chunk;
    if (c0 >= length) return false;
    n = length - c0 < path_chunk ? static_cast<int>(length - c0) : path_chunk;
    return true;
  }

  // The query chunk of a forward block: sequence blockIdx.z, chunk ci counted from the last by
  // blockIdx.x (the heaviest chunks start first), its first token c0 and its n <= C rows. False
  // when the sequence has no such chunk.
  __device__ bool query_chunk(index_t& batch, index_t& start, index_t& length, index_t& ci,
                              index_t& c0, int& n) const {
    a.sequence(blockIdx.z, batch, start, length);
    ci = static_cast<index_t>(gridDim.x) - 1 - blockIdx.x;
    c0 = ci * path_chunk;
    if (c0 >= length) return false;
    n = length - c0 < path_chunk ? static_cast<int>(length - c0) : path_chunk;
    return true;
  }
};

// Where the prefill key cache of (KV head h, sequence blockIdx.y) goes. Out: [B, T, H, D]
// (strided). slot_of != nullptr: sequence n goes to out + slot_of[n] * out_s0, its token j at
// j * out_s1 (a decoding cache); otherwise to its batch row and its own token positions. recent
// and transitions (a device decoding cache, else nullptr): the slot's ring of recent keys and M.
// A decoding cache defers the transitions (path_decode.cuh): the keys from F on are recent, kept
// in float in the ring too, and M starts as I (set by the constructor, the CTA's threads).
template <class Out>
struct key_cache_rows {
  Out* dst;
  float* ring = nullptr;
  index_t F, ring_stride;
  __device__ key_cache_rows(const path_kernel_params& p, Out* out, index_t out_s0, index_t out_s1,
                            index_t out_s2, const std::int32_t* slot_of, float* recent,
                            float* transitions, int h, index_t batch, index_t start, index_t length)
      : dst(slot_of != nullptr ? out + slot_of[blockIdx.y] * out_s0 + h * out_s2
                               : out + batch * out_s0 + start * out_s1 + h * out_s2),
        F(path_decode_flushed(length)),
        ring_stride(index_t(p.kv_heads) * p.a.head_dim),
        s1(out_s1) {
    if (recent == nullptr) return;
    const int D = p.a.head_dim;
    const index_t slot = slot_of[blockIdx.y];
    ring = recent + (slot * path_decode_recent * p.kv_heads + h) * D;
    float* M = transitions + (slot * p.kv_heads + h) * D * D;
    for (int idx = threadIdx.x; idx < D * D; idx += blockDim.x)
      M[idx] = idx / D == idx % D ? 1.f : 0.f;
  }
  // Element i of token j's key.
  __device__ void put(index_t j, int i, float x) const {
    dst[j * s1 + i] = from_float<Out>(x);
    if (ring != nullptr && j >= F) ring[(j % path_decode_recent) * ring_stride + i] = x;
  }

 private:
  index_t s1;
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
