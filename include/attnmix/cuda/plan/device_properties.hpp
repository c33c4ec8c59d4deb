#pragma once
// What the plans know of a device: the numbers cudaGetDeviceProperties reports, as plain fields.
// Filled once per device by runtime/device.cuh (query_device_properties); tests fill it by hand
// for devices this machine does not have. Pure C++: no CUDA header.

#include <cstddef>

namespace attnmix {
namespace detail {
namespace cuda {

struct device_properties {
  int sms = 0;                           // multiprocessors
  int cc_major = 0, cc_minor = 0;        // compute capability
  std::size_t smem_per_block = 0;        // default dynamic shared-memory limit of a block
  std::size_t smem_per_block_optin = 0;  // what a kernel may opt in to (cudaFuncSetAttribute)
  std::size_t smem_per_sm = 0;           // shared memory of one multiprocessor
  int registers_per_sm = 0;              // 32-bit registers of one multiprocessor
  int max_grid_y = 0, max_grid_z = 0;    // grid extents along y and z

  // Compute capability 9.x, where the sm_90a kernels run. They need sm_90a code in the binary
  // (CMAKE_CUDA_ARCHITECTURES 90a-real, the default); plain sm_90 code traps in them.
  bool hopper() const { return cc_major == 9; }
  // 9.0 and later: kernels may overlap the one before them (programmatic dependent launch).
  bool dependent_launch() const { return cc_major >= 9; }
  // 9.0 and later: thread-block clusters.
  bool clusters() const { return cc_major >= 9; }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
