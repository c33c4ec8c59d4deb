#pragma once
// Row-wise CUDA kernels of the layers' backward and of training (the device twins of the
// backward half of cpu/layer_ops.hpp); their launches are launch/rows_backward.cuh. Statistics
// in float (double for the loss, the optimiser and the gradient norm), whatever the storage
// type.
//
// Every sum over rows has a fixed order that depends on the sizes only, never on the timing of
// threads: no atomics. Sums over many rows go through fixed chunks of rows (row_chunk), each
// chunk's partial written to scratch by one thread, then the chunks summed in order by one
// thread per output. Block reductions are fixed shared-memory trees. Internal.

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attnmix/core/tensor_view.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/row_ops.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Rows per chunk of the two-stage sums over rows (weight gradients of norms and convolutions).
inline constexpr int row_chunk = 256;
// Threads of the block reductions (a power of two).
inline constexpr int reduce_threads = 256;

template <class T>
__device__ __forceinline__ double to_double(T x) {
  if constexpr (std::is_same_v<T, double>)
    return x;
  else
    return double(to_float(x));
}
template <class T>
__device__ __forceinline__ T from_double(double x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return static_cast<T>(x);
  else
    return from_float<T>(float(x));
}

// Fixed-tree sum of one value per thread of a block of reduce_threads threads; every thread
// gets the total. `sh` holds reduce_threads values.
template <class A>
__device__ A block_sum(A v, A* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = reduce_threads / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const A total = sh[0];
  __syncthreads();  // sh is free again
  return total;
}
__device__ inline float block_max(float v, float* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = reduce_threads / 2; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  const float m = sh[0];
  __syncthreads();
  return m;
}

// ---- slopes of the element-wise maps -------------------------------------------------------
// (dOp/da, dOp/db) at (a, b), for each forward functor of kernels/rows.cuh (the formulas of
// cpu/layer_ops.hpp's slope(), in float with the accurate expf/erff).
template <class Op>
struct slope_of;
template <>
struct slope_of<silu_times> {
  __device__ float2 operator()(float g, float u) const {
    const float s = 1.f / (1.f + expf(-g));
    return make_float2(u * s * (1.f + g * (1.f - s)), g * s);
  }
};
template <>
struct slope_of<times_sigmoid> {
  __device__ float2 operator()(float o, float g) const {
    const float s = 1.f / (1.f + expf(-g));
    return make_float2(s, o * s * (1.f - s));
  }
};
template <>
struct slope_of<gelu_of> {
  __device__ float2 operator()(float x, float) const {
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143267794f;  // 1/sqrt(2 pi)
    return make_float2(0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * pdf, 0.f);
  }
};
template <>
struct slope_of<relu_of> {
  __device__ float2 operator()(float x, float) const {
    return make_float2(x > 0.f ? 1.f : 0.f, 0.f);
  }
};
template <>
struct slope_of<log_sigmoid_of> {
  __device__ float2 operator()(float x, float) const {
    return make_float2(1.f / (1.f + expf(x)), 0.f);  // sigmoid(-x)
  }
};
template <>
struct slope_of<two_sigmoid_of> {
  __device__ float2 operator()(float x, float) const {
    const float s = 1.f / (1.f + expf(-x));
    return make_float2(2.f * s * (1.f - s), 0.f);
  }
};
template <>
struct slope_of<plus> {
  __device__ float2 operator()(float, float) const { return make_float2(1.f, 1.f); }
};

// da[i] = dy[i] dOp/da, db[i] = dy[i] dOp/db (written, or added with acc); da or db null:
// skipped; b null: Op sees 0. da or db may be dy (each element is read before it is written).
template <class Op, class Y, class X, class Z>
__global__ void map_backward_kernel(const Y* dy, const X* a, const Z* b, X* da, Z* db, index_t n,
                                    bool acc) {
  const slope_of<Op> slope{};
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const float g = to_float(dy[i]);
    const float2 s = slope(to_float(a[i]), b != nullptr ? to_float(b[i]) : 0.f);
    if (da != nullptr) {
      const float v = g * s.x;
      da[i] = from_float<X>(acc ? to_float(da[i]) + v : v);
    }
    if (db != nullptr) {
      const float v = g * s.y;
      db[i] = from_float<Z>(acc ? to_float(db[i]) + v : v);
    }
  }
}

