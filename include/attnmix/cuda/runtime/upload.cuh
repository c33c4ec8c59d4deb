#pragma once
// Host arrays on the device: the copy every launcher uploads with (upload_host), and the
// sequence offsets of a packed batch: how long the longest sequence is, how many scratch bytes
// the copy of cu_seqlens takes, and the stream-ordered copy itself.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "attnmix/config.hpp"
#include "attnmix/cuda/plan/scratch.hpp"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Copies `bytes` of host memory at src to dst on `stream`, reading src now, as an eager call
// does: a copy from pageable memory stages its bytes before it returns, so the caller's array
// (often a temporary) may go at once. A copy captured into a CUDA graph would instead read src
// at every replay, long after a temporary is gone; so while `stream` captures, the bytes are
// copied into a host buffer that the graph owns (a user object, freed with the graph) and the
// graph copies from there.
inline void upload_host(void* dst, const void* src, std::size_t bytes, cudaStream_t stream,
                        const char* what) {
  if (bytes == 0) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  check(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph), "cudaStreamGetCaptureInfo");
  if (status == cudaStreamCaptureStatusActive) {
    void* copy = std::malloc(bytes);
    if (copy == nullptr) throw std::bad_alloc();
    std::memcpy(copy, src, bytes);
    cudaUserObject_t owner{};
    const cudaError_t made = cudaUserObjectCreate(
        &owner, copy, [](void* p) { std::free(p); }, 1, cudaUserObjectNoDestructorSync);
    if (made != cudaSuccess) std::free(copy);
    check(made, "cudaUserObjectCreate");
    const cudaError_t kept = cudaGraphRetainUserObject(graph, owner, 1, cudaGraphUserObjectMove);
    if (kept != cudaSuccess) (void)cudaUserObjectRelease(owner, 1);
    check(kept, "cudaGraphRetainUserObject");
    src = copy;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), what);
}

// The longest sequence of a problem (attention_problem or linear_attention_problem).
template <class Problem>
index_t longest_sequence(const Problem& p) {
  index_t longest = 0;
  for (index_t n = 0; n < p.num_sequences; ++n) longest = std::max(longest, p.seq(n).length);
  return longest;
}

// Scratch bytes for the device copy of a problem's cu_seqlens: 0 for a dense batch, else padded
// to 256 so that what follows it stays aligned.
template <class Problem>
std::size_t offsets_bytes(const Problem& p) {
  if (p.cu_seqlens == nullptr) return 0;
  return cu_seqlens_scratch_bytes(p.num_sequences);
}

// Copies cu_seqlens (validated host memory) to dst on `stream`; returns the device copy, or
// nullptr for a dense batch.
template <class Problem>
const std::int32_t* upload_offsets(unsigned char* dst, const Problem& p, cudaStream_t stream) {
  if (p.cu_seqlens == nullptr) return nullptr;
  upload_host(dst, p.cu_seqlens,
              static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t), stream,
              "cudaMemcpyAsync(cu_seqlens)");
  return reinterpret_cast<const std::int32_t*>(dst);
}

// The keys' offsets on the device (a softmax-family problem): nullptr for dense keys, `queries`
// (the device copy of cu_seqlens) where they are the same offsets, else a copy in dst, which
// key_offsets_bytes (plan/attention.hpp) sized.
template <class Problem>
const std::int32_t* upload_key_offsets(unsigned char* dst, const Problem& p,
                                       const std::int32_t* queries, cudaStream_t stream) {
  if (p.cu_seqlens_k == nullptr) return nullptr;
  if (p.cu_seqlens_k == p.cu_seqlens) return queries;
  upload_host(dst, p.cu_seqlens_k,
              static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t), stream,
              "cudaMemcpyAsync(cu_seqlens_k)");
  return reinterpret_cast<const std::int32_t*>(dst);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
