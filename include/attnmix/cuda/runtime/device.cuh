#pragma once
// The one query of a device's properties (cached per device), attnmix's scratch pool on it, and
// kernel attributes raised once per kernel and device.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// What the launchers need to know of a device, looked up once per device: its properties (what
// the plans read) and attnmix's scratch pool on it.
struct device_info {
  device_properties props;
  // The stream-ordered pool attnmix takes its scratch from. It keeps what it has once held (no
  // release threshold), so that a call's scratch costs no mapping of fresh memory after the
  // first calls; the default pool would hand memory back at every synchronisation.
  cudaMemPool_t scratch_pool = nullptr;
};

// The device's properties as the plans read them (every hardware number the library uses comes
// from here).
inline device_properties query_device_properties(int device) {
  device_properties p;
  auto attribute = [device](cudaDeviceAttr a) {
    int v = 0;
    check(cudaDeviceGetAttribute(&v, a, device), "cudaDeviceGetAttribute");
    return v;
  };
  p.sms = attribute(cudaDevAttrMultiProcessorCount);
  p.cc_major = attribute(cudaDevAttrComputeCapabilityMajor);
  p.cc_minor = attribute(cudaDevAttrComputeCapabilityMinor);
  p.smem_per_block = std::size_t(attribute(cudaDevAttrMaxSharedMemoryPerBlock));
  p.smem_per_block_optin = std::size_t(attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
  p.smem_per_sm = std::size_t(attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor));
  p.registers_per_sm = attribute(cudaDevAttrMaxRegistersPerMultiprocessor);
  p.max_grid_y = attribute(cudaDevAttrMaxGridDimY);
  p.max_grid_z = attribute(cudaDevAttrMaxGridDimZ);
  return p;
}

inline const device_info& current_device() {
  static std::mutex mutex;
  static std::map<int, device_info> known;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it != known.end()) return it->second;  // map nodes do not move: the reference stays valid
  device_info info;
  info.props = query_device_properties(device);
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  check(cudaMemPoolCreate(&info.scratch_pool, &props), "cudaMemPoolCreate");
  std::uint64_t keep = UINT64_MAX;
  check(cudaMemPoolSetAttribute(info.scratch_pool, cudaMemPoolAttrReleaseThreshold, &keep),
        "cudaMemPoolSetAttribute");
  return known.emplace(device, info).first->second;
}

// The current device's properties (cached).
inline const device_properties& current_properties() {
  return current_device().props;
}

// Raises `attribute` of `kernel` on the current device to `value` unless a call here already has:
// launchers call this on every launch, the driver sees it once per kernel and device.
template <class Kernel>
void raise_kernel_attribute(Kernel kernel, cudaFuncAttribute attribute, int value) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> set;  // (kernel, device, attribute)
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  int& current = set[{reinterpret_cast<const void*>(kernel), device, static_cast<int>(attribute)}];
  if (current >= value) return;
  check(cudaFuncSetAttribute(kernel, attribute, value), "cudaFuncSetAttribute");
  current = value;
}

// Lets `kernel` take `bytes` of dynamic shared memory.
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, int bytes) {
  raise_kernel_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Gives `kernel` all of the SM's shared memory (the L1 cache keeps the rest), for kernels whose
// occupancy shared memory bounds.
template <class Kernel>
void prefer_shared_memory(Kernel kernel) {
  raise_kernel_attribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
