#pragma once
// Shared-memory barriers (mbarrier; sm_90 for the parity wait): a producer and its consumers hand
// buffers back and forth without stopping the whole CTA. A barrier completes a phase when `count`
// threads have arrived; waiters name the phase by its parity (0, 1, 0, ...).

#include <cstdint>

#include "attnmix/cuda/arch/mma.cuh"

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

// The work queue of the persistent kernels. A CTA takes item blockIdx.x first, then items of a
// device-wide counter (zeroed before the launch). Thread 0 of the producer warpgroup draws one
// item ahead, so that the atomic's round trip to L2 overlaps the current item instead of
// stalling the producer between items; the warpgroup reads the drawn item after named barrier 1.
// Two slots, so that a slow reader of one draw never sees the next.
struct work_queue {
  int* counter;
  int* slots;  // two ints of shared memory
  int thread;  // in the producer warpgroup
  int draws = 0;
  int drawn = 0;  // thread 0: the item after the current one

  __device__ work_queue(int* counter_, int* slots_, int thread_)
      : counter(counter_), slots(slots_), thread(thread_) {
    draw();
  }
  __device__ void draw() {
    if (thread == 0) drawn = atomicAdd(counter, 1) + static_cast<int>(gridDim.x);
  }
  // The item after the current one, for the whole warpgroup.
  __device__ int next() {
    int* slot = slots + draws++ % 2;
    if (thread == 0) *slot = drawn;
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    const int n = *slot;
    draw();
    return n;
  }
};

// Hands work item n (-1: no more) to the consumers: they wait on `full` (counted for the whole
// producer warpgroup, two arrivals a thread), then read *slot; the arrival on copies completes
// once this thread's cp.async copies for the item have landed.
__device__ __forceinline__ void publish_work_item(int* slot, int n, std::uint64_t* full,
                                                  int thread) {
  if (thread == 0) *slot = n;
  mbarrier_arrive(full);
  mbarrier_arrive_on_copies(full);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