// ---- bias gradient -------------------------------------------------------------------------
// dbias[o] += sum_r dy[r, o] for o < out: one thread per column, the rows in order.
template <class Y>
__global__ void bias_backward_kernel(const Y* dy, index_t ld, index_t rows, index_t out,
                                     float* dbias) {
  for (index_t o = blockIdx.x * index_t(blockDim.x) + threadIdx.x; o < out;
       o += index_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (index_t r = 0; r < rows; ++r) s += to_float(dy[r * ld + o]);
    dbias[o] += s;
  }
}

// ---- RMSNorm / L2 norm backward ------------------------------------------------------------
// With r = 1/sqrt(m + eps), m = mean(x^2) (RMSNorm) or sum(x^2) (L2), u = w dy:
//   dx = r u - x r^3 (u.x) / n (n = width, or 1 for L2),  dw += dy x r.
// Stage 1, one warp per group: stat[2g] = r, stat[2g+1] = r^3 (u.x) / n.
template <class X, class Y>
__global__ void norm_stats_kernel(const X* x, const Y* dy, index_t groups, int width,
                                  const float* w, bool per_group, int groups_per_row, bool mean,
                                  float eps, float* stat) {
  const index_t g = blockIdx.x * index_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= groups) return;  // whole warps leave together
  const X* xi = x + g * width;
  const Y* dyi = dy + g * width;
  const float* wi = w == nullptr ? nullptr : per_group ? w + (g % groups_per_row) * width : w;
  float ss = 0.f, ux = 0.f;
  for (int c = lane; c < width; c += 32) {
    const float v = to_float(xi[c]);
    ss += v * v;
    ux += to_float(dyi[c]) * (wi != nullptr ? wi[c] : 1.f) * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
    ux += __shfl_xor_sync(0xffffffffu, ux, o);
  }
  if (lane == 0) {
    const float n = mean ? float(width) : 1.f;
    const float r = rsqrtf(ss / n + eps);
    stat[2 * g] = r;
    stat[2 * g + 1] = r * r * r * ux / n;
  }
}

// Stage 2 (with a weight), chunk part: part[k, e] = sum over the rows of chunk k (in order) and
// the groups of a row that use weight element e (the one group h = e / width when per_group, else
// every group of the row in order) of dy x r. Grid: (columns of wn, chunks).
template <class X, class Y>
__global__ void norm_dw_part_kernel(const X* x, const Y* dy, index_t rows, int width, index_t wn,
                                    bool per_group, int groups_per_row, const float* stat,
                                    float* part) {
  const index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t k = blockIdx.y;
  if (e >= wn) return;
  const int c = int(e % width);
  const int h0 = per_group ? int(e / width) : 0, h1 = per_group ? h0 + 1 : groups_per_row;
  const index_t r0 = k * row_chunk, r1 = r0 + row_chunk < rows ? r0 + row_chunk : rows;
  float s = 0.f;
  for (index_t r = r0; r < r1; ++r)
    for (int h = h0; h < h1; ++h) {
      const index_t g = r * groups_per_row + h;
      s += to_float(dy[g * width + c]) * to_float(x[g * width + c]) * stat[2 * g];
    }
  part[k * wn + e] = s;
}

// dst[e] += sum_k part[k, e] over k < chunks, in order (one thread per e). (A template, so
// that the header defines no non-inline kernel.)
template <class A>
__global__ void sum_chunks_kernel(const A* part, index_t chunks, index_t n, A* dst) {
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < n;
       e += index_t(gridDim.x) * blockDim.x) {
    A s = 0;
    for (index_t k = 0; k < chunks; ++k) s += part[k * n + e];
    dst[e] += s;
  }
}

// Stage 3, element-wise: dx = r w dy - k x (written, or added). dx may be dy.
template <class X, class Y>
__global__ void norm_dx_kernel(const X* x, const Y* dy, Y* dx, index_t groups, int width,
                               const float* w, bool per_group, int groups_per_row,
                               const float* stat, bool acc) {
  const index_t n = groups * width;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t g = i / width;
    const int c = int(i % width);
    const float wc = w == nullptr ? 1.f : per_group ? w[(g % groups_per_row) * width + c] : w[c];
    const float d = stat[2 * g] * to_float(dy[i]) * wc - stat[2 * g + 1] * to_float(x[i]);
    dx[i] = from_float<Y>(acc ? to_float(dx[i]) + d : d);
  }
}

