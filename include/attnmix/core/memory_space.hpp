#pragma once
// Memory spaces. A view records the space its pointer lives in (the enum); a backend tag names the
// space its kernels read (a type, Kokkos' idiom), so that storage and checks follow the backend.

#include <cstddef>
#include <limits>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace attnmix {

enum class memory_space { host, device };

inline const char* to_string(memory_space s) {
  return s == memory_space::host ? "host" : "device";
}

// Memory-space types: what backend tags name as `memory_space` and owned storage is typed by.
struct host_space {
  static constexpr memory_space value = memory_space::host;
  static constexpr const char* name = "host";
};
// Bytes of physical memory of this machine (the largest value of std::size_t where the platform
// does not say): host storage larger than this is rejected before it is allocated, as a bad size
// rather than an allocation failure (which sanitizers and overcommitting kernels turn into aborts
// or later crashes).
inline std::size_t host_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 &&
      static_cast<std::size_t>(pages) <= std::numeric_limits<std::size_t>::max() / page)
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
#endif
  return std::numeric_limits<std::size_t>::max();
}

struct device_space {
  static constexpr memory_space value = memory_space::device;
  static constexpr const char* name = "device";
};

// Bytes a memory space holds (space_bytes<Space>::get()): owned storage larger than this is a bad
// size, rejected before it is allocated. The CUDA backend specialises it for device_space (the
// device's total memory, cuda/runtime/memory.cuh).
template <class Space>
struct space_bytes;
template <>
struct space_bytes<host_space> {
  static std::size_t get() { return host_memory_bytes(); }
};

}  // namespace attnmix
