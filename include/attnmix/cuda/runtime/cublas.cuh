#pragma once
// The layers' dense projections on the GPU: cuBLAS GEMMs in row-major terms. Internal.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "attnmix/core/error.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

inline void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw cuda_error(concat("attnmix: ", what, ": cuBLAS status ", int(status)));
}

// An owned cuBLAS handle (creating one costs milliseconds: make it once, reuse it).
class blas_handle {
 public:
  blas_handle() { check(cublasCreate(&h_), "cublasCreate"); }
  ~blas_handle() {
    if (h_ != nullptr) (void)cublasDestroy(h_);
  }
  blas_handle(const blas_handle&) = delete;
  blas_handle& operator=(const blas_handle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

template <class T>
constexpr cudaDataType_t blas_type() {
  if constexpr (std::is_same_v<T, float>)
    return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, attnmix::half>)
    return CUDA_R_16F;
  else {
    static_assert(std::is_same_v<T, attnmix::bfloat16>,
                  "attnmix: cuBLAS projections take float/half/bf16");
    return CUDA_R_16BF;
  }
}

// y[r, :] = x[r, :] W^T for r < rows (nn.Linear without its bias): W [out, in] row-major, x
// [rows, in] with row stride ldx, y [rows, out] with row stride ldy; float accumulation.
// Row-major Y = X W^T is column-major Y^T = W X^T, i.e. GEMM(op(W) = T, op(X) = N).
// Y may be float while X and W are 16-bit (the gate logits the kernels read in float).
template <class X, class Y>
void gemm_rows(cublasHandle_t h, cudaStream_t stream, const X* x, index_t ldx, index_t rows,
               const X* W, index_t in, index_t out, Y* y, index_t ldy) {
  if (rows == 0 || out == 0) return;
  check(cublasSetStream(h, stream), "cublasSetStream");
  const float alpha = 1.f, beta = 0.f;
  check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(rows), int(in), &alpha, W,
                     blas_type<X>(), int(in), x, blas_type<X>(), int(ldx), &beta, y, blas_type<Y>(),
                     int(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
}

// The backward of gemm_rows. dx[r, :] = dy[r, :] W (+ dx with accumulate): dy [rows, out]
// (row stride lddy), W [out, in], dx [rows, in] (row stride lddx). Row-major DX = DY W is
// column-major DX^T = W^T DY^T: GEMM(op(W) = N, op(DY) = N), m = in, n = rows, k = out.
template <class Y, class W, class X>
void gemm_rows_dx(cublasHandle_t h, cudaStream_t stream, const Y* dy, index_t lddy, index_t rows,
                  const W* w, index_t in, index_t out, X* dx, index_t lddx, bool accumulate) {
  if (rows == 0 || in == 0) return;
  check(cublasSetStream(h, stream), "cublasSetStream");
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(in), int(rows), int(out), &alpha, w,
                     blas_type<W>(), int(in), dy, blas_type<Y>(), int(lddy), &beta, dx,
                     blas_type<X>(), int(lddx), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx(dx)");
}

// dW += dy^T x: x [rows, in] (row stride ldx), dy [rows, out] (row stride lddy), dW [out, in]
// row-major in float. Column-major dW^T = X^T DY: GEMM(op(X^T) = N, op(DY^T) = T), m = in,
// n = out, k = rows, beta = 1. (cuBLAS's GEMM is deterministic for one configuration.)
template <class X, class Y>
void gemm_rows_dw(cublasHandle_t h, cudaStream_t stream, const X* x, index_t ldx, index_t rows,
                  const Y* dy, index_t lddy, index_t in, index_t out, float* dw) {
  if (rows == 0 || in == 0 || out == 0) return;
  check(cublasSetStream(h, stream), "cublasSetStream");
  const float alpha = 1.f, beta = 1.f;
  check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, int(in), int(out), int(rows), &alpha, x,
                     blas_type<X>(), int(ldx), dy, blas_type<Y>(), int(lddy), &beta, dw, CUDA_R_32F,
                     int(in), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx(dW)");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
