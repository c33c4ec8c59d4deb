#pragma once
// Hopper warpgroup tensor-core primitives (sm_90a): wgmma.mma_async with float accumulators, its
// fences, and shared-memory matrix descriptors for 128-byte-swizzled tiles (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate").
//
// Tiles are stored in "atoms" of R rows x 64 16-bit elements (128-byte rows); 16-byte chunk c of
// row r sits at chunk (c ^ (r % 8)) of its row, the pattern the hardware's 128-byte swizzle
// expects of a 1024-byte aligned atom. A tile wider than 64 elements is several atoms one after
// the other. The accumulator of a 64 x N tile is the mma.sync m16n8 layout repeated: warp w of the
// warpgroup holds rows 16 w .. 16 w + 15, and with g = lane / 4, c = 2 (lane % 4),
// d[4 j + 2 h + e] = (row g + 8 h, column 8 j + c + e). The register A operand of m64k16 is the
// mma.sync m16k16 A fragment of the warp's 16 rows.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "attnmix/config.hpp"
#include "attnmix/cuda/arch/mma.cuh"

// wgmma exists only in sm_90a code; elsewhere the wrappers trap, and the launcher never picks the
// kernels that use them.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNMIX_WGMMA 1
#else
#define ATTNMIX_WGMMA 0
#endif

