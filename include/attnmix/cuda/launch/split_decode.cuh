#pragma once
// Host side of the split decoding kernels (kernels/split_decode.cuh): where a step's partial
// states go and what its merge writes.

#include <cstddef>

#include "attnmix/attention/args.hpp"
#include "attnmix/cuda/kernels/split_decode.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// The partial states of a step of `splits` blocks a row in `work` (the maxima and sums at 0, the
// outputs at ml_bytes), merged into a.out ([N, 1, HQ, Dv]) and, if given, a.lse ([N, 1, HQ]).
template <class T>
split_decode_parts split_parts(const attention_args<T>& a, int splits, unsigned char* work,
                               std::size_t ml_bytes) {
  split_decode_parts p{};
  p.ml = reinterpret_cast<float*>(work);
  p.o = reinterpret_cast<float*>(work + ml_bytes);
  p.splits = splits;
  p.q_heads = static_cast<int>(a.out.extent(2));
  p.value_dim = static_cast<int>(a.out.extent(3));
  p.out = a.out.data();
  p.out_s[0] = a.out.stride(0), p.out_s[1] = a.out.stride(2);
  p.lse = a.lse.has_value() ? a.lse.data() : nullptr;
  if (a.lse.has_value()) p.lse_s[0] = a.lse.stride(0), p.lse_s[1] = a.lse.stride(2);
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
