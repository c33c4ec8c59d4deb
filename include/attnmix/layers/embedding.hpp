#pragma once
// layers::embedding: token ids to rows of a table (PyTorch's nn.Embedding), weight [vocab, D]
// in T. Ids are checked by the caller (a language model checks every id before it runs).

#include <cstdint>
#include <string>

#include "attnmix/core/scalar.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

template <class T, class Backend = backend::cpu>
class embedding {
  using space = typename Backend::memory_space;

 public:
  embedding() = default;
  embedding(index_t vocab, index_t width) : weight({vocab, width}), vocab_(vocab), width_(width) {}
  template <class U, class B>
  explicit embedding(const embedding<U, B>& other)
      : weight(other.weight), vocab_(other.vocab()), width_(other.width()) {}

  index_t vocab() const { return vocab_; }
  index_t width() const { return width_; }

  // y[r, :] = weight[ids[r], :]; ids: [rows] in the backend's memory, each in [0, vocab).
  template <class Y>
  void apply(const context<Backend>& c, const std::int32_t* ids, index_t rows, Y* y) const {
    ops<Backend>::gather_rows(c, weight.ptr(), ids, rows, width_, y);
  }
  // weight.grad[ids[r], :] += dy[r, :].
  template <class Y>
  void backward(const context<Backend>& c, const std::int32_t* ids, index_t rows, const Y* dy) {
    ops<Backend>::scatter_add_rows(c, dy, ids, rows, width_, weight.grad_ptr());
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    f(prefix + "weight", weight);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    f(prefix + "weight", weight);
  }

  parameter<T, space> weight;

 private:
  index_t vocab_ = 0, width_ = 0;
};

}  // namespace layers
}  // namespace attnmix
