#pragma once
// Row-wise CPU kernels of the layers, on contiguous [rows, features] buffers. Internal.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/layers/common.hpp"

namespace attnmix {
namespace layers {
namespace detail {

// Rows per task of the row-parallel loops: large enough that Eigen's GEMM runs at speed.
inline constexpr index_t row_block = 256;

template <class Body>
void for_row_blocks(index_t rows, const backend::cpu& be, Body&& body) {
  const index_t blocks = (rows + row_block - 1) / row_block;
  const int workers = attnmix::detail::cpu::worker_count(be, blocks);
  attnmix::detail::cpu::parallel_for(blocks, workers, [&](index_t b, int) {
    const index_t r0 = b * row_block;
    body(r0, std::min(rows, r0 + row_block));
  });
}

// y[r, :] = x[r, :] W^T (+ bias); x: [rows, in] (row stride x_stride), W: [out, in], y: [rows,
// out] (row stride y_stride). Eigen's GEMM per block of rows, blocks across the workers.
template <class T>
void linear_rows(const T* x, index_t x_stride, index_t rows, const T* W, index_t in, index_t out,
                 const T* bias, T* y, index_t y_stride, const backend::cpu& be) {
  using attnmix::detail::cpu::rows_of;
  const auto Wm = rows_of(W, out, in, in);
  for_row_blocks(rows, be, [&](index_t r0, index_t r1) {
    auto Y = rows_of(y + r0 * y_stride, r1 - r0, out, y_stride);
    Y.noalias() = rows_of(x + r0 * x_stride, r1 - r0, in, x_stride) * Wm.transpose();
    if (bias != nullptr) {
      const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b(bias, out);
      Y.rowwise() += b;
    }
  });
}

// RMSNorm over groups of `width` contiguous values: y = x / sqrt(mean(x^2) + eps) * w, with
// w of `width` values (shared by the groups) or of groups * width (per_group). Statistics in
// accum_t<T>. x and y may be the same buffer.
template <class T>
void rms_norm_groups(const T* x, T* y, index_t count, index_t width, const T* w, bool per_group,
                     index_t groups_per_row, double eps, const backend::cpu& be) {
  using A = accum_t<T>;
  const index_t rows = count / groups_per_row;
  for_row_blocks(rows, be, [&](index_t r0, index_t r1) {
    for (index_t g = r0 * groups_per_row; g < r1 * groups_per_row; ++g) {
      const T* xi = x + g * width;
      T* yi = y + g * width;
      A ss = 0;
      for (index_t c = 0; c < width; ++c) ss += A(xi[c]) * A(xi[c]);
      const A r = A(1) / std::sqrt(ss / A(width) + A(eps));
      const T* wi = w == nullptr ? nullptr : per_group ? w + (g % groups_per_row) * width : w;
      for (index_t c = 0; c < width; ++c)
        yi[c] = static_cast<T>(A(xi[c]) * r * (wi ? A(wi[c]) : A(1)));
    }
  });
}

template <class A>
inline A sigmoid(A x) {
  return A(1) / (A(1) + std::exp(-x));
}
template <class A>
inline A silu(A x) {
  return x * sigmoid(x);
}
// log(sigmoid(x)) without overflow: min(x, 0) - log1p(exp(-|x|)).
template <class A>
inline A log_sigmoid(A x) {
  return std::min(x, A(0)) - std::log1p(std::exp(-std::abs(x)));
}
template <class A>
inline A gelu(A x) {  // exact (erf) GELU, PyTorch's default
  return A(0.5) * x * (A(1) + std::erf(x / std::sqrt(A(2))));
}

// Causal depthwise convolution over the rows of each sequence, restarting at sequence starts:
//   y[t, c] = act( sum_{r<K} W[c, r] x[t - (K-1) + r, c] ),  x before the sequence start = 0
// (or the rolling state of the sequence when `state` is given: its K-1 previous inputs,
// [N, K-1, C], oldest first). W: [C, 1, K] (PyTorch Conv1d, groups = C).
// If final_state != nullptr it receives each sequence's last K-1 inputs (zero-filled).
template <class T>
void short_conv_rows(const T* x, T* y, const token_layout& L, index_t C, const T* W, index_t K,
                     bool silu_act, const T* state, T* final_state, const backend::cpu& be) {
  using A = accum_t<T>;
  const index_t N = L.num_sequences();
  // Taps transposed to [K, C] so that the inner loop runs over contiguous channels.
  std::vector<A> wt(static_cast<std::size_t>(K * C));
  for (index_t c = 0; c < C; ++c)
    for (index_t r = 0; r < K; ++r) wt[static_cast<std::size_t>(r * C + c)] = A(W[c * K + r]);
  const int workers = attnmix::detail::cpu::worker_count(be, N);
  attnmix::detail::cpu::parallel_for(N, workers, [&](index_t n, int) {
    const index_t len = L.seq(n).length, r0 = L.first_row(n);
    const T* st = state ? state + n * (K - 1) * C : nullptr;
    // Row of inputs at sequence position p (p < 0: the state's row, or nullptr for zeros).
    auto row = [&](index_t p) -> const T* {
      if (p >= 0) return x + (r0 + p) * C;
      const index_t s = (K - 1) + p;
      return (st != nullptr && s >= 0) ? st + s * C : nullptr;
    };
    std::vector<A> acc(static_cast<std::size_t>(C));
    for (index_t t = 0; t < len; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (index_t r = 0; r < K; ++r) {
        const T* in = row(t - (K - 1) + r);
        if (in == nullptr) continue;
        const A* w = wt.data() + r * C;
        for (index_t c = 0; c < C; ++c) acc[static_cast<std::size_t>(c)] += w[c] * A(in[c]);
      }
      T* yt = y + (r0 + t) * C;
      for (index_t c = 0; c < C; ++c) {
        const A v = acc[static_cast<std::size_t>(c)];
        yt[c] = static_cast<T>(silu_act ? silu(v) : v);
      }
    }
    if (final_state != nullptr) {
      T* fs = final_state + n * (K - 1) * C;
      for (index_t s = 0; s < K - 1; ++s) {
        const T* in = row(len - (K - 1) + s);
        for (index_t c = 0; c < C; ++c) fs[s * C + c] = in ? in[c] : T(0);
      }
    }
  });
}

// Per-head L2 normalisation: v / sqrt(sum v^2 + eps) (eps inside the sqrt, as fla's l2norm).
template <class T>
void l2_norm_groups(T* x, index_t groups, index_t width, double eps) {
  using A = accum_t<T>;
  for (index_t g = 0; g < groups; ++g) {
    T* v = x + g * width;
    A ss = 0;
    for (index_t c = 0; c < width; ++c) ss += A(v[c]) * A(v[c]);
    const A r = A(1) / std::sqrt(ss + A(eps));
    for (index_t c = 0; c < width; ++c) v[c] = static_cast<T>(A(v[c]) * r);
  }
}

// Rotary position embedding, rotate-half form (fla's RotaryEmbedding default): for i < d/2 the
// pair (x_i, x_{i+d/2}) turns by pos * theta^(-2i/d). x: [rows, heads, d], pos[row].
template <class T>
void rope_rows(T* x, index_t rows, index_t heads, index_t d, const index_t* pos, double theta) {
  const index_t half = d / 2;
  std::vector<double> inv(static_cast<std::size_t>(half));
  for (index_t i = 0; i < half; ++i)
    inv[static_cast<std::size_t>(i)] = std::pow(theta, -2.0 * double(i) / double(d));
  for (index_t r = 0; r < rows; ++r)
    for (index_t i = 0; i < half; ++i) {
      const double a = double(pos[r]) * inv[static_cast<std::size_t>(i)];
      const double cs = std::cos(a), sn = std::sin(a);
      for (index_t h = 0; h < heads; ++h) {
        T* v = x + (r * heads + h) * d;
        const double x0 = double(v[i]), x1 = double(v[i + half]);
        v[i] = static_cast<T>(x0 * cs - x1 * sn);
        v[i + half] = static_cast<T>(x1 * cs + x0 * sn);
      }
    }
}

// Position of every row within its sequence (plus an offset per sequence).
inline std::vector<index_t> positions(const token_layout& L,
                                      const std::vector<index_t>& offset = {}) {
  std::vector<index_t> pos(static_cast<std::size_t>(L.rows()), 0);
  for (index_t n = 0; n < L.num_sequences(); ++n) {
    const index_t r0 = L.first_row(n), o = offset.empty() ? 0 : offset[static_cast<std::size_t>(n)];
    for (index_t t = 0; t < L.seq(n).length; ++t) pos[static_cast<std::size_t>(r0 + t)] = o + t;
  }
  return pos;
}

}  // namespace detail
}  // namespace layers
}  // namespace attnmix
