#pragma once
// Row-wise CUDA kernels of the layers (the device twins of cpu/layer_ops.hpp), on
// contiguous [rows, features] buffers; their launches are launch/rows.cuh. Statistics and
// activations are computed in float whatever the storage type. Internal.

#include <cuda_runtime.h>

#include <cstdint>

#include "attnmix/core/tensor_view.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/collective/row_ops.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// ---- elementwise maps ----------------------------------------------------------------------
// y[i] = Op(a[i], b[i]) over n values; each Op is a struct so that nvcc needs no lambdas.

template <class Op, class Out, class InA, class InB>
__global__ void map_kernel(Out* __restrict__ y, const InA* a, const InB* b, index_t n, Op op) {
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x)
    y[i] = from_float<Out>(op(to_float(a[i]), b != nullptr ? to_float(b[i]) : 0.f));
}

// ---- bias ----------------------------------------------------------------------------------
template <class Y, class B>
__global__ void add_bias_kernel(Y* y, const B* bias, index_t rows, index_t width, index_t ld) {
  const index_t n = rows * width;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t r = i / width, c = i % width;
    y[r * ld + c] = from_float<Y>(to_float(y[r * ld + c]) + to_float(bias[c]));
  }
}

// ---- RMSNorm / L2 norm over groups ---------------------------------------------------------
// One warp per group of `width` contiguous values:
//   y = x / sqrt(mean(x^2) + eps) * w   (mean = true: RMSNorm; w may be null)
//   y = x / sqrt(sum(x^2) + eps)        (mean = false: fla's l2norm)
// w holds `width` values shared by the groups, or groups_per_row * width (per_group).
template <class In, class Out>
__global__ void norm_kernel(const In* x, Out* y, index_t groups, int width, const float* w,
                            bool per_group, int groups_per_row, bool mean, float eps) {
  const index_t g = blockIdx.x * index_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (g >= groups) return;  // whole warps leave together: the shuffles below stay full
  const In* xi = x + g * width;
  Out* yi = y + g * width;
  float ss = 0.f;
  for (int c = lane; c < width; c += 32) {
    const float v = to_float(xi[c]);
    ss += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float r = rsqrtf((mean ? ss / float(width) : ss) + eps);
  const float* wi = w == nullptr ? nullptr : per_group ? w + (g % groups_per_row) * width : w;
  for (int c = lane; c < width; c += 32)
    yi[c] = from_float<Out>(to_float(xi[c]) * r * (wi != nullptr ? wi[c] : 1.f));
}

// ---- causal depthwise short convolution ----------------------------------------------------
// The sequence of row r: the n of cu[n] <= r < cu[n + 1] (rows of N sequences at offsets cu).
__device__ __forceinline__ index_t sequence_of_row(index_t r, const std::int32_t* cu, index_t N) {
  index_t lo = 0, hi = N;
  while (hi - lo > 1) {
    const index_t mid = (lo + hi) / 2;
    if (cu[mid] <= r)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// y[r, c] = act( sum_{j<K} w[c, j] x[r - (K-1) + j, c] ), taps before the row's sequence start
// (position p < K-1-j) reading zero. Row r's position p in its sequence is pos[r], or (pos
// null) found from the sequences' row offsets cu. state_in (optional): each sequence's
// K - 1 inputs before its first row, [N, K - 1, C], oldest first; without it they are zeros.
template <class In, class Out>
__global__ void short_conv_kernel(const In* x, Out* y, index_t rows, int channels, const float* w,
                                  int K, bool silu, const std::int32_t* pos, const In* state_in,
                                  const std::int32_t* cu, index_t N) {
  const index_t n = rows * channels;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t r = i / channels;
    const int c = int(i % channels);
    index_t seq = -1;  // r's sequence, where it is needed
    int p = 0;
    if (pos != nullptr) {
      p = pos[r];
    } else {
      seq = sequence_of_row(r, cu, N);
      p = int(r - cu[seq]);
    }
    const In* st = nullptr;
    if (state_in != nullptr && p < K - 1) {
      if (seq < 0) seq = sequence_of_row(r, cu, N);
      st = state_in + seq * (K - 1) * channels;
    }
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      const int back = K - 1 - j;  // how many tokens before r this tap reads
      if (back <= p)
        acc += w[c * K + j] * to_float(x[(r - back) * channels + c]);
      else if (st != nullptr)  // position p - back < 0: the state's row K - 1 + p - back
        acc += w[c * K + j] * to_float(st[(K - 1 + p - back) * channels + c]);
    }
    y[i] = from_float<Out>(silu ? acc / (1.f + __expf(-acc)) : acc);
  }
}

// Each of the N sequences' last K - 1 inputs (before its first row: state_in's, or zeros) into
// state_out [N, K - 1, C], oldest first. Sequence n: rows cu[n] .. cu[n + 1]. state_out must
// not be state_in.
template <class T>
__global__ void short_conv_state_kernel(const T* x, const T* state_in, T* state_out, index_t N,
                                        int channels, int K, const std::int32_t* cu) {
  const int taps = K - 1;
  const index_t n_all = N * taps * channels;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n_all;
       i += index_t(gridDim.x) * blockDim.x) {
    const int c = int(i % channels), s = int((i / channels) % taps);
    const index_t n = i / (index_t(channels) * taps);
    const index_t start = cu[n], len = cu[n + 1] - cu[n];
    const index_t p = len - taps + s;  // the position this state row holds
    T v = from_float<T>(0.f);
    if (p >= 0)
      v = x[(start + p) * channels + c];
    else if (state_in != nullptr)
      v = state_in[(n * taps + taps + p) * channels + c];
    state_out[i] = v;
  }
}

