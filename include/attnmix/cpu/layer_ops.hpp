#pragma once
// layers::ops<backend::cpu>: the layers' row operations on the host, on contiguous
// [rows, features] buffers (Eigen's GEMM for the projections, plain loops for the rest), the
// reference every other backend is checked against. Statistics in accum_t<T>.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// Rows per task of the row-parallel loops: large enough that Eigen's GEMM runs at speed.
inline constexpr index_t row_block = 256;

template <class Body>
void for_row_blocks(index_t rows, const backend::cpu& be, Body&& body) {
  const index_t blocks = (rows + row_block - 1) / row_block;
  const int workers = worker_count(be, blocks);
  parallel_for(blocks, workers, [&](index_t b, int) {
    const index_t r0 = b * row_block;
    body(r0, std::min(rows, r0 + row_block));
  });
}

// y[r, :] = x[r, :] W^T (+ bias); x: [rows, in] (row stride x_stride), W: [out, in], y: [rows,
// out] (row stride y_stride). Eigen's GEMM per block of rows, blocks across the workers.
template <class T>
void linear_rows(const T* x, index_t x_stride, index_t rows, const T* W, index_t in, index_t out,
                 const T* bias, T* y, index_t y_stride, const backend::cpu& be) {
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
void short_conv_rows(const T* x, T* y, const layers::token_layout& L, index_t C, const T* W,
                     index_t K, bool silu_act, const T* state, T* final_state,
                     const backend::cpu& be) {
  using A = accum_t<T>;
  const index_t N = L.num_sequences();
  // Taps transposed to [K, C] so that the inner loop runs over contiguous channels.
  std::vector<A> wt(static_cast<std::size_t>(K * C));
  for (index_t c = 0; c < C; ++c)
    for (index_t r = 0; r < K; ++r) wt[static_cast<std::size_t>(r * C + c)] = A(W[c * K + r]);
  const int workers = worker_count(be, N);
  parallel_for(N, workers, [&](index_t n, int) {
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
// inverse: turn the other way (the backward of the rotation is its transpose).
template <class T>
void rope_rows(T* x, index_t rows, index_t heads, index_t d, const std::int32_t* pos, double theta,
               bool inverse = false) {
  const index_t half = d / 2;
  std::vector<double> inv(static_cast<std::size_t>(half));
  for (index_t i = 0; i < half; ++i)
    inv[static_cast<std::size_t>(i)] = std::pow(theta, -2.0 * double(i) / double(d));
  for (index_t r = 0; r < rows; ++r)
    for (index_t i = 0; i < half; ++i) {
      const double a = double(pos[r]) * inv[static_cast<std::size_t>(i)];
      const double cs = std::cos(a), sn = inverse ? -std::sin(a) : std::sin(a);
      for (index_t h = 0; h < heads; ++h) {
        T* v = x + (r * heads + h) * d;
        const double x0 = double(v[i]), x1 = double(v[i + half]);
        v[i] = static_cast<T>(x0 * cs - x1 * sn);
        v[i + half] = static_cast<T>(x1 * cs + x0 * sn);
      }
    }
}

// ---- Backward ---------------------------------------------------------------------------------
// Parameter gradients are added to (so that a weight used twice, or several micro-batches, sum;
// the optimiser zeroes them); activation gradients are written, or added when `accumulate`.
// Reductions over rows go through fixed blocks (of rows, or of output features), summed in
// order, so the bits do not depend on the thread count.

// dx = dy W (+ dx): dy [rows, out] (row stride lddy), W [out, in], dx [rows, in] (stride lddx).
template <class T>
void linear_rows_dx(const T* dy, index_t lddy, index_t rows, const T* W, index_t in, index_t out,
                    T* dx, index_t lddx, bool accumulate, const backend::cpu& be) {
  const auto Wm = rows_of(W, out, in, in);
  for_row_blocks(rows, be, [&](index_t r0, index_t r1) {
    auto X = rows_of(dx + r0 * lddx, r1 - r0, in, lddx);
    const auto Y = rows_of(dy + r0 * lddy, r1 - r0, out, lddy);
    if (accumulate)
      X.noalias() += Y * Wm;
    else
      X.noalias() = Y * Wm;
  });
}

// dW += dy^T x and dbias += colsum(dy): x [rows, in] (stride ldx), dy [rows, out] (stride lddy),
// dW [out, in], dbias [out] or null. Blocks of output features across the workers: each
// element of dW is one task's, summed over the rows in order.
template <class T>
void linear_rows_dw(const T* x, index_t ldx, index_t rows, const T* dy, index_t lddy, index_t in,
                    index_t out, T* dW, T* dbias, const backend::cpu& be) {
  constexpr index_t cols = 64;  // output features per task
  const index_t tasks = (out + cols - 1) / cols;
  const auto X = rows_of(x, rows, in, ldx);
  parallel_for(tasks, worker_count(be, tasks), [&](index_t t, int) {
    const index_t o0 = t * cols, n = std::min(out, o0 + cols) - o0;
    const auto Y = rows_of(dy + o0, rows, n, lddy);
    rows_of(dW + o0 * in, n, in, in).noalias() += Y.transpose() * X;
    if (dbias != nullptr)
      for (index_t o = 0; o < n; ++o) {
        T sum = 0;
        for (index_t r = 0; r < rows; ++r) sum += dy[r * lddy + o0 + o];
        dbias[o0 + o] += sum;
      }
  });
}

// Backward of rms_norm_groups (mean) and l2_norm_groups: dx (written, or added) and, for the
// RMSNorm with a weight, dw (added). With r = 1/sqrt(m + eps), m = mean(x^2) (RMSNorm) or
// sum(x^2) (L2), and u = w * dy:  dx = r u - r^3 x (u.x) / n,  n = width (RMSNorm) or 1 (L2);
// dw += dy x r. dx may be dy.
template <class T>
void norm_groups_backward(const T* x, const T* dy, T* dx, index_t count, index_t width, const T* w,
                          bool per_group, index_t groups_per_row, bool mean, double eps, T* dw,
                          bool accumulate, const backend::cpu& be) {
  using A = accum_t<T>;
  const index_t rows = count / groups_per_row;
  const index_t blocks = (rows + row_block - 1) / row_block;
  const index_t wn = w == nullptr ? 0 : per_group ? groups_per_row * width : width;
  // Per block of rows, its part of dw; summed in block order below.
  std::vector<A> part(static_cast<std::size_t>(dw != nullptr ? blocks * wn : 0), A(0));
  parallel_for(blocks, worker_count(be, blocks), [&](index_t b, int) {
    const index_t r0 = b * row_block, r1 = std::min(rows, r0 + row_block);
    A* pb = part.empty() ? nullptr : part.data() + b * wn;
    for (index_t g = r0 * groups_per_row; g < r1 * groups_per_row; ++g) {
      const T *xi = x + g * width, *dyi = dy + g * width;
      T* dxi = dx + g * width;
      const index_t woff = per_group ? (g % groups_per_row) * width : 0;
      const T* wi = w == nullptr ? nullptr : w + woff;
      A ss = 0, ux = 0;
      for (index_t c = 0; c < width; ++c) {
        const A u = A(dyi[c]) * (wi ? A(wi[c]) : A(1));
        ss += A(xi[c]) * A(xi[c]);
        ux += u * A(xi[c]);
      }
      const A n = mean ? A(width) : A(1);
      const A r = A(1) / std::sqrt(ss / n + A(eps));
      const A k = r * r * r * ux / n;
      for (index_t c = 0; c < width; ++c) {
        const A xc = A(xi[c]), dyc = A(dyi[c]);
        if (pb != nullptr) pb[woff + c] += dyc * xc * r;
        const A d = r * dyc * (wi ? A(wi[c]) : A(1)) - k * xc;
        dxi[c] = static_cast<T>(accumulate ? A(dxi[c]) + d : d);
      }
    }
  });
  if (dw != nullptr)
    for (index_t b = 0; b < blocks; ++b)
      for (index_t e = 0; e < wn; ++e)
        dw[e] += static_cast<T>(part[static_cast<std::size_t>(b * wn + e)]);
}

// Backward of short_conv_rows (no states): dx (written, or added) and dW (added), from the
// forward's input x. With u the pre-activation (recomputed) and du = dy act'(u):
//   dx[t, c] = sum_r W[c, r] du[t + (K-1) - r, c],  dW[c, r] += sum_t du[t, c] x[t-(K-1)+r, c]
// within each sequence. Blocks of channels across the workers, so that each dW element is one
// task's. dx may not be dy.
template <class T>
void short_conv_rows_backward(const T* x, const T* dy, T* dx, const layers::token_layout& L,
                              index_t C, const T* W, index_t K, bool silu_act, T* dW,
                              bool accumulate, const backend::cpu& be) {
  using A = accum_t<T>;
  constexpr index_t block = 64;  // channels per task
  const index_t tasks = (C + block - 1) / block, N = L.num_sequences();
  parallel_for(tasks, worker_count(be, tasks), [&](index_t task, int) {
    const index_t c0 = task * block, nc = std::min(C, c0 + block) - c0;
    std::vector<A> du, wsum(static_cast<std::size_t>(nc * K), A(0));
    for (index_t n = 0; n < N; ++n) {
      const index_t len = L.seq(n).length, r0 = L.first_row(n);
      du.assign(static_cast<std::size_t>(len * nc), A(0));
      for (index_t t = 0; t < len; ++t)
        for (index_t c = 0; c < nc; ++c) {
          A u = 0;
          for (index_t r = 0; r < K; ++r) {
            const index_t p = t - (K - 1) + r;
            if (p >= 0) u += A(W[(c0 + c) * K + r]) * A(x[(r0 + p) * C + c0 + c]);
          }
          const A g = A(dy[(r0 + t) * C + c0 + c]);
          const A s = sigmoid(u);
          du[static_cast<std::size_t>(t * nc + c)] = silu_act ? g * s * (A(1) + u * (A(1) - s)) : g;
        }
      for (index_t t = 0; t < len; ++t)
        for (index_t c = 0; c < nc; ++c) {
          A d = 0;
          for (index_t r = 0; r < K; ++r) {
            const index_t q = t + (K - 1) - r;  // the output that reads x[t] through tap r
            if (q < len) d += A(W[(c0 + c) * K + r]) * du[static_cast<std::size_t>(q * nc + c)];
            const index_t p = t - (K - 1) + r;
            if (p >= 0)
              wsum[static_cast<std::size_t>(c * K + r)] +=
                  du[static_cast<std::size_t>(t * nc + c)] * A(x[(r0 + p) * C + c0 + c]);
          }
          T& out = dx[(r0 + t) * C + c0 + c];
          out = static_cast<T>(accumulate ? A(out) + d : d);
        }
    }
    for (index_t c = 0; c < nc; ++c)
      for (index_t r = 0; r < K; ++r)
        dW[(c0 + c) * K + r] += static_cast<T>(wsum[static_cast<std::size_t>(c * K + r)]);
  });
}

// ---- Training -----------------------------------------------------------------------------------

// Softmax cross-entropy of rows of logits [rows, V] (row stride ld) against labels[r] (a class
// in [0, V), or `ignore`). Returns the sum of -log softmax(logits_r)[label_r] over the rows not
// ignored; if dlogits != nullptr it receives (softmax(logits_r) - onehot(label_r)) * scale,
// and 0 on ignored rows. Blocks of rows summed in order; in accum_t<T>.
template <class T>
double cross_entropy_rows(const T* logits, index_t ld, index_t rows, index_t V,
                          const std::int32_t* labels, std::int32_t ignore, T* dlogits, index_t ldd,
                          double scale, const backend::cpu& be) {
  using A = accum_t<T>;
  const index_t blocks = (rows + row_block - 1) / row_block;
  std::vector<double> part(static_cast<std::size_t>(blocks), 0.0);
  parallel_for(blocks, worker_count(be, blocks), [&](index_t b, int) {
    double sum = 0;
    for (index_t r = b * row_block; r < std::min(rows, (b + 1) * row_block); ++r) {
      const T* z = logits + r * ld;
      const std::int32_t y = labels[r];
      if (y == ignore) {
        if (dlogits != nullptr) std::fill_n(dlogits + r * ldd, V, T(0));
        continue;
      }
      A m = A(z[0]);
      for (index_t c = 1; c < V; ++c) m = std::max(m, A(z[c]));
      A l = 0;
      for (index_t c = 0; c < V; ++c) l += std::exp(A(z[c]) - m);
      const A lse = m + std::log(l);
      sum += double(lse - A(z[y]));
      if (dlogits != nullptr) {
        T* d = dlogits + r * ldd;
        for (index_t c = 0; c < V; ++c)
          d[c] = static_cast<T>((std::exp(A(z[c]) - lse) - (c == y ? A(1) : A(0))) * A(scale));
      }
    }
    part[static_cast<std::size_t>(b)] = sum;
  });
  double total = 0;
  for (double x : part) total += x;
  return total;
}

}  // namespace cpu
}  // namespace detail

namespace layers {

template <>
struct ops<backend::cpu> {
  // Nothing outlives a call on the CPU.
  struct handles {};

  template <class T>
  static constexpr bool computes = std::is_same_v<T, float> || std::is_same_v<T, double>;
  static constexpr const char* computes_message = "float or double";

  // One host allocation per call, carved in order (uninitialised, as the vectors it replaces
  // were about to be overwritten), aligned to the takes' 256 bytes: Eigen's vectorised sums start
  // their packets where the data is aligned, so an array's alignment sets the order of its sums,
  // and a call's bits would otherwise depend on where the allocator put its scratch.
  class scratch {
    struct release {
      void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t{256}); }
    };

   public:
    scratch(const backend::cpu&, std::size_t bytes)
        : buf_(bytes > 0
                   ? static_cast<unsigned char*>(::operator new[](bytes, std::align_val_t{256}))
                   : nullptr),
          at_(buf_.get(), bytes) {}
    template <class S>
    S* take(index_t n) {
      return at_.take<S>(n);
    }

   private:
    std::unique_ptr<unsigned char[], release> buf_;
    detail::scratch_cursor at_;
  };

  // y = x W^T (+ bias): x [rows, in] (row stride ldx), W [out, in], y [rows, out] (stride ldy).
  template <class C, class T, class B>
  static void gemm(const C& c, const T* x, index_t ldx, index_t rows, const T* W, index_t in,
                   index_t out, const B* bias, T* y, index_t ldy) {
    static_assert(std::is_same_v<B, T>, "attnmix::layers::ops<cpu>::gemm: bias in the rows' type");
    attnmix::detail::cpu::linear_rows(x, ldx, rows, W, in, out, bias, y, ldy, c.be);
  }

  // mean: RMSNorm y = x / sqrt(mean(x^2) + eps) * w; else the L2 norm x / sqrt(sum(x^2) + eps)
  // (w unused). Groups of `width` values; w shared or per group of a row.
  template <class C, class T, class W>
  static void norm(const C& c, const T* x, T* y, index_t groups, index_t width, const W* w,
                   bool per_group, index_t groups_per_row, bool mean, double eps) {
    if (mean) {
      attnmix::detail::cpu::rms_norm_groups(x, y, groups, width, w, per_group, groups_per_row, eps,
                                            c.be);
    } else {
      if (y != x) std::copy_n(x, groups * width, y);
      attnmix::detail::cpu::l2_norm_groups(y, groups, width, eps);
    }
  }

  // Causal depthwise conv over the rows of each sequence of c.layout; state_in: each sequence's
  // K-1 previous inputs (decoding); state_out receives its last K-1 inputs.
  template <class C, class T, class W>
  static void short_conv(const C& c, const T* x, T* y, index_t channels, const W* w, index_t K,
                         bool silu, const T* state_in = nullptr, T* state_out = nullptr) {
    attnmix::detail::cpu::short_conv_rows(x, y, c.layout, channels, w, K, silu, state_in, state_out,
                                          c.be);
  }

  template <class C, class T>
  static void rope(const C& c, T* x, index_t rows, index_t heads, index_t d, double theta) {
    attnmix::detail::cpu::rope_rows(x, rows, heads, d, c.positions, theta);
  }

  // y[i] = Fn(a[i], b[i]) in accum_t; b may be null (Fn sees 0). y may be a or b.
  template <class Fn, class C, class Y, class X, class Z = Y>
  static void map(const C&, Y* y, const X* a, const Z* b, index_t n) {
    using A = accum_t<Y>;
    for (index_t i = 0; i < n; ++i)
      y[i] = static_cast<Y>(apply(Fn{}, A(a[i]), b != nullptr ? A(b[i]) : A(0)));
  }

  // y[dst[r], :] = x[src[r], :] for r < rows; a null src or dst is the identity.
  template <class C, class X, class Y>
  static void move_rows(const C&, const X* x, Y* y, const std::int64_t* src,
                        const std::int64_t* dst, index_t rows, index_t width) {
    for (index_t r = 0; r < rows; ++r) {
      const X* in = x + (src ? src[r] : r) * width;
      Y* o = y + (dst ? dst[r] : r) * width;
      for (index_t e = 0; e < width; ++e) o[e] = static_cast<Y>(in[e]);
    }
  }

  // pos[r]: row r's position in its sequence of L (plus offset[n] for sequence n).
  static void positions(const backend::cpu&, std::int32_t* pos, const token_layout& L,
                        const std::vector<index_t>& offset = {}) {
    for (index_t n = 0; n < L.num_sequences(); ++n) {
      const index_t r0 = L.first_row(n), o = offset.empty() ? 0 : offset[std::size_t(n)];
      for (index_t t = 0; t < L.seq(n).length; ++t) pos[r0 + t] = std::int32_t(o + t);
    }
  }
  template <class S>
  static void upload(const backend::cpu&, S* dst, const S* src, index_t n) {
    if (n > 0) std::memcpy(dst, src, std::size_t(n) * sizeof(S));
  }
  template <class S>
  static void zero(const backend::cpu&, S* p, index_t n) {
    std::fill(p, p + n, S(0));
  }

  // Host memory needs no check beyond the views' space tags.
  template <class V>
  static void check_memory(const std::string&, const char*, const V&) {}

  // Wall-clock time of a block, for stack_inputs::on_layer.
  class timer {
   public:
    timer(const backend::cpu&, bool) {}
    void start() { t0_ = std::chrono::steady_clock::now(); }
    double seconds() const {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    }

   private:
    std::chrono::steady_clock::time_point t0_{};
  };

  // Host loops of the decoding paths, spread over the backend's threads.
  template <class Body>
  static void for_each(const backend::cpu& be, index_t n, Body&& body) {
    const int workers = attnmix::detail::cpu::worker_count(be, n);
    attnmix::detail::cpu::parallel_for(n, workers, [&](index_t i, int) { body(i); });
  }

  // ---- Backward (see layers/ops.hpp) ----
  template <class C, class T>
  static void gemm_dx(const C& c, const T* dy, index_t lddy, index_t rows, const T* W, index_t in,
                      index_t out, T* dx, index_t lddx, bool accumulate = false) {
    attnmix::detail::cpu::linear_rows_dx(dy, lddy, rows, W, in, out, dx, lddx, accumulate, c.be);
  }
  template <class C, class T, class G, class GB>
  static void gemm_dw(const C& c, const T* x, index_t ldx, index_t rows, const T* dy, index_t lddy,
                      index_t in, index_t out, G* dW, GB* dbias) {
    static_assert(std::is_same_v<G, T> && std::is_same_v<GB, T>,
                  "attnmix::layers::ops<cpu>::gemm_dw: gradients in the rows' type");
    attnmix::detail::cpu::linear_rows_dw(x, ldx, rows, dy, lddy, in, out, dW, dbias, c.be);
  }
  template <class C, class T, class W>
  static void norm_backward(const C& c, const T* x, const T* dy, T* dx, index_t groups,
                            index_t width, const W* w, bool per_group, index_t groups_per_row,
                            bool mean, double eps, W* dw, bool accumulate = false) {
    static_assert(std::is_same_v<W, T>, "attnmix::layers::ops<cpu>::norm_backward: weights in T");
    attnmix::detail::cpu::norm_groups_backward(x, dy, dx, groups, width, w, per_group,
                                               groups_per_row, mean, eps, dw, accumulate, c.be);
  }
  template <class C, class T, class W>
  static void short_conv_backward(const C& c, const T* x, const T* dy, T* dx, index_t channels,
                                  const W* w, index_t K, bool silu, W* dw,
                                  bool accumulate = false) {
    static_assert(std::is_same_v<W, T>,
                  "attnmix::layers::ops<cpu>::short_conv_backward: taps in T");
    attnmix::detail::cpu::short_conv_rows_backward(x, dy, dx, c.layout, channels, w, K, silu, dw,
                                                   accumulate, c.be);
  }
  template <class C, class T>
  static void rope_backward(const C& c, T* dx, index_t rows, index_t heads, index_t d,
                            double theta) {
    attnmix::detail::cpu::rope_rows(dx, rows, heads, d, c.positions, theta, true);
  }
  // da = dy dFn/da, db = dy dFn/db (written, or added when accumulate); db may be null (and is
  // for unary functions); da or db may be dy.
  template <class Fn, class C, class Y, class X, class Z = Y>
  static void map_backward(const C&, const Y* dy, const X* a, const Z* b, X* da, Z* db, index_t n,
                           bool accumulate = false) {
    using A = accum_t<Y>;
    for (index_t i = 0; i < n; ++i) {
      const auto [ga, gb] = slope(Fn{}, A(a[i]), b != nullptr ? A(b[i]) : A(0));
      const A g = A(dy[i]);
      if (da != nullptr) da[i] = static_cast<X>(accumulate ? A(da[i]) + g * ga : g * ga);
      if (db != nullptr) db[i] = static_cast<Z>(accumulate ? A(db[i]) + g * gb : g * gb);
    }
  }

  // ---- Training (see layers/ops.hpp) ----
  template <class C, class T>
  static void cross_entropy(const C& c, const T* logits, index_t ld, index_t rows, index_t V,
                            const std::int32_t* labels, std::int32_t ignore, T* dlogits,
                            index_t ldd, double scale, double* total) {
    *total += attnmix::detail::cpu::cross_entropy_rows(logits, ld, rows, V, labels, ignore, dlogits,
                                                       ldd, scale, c.be);
  }
  // One AdamW step on n values (PyTorch's torch.optim.AdamW): p *= 1 - lr wd; m, v the moving
  // moments of g; p -= lr m^ / (sqrt(v^) + eps) with the bias corrections of step `step` (>= 1).
  // With `copy`, the new p is also written there in Q (a 16-bit copy of float master weights).
  template <class P, class G, class S, class Q = P>
  static void adamw(const backend::cpu&, P* p, const G* g, S* m, S* v, index_t n, double lr,
                    double beta1, double beta2, double eps, double wd, index_t step,
                    Q* copy = nullptr) {
    const double c1 = 1 - std::pow(beta1, double(step)), c2 = 1 - std::pow(beta2, double(step));
    for (index_t i = 0; i < n; ++i) {
      const double gi = double(g[i]);
      const double mi = beta1 * double(m[i]) + (1 - beta1) * gi;
      const double vi = beta2 * double(v[i]) + (1 - beta2) * gi * gi;
      m[i] = static_cast<S>(mi);
      v[i] = static_cast<S>(vi);
      const double pi = double(p[i]) * (1 - lr * wd);
      p[i] = static_cast<P>(pi - lr * (mi / c1) / (std::sqrt(vi / c2) + eps));
      if (copy != nullptr) copy[i] = static_cast<Q>(p[i]);
    }
  }
  // *total += the sum of g[i]^2 in double (gradient clipping).
  template <class G>
  static void sum_squares(const backend::cpu&, const G* g, index_t n, double* total) {
    double s = 0;
    for (index_t i = 0; i < n; ++i) s += double(g[i]) * double(g[i]);
    *total += s;
  }
  // g *= max_norm / (norm + 1e-6) when norm = sqrt(*sum_squares) exceeds max_norm.
  template <class G>
  static void clip(const backend::cpu&, G* g, index_t n, const double* sum_squares,
                   double max_norm) {
    const double norm = std::sqrt(*sum_squares);
    if (!(norm > max_norm)) return;
    const double factor = max_norm / (norm + 1e-6);
    for (index_t i = 0; i < n; ++i) g[i] = static_cast<G>(double(g[i]) * factor);
  }
  template <class S>
  static void download(const backend::cpu&, S* dst, const S* src, index_t n) {
    std::copy_n(src, n, dst);
  }

  // y[r, :] = W[ids[r], :] for r < rows (W: [V, width]); ids already checked to be in [0, V).
  template <class C, class W, class Y>
  static void gather_rows(const C&, const W* w, const std::int32_t* ids, index_t rows,
                          index_t width, Y* y) {
    for (index_t r = 0; r < rows; ++r) {
      const W* src = w + index_t(ids[r]) * width;
      for (index_t e = 0; e < width; ++e) y[r * width + e] = static_cast<Y>(src[e]);
    }
  }
  // dW[ids[r], :] += dy[r, :] for r < rows, in row order (blocks of columns across the workers,
  // so that repeated ids sum in the same order whatever the thread count).
  template <class C, class Y, class G>
  static void scatter_add_rows(const C& c, const Y* dy, const std::int32_t* ids, index_t rows,
                               index_t width, G* dw) {
    constexpr index_t cols = 64;
    const index_t tasks = (width + cols - 1) / cols;
    attnmix::detail::cpu::parallel_for(
        tasks, attnmix::detail::cpu::worker_count(c.be, tasks), [&](index_t t, int) {
          const index_t e0 = t * cols, e1 = std::min(width, e0 + cols);
          for (index_t r = 0; r < rows; ++r) {
            G* dst = dw + index_t(ids[r]) * width;
            for (index_t e = e0; e < e1; ++e) dst[e] += static_cast<G>(dy[r * width + e]);
          }
        });
  }

 private:
  template <class A>
  static A apply(fn::silu_times, A g, A u) {
    return attnmix::detail::cpu::silu(g) * u;
  }
  template <class A>
  static A apply(fn::times_sigmoid, A o, A g) {
    return o * attnmix::detail::cpu::sigmoid(g);
  }
  template <class A>
  static A apply(fn::gelu, A x, A) {
    return attnmix::detail::cpu::gelu(x);
  }
  template <class A>
  static A apply(fn::relu, A x, A) {
    return x > A(0) ? x : A(0);
  }
  template <class A>
  static A apply(fn::log_sigmoid, A x, A) {
    return attnmix::detail::cpu::log_sigmoid(x);
  }
  template <class A>
  static A apply(fn::two_sigmoid, A x, A) {
    return A(2) * attnmix::detail::cpu::sigmoid(x);
  }
  template <class A>
  static A apply(fn::plus, A a, A b) {
    return a + b;
  }

  // (dFn/da, dFn/db) at (a, b).
  template <class A>
  struct pair {
    A a, b;
  };
  template <class A>
  static pair<A> slope(fn::silu_times, A g, A u) {
    const A s = attnmix::detail::cpu::sigmoid(g);
    return {u * s * (A(1) + g * (A(1) - s)), g * s};
  }
  template <class A>
  static pair<A> slope(fn::times_sigmoid, A o, A g) {
    const A s = attnmix::detail::cpu::sigmoid(g);
    return {s, o * s * (A(1) - s)};
  }
  template <class A>
  static pair<A> slope(fn::gelu, A x, A) {
    const A pdf = std::exp(-x * x / A(2)) / std::sqrt(A(2) * A(3.14159265358979323846));
    return {A(0.5) * (A(1) + std::erf(x / std::sqrt(A(2)))) + x * pdf, A(0)};
  }
  template <class A>
  static pair<A> slope(fn::relu, A x, A) {
    return {x > A(0) ? A(1) : A(0), A(0)};
  }
  template <class A>
  static pair<A> slope(fn::log_sigmoid, A x, A) {
    return {attnmix::detail::cpu::sigmoid(-x), A(0)};
  }
  template <class A>
  static pair<A> slope(fn::two_sigmoid, A x, A) {
    const A s = attnmix::detail::cpu::sigmoid(x);
    return {A(2) * s * (A(1) - s), A(0)};
  }
  template <class A>
  static pair<A> slope(fn::plus, A, A) {
    return {A(1), A(1)};
  }
};

static_assert(has_training_ops_v<backend::cpu>, "ops<backend::cpu> lacks an operation");

}  // namespace layers
}  // namespace attnmix
