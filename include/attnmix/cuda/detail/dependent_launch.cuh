#pragma once
// Programmatic dependent launch (compute capability 9.0 and later): a kernel started with
// launch_dependent() may begin on the SMs that the kernel before it in the stream frees, before
// that kernel has ended. It does the work that does not depend on that kernel (loading its own
// inputs), then grid_dependency_wait() waits until the kernel before has completed and its writes
// are visible. The kernel before calls allow_dependents() once it no longer needs the GPU to
// itself; without the call the dependent may start only as its last CTAs exit. On older devices,
// and for a kernel launched the usual way, the three are the plain stream order.

#include <cuda_runtime.h>

#include <utility>

#include "attnmix/cuda/runtime.cuh"

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

// kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap the kernel before it.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                      cudaStream_t stream, const char* what, Args&&... args) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = std::size_t(smem);
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = current_device().dependent_launch ? 1 : 0;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
