#pragma once
// Launches of the layers' backward and training kernels (kernels/rows_backward.cuh): map
// slopes, bias, norm and short-conv gradients, embeddings, cross-entropy, AdamW, sums of
// squares. Scratch of the two-stage sums comes from the stream-ordered pool; each call checks
// its launches.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attnmix/core/tensor_view.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/rows_backward.cuh"
#include "attnmix/cuda/launch/rows.cuh"
#include "attnmix/cuda/runtime/error.cuh"
#include "attnmix/cuda/runtime/memory.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Bytes of n values of S in a carved scratch buffer, rounded to 256 (aligned starts).
template <class S>
constexpr std::size_t scratch_bytes_of(index_t n) {
  return (static_cast<std::size_t>(n) * sizeof(S) + 255) / 256 * 256;
}

template <class T>
auto* dev(T* p) {
  return reinterpret_cast<device_t<T>*>(p);
}
template <class T>
const auto* dev(const T* p) {
  return reinterpret_cast<const device_t<T>*>(p);
}

// da = dy dOp/da, db = dy dOp/db (written, or added with acc); either may be null.
template <class Op, class Y, class X, class Z>
void map_backward(const Y* dy, const X* a, const Z* b, X* da, Z* db, index_t n, bool acc,
                  cudaStream_t stream) {
  if (n == 0) return;
  map_backward_kernel<Op>
      <<<grid_for(n, 256), 256, 0, stream>>>(dev(dy), dev(a), dev(b), dev(da), dev(db), n, acc);
  check(cudaGetLastError(), "attnmix layer map backward kernel launch");
}

// dbias[o] += sum_r dy[r, o].
template <class Y>
void bias_backward(const Y* dy, index_t ld, index_t rows, index_t out, float* dbias,
                   cudaStream_t stream) {
  if (rows == 0 || out == 0) return;
  bias_backward_kernel<<<grid_for(out, 128), 128, 0, stream>>>(dev(dy), ld, rows, out, dbias);
  check(cudaGetLastError(), "attnmix bias backward kernel launch");
}

// dst[e] += sum of part[k, e] over k < chunks (n values of dst).
template <class A>
void sum_chunks(const A* part, index_t chunks, index_t n, A* dst, cudaStream_t stream) {
  if (n == 0) return;
  sum_chunks_kernel<<<grid_for(n, 128), 128, 0, stream>>>(part, chunks, n, dst);
  check(cudaGetLastError(), "attnmix chunk sum kernel launch");
}

inline index_t row_chunks(index_t rows) {
  return (rows + row_chunk - 1) / row_chunk;
}

// Backward of norm_groups: dx (written, or added) and, with dw (and w), dw added. dx may be dy.
template <class X, class Y>
void norm_groups_backward(const X* x, const Y* dy, Y* dx, index_t groups, index_t width,
                          const float* w, bool per_group, index_t groups_per_row, bool mean,
                          double eps, float* dw, bool acc, cudaStream_t stream) {
  if (groups == 0 || width == 0) return;
  const index_t rows = groups / groups_per_row;
  const index_t wn = (w == nullptr || dw == nullptr) ? 0
                     : per_group                     ? groups_per_row * width
                                                     : width;
  const index_t chunks = row_chunks(rows);
  stream_buffer buf(scratch_bytes_of<float>(2 * groups) + scratch_bytes_of<float>(chunks * wn),
                    stream);
  float* stat = reinterpret_cast<float*>(buf.get());
  float* part = reinterpret_cast<float*>(buf.get() + scratch_bytes_of<float>(2 * groups));
  constexpr int warps = 8;
  norm_stats_kernel<<<unsigned((groups + warps - 1) / warps), 32 * warps, 0, stream>>>(
      dev(x), dev(dy), groups, int(width), w, per_group, int(groups_per_row), mean, float(eps),
      stat);
  check(cudaGetLastError(), "attnmix norm backward (stats) kernel launch");
  if (wn > 0) {  // before dx: dx may overwrite dy
    const dim3 grid(unsigned((wn + 127) / 128), unsigned(chunks));
    norm_dw_part_kernel<<<grid, 128, 0, stream>>>(dev(x), dev(dy), rows, int(width), wn, per_group,
                                                  int(groups_per_row), stat, part);
    check(cudaGetLastError(), "attnmix norm backward (dw) kernel launch");
    sum_chunks(part, chunks, wn, dw, stream);
  }
  norm_dx_kernel<<<grid_for(groups * width, 256), 256, 0, stream>>>(
      dev(x), dev(dy), dev(dx), groups, int(width), w, per_group, int(groups_per_row), stat, acc);
  check(cudaGetLastError(), "attnmix norm backward (dx) kernel launch");
}