namespace attnmix {
namespace detail {
namespace cuda {

// Element offset of 16-byte chunk c of row r in a tile of Rows rows stored as 64-column atoms.
template <int Rows>
struct sw128_layout {
  __device__ __forceinline__ static int offset(int r, int c) {
    return (c / 8) * Rows * 64 + r * 64 + ((c % 8) ^ (r % 8)) * 8;
  }
};

// Copies rows [0, Rows) of a row-major tile into a 64-column-atom tile with the 128 threads of
// a warpgroup (cp.async, 16 bytes each); rows >= valid are zero-filled from `safe`. A thread
// keeps one 16-byte column c and steps down the rows 128 / chunks at a time, so that its
// swizzled position within a row never changes (the step is a multiple of 8 rows): a copy costs a
// few instructions, which matters to a producer that issues thousands of them.
template <int Rows, int Cols, class T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, index_t stride, index_t valid,
                                          const T* safe, int thread) {
  constexpr int chunks = Cols / 8, step = 128 / chunks;
  static_assert(Rows * chunks % 128 == 0 && step % 8 == 0, "whole passes of the warpgroup");
  const int r0 = thread / chunks, c = thread % chunks;
  T* dst = smem + sw128_layout<Rows>::offset(r0, c);
  const T* src = gmem + r0 * stride + c * 8;
#pragma unroll
  for (int i = 0; i < Rows / step; ++i) {
    const bool ok = r0 + i * step < valid;
    cp_async_16(dst + i * step * 64, ok ? src + i * step * stride : safe, ok);
  }
}

// Descriptor of a 128-byte-swizzled operand at `p` (its atom 1024-byte aligned, or p an offset
// into one along a row). lbo / sbo: bytes between atoms along the leading dimension and between
// groups of 8 rows.
__device__ __forceinline__ std::uint64_t wgmma_desc(const void* p, std::uint32_t lbo,
                                                    std::uint32_t sbo) {
  return static_cast<std::uint64_t>((smem_address(p) & 0x3FFFF) >> 4) |
         static_cast<std::uint64_t>(lbo >> 4) << 16 | static_cast<std::uint64_t>(sbo >> 4) << 32 |
         std::uint64_t{1} << 62;
}

// The descriptor `units` 16-byte units further along its start address. The address field fills
// the low 14 bits and never carries out (shared memory is under 256 KB), so a 32-bit add on the
// low word does: a 64-bit add costs three uniform instructions a product, where they queue
// before each wgmma.
__device__ __forceinline__ std::uint64_t wgmma_desc_add(std::uint64_t desc, std::uint32_t units) {
  std::uint32_t lo, hi;
  asm("mov.b64 {%0, %1}, %2;\n" : "=r"(lo), "=r"(hi) : "l"(desc));
  lo += units;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(desc) : "r"(lo), "r"(hi));
  return desc;
}

__device__ __forceinline__ void wgmma_unsupported() {
  asm volatile("trap;");
}

// Orders this thread's register writes before the warpgroup's next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() {
#if ATTNMIX_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if ATTNMIX_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
#if ATTNMIX_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}
// Shared memory written through the generic proxy (stores, cp.async) becomes visible to the
// tensor cores' async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#if ATTNMIX_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// The same between global memory written by the async proxy (bulk copies) and the generic
// proxy's loads, stores and flags.
__device__ __forceinline__ void fence_proxy_async_global() {
#if ATTNMIX_WGMMA
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// dst[i] += src[i] for the `bytes` / 4 floats at src (shared memory) by the bulk-copy engine, one
// instruction a thread issues (16-byte aligned, bytes a multiple of 16); then the group commit,
// and the wait until at most Pending groups of this thread are incomplete (their writes done).
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
#if ATTNMIX_WGMMA
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(smem_address(src)), "r"(bytes)
      : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if ATTNMIX_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <int Pending>
__device__ __forceinline__ void bulk_wait() {
#if ATTNMIX_WGMMA
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

// The register file of an sm_90 multiprocessor. setmaxnreg takes its counts as immediates, so
// the split below is fixed when the kernel is compiled: this is a fact of the architecture the
// sm90_ kernels are built for (device_properties::registers_per_sm reports the same number at run
// time), not a runtime property.
constexpr int sm90_registers_per_sm = 65536;

// The registers a consumer warpgroup may claim when `producers` warpgroups keep `kept` each: what
// the launch gave the CTA's `threads` (sm90_registers_per_sm / threads, rounded down to 8) less
// the producers' share, split among the consumers. setmaxnreg.inc waits until the registers are
// free, so the total must not exceed the launch's allocation.
constexpr int claimable_registers(int threads, int consumers, int kept, int producers = 1) {
  return (sm90_registers_per_sm / threads / 8 * 8 * threads - 128 * producers * kept) /
         (128 * consumers) / 8 * 8;
}

// Moves registers between the warpgroups of a CTA (sm_90a): a producer gives its surplus back,
// the consumers take it. Counts are multiples of 8 in [24, 256].
template <int Count>
__device__ __forceinline__ void release_registers() {
#if ATTNMIX_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Count));
#endif
}
template <int Count>
__device__ __forceinline__ void claim_registers() {
#if ATTNMIX_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Count));
#endif
}

// wgmma reads and writes registers asynchronously, which the compiler cannot see: after a wait,
// this marks `r` as rewritten there, so that no read of an accumulator moves above the wait and
// no register of an operand in flight is reused before it.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(std::uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// The register A operand of a product taken from a 64-row accumulator: fragment kc holds
// columns 16 kc .. 16 kc + 15 of d, in U (the layouts match, so no data moves).
template <class U, int N>
__device__ __forceinline__ void to_fragments(std::uint32_t (&a)[N / 8][4], const float (&d)[N]) {
#pragma unroll
  for (int kc = 0; kc < N / 8; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kc][r] = pack2<U>(d[8 * kc + 2 * r], d[8 * kc + 2 * r + 1]);
}

#define ATTNMIX_D8(i)                                                                         \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define ATTNMIX_D32 ATTNMIX_D8(0), ATTNMIX_D8(8), ATTNMIX_D8(16), ATTNMIX_D8(24)
#define ATTNMIX_D64 ATTNMIX_D32, ATTNMIX_D8(32), ATTNMIX_D8(40), ATTNMIX_D8(48), ATTNMIX_D8(56)
#define ATTNMIX_R32                                                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ATTNMIX_R64                                                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"

// wgmma with both operands in shared memory; `accumulate` = 0 overwrites d. Operands %R.. follow
// the R accumulators.
#define ATTNMIX_WGMMA_SS(shape, type, regs, a, b, acc, ta, tb)                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" acc ", 0;\nwgmma.mma_async.sync.aligned." shape \
  ".f32." type "." type " {" regs "}, %" a ", %" b ", p, 1, 1, %" ta ", %" tb ";\n}\n"
// wgmma with A in registers.
#define ATTNMIX_WGMMA_RS(shape, type, regs, a0, a1, a2, a3, b, tb, one)                            \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" one ", 0;\nwgmma.mma_async.sync.aligned." shape             \
  ".f32." type "." type " {" regs "}, {%" a0 ", %" a1 ", %" a2 ", %" a3 "}, %" b ", p, 1, 1, %" tb \
  ";\n}\n"

// d (+)= A B for a 64 x N tile (N = 64 or 128: d has N / 2 floats), K = 16; A and B are
// descriptors. TransB = 1 reads B stored with N contiguous (MN-major), 0 with K contiguous;
// TransA = 1 reads A stored with M contiguous.
template <class T, int TransB, int TransA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], std::uint64_t a, std::uint64_t b,
                                         int accumulate) {
#if ATTNMIX_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(ATTNMIX_WGMMA_SS("m64n64k16", "bf16", ATTNMIX_R32, "32", "33", "34", "36", "35")
                 : ATTNMIX_D32
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransB), "n"(TransA));
  else
    asm volatile(ATTNMIX_WGMMA_SS("m64n64k16", "f16", ATTNMIX_R32, "32", "33", "34", "36", "35")
                 : ATTNMIX_D32
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransB), "n"(TransA));
#else
  wgmma_unsupported();
