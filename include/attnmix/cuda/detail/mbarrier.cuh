#pragma once
// Shared-memory barriers (mbarrier; sm_90 for the parity wait): a producer and its consumers hand
// buffers back and forth without stopping the whole CTA. A barrier completes a phase when `count`
// threads have arrived; waiters name the phase by its parity (0, 1, 0, ...).

#include <cstdint>

#include "attnmix/cuda/detail/mma.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// One thread initialises; a __syncthreads must follow before any use.
__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count)
               : "memory");
}

// Arrives with release semantics: this thread's earlier shared-memory writes are visible to the
// threads that see the phase complete.
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                   smem_address(bar))
               : "memory");
}

// Arrives once this thread's earlier cp.async copies have landed (the arrival is not counted
// up front: `count` includes it).
__device__ __forceinline__ void mbarrier_arrive_on_copies(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar))
               : "memory");
}

// Blocks until the phase of the given parity has completed (acquire semantics). sm_90 and later
// (only the Hopper kernels wait on mbarriers).
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)bar, (void)parity;
  asm volatile("trap;");
#else
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
#endif
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
