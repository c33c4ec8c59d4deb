#pragma once
// layers::rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last `width` values of each
// row (fla's RMSNorm); weight [width] in accum_t<T>, statistics in accum_t<T>.
// layers::head_rms_norm: the same per head of a [rows, heads, d] buffer, with a weight of [d]
// (shared by the heads, fla's Attention qk-norm) or [heads * d] (fla's FoX GroupNorm qk-norm).
// Both run on ops<Backend>::norm; input and output types may differ (the float residual stream
// of a stack into its compute type).

#include <cmath>
#include <string>

#include "attnmix/core/scalar.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

namespace detail {
// eps, checked finite and > 0 (a NaN or negative eps makes every output NaN).
inline double checked_eps(const char* layer, double eps) {
  attnmix::detail::require(std::isfinite(eps) && eps > 0, std::string("attnmix::layers::") + layer,
                           "eps", "must be finite and > 0 but is ", eps);
  return eps;
}
}  // namespace detail

template <class T, class Backend = backend::cpu>
class rms_norm {
  using space = typename Backend::memory_space;

 public:
  rms_norm() = default;
  explicit rms_norm(index_t width, double eps = 1e-6)
      : weight({width}, accum_t<T>(1)), width_(width), eps_(detail::checked_eps("rms_norm", eps)) {}
  template <class U, class B>
  explicit rms_norm(const rms_norm<U, B>& other)
      : weight(other.weight), width_(other.width()), eps_(other.eps()) {}

  index_t width() const { return width_; }
  double eps() const { return eps_; }

  // x, y: [rows, width] (may be the same buffer).
  template <class In, class Out>
  void apply(const context<Backend>& c, const In* x, index_t rows, Out* y) const {
    ops<Backend>::norm(c, x, y, rows, width_, weight.ptr(), false, 1, true, eps_);
  }
  void apply(const T* x, index_t rows, T* y, const Backend& be) const {
    const typename ops<Backend>::handles h{};
    const token_layout L{1, rows, {}};
    apply(context<Backend>{be, L, nullptr, h}, x, rows, y);
  }
  // Backward of apply, from the forward's input x: weight.grad += (dy x / rms) summed over the
  // rows, dx written (or added with `accumulate`); dx may be dy. x, dy and dx in T, or (a stack's
  // residual stream in mixed precision) in accum_t<T>.
  template <class X, class G>
  void backward(const context<Backend>& c, const X* x, index_t rows, const G* dy, G* dx,
                bool accumulate = false) {
    ops<Backend>::norm_backward(c, x, dy, dx, rows, width_, weight.ptr(), false, 1, true, eps_,
                                weight.grad_ptr(), accumulate);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
  }

  parameter<accum_t<T>, space> weight;

 private:
  index_t width_ = 0;
  double eps_ = 1e-6;
};

template <class T, class Backend = backend::cpu>
class head_rms_norm {
  using space = typename Backend::memory_space;

 public:
  head_rms_norm() = default;
  // per_head: weight [heads * d]; else weight [d].
  head_rms_norm(index_t heads, index_t d, bool per_head, double eps = 1e-5)
      : weight({per_head ? heads * d : d}, accum_t<T>(1)),
        heads_(heads),
        d_(d),
        per_head_(per_head),
        eps_(detail::checked_eps("head_rms_norm", eps)) {}
  template <class U, class B>
  explicit head_rms_norm(const head_rms_norm<U, B>& other)
      : weight(other.weight),
        heads_(other.heads()),
        d_(other.head_dim()),
        per_head_(other.per_head()),
        eps_(other.eps()) {}

  index_t heads() const { return heads_; }
  index_t head_dim() const { return d_; }
  bool per_head() const { return per_head_; }
  double eps() const { return eps_; }

  // x, y: [rows, heads, d] (may be the same buffer).
  template <class In, class Out>
  void apply(const context<Backend>& c, const In* x, index_t rows, Out* y) const {
    ops<Backend>::norm(c, x, y, rows * heads_, d_, weight.ptr(), per_head_, heads_, true, eps_);
  }
  // Backward of apply, as rms_norm's.
  void backward(const context<Backend>& c, const T* x, index_t rows, const T* dy, T* dx,
                bool accumulate = false) {
    ops<Backend>::norm_backward(c, x, dy, dx, rows * heads_, d_, weight.ptr(), per_head_, heads_,
                                true, eps_, weight.grad_ptr(), accumulate);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
  }

  parameter<accum_t<T>, space> weight;

 private:
  index_t heads_ = 0, d_ = 0;
  bool per_head_ = false;
  double eps_ = 1e-5;
};

}  // namespace layers
}  // namespace attnmix
