#pragma once
// Launches of the layers' row-wise kernels (kernels/rows.cuh): element-wise maps, bias, norms,
// short convolution, rotary embedding, positions, row moves. Each call checks its launch.

#include <cuda_runtime.h>

#include <cstdint>

#include "attnmix/core/tensor_view.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/rows.cuh"
#include "attnmix/cuda/plan/rows.hpp"
#include "attnmix/cuda/runtime/device.cuh"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// The grid of a grid-stride loop over n values (plan/rows.hpp) on the current device.
inline unsigned grid_for(index_t n, int threads) {
  return rows_grid(n, threads, current_properties());
}

// y = Op(a, b) elementwise (b may be null: Op sees 0). y may be a or b.
template <class Op, class Out, class InA, class InB = float>
void map(Out* y, const InA* a, const InB* b, index_t n, cudaStream_t stream, Op op = Op{}) {
  if (n == 0) return;
  map_kernel<Op, device_t<Out>, device_t<InA>, device_t<InB>><<<grid_for(n, 256), 256, 0, stream>>>(
      reinterpret_cast<device_t<Out>*>(y), reinterpret_cast<const device_t<InA>*>(a),
      reinterpret_cast<const device_t<InB>*>(b), n, op);
  check(cudaGetLastError(), "attnmix layer map kernel launch");
}

// y[r, c] += bias[c] for r < rows, c < width; y's row stride ld.
template <class Y, class B>
void add_bias(Y* y, const B* bias, index_t rows, index_t width, index_t ld, cudaStream_t stream) {
  if (rows * width == 0) return;
  add_bias_kernel<<<grid_for(rows * width, 256), 256, 0, stream>>>(
      reinterpret_cast<device_t<Y>*>(y), reinterpret_cast<const device_t<B>*>(bias), rows, width,
      ld);
  check(cudaGetLastError(), "attnmix bias kernel launch");
}

template <class In, class Out>
void norm_groups(const In* x, Out* y, index_t groups, index_t width, const float* w, bool per_group,
                 index_t groups_per_row, bool mean, double eps, cudaStream_t stream) {
  if (groups == 0) return;
  constexpr int warps = 8;
  norm_kernel<<<unsigned((groups + warps - 1) / warps), 32 * warps, 0, stream>>>(
      reinterpret_cast<const device_t<In>*>(x), reinterpret_cast<device_t<Out>*>(y), groups,
      int(width), w, per_group, int(groups_per_row), mean, float(eps));
  check(cudaGetLastError(), "attnmix norm kernel launch");
}

// The rows split into N sequences at the row offsets cu (device, N + 1; needed with states);
// pos (device, optional) gives each row's position. state_in, state_out (optional, [N, K - 1,
// C], distinct): the inputs before each sequence's first row, and its last K - 1 inputs after.
template <class In, class Out>
void short_conv(const In* x, Out* y, index_t rows, index_t channels, const float* w, index_t K,
                bool silu, const std::int32_t* pos, cudaStream_t stream,
                const In* state_in = nullptr, In* state_out = nullptr, index_t N = 0,
                const std::int32_t* cu = nullptr) {
  using D = device_t<In>;
  const auto* sin = reinterpret_cast<const D*>(state_in);
  if (rows * channels > 0) {
    short_conv_kernel<<<grid_for(rows * channels, 256), 256, 0, stream>>>(
        reinterpret_cast<const D*>(x), reinterpret_cast<device_t<Out>*>(y), rows, int(channels), w,
        int(K), silu, pos, sin, cu, N);
    check(cudaGetLastError(), "attnmix short conv kernel launch");
  }
  if (state_out != nullptr && N * (K - 1) * channels > 0) {
    short_conv_state_kernel<<<grid_for(N * (K - 1) * channels, 256), 256, 0, stream>>>(
        reinterpret_cast<const D*>(x), sin, reinterpret_cast<D*>(state_out), N, int(channels),
        int(K), cu);
    check(cudaGetLastError(), "attnmix short conv state kernel launch");
  }
}

// inverse: the backward (the opposite rotation).
template <class T>
void rope(T* x, index_t rows, index_t heads, index_t d, const std::int32_t* pos, double theta,
          cudaStream_t stream, bool inverse = false) {
  if (rows * heads * (d / 2) == 0) return;
  rope_kernel<<<grid_for(rows * heads * (d / 2), 256), 256, 0, stream>>>(
      reinterpret_cast<device_t<T>*>(x), rows, int(heads), int(d), pos, theta, inverse);
  check(cudaGetLastError(), "attnmix rope kernel launch");
}

// pos[r] = r mod tokens: row r's position in its sequence of a dense [B, tokens] batch.
inline void dense_positions(std::int32_t* pos, index_t rows, index_t tokens, cudaStream_t stream) {
  if (rows == 0) return;
  dense_positions_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(pos, rows, tokens);
  check(cudaGetLastError(), "attnmix positions kernel launch");
}

template <class In, class Out>
void move_rows(const In* x, Out* y, const std::int64_t* src, const std::int64_t* dst, index_t rows,
               index_t width, cudaStream_t stream) {
  if (rows * width == 0) return;
  move_rows_kernel<<<grid_for(rows * width, 256), 256, 0, stream>>>(
      reinterpret_cast<const device_t<In>*>(x), reinterpret_cast<device_t<Out>*>(y), src, dst, rows,
      width);
  check(cudaGetLastError(), "attnmix row copy kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
