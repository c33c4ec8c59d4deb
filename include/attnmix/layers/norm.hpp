#pragma once
// layers::rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last `width` values of each
// row (fla's RMSNorm); weight [width], statistics in accum_t<T>.
// layers::head_rms_norm: the same per head of a [rows, heads, d] buffer, with a weight of [d]
// (shared by the heads, fla's Attention qk-norm) or [heads * d] (fla's FoX GroupNorm qk-norm).

#include <string>

#include "attnmix/layers/common.hpp"
#include "attnmix/layers/detail/cpu_ops.hpp"

namespace attnmix {
namespace layers {

template <class T>
class rms_norm {
 public:
  rms_norm() = default;
  explicit rms_norm(index_t width, double eps = 1e-6)
      : weight({width}, T(1)), width_(width), eps_(eps) {}

  index_t width() const { return width_; }
  double eps() const { return eps_; }

  // x, y: [rows, width] (may be the same buffer).
  void apply(const T* x, index_t rows, T* y, const backend::cpu& be) const {
    detail::rms_norm_groups(x, y, rows, width_, weight.ptr(), false, 1, eps_, be);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
  }

  parameter<T> weight;

 private:
  index_t width_ = 0;
  double eps_ = 1e-6;
};

template <class T>
class head_rms_norm {
 public:
  head_rms_norm() = default;
  // per_head: weight [heads * d]; else weight [d].
  head_rms_norm(index_t heads, index_t d, bool per_head, double eps = 1e-5)
      : weight({per_head ? heads * d : d}, T(1)),
        heads_(heads),
        d_(d),
        per_head_(per_head),
        eps_(eps) {}

  // x, y: [rows, heads, d] (may be the same buffer).
  void apply(const T* x, index_t rows, T* y, const backend::cpu& be) const {
    detail::rms_norm_groups(x, y, rows * heads_, d_, weight.ptr(), per_head_, heads_, eps_, be);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
  }

  parameter<T> weight;

 private:
  index_t heads_ = 0, d_ = 0;
  bool per_head_ = false;
  double eps_ = 1e-5;
};

}  // namespace layers
}  // namespace attnmix
