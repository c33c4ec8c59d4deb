#pragma once
// Warp-level tensor-core and copy primitives (sm_80+): mma.sync m16n8k16 and m16n8k8 (tf32),
// ldmatrix, cp.async, L2 prefetch, global reductions.
// Fragment layouts follow the PTX ISA ("Matrix fragments for mma.m16n8k16"); with g = lane / 4
// and c = 2 * (lane % 4):
//   A 16x16: a0 = (g, c..c+1), a1 = (g+8, c..), a2 = (g, c+8..), a3 = (g+8, c+8..)
//   B 16x8:  b0 = (k = c..c+1, n = g), b1 = (k = c+8.., n = g)
//   C 16x8:  c0,c1 = (g, c..c+1), c2,c3 = (g+8, c..c+1)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attnmix {
namespace detail {
namespace cuda {

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy to a shared-memory address (smem_address); bytes beyond `valid`
// (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async_16(std::uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(smem_address(smem), gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Asks L2 for the 128-byte line that holds p, a global address (a hint: no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// 2^x on the special-function unit; the kernels' inputs are <= 0 or -inf, so flushing denormal
// results to zero loses nothing that matters.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// e^x the same way: __expf's ex2 does not flush, which costs a compare, two predicated
// multiplies and a select an element; the results differ only below 1e-38.
__device__ __forceinline__ float fast_exp(float x) {
  return fast_exp2(x * 1.4426950408889634f);
}

// Element offset of 16-byte chunk `c` of row `r` in a row-major tile of Cols elements. Chunks
// are XOR-swizzled by the row so that ldmatrix reads of 8 consecutive rows hit distinct banks.
template <int Cols>
__device__ __forceinline__ int swizzle(int r, int c) {
  return r * Cols + ((c ^ (r & 7)) * 8);
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  ldmatrix_x4_trans(r, smem_address(smem));
}

// *p += (x, y) in global memory, fire and forget (two floats, 8-byte aligned p). Reductions a
// thread issues to one address are applied in its program order, so a sum that only one thread
// of the grid adds to gets the bits of load, add, store -- without waiting for the load.
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(y) : "memory");
#endif
}

__device__ __forceinline__ void red_add(double* p, double x) {
  asm volatile("red.global.add.f64 [%0], %1;\n" ::"l"(p), "d"(x) : "memory");
}
__device__ __forceinline__ void red_add(float* p, float x) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
}

// A flag in global memory read with acquire and written with release semantics (GPU scope):
// what a thread wrote before the release (and fenced, for the other threads of its CTA) is seen
// by a thread that reads the released value.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// d += a * b with 16-bit inputs (T = __half or __nv_bfloat16) and float accumulators.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Two floats packed as one 32-bit pair of T (low half first).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

// The inverse of pack2 (bfloat16 by shifts: the conversion intrinsic costs two more operations).
template <class T>
__device__ __forceinline__ float2 unpack2(std::uint32_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// x = big + small for three-pass tf32 products: big is x cut to tf32's 10-bit mantissa, and
// small, exact in float, is cut the same way by the tensor core (about 21 bits kept in all).
// Truncation is one logic operation where cvt.rna.tf32.f32 is a sequence on sm_90.
__device__ __forceinline__ void split_tf32(float x, std::uint32_t& big, std::uint32_t& small) {
  big = __float_as_uint(x) & 0xffffe000u;
  small = __float_as_uint(x - __uint_as_float(big));
}

// d += a * b, tf32 inputs, m16n8k8. With g = lane / 4 and t = lane % 4:
//   A 16x8: a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
//   B 8x8:  b0 = (k = t, n = g), b1 = (k = t+4, n = g);  C as for m16n8k16.
__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const std::uint32_t (&a)[4],
                                              const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
