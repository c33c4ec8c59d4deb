#pragma once
// train::language_model: token ids -> embeddings -> a stack -> the output head -> logits, and the
// mean cross-entropy against labels with the gradient of every parameter (fla's ForCausalLM
// layout and names: "model.embeddings.weight", "model.layers.{i}....", "model.norm.weight",
// "lm_head.weight"). For a causal stack, labels[b, t] = tokens[b, t + 1] is next-token
// prediction; any other labelling (a classification per position) works the same.

#include <cstdint>
#include <string>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/core/validate.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/embedding.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace train {

// Labels equal to this are not predicted (PyTorch's ignore_index).
inline constexpr std::int32_t ignore_label = -100;

template <class Stack>
class language_model {
  using T = typename Stack::scalar;
  using Backend = typename Stack::backend_type;
  using O = layers::ops<Backend>;
  using ids_view = tensor_view<const std::int32_t, 2>;

 public:
  language_model(const layers::config& c, index_t vocab)
      : stack(c), embeddings(vocab, c.hidden_size), lm_head(c.hidden_size, vocab) {
    detail::require(vocab >= 1, "attnmix::train::language_model", "vocab", "must be >= 1 but is ",
                    vocab);
  }

  // The same model on another backend or in another type (a device model from a host one): every
  // weight copied (and rounded) once, as the stack's converting constructor does.
  template <class Other>
  explicit language_model(const language_model<Other>& other)
      : stack(other.stack), embeddings(other.embeddings), lm_head(other.lm_head) {}

  index_t vocab() const { return embeddings.vocab(); }
  index_t hidden_size() const { return stack.hidden_size(); }

  // logits [B, T, V] of tokens [B, T] (host memory, ids in [0, vocab)).
  void forward(const ids_view& tokens, const view3<T>& logits,
               const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::train::language_model::forward";
    check_ids(fn, "tokens", tokens, false);
    detail::check_layout(fn, "logits", logits);
    detail::check_shape(fn, "logits", logits, {tokens.extent(0), tokens.extent(1), vocab()},
                        "[B, T, vocab]");
    const index_t rows = tokens.extent(0) * tokens.extent(1), D = hidden_size();
    typename O::scratch s(
        be, layers::scratch_bytes<std::int32_t>(rows) + layers::scratch_bytes<T>(rows * D) * 2);
    std::int32_t* ids = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(rows * D), *h = s.template take<T>(rows * D);
    const layers::token_layout L{1, rows, {}};
    const layers::context<Backend> c{be, L, nullptr, handles_};
    O::upload(be, ids, tokens.data(), rows);
    embeddings.apply(c, ids, rows, x);
    stack.forward(view3<const T>(x, {tokens.extent(0), tokens.extent(1), D}, space_of_v<Backend>),
                  view3<T>(h, {tokens.extent(0), tokens.extent(1), D}, space_of_v<Backend>), {},
                  be);
    lm_head.apply(c, h, rows, logits.data());
  }

  // The mean cross-entropy of the logits of tokens [B, T] against labels [B, T] (both host
  // memory; a label is a class in [0, vocab) or ignore_label) over the labels not ignored (0 if
  // all are). With `backward`, every parameter's gradient of that mean is added to its .grad.
  // Throws attnmix::error naming the argument (and changes nothing) on an id out of range or
  // mismatched shapes.
  double loss(const ids_view& tokens, const ids_view& labels, bool backward = true,
              const Backend& be = Backend{}) {
    const std::string fn = "attnmix::train::language_model::loss";
    check_ids(fn, "tokens", tokens, false);
    check_ids(fn, "labels", labels, true);
    detail::require(labels.shape() == tokens.shape(), fn, "labels", "has shape ",
                    detail::shape_of(labels), " but must have the shape of 'tokens', ",
                    detail::shape_of(tokens));
    const index_t B = tokens.extent(0), Tn = tokens.extent(1), rows = B * Tn, D = hidden_size();
    const index_t V = vocab();
    index_t count = 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t) count += labels(b, t) != ignore_label;
    if (count == 0) return 0.0;
    typename O::scratch s(be, layers::scratch_bytes<std::int32_t>(rows) * 2 +
                                  layers::scratch_bytes<T>(rows * D) * 2 +
                                  layers::scratch_bytes<T>(rows * V) * 2);
    std::int32_t *ids = s.template take<std::int32_t>(rows),
                 *ys = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(rows * D), *h = s.template take<T>(rows * D);
    T *logits = s.template take<T>(rows * V), *dlogits = s.template take<T>(rows * V);
    const layers::token_layout L{1, rows, {}};
    const layers::context<Backend> c{be, L, nullptr, handles_};
    O::upload(be, ids, tokens.data(), rows);
    O::upload(be, ys, labels.data(), rows);
    const view3<const T> xv(x, {B, Tn, D}, space_of_v<Backend>);
    const view3<T> hv(h, {B, Tn, D}, space_of_v<Backend>);
    embeddings.apply(c, ids, rows, x);
    typename Stack::saved_type saved;
    if (backward)
      stack.forward(xv, hv, saved, {}, be);
    else
      stack.forward(xv, hv, {}, be);
    lm_head.apply(c, h, rows, logits);
    const double sum = O::cross_entropy(c, logits, V, rows, V, ys, ignore_label,
                                        backward ? dlogits : nullptr, V, 1.0 / double(count));
    if (backward) {
      lm_head.backward(c, h, rows, dlogits, x);  // d(stack output) into x's room
      stack.backward(view3<const T>(x, {B, Tn, D}, space_of_v<Backend>), hv, saved, be);
      embeddings.backward(c, ids, rows, h);  // h holds d(embeddings) now
    }
    return sum / double(count);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

  Stack stack;
  layers::embedding<T, Backend> embeddings;
  layers::linear<T, Backend> lm_head;

 private:
  typename O::handles handles_{};  // the embedding's and the head's (cuBLAS on the GPU)

  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.embeddings.visit_parameters(f, prefix + "model.embeddings.");
    s.stack.visit_parameters(f, prefix + "model.");
    s.lm_head.visit_parameters(f, prefix + "lm_head.");
  }

  // ids [B, T] in host memory, contiguous, each in [0, vocab) (or ignore_label for labels).
  void check_ids(const std::string& fn, const char* arg, const ids_view& ids,
                 bool may_ignore) const {
    detail::check_layout(fn, arg, ids);
    detail::check_space(fn, arg, ids, memory_space::host, "reading ids");
    detail::require(ids.extent(1) <= 1 || ids.stride(0) == ids.extent(1) || ids.extent(0) <= 1, fn,
                    arg, "must be contiguous ([B, T] row-major)");
    for (index_t b = 0; b < ids.extent(0); ++b)
      for (index_t t = 0; t < ids.extent(1); ++t) {
        const std::int32_t id = ids(b, t);
        if (may_ignore && id == ignore_label) continue;
        detail::require(id >= 0 && id < vocab(), fn, arg, "holds ", id, " at [", b, ", ", t,
                        "], outside the vocabulary [0, ", vocab(), ")",
                        may_ignore ? " (and not ignore_label)" : "");
      }
  }
};

}  // namespace train
}  // namespace attnmix
