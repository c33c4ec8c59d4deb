#pragma once
// A launch's grid and block as plain numbers (dim3 without the CUDA header).

namespace attnmix {
namespace detail {
namespace cuda {

struct launch_grid {
  unsigned x = 1, y = 1, z = 1;
};

inline bool operator==(const launch_grid& a, const launch_grid& b) {
  return a.x == b.x && a.y == b.y && a.z == b.z;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
