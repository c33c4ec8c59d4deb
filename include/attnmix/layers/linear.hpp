#pragma once
// layers::linear: a dense projection y = x W^T (+ b), PyTorch's nn.Linear layout.
//   weight [out, in], optional bias [out]; x: [rows, in] -> y: [rows, out].
// On the CPU it runs Eigen's GEMM per block of 256 rows, the blocks spread over the backend's
// threads. (A CUDA backend would call cuBLAS here; the layer API takes the backend object.)

#include <string>

#include "attnmix/layers/common.hpp"
#include "attnmix/layers/detail/cpu_ops.hpp"

namespace attnmix {
namespace layers {

template <class T>
class linear {
 public:
  linear() = default;
  linear(index_t in, index_t out, bool bias = false)
      : weight({out, in}), in_(in), out_(out), bias_(bias ? parameter<T>({out}) : parameter<T>()) {}

  index_t in_features() const { return in_; }
  index_t out_features() const { return out_; }
  bool has_bias() const { return !bias_.empty(); }

  // y[r, :] = x[r, :] W^T + b for r < rows; strides are row strides in elements.
  void apply(const T* x, index_t rows, T* y, const backend::cpu& be) const {
    apply(x, in_, rows, y, out_, be);
  }
  void apply(const T* x, index_t x_stride, index_t rows, T* y, index_t y_stride,
             const backend::cpu& be) const {
    detail::linear_rows(x, x_stride, rows, weight.ptr(), in_, out_,
                        has_bias() ? bias_.ptr() : nullptr, y, y_stride, be);
  }

  // Visits "<prefix>weight" and "<prefix>bias" (when present).
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
    if (has_bias()) f(prefix + "bias", bias_);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
    if (has_bias()) f(prefix + "bias", bias_);
  }

  parameter<T>& bias() { return bias_; }
  const parameter<T>& bias() const { return bias_; }

  parameter<T> weight;

 private:
  index_t in_ = 0, out_ = 0;
  parameter<T> bias_;
};

}  // namespace layers
}  // namespace attnmix
