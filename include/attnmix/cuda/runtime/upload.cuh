#pragma once
// The sequence offsets of a packed batch on the device: how long the longest sequence is, how
// many scratch bytes the copy of cu_seqlens takes, and the stream-ordered copy itself.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attnmix/config.hpp"
#include "attnmix/cuda/plan/scratch.hpp"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

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
  check(cudaMemcpyAsync(dst, p.cu_seqlens,
                        static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t),
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(cu_seqlens)");
  return reinterpret_cast<const std::int32_t*>(dst);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