// ---- short convolution backward -------------------------------------------------------------
// Rows r and r + s (s >= 0) are in the same sequence iff pos[r + s] == pos[r] + s (positions
// restart at 0 at every sequence start).
// du[q, c] = dy[q, c] act'(u[q, c]), u the pre-activation recomputed as the forward does.
template <class X, class Y>
__global__ void conv_du_kernel(const X* x, const Y* dy, float* du, index_t rows, int channels,
                               const float* w, int K, bool silu, const std::int32_t* pos) {
  const index_t n = rows * channels;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t r = i / channels;
    const int c = int(i % channels), p = pos[r];
    const float g = to_float(dy[i]);
    if (!silu) {
      du[i] = g;
      continue;
    }
    float u = 0.f;
    for (int j = 0; j < K; ++j) {
      const int back = K - 1 - j;
      if (back <= p) u += w[c * K + j] * to_float(x[(r - back) * channels + c]);
    }
    const float s = 1.f / (1.f + expf(-u));
    du[i] = g * s * (1.f + u * (1.f - s));
  }
}

// dx[t, c] = sum_j w[c, j] du[t + (K-1) - j, c] over the outputs of t's sequence (written, or
// added). dx must not be dy.
template <class Y>
__global__ void conv_dx_kernel(const float* du, Y* dx, index_t rows, int channels, const float* w,
                               int K, const std::int32_t* pos, bool acc) {
  const index_t n = rows * channels;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t t = i / channels;
    const int c = int(i % channels), p = pos[t];
    float d = 0.f;
    for (int j = 0; j < K; ++j) {
      const index_t s = K - 1 - j, q = t + s;  // the output that reads x[t] through tap j
      if (q < rows && index_t(pos[q]) == index_t(p) + s) d += w[c * K + j] * du[q * channels + c];
    }
    dx[i] = from_float<Y>(acc ? to_float(dx[i]) + d : d);
  }
}

// part[k, c*K + j] = sum over the rows q of chunk k (in order) of du[q, c] x[q - (K-1) + j, c]
// (taps inside q's sequence). Grid: (columns of channels * K, chunks).
template <class X>
__global__ void conv_dw_part_kernel(const X* x, const float* du, index_t rows, int channels, int K,
                                    const std::int32_t* pos, float* part) {
  const index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t k = blockIdx.y, wn = index_t(channels) * K;
  if (e >= wn) return;
  const int c = int(e / K), j = int(e % K), back = K - 1 - j;
  const index_t r0 = k * row_chunk, r1 = r0 + row_chunk < rows ? r0 + row_chunk : rows;
  float s = 0.f;
  for (index_t q = r0; q < r1; ++q)
    if (back <= pos[q]) s += du[q * channels + c] * to_float(x[(q - back) * channels + c]);
  part[k * wn + e] = s;
}

// ---- embeddings ----------------------------------------------------------------------------
// y[r, e] = W[ids[r], e].
template <class W, class Y>
__global__ void gather_rows_kernel(const W* w, const std::int32_t* ids, index_t rows, index_t width,
                                   Y* y) {
  const index_t n = rows * width;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t r = i / width, e = i % width;
    y[i] = from_float<Y>(to_float(w[index_t(ids[r]) * width + e]));
  }
}

// dW[ids[r], e] += dy[r, e]: one thread per column e walks the rows in order, so that repeated
// ids sum in row order, and no two threads touch one element.
template <class Y>
__global__ void scatter_add_rows_kernel(const Y* dy, const std::int32_t* ids, index_t rows,
                                        index_t width, float* dw) {
  for (index_t e = blockIdx.x * index_t(blockDim.x) + threadIdx.x; e < width;
       e += index_t(gridDim.x) * blockDim.x)
    for (index_t r = 0; r < rows; ++r)
      dw[index_t(ids[r]) * width + e] += to_float(dy[r * width + e]);
}