// Backward of short_conv: dx (written, or added; not dy) and dw (added, [channels, K]).
template <class X, class Y>
void short_conv_backward(const X* x, const Y* dy, Y* dx, index_t rows, index_t channels,
                         const float* w, index_t K, bool silu, const std::int32_t* pos, float* dw,
                         bool acc, cudaStream_t stream) {
  const index_t n = rows * channels;
  if (n == 0) return;
  const index_t chunks = row_chunks(rows), wn = channels * K;
  stream_buffer buf(scratch_bytes_of<float>(n) + scratch_bytes_of<float>(chunks * wn), stream);
  float* du = reinterpret_cast<float*>(buf.get());
  float* part = reinterpret_cast<float*>(buf.get() + scratch_bytes_of<float>(n));
  conv_du_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(x), dev(dy), du, rows, int(channels), w,
                                                       int(K), silu, pos);
  check(cudaGetLastError(), "attnmix short conv backward (du) kernel launch");
  if (dw != nullptr) {
    const dim3 grid(unsigned((wn + 127) / 128), unsigned(chunks));
    conv_dw_part_kernel<<<grid, 128, 0, stream>>>(dev(x), du, rows, int(channels), int(K), pos,
                                                  part);
    check(cudaGetLastError(), "attnmix short conv backward (dw) kernel launch");
    sum_chunks(part, chunks, wn, dw, stream);
  }
  conv_dx_kernel<<<grid_for(n, 256), 256, 0, stream>>>(du, dev(dx), rows, int(channels), w, int(K),
                                                       pos, acc);
  check(cudaGetLastError(), "attnmix short conv backward (dx) kernel launch");
}

template <class W, class Y>
void gather_rows(const W* w, const std::int32_t* ids, index_t rows, index_t width, Y* y,
                 cudaStream_t stream) {
  if (rows * width == 0) return;
  gather_rows_kernel<<<grid_for(rows * width, 256), 256, 0, stream>>>(dev(w), ids, rows, width,
                                                                      dev(y));
  check(cudaGetLastError(), "attnmix embedding kernel launch");
}

template <class Y>
void scatter_add_rows(const Y* dy, const std::int32_t* ids, index_t rows, index_t width, float* dw,
                      cudaStream_t stream) {
  if (rows * width == 0) return;
  scatter_add_rows_kernel<<<grid_for(width, 128), 128, 0, stream>>>(dev(dy), ids, rows, width, dw);
  check(cudaGetLastError(), "attnmix embedding backward kernel launch");
}

// Adds the sum over n values of v (or of their squares) to *total (device memory), in double, in
// a fixed order: a fixed grid of partial sums, then one block over them. Reads nothing back.
template <bool Square, class G>
void sum_values(const G* v, index_t n, double* total, cudaStream_t stream) {
  if (n == 0) return;
  constexpr index_t most_blocks = 1024;  // a fixed grid: the order does not depend on the device
  const index_t want = (n + reduce_threads - 1) / reduce_threads;
  const index_t blocks = want < most_blocks ? want : most_blocks;
  stream_buffer buf(scratch_bytes_of<double>(blocks), stream);
  double* part = reinterpret_cast<double*>(buf.get());
  sum_part_kernel<Square><<<unsigned(blocks), reduce_threads, 0, stream>>>(dev(v), n, part, false);
  check(cudaGetLastError(), "attnmix sum kernel launch");
  sum_part_kernel<false><<<1, reduce_threads, 0, stream>>>(part, blocks, total, true);
  check(cudaGetLastError(), "attnmix sum kernel launch");
}

// Softmax cross-entropy of rows of logits; adds the summed loss (double, rows in order) to *total
// (device memory). Reads nothing back.
template <class T>
void cross_entropy(const T* logits, index_t ld, index_t rows, index_t V, const std::int32_t* labels,
                   std::int32_t ignore, T* dlogits, index_t ldd, double scale, double* total,
                   cudaStream_t stream) {
  if (rows == 0) return;
  stream_buffer buf(scratch_bytes_of<double>(rows), stream);
  double* loss = reinterpret_cast<double*>(buf.get());
  cross_entropy_rows_kernel<<<unsigned(rows), reduce_threads, 0, stream>>>(
      dev(logits), ld, rows, V, labels, ignore, dev(dlogits), ldd, float(scale), loss);
  check(cudaGetLastError(), "attnmix cross-entropy kernel launch");
  sum_values<false>(loss, rows, total, stream);
}

template <class P, class G, class S, class Q>
void adamw(P* p, const G* g, S* m, S* v, index_t n, double lr, double beta1, double beta2,
           double eps, double wd, double c1, double c2, Q* copy, cudaStream_t stream) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(p), dev(g), dev(m), dev(v), n, lr, beta1,
                                                     beta2, eps, wd, c1, c2, dev(copy));
  check(cudaGetLastError(), "attnmix AdamW kernel launch");
}

template <class G>
void clip(G* g, index_t n, const double* sum_squares, double max_norm, cudaStream_t stream) {
  if (n == 0) return;
  clip_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(g), n, sum_squares, max_norm);
  check(cudaGetLastError(), "attnmix clip kernel launch");
}

// Copies n values of device memory at src to the host at dst, and waits for them: the one read
// of a device value a training step makes.
template <class S>
void download(S* dst, const S* src, index_t n, cudaStream_t stream) {
  if (n == 0) return;
  ++counts().waits;
  check(cudaMemcpyAsync(dst, src, std::size_t(n) * sizeof(S), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
