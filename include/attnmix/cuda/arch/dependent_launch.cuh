#pragma once
// The device side of programmatic dependent launch (sm_90; plain stream order before): a kernel
// launched with launch_dependent() (launch/launch_attributes.cuh) calls grid_dependency_wait()
// before it reads what the kernel before it wrote; that kernel calls allow_dependents() once it
// no longer needs the GPU to itself.

namespace attnmix {
namespace detail {
namespace cuda {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