// ---- cross-entropy -------------------------------------------------------------------------
// One block (reduce_threads) per row: loss[r] = lse(z_r) - z_r[label] (0 when ignored), and
// dlogits[r, :] = (softmax(z_r) - onehot(label)) * scale (0 when ignored) if dlogits is given.
template <class T>
__global__ void cross_entropy_rows_kernel(const T* logits, index_t ld, index_t rows, index_t V,
                                          const std::int32_t* labels, std::int32_t ignore,
                                          T* dlogits, index_t ldd, float scale, double* loss) {
  __shared__ float sh[reduce_threads];
  const index_t r = blockIdx.x;
  if (r >= rows) return;  // the whole block
  const T* z = logits + r * ld;
  const std::int32_t y = labels[r];
  if (y == ignore) {
    if (dlogits != nullptr)
      for (index_t c = threadIdx.x; c < V; c += reduce_threads)
        dlogits[r * ldd + c] = from_float<T>(0.f);
    if (threadIdx.x == 0) loss[r] = 0.0;
    return;
  }
  float m = -__int_as_float(0x7f800000);  // -inf
  for (index_t c = threadIdx.x; c < V; c += reduce_threads) m = fmaxf(m, to_float(z[c]));
  m = block_max(m, sh);
  float l = 0.f;
  for (index_t c = threadIdx.x; c < V; c += reduce_threads) l += expf(to_float(z[c]) - m);
  l = block_sum(l, sh);
  const float lse = m + logf(l);
  if (threadIdx.x == 0) loss[r] = double(lse - to_float(z[y]));
  if (dlogits != nullptr)
    for (index_t c = threadIdx.x; c < V; c += reduce_threads)
      dlogits[r * ldd + c] =
          from_float<T>((expf(to_float(z[c]) - lse) - (c == index_t(y) ? 1.f : 0.f)) * scale);
}

// ---- sums in double ------------------------------------------------------------------------
// part[b] = sum of f(v[i]) over the values of block b of a fixed grid-stride loop (grid `blocks`,
// reduce_threads each), f = x (Square = false) or x^2; with `add`, added to part[b] instead.
template <bool Square, class G>
__global__ void sum_part_kernel(const G* v, index_t n, double* part, bool add) {
  __shared__ double sh[reduce_threads];
  double s = 0.0;
  for (index_t i = blockIdx.x * index_t(reduce_threads) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * reduce_threads) {
    const double x = to_double(v[i]);
    s += Square ? x * x : x;
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) part[blockIdx.x] = add ? part[blockIdx.x] + s : s;
}

// ---- optimiser -----------------------------------------------------------------------------
// One AdamW step (PyTorch's), in double as the CPU one: c1, c2 the bias corrections; with
// `copy`, the new weights also rounded into it (the 16-bit copy of float master weights).
template <class P, class G, class S, class Q>
__global__ void adamw_kernel(P* p, const G* g, S* m, S* v, index_t n, double lr, double beta1,
                             double beta2, double eps, double wd, double c1, double c2, Q* copy) {
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const double gi = to_double(g[i]);
    const double mi = beta1 * to_double(m[i]) + (1 - beta1) * gi;
    const double vi = beta2 * to_double(v[i]) + (1 - beta2) * gi * gi;
    m[i] = from_double<S>(mi);
    v[i] = from_double<S>(vi);
    const double pi = to_double(p[i]) * (1 - lr * wd);
    const P next = from_double<P>(pi - lr * (mi / c1) / (sqrt(vi / c2) + eps));
    p[i] = next;
    if (copy != nullptr) copy[i] = from_float<Q>(to_float(next));
  }
}

// Gradient clipping: g[i] *= max_norm / (norm + 1e-6) when norm = sqrt(*sum_squares) exceeds
// max_norm (in double, the factor as the host computes it), else nothing.
template <class G>
__global__ void clip_kernel(G* g, index_t n, const double* sum_squares, double max_norm) {
  const double norm = sqrt(*sum_squares);
  if (!(norm > max_norm)) return;
  const double factor = max_norm / (norm + 1e-6);
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x)
    g[i] = from_double<G>(to_double(g[i]) * factor);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
