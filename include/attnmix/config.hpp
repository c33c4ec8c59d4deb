#pragma once
// Compiler and host/device macros shared by every attnmix header.

#define ATTNMIX_VERSION_MAJOR 0
#define ATTNMIX_VERSION_MINOR 1
#define ATTNMIX_VERSION_PATCH 0

#if defined(__CUDACC__)
#define ATTNMIX_HOST_DEVICE __host__ __device__
#define ATTNMIX_DEVICE __device__
#else
#define ATTNMIX_HOST_DEVICE
#define ATTNMIX_DEVICE
#endif

#if defined(__CUDACC__) || defined(__clang__) || defined(__GNUC__)
#define ATTNMIX_RESTRICT __restrict__
#else
#define ATTNMIX_RESTRICT
#endif

#include <cstdint>

namespace attnmix {
// Every extent, stride and offset is 64-bit: packed batches overflow int32 offsets early.
using index_t = std::int64_t;
}  // namespace attnmix
