#pragma once
// layers::linear: a dense projection y = x W^T (+ b), PyTorch's nn.Linear layout.
//   weight [out, in] in T, optional bias [out] in accum_t<T>; x: [rows, in] -> y: [rows, out].
// Runs on ops<Backend>::gemm (Eigen per block of rows on the CPU, cuBLAS on the GPU). A linear
// on another backend or in another type is made from a host one by copying its weights once.

#include <cstdint>
#include <string>
#include <type_traits>

#include "attnmix/core/scalar.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

template <class T, class Backend = backend::cpu>
class linear {
  using space = typename Backend::memory_space;

 public:
  using bias_type = accum_t<T>;

  linear() = default;
  linear(index_t in, index_t out, bool bias = false)
      : weight({out, in}),
        in_(in),
        out_(out),
        bias_(bias ? parameter<bias_type, space>({out}) : parameter<bias_type, space>()) {}
  // The same projection with the weights copied (and rounded) to T in Backend's memory.
  template <class U, class B>
  explicit linear(const linear<U, B>& other)
      : weight(other.weight),
        in_(other.in_features()),
        out_(other.out_features()),
        bias_(other.bias()) {}

  index_t in_features() const { return in_; }
  index_t out_features() const { return out_; }
  bool has_bias() const { return !bias_.empty(); }

  // y[r, :] = x[r, :] W^T + b for r < rows; ldx, ldy: row strides in elements. Y is T, or the
  // float of gate logits where the backend writes them so.
  template <class Y>
  void apply(const context<Backend>& c, const T* x, index_t rows, Y* y) const {
    apply(c, x, in_, rows, y, out_);
  }
  template <class Y>
  void apply(const context<Backend>& c, const T* x, index_t ldx, index_t rows, Y* y,
             index_t ldy) const {
    ops<Backend>::gemm(c, x, ldx, rows, weight.ptr(), in_, out_,
                       has_bias() ? bias_.ptr() : static_cast<const bias_type*>(nullptr), y, ldy);
  }
  // The same as one call of its own.
  void apply(const T* x, index_t rows, T* y, const Backend& be) const {
    const typename ops<Backend>::handles h{};
    const token_layout L{1, rows, {}};
    apply(context<Backend>{be, L, nullptr, h}, x, rows, y);
  }

  // Backward of apply, from the forward's input x: weight.grad += dy^T x, bias.grad +=
  // colsum(dy), and dx = dy W (written, or added with `accumulate`; skipped when dx is null).
  void backward(const context<Backend>& c, const T* x, index_t rows, const T* dy, T* dx,
                bool accumulate = false) {
    backward(c, x, in_, rows, dy, out_, dx, in_, accumulate);
  }
  // The same with dy in another type (in mixed precision, the float gradient of gate logits):
  // rounded to T first, as every gradient that meets T's weights in a product.
  template <class G, std::enable_if_t<!std::is_same_v<G, T>, int> = 0>
  void backward(const context<Backend>& c, const T* x, index_t rows, const G* dy, T* dx,
                bool accumulate = false) {
    typename ops<Backend>::scratch s(c.be, scratch_bytes<T>(rows * out_));
    T* d = s.template take<T>(rows * out_);
    const std::int64_t* same = nullptr;
    ops<Backend>::move_rows(c, dy, d, same, same, rows, out_);
    backward(c, x, rows, d, dx, accumulate);
  }
  void backward(const context<Backend>& c, const T* x, index_t ldx, index_t rows, const T* dy,
                index_t lddy, T* dx, index_t lddx, bool accumulate = false) {
    ops<Backend>::gemm_dw(c, x, ldx, rows, dy, lddy, in_, out_, weight.grad_ptr(),
                          has_bias() ? bias_.grad_ptr() : static_cast<bias_type*>(nullptr));
    if (dx != nullptr)
      ops<Backend>::gemm_dx(c, dy, lddy, rows, weight.ptr(), in_, out_, dx, lddx, accumulate);
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

  parameter<bias_type, space>& bias() { return bias_; }
  const parameter<bias_type, space>& bias() const { return bias_; }

  parameter<T, space> weight;

 private:
  index_t in_ = 0, out_ = 0;
  parameter<bias_type, space> bias_;
};

}  // namespace layers
}  // namespace attnmix
