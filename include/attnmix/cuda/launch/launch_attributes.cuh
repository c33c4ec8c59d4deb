#pragma once
// Host launches with the attributes of compute capability 9.0 and later (the device side of the
// dependent launch is arch/dependent_launch.cuh).
//
// Programmatic dependent launch: a kernel started with launch_dependent() may begin on the SMs
// that the kernel before it in the stream frees, before that kernel has ended. It does the work
// that does not depend on that kernel (loading its own inputs), then grid_dependency_wait() waits
// until the kernel before has completed and its writes are visible. The kernel before calls
// allow_dependents() once it no longer needs the GPU to itself; without the call the dependent
// may start only as its last CTAs exit. On older devices, and for a kernel launched the usual
// way, the three are the plain stream order.
//
// Thread-block clusters: launch_clustered() runs the grid in clusters of CTAs that the hardware
// schedules together and that may read each other's shared memory (only on 9.0 and later; the
// caller checks device_properties::clusters).

#include <cuda_runtime.h>

#include <utility>

#include "attnmix/cuda/arch/dependent_launch.cuh"
#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// kernel<<<grid, block, smem, stream>>>(args...) with `count` launch attributes.
template <class... Params, class... Args>
void launch_with(cudaLaunchAttribute* attrs, unsigned count, void (*kernel)(Params...), dim3 grid,
                 dim3 block, int smem, cudaStream_t stream, const char* what, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = std::size_t(smem);
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap the kernel before it.
template <class Kernel, class... Args>
void launch_dependent(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream,
                      const char* what, Args&&... args) {
  cudaLaunchAttribute overlap;
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  launch_with(&overlap, current_properties().dependent_launch() ? 1 : 0, kernel, grid, block, smem,
              stream, what, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster` CTAs along x (grid.x a
// multiple of it).
template <class Kernel, class... Args>
void launch_clustered(Kernel kernel, dim3 grid, unsigned cluster, dim3 block, int smem,
                      cudaStream_t stream, const char* what, Args&&... args) {
  cudaLaunchAttribute shape;
  shape.id = cudaLaunchAttributeClusterDimension;
  shape.val.clusterDim.x = cluster;
  shape.val.clusterDim.y = 1;
  shape.val.clusterDim.z = 1;
  launch_with(&shape, 1, kernel, grid, block, smem, stream, what, std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