// ---- rotary position embedding (rotate-half) -----------------------------------------------
// The angle pos * theta^(-2i/d) in double, as the CPU path: float loses ~1e-3 rad at 16k.
// inverse: turn the other way (the backward: the rotation's transpose).
template <class T>
__global__ void rope_kernel(T* x, index_t rows, int heads, int d, const std::int32_t* pos,
                            double theta, bool inverse) {
  const int half = d / 2;
  const index_t n = rows * heads * half;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const int k = int(i % half);
    const index_t rh = i / half, r = rh / heads;
    double sn, cs;
    sincos(double(pos[r]) * pow(theta, -2.0 * k / d), &sn, &cs);
    if (inverse) sn = -sn;
    T* v = x + rh * d;
    const float x0 = to_float(v[k]), x1 = to_float(v[k + half]);
    v[k] = from_float<T>(float(x0 * cs - x1 * sn));
    v[k + half] = from_float<T>(float(x1 * cs + x0 * sn));
  }
}

// ---- positions of a dense batch ------------------------------------------------------------
template <class I>  // a template, so that the header defines no non-inline kernel
__global__ void dense_positions_kernel(I* pos, index_t rows, index_t tokens) {
  for (index_t r = blockIdx.x * index_t(blockDim.x) + threadIdx.x; r < rows;
       r += index_t(gridDim.x) * blockDim.x)
    pos[r] = I(r % tokens);
}

// ---- row gather / scatter (packing the valid tokens of a masked batch) ---------------------
// y[dst[r], :] = x[src[r], :] for r < rows; a null src or dst is the identity.
template <class In, class Out>
__global__ void move_rows_kernel(const In* x, Out* y, const std::int64_t* src,
                                 const std::int64_t* dst, index_t rows, index_t width) {
  const index_t n = rows * width;
  for (index_t i = blockIdx.x * index_t(blockDim.x) + threadIdx.x; i < n;
       i += index_t(gridDim.x) * blockDim.x) {
    const index_t r = i / width, c = i % width;
    y[(dst ? dst[r] : r) * width + c] =
        from_float<Out>(to_float(x[(src ? src[r] : r) * width + c]));
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
