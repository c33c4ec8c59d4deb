#pragma once
// CUDA runtime plumbing shared by the CUDA backend: error checks, memory-space checks and owned
// device memory.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tensor_view.hpp"

namespace attnmix {

// A CUDA runtime failure (as opposed to a rejected argument, which is attnmix::error).
class cuda_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
namespace cuda {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw cuda_error(concat("attnmix: ", what, ": ", cudaGetErrorString(status)));
}

// True for memory the device can address: cudaMalloc'd or managed.
inline bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state of this query
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// What the launchers need to know of a device, looked up once per device.
struct device_info {
  int sms = 0;          // multiprocessors
  bool hopper = false;  // compute capability 9.x, where the sm_90a kernels run. They need sm_90a
                        // code in the binary (CMAKE_CUDA_ARCHITECTURES 90a-real, the default);
                        // plain sm_90 code traps in them.
  bool dependent_launch = false;  // 9.0 and later: kernels may overlap the one before them
  bool clusters = false;          // 9.0 and later: thread-block clusters
  // The stream-ordered pool attnmix takes its scratch from. It keeps what it has once held (no
  // release threshold), so that a call's scratch costs no mapping of fresh memory after the
  // first calls; the default pool would hand memory back at every synchronisation.
  cudaMemPool_t scratch_pool = nullptr;
};

inline const device_info& current_device() {
  static std::mutex mutex;
  static std::map<int, device_info> known;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it != known.end()) return it->second;  // map nodes do not move: the reference stays valid
  device_info info;
  int major = 0;
  check(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute");
  info.hopper = major == 9;
  info.dependent_launch = major >= 9;
  info.clusters = major >= 9;
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

// Device memory from cudaMalloc, freed when the owner goes; movable, not copyable.
class device_memory {
 public:
  device_memory() = default;
  // Throws cuda_error (naming `what`) when the allocation fails.
  device_memory(std::size_t bytes, const char* what) {
    void* p = nullptr;
    if (bytes > 0) check(cudaMalloc(&p, bytes), what);
    ptr_.reset(p);
  }
  void* get() const { return ptr_.get(); }

 private:
  struct free_device {
    void operator()(void* p) const { (void)cudaFree(p); }
  };
  std::unique_ptr<void, free_device> ptr_;
};

// A view that claims device memory must really point to it: a host pointer handed to a
// kernel is an illegal address, not an error message.
template <class T, int R>
void check_device_pointer(const std::string& fn, const char* arg, const tensor_view<T, R>& v) {
  if (!v.has_value() || v.size() == 0) return;
  require(is_device_pointer(v.data()), fn, arg,
          "is marked as device memory but its pointer is not device memory");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