#endif
}
template <class T, int TransB, int TransA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], std::uint64_t a, std::uint64_t b,
                                         int accumulate) {
#if ATTNMIX_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(ATTNMIX_WGMMA_SS("m64n128k16", "bf16", ATTNMIX_R64, "64", "65", "66", "68", "67")
                 : ATTNMIX_D64
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransB), "n"(TransA));
  else
    asm volatile(ATTNMIX_WGMMA_SS("m64n128k16", "f16", ATTNMIX_R64, "64", "65", "66", "68", "67")
                 : ATTNMIX_D64
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransB), "n"(TransA));
#else
  wgmma_unsupported();
#endif
}

// d (+)= A B for a 64 x N tile, K = 16, with A the register fragment `a`.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const std::uint32_t (&a)[4],
                                         std::uint64_t b, int accumulate = 1) {
#if ATTNMIX_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        ATTNMIX_WGMMA_RS("m64n64k16", "bf16", ATTNMIX_R32, "32", "33", "34", "35", "36", "37", "38")
        : ATTNMIX_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB), "r"(accumulate));
  else
    asm volatile(
        ATTNMIX_WGMMA_RS("m64n64k16", "f16", ATTNMIX_R32, "32", "33", "34", "35", "36", "37", "38")
        : ATTNMIX_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB), "r"(accumulate));
#else
  wgmma_unsupported();
#endif
}
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const std::uint32_t (&a)[4],
                                         std::uint64_t b, int accumulate = 1) {
#if ATTNMIX_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(ATTNMIX_WGMMA_RS("m64n128k16", "bf16", ATTNMIX_R64, "64", "65", "66", "67", "68",
                                  "69", "70")
                 : ATTNMIX_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB),
                   "r"(accumulate));
  else
    asm volatile(
        ATTNMIX_WGMMA_RS("m64n128k16", "f16", ATTNMIX_R64, "64", "65", "66", "67", "68", "69", "70")
        : ATTNMIX_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB), "r"(accumulate));
#else
  wgmma_unsupported();
#endif
}

#undef ATTNMIX_WGMMA_RS
#undef ATTNMIX_WGMMA_SS
#undef ATTNMIX_R64
#undef ATTNMIX_R32
#undef ATTNMIX_D64
#undef ATTNMIX_D32
#undef ATTNMIX_D8

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
