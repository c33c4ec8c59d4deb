#pragma once
// Memory spaces. A view records the space its pointer lives in (the enum); a backend tag names the
// space its kernels read (a type, Kokkos' idiom), so that storage and checks follow the backend.

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
struct device_space {
  static constexpr memory_space value = memory_space::device;
  static constexpr const char* name = "device";
};

}  // namespace attnmix
