#pragma once
// Scratch arithmetic every plan shares: each part of a call's scratch starts 256-byte aligned
// (the kernels read it with 16-byte vectors and the allocator hands out 256-byte aligned blocks).

#include <cstddef>
#include <cstdint>

#include "attnmix/config.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr std::size_t scratch_alignment = 256;

constexpr std::size_t padded_bytes(std::size_t n) {
  return (n + scratch_alignment - 1) / scratch_alignment * scratch_alignment;
}

// The device copy of cu_seqlens for `sequences` sequences, padded.
constexpr std::size_t cu_seqlens_scratch_bytes(index_t sequences) {
  return padded_bytes(static_cast<std::size_t>(sequences + 1) * sizeof(std::int32_t));
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
