#pragma once
// train::language_model: token ids -> embeddings -> a stack -> the output head -> logits, and the
// mean cross-entropy against labels with the gradient of every parameter (fla's ForCausalLM
// layout and names: "model.embeddings.weight", "model.layers.{i}....", "model.norm.weight",
// "lm_head.weight"). For a causal stack, labels[b, t] = tokens[b, t + 1] is next-token
// prediction; any other labelling (a classification per position) works the same.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/host_tensor.hpp"
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
  using scalar = T;  // the compute type of the stack: its activations and logits
  using backend_type = Backend;

  // Throws attnmix::error for vocab < 1 or a table too large to address (before any member is
  // built), and for a config the stack rejects.
  language_model(const layers::config& c, index_t vocab)
      : stack(checked(c, vocab)), embeddings(vocab, c.hidden_size), lm_head(c.hidden_size, vocab) {}

  // The same model on another backend or in another type (a device model from a host one): every
  // weight copied (and rounded) once, as the stack's converting constructor does.
  template <class Other>
  explicit language_model(const language_model<Other>& other)
      : logits_rows(other.logits_rows),
        stack(other.stack),
        embeddings(other.embeddings),
        lm_head(other.lm_head) {}

  index_t vocab() const { return embeddings.vocab(); }
  index_t hidden_size() const { return stack.hidden_size(); }

  // logits [B, T, V] (contiguous, in the backend's memory, apart from tokens and the weights) of
  // tokens [B, T] (host memory, any row stride, ids in [0, vocab)). Throws
  // attnmix::error naming the argument, and writes nothing, on a bad id, shape or layout.
  void forward(const ids_view& tokens, const view3<T>& logits,
               const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::train::language_model::forward";
    check_members(fn);
    check_ids_layout(fn, "tokens", tokens);
    const index_t B = tokens.extent(0), Tn = tokens.extent(1), D = hidden_size(), V = vocab();
    detail::check_given(fn, "logits", logits);
    detail::check_layout(fn, "logits", logits);
    detail::check_space(fn, "logits", logits, space_of_v<Backend>, Backend::name);
    detail::check_shape(fn, "logits", logits, {B, Tn, V}, "[B, T, vocab]");
    // The head writes rows x vocab values from logits.data() on.
    check_contiguous(fn, "logits", logits, "[B, T, vocab]");
    O::check_memory(fn, "logits", logits);
    if (logits.space() == tokens.space())
      detail::check_no_alias(fn, "logits", logits, "tokens", tokens);
    check_apart_from_weights(fn, "logits", logits);
    const index_t rows = check_rows(fn, tokens);
    const std::vector<std::int32_t> ids_host = read_ids(fn, "tokens", tokens, false);
    if (rows == 0) return;
    typename O::scratch s(
        be, layers::scratch_bytes<std::int32_t>(rows) + layers::scratch_bytes<T>(rows * D) * 2);
    std::int32_t* ids = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(rows * D), *h = s.template take<T>(rows * D);
    const layers::token_layout L{1, rows, {}};
    const layers::context<Backend> c{be, L, nullptr, handles_};
    O::upload(be, ids, ids_host.data(), rows);
    embeddings.apply(c, ids, rows, x);
    stack.forward(view3<const T>(x, {B, Tn, D}, space_of_v<Backend>),
                  view3<T>(h, {B, Tn, D}, space_of_v<Backend>), {}, be);
    lm_head.apply(c, h, rows, logits.data());
  }

  // The mean cross-entropy of the logits of tokens [B, T] against labels [B, T] (both host
  // memory, any row stride; a label is a class in [0, vocab) or ignore_label) over the
  // labels not ignored (0 if all are). With `backward`, every parameter's gradient of that mean
  // is added to its .grad. Throws attnmix::error naming the argument (and changes nothing) on an
  // id out of range, a bad layout or mismatched shapes.
  double loss(const ids_view& tokens, const ids_view& labels, bool backward = true,
              const Backend& be = Backend{}) {
    static_assert(layers::has_training_ops_v<Backend>,
                  "attnmix::train::language_model::loss: layers::ops<Backend> lacks a training "
                  "operation (the list is in attnmix/layers/ops.hpp)");
    const std::string fn = "attnmix::train::language_model::loss";
    check_members(fn);
    detail::require(logits_rows >= 0, fn, "logits_rows",
                    "must be >= 0 (0: every row at once) but is ", logits_rows);
    check_ids_layout(fn, "tokens", tokens);
    check_ids_layout(fn, "labels", labels);
    detail::require(labels.shape() == tokens.shape(), fn, "labels", "has shape ",
                    detail::shape_of(labels), " but must have the shape of 'tokens', ",
                    detail::shape_of(tokens));
    const index_t rows = check_rows(fn, tokens);
    const std::vector<std::int32_t> ids_host = read_ids(fn, "tokens", tokens, false),
                                    labels_host = read_ids(fn, "labels", labels, true);
    const index_t B = tokens.extent(0), Tn = tokens.extent(1), D = hidden_size(), V = vocab();
    index_t count = 0;
    for (const std::int32_t y : labels_host) count += y != ignore_label;
    if (count == 0) return 0.0;
    // The head and the cross-entropy run on blocks of logits_rows rows: with a large vocabulary
    // [rows, V] logits need not exist at once (32k tokens of a 32k vocabulary are 2^30 of them).
    const index_t block = logits_block(rows);
    typename O::scratch s(be, layers::scratch_bytes<std::int32_t>(rows) * 2 +
                                  layers::scratch_bytes<T>(rows * D) * 2 +
                                  layers::scratch_bytes<T>(block * V) * (backward ? 2 : 1));
    std::int32_t *ids = s.template take<std::int32_t>(rows),
                 *ys = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(rows * D), *h = s.template take<T>(rows * D);
    T* logits = s.template take<T>(block * V);
    T* dlogits = backward ? s.template take<T>(block * V) : nullptr;
    const layers::token_layout L{1, rows, {}};
    const layers::context<Backend> c{be, L, nullptr, handles_};
    O::upload(be, ids, ids_host.data(), rows);
    O::upload(be, ys, labels_host.data(), rows);
    const view3<const T> xv(x, {B, Tn, D}, space_of_v<Backend>);
    const view3<T> hv(h, {B, Tn, D}, space_of_v<Backend>);
    embeddings.apply(c, ids, rows, x);
    if (backward)
      stack.forward(xv, hv, saved_, {}, be);
    else
      stack.forward(xv, hv, {}, be);
    total_.resize(1);
    O::zero(be, total_.data(), 1);
    for (index_t r0 = 0; r0 < rows; r0 += block) {
      const index_t n = std::min(block, rows - r0);
      lm_head.apply(c, h + r0 * D, n, logits);
      O::cross_entropy(c, logits, V, n, V, ys + r0, ignore_label, dlogits, V, 1.0 / double(count),
                       total_.data());
      if (backward) lm_head.backward(c, h + r0 * D, n, dlogits, x + r0 * D);  // d(stack output)
    }
    if (backward) {
      stack.backward(view3<const T>(x, {B, Tn, D}, space_of_v<Backend>), hv, saved_, be);
      embeddings.backward(c, ids, rows, h);  // h holds d(embeddings) now
    }
    double sum = 0;  // the call's one read of a device value, after the whole backward is queued
    O::download(be, &sum, total_.data(), 1);
    return sum / double(count);
  }

  // Greedy generation (causal stacks): each prompt of prompts [N, P] (host memory, any row
  // stride, P >= 1) prefilled into a fresh cache of N sequences, then `steps` tokens a sequence,
  // each the argmax of the logits of the token before it (the smallest id among equal ones), fed
  // back one token a step through the stack's decode. Returns the new ids [N, steps], row n
  // continuing prompt n. Each step reads its N x vocab logits back to the host. Throws
  // attnmix::error naming the argument, before anything runs, on a bad id, shape or step count.
  host_tensor<std::int32_t, 2> generate(const ids_view& prompts, index_t steps,
                                        const Backend& be = Backend{}) const {
    return generate(prompts, {}, steps, be);
  }
  // The same for prompts of several lengths packed as [1, total] with cu_seqlens (host, N + 1
  // offsets from 0 to total; every prompt holds a token).
  host_tensor<std::int32_t, 2> generate(const ids_view& prompts,
                                        const view1<const std::int32_t>& cu_seqlens, index_t steps,
                                        const Backend& be = Backend{}) const {
    static_assert(Stack::causal, "attnmix::train::language_model::generate: a causal stack");
    const std::string fn = "attnmix::train::language_model::generate";
    check_members(fn);
    check_ids_layout(fn, "prompts", prompts);
    const index_t B = prompts.extent(0), P = prompts.extent(1), D = hidden_size(), V = vocab();
    const detail::packed_batch pb = detail::resolve_packed_batch(fn, cu_seqlens, B, P, "prompts");
    const index_t N = pb.sequences;
    std::vector<std::int32_t> cu;  // the prompts' offsets in rows
    for (index_t n = 0; n <= N; ++n)
      cu.push_back(pb.cu_seqlens != nullptr ? pb.cu_seqlens[n] : std::int32_t(n * P));
    index_t longest = 0;
    for (index_t n = 0; n < N; ++n) {
      const index_t len = cu[std::size_t(n + 1)] - cu[std::size_t(n)];
      detail::require(len >= 1, fn, "prompts", "has a prompt of ", len, " tokens (sequence ", n,
                      "), but each prompt needs a token");
      longest = std::max(longest, len);
    }
    detail::require(steps >= 0 && steps <= std::numeric_limits<std::int32_t>::max() - longest, fn,
                    "steps", "must be >= 0 (and a prompt plus steps within 2^31 tokens) but is ",
                    steps);
    const index_t rows = check_rows(fn, prompts);
    const std::vector<std::int32_t> ids_host = read_ids(fn, "prompts", prompts, false);
    host_tensor<std::int32_t, 2> out({N, steps});
    if (N == 0 || steps == 0) return out;
    auto cache = stack.make_cache(N, longest + steps);
    // The decoding steps' N <= rows ids and embeddings reuse the prompts' arrays.
    using layers::scratch_bytes;
    typename O::scratch s(be, scratch_bytes<std::int32_t>(rows) + scratch_bytes<T>(rows * D) * 2 +
                                  scratch_bytes<std::int64_t>(N) + scratch_bytes<T>(N * D) +
                                  scratch_bytes<T>(N * V));
    std::int32_t* ids = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(rows * D), *h = s.template take<T>(rows * D);
    std::int64_t* last_rows = s.template take<std::int64_t>(N);
    T* last = s.template take<T>(N * D);
    T* logits = s.template take<T>(N * V);
    const layers::context<Backend> c{be, layers::token_layout{1, rows, {}}, nullptr, handles_};
    O::upload(be, ids, ids_host.data(), rows);
    embeddings.apply(c, ids, rows, x);
    stack.prefill(view3<const T>(x, {B, P, D}, space_of_v<Backend>),
                  view3<T>(h, {B, P, D}, space_of_v<Backend>), cache, cu_seqlens, be);
    std::vector<std::int64_t> at(static_cast<std::size_t>(N));
    for (index_t n = 0; n < N; ++n) at[std::size_t(n)] = cu[std::size_t(n + 1)] - 1;
    O::upload(be, last_rows, at.data(), N);
    O::move_rows(c, h, last, last_rows, static_cast<const std::int64_t*>(nullptr), N, D);
    std::vector<T> z(static_cast<std::size_t>(N * V));
    std::vector<std::int32_t> next(static_cast<std::size_t>(N));
    for (index_t t = 0;; ++t) {
      lm_head.apply(c, last, N, logits);
      O::download(be, z.data(), logits, N * V);
      for (index_t n = 0; n < N; ++n) {
        const T* row = z.data() + n * V;
        index_t best = 0;
        for (index_t v = 1; v < V; ++v)
          if (static_cast<accum_t<T>>(row[v]) > static_cast<accum_t<T>>(row[best])) best = v;
        out(n, t) = next[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(best);
      }
      if (t + 1 == steps) break;
      O::upload(be, ids, next.data(), N);
      embeddings.apply(c, ids, N, x);
      stack.decode(view3<const T>(x, {N, 1, D}, space_of_v<Backend>),
                   view3<T>(last, {N, 1, D}, space_of_v<Backend>), cache, be);
    }
    return out;
  }

  // loss() keeps what the training forward saves (the activations of every layer) from one call
  // to the next and grows it as needed, so that steps after the first allocate nothing; this
  // frees it.
  void release_activations() { saved_ = typename Stack::saved_type{}; }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

  // Rows of logits that loss() forms at once (the head and the cross-entropy run a block of rows
  // at a time, so that [rows, vocab] logits need not exist together); 0, the default: all rows.
  // Any count gives the same loss and gradients up to the rounding of the head's weight
  // gradient, summed a block at a time.
  index_t logits_rows = 0;

  Stack stack;
  layers::embedding<T, Backend> embeddings;
  layers::linear<T, Backend> lm_head;

 private:
  index_t logits_block(index_t rows) const {
    return std::max<index_t>(1, logits_rows > 0 ? std::min(rows, logits_rows) : rows);
  }

  typename O::handles handles_{};     // the embedding's and the head's (cuBLAS on the GPU)
  typename Stack::saved_type saved_;  // loss()'s training forward, kept (release_activations)
  layers::buffer<double, typename Backend::memory_space> total_;  // loss()'s summed loss

  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.embeddings.visit_parameters(f, prefix + "model.embeddings.");
    s.stack.visit_parameters(f, prefix + "model.");
    s.lm_head.visit_parameters(f, prefix + "lm_head.");
  }

  // c, once the model's own argument is checked: the first member initialiser calls it, so that
  // a bad vocabulary is an attnmix::error before any member is built (the stack checks c).
  static const layers::config& checked(const layers::config& c, index_t vocab) {
    const std::string fn = "attnmix::train::language_model";
    detail::require(vocab >= 1, fn, "vocab", "must be >= 1 but is ", vocab);
    // The embedding table and the head hold vocab x hidden_size values of up to 8 bytes.
    index_t n = 0;
    detail::require(
        c.hidden_size < 1 ||
            detail::checked_mul(vocab, c.hidden_size, n, std::numeric_limits<index_t>::max() / 8),
        fn, "vocab", "is ", vocab, ", which with hidden_size ", c.hidden_size,
        " makes the embedding table too large to address");
    return c;
  }

  // The public members must still agree (each can be replaced): the table and the head are
  // [vocab, hidden_size], hidden_size the stack's width.
  void check_members(const std::string& fn) const {
    const index_t V = vocab(), D = hidden_size();
    const std::vector<index_t> table{V, D};
    detail::require(embeddings.width() == D && embeddings.weight.shape == table, fn, "embeddings",
                    "has a table of shape ", layers::shape_string(embeddings.weight.shape),
                    " but must be [vocab, hidden_size] = [", V, ", ", D, "]");
    detail::require(
        lm_head.in_features() == D && lm_head.out_features() == V && lm_head.weight.shape == table,
        fn, "lm_head", "has a weight of shape ", layers::shape_string(lm_head.weight.shape),
        " but must be [vocab, hidden_size] = [", V, ", ", D, "]");
  }

  // ids [B, T] in host memory; they are read one by one, so any row stride does.
  static void check_ids_layout(const std::string& fn, const char* arg, const ids_view& ids) {
    detail::check_given(fn, arg, ids);
    detail::check_layout(fn, arg, ids);
    detail::check_space(fn, arg, ids, memory_space::host, "reading ids");
  }

  // Rows of a batch of this shape, once every buffer of them (rows x max(D, V) values, a few of
  // each, of up to 8 bytes) is known to be addressable.
  index_t check_rows(const std::string& fn, const ids_view& tokens) const {
    index_t rows = 0, n = 0;
    const bool fits = detail::checked_mul(tokens.extent(0), tokens.extent(1), rows) &&
                      detail::checked_mul(rows, std::max(hidden_size(), vocab()), n,
                                          std::numeric_limits<index_t>::max() / 64);
    detail::require(fits, fn, "tokens", "has shape ", detail::shape_of(tokens),
                    ", too many rows for buffers of hidden_size ", hidden_size(), " and vocab ",
                    vocab());
    return rows;
  }

  // The ids of the view, row-major: exactly the values that are checked are the ones used. Each
  // in [0, vocab) (or ignore_label, for labels).
  std::vector<std::int32_t> read_ids(const std::string& fn, const char* arg, const ids_view& ids,
                                     bool may_ignore) const {
    std::vector<std::int32_t> out;
    out.reserve(static_cast<std::size_t>(ids.extent(0) * ids.extent(1)));
    for (index_t b = 0; b < ids.extent(0); ++b)
      for (index_t t = 0; t < ids.extent(1); ++t) {
        const std::int32_t id = ids(b, t);
        if (!(may_ignore && id == ignore_label))
          detail::require(id >= 0 && id < vocab(), fn, arg, "holds ", id, " at [", b, ", ", t,
                          "], outside the vocabulary [0, ", vocab(), ")",
                          may_ignore ? " (and not ignore_label)" : "");
        out.push_back(id);
      }
    return out;
  }

  // A view written as size() values from data() on must be row-major without gaps (a dimension
  // of extent 1 may have any stride).
  template <class V>
  static void check_contiguous(const std::string& fn, const char* arg, const V& v,
                               const char* dims) {
    index_t expected = 1;
    bool dense = true;
    for (int i = V::rank - 1; i >= 0; --i) {
      if (v.extent(i) > 1 && v.stride(i) != expected) dense = false;
      expected *= v.extent(i);
    }
    detail::require(dense || v.size() == 0, fn, arg, "must be contiguous (", dims,
                    " row-major) but has shape ", detail::shape_of(v), " and strides ",
                    detail::shape_string(v.strides().data(), V::rank));
  }

  // An output of a const call may not be written into the model's own weights.
  template <class V>
  void check_apart_from_weights(const std::string& fn, const char* arg, const V& v) const {
    if (v.size() == 0) return;
    const auto out = detail::byte_range(v);
    visit_parameters([&](const std::string& name, const auto& p) {
      if (p.numel() == 0) return;
      const auto first = reinterpret_cast<std::uintptr_t>(p.ptr());
      const auto last = first + static_cast<std::uintptr_t>(p.numel()) * sizeof(*p.ptr()) - 1;
      detail::require(out.second < first || last < out.first, fn, arg,
                      "overlaps the model's parameter '", name, "'");
    });
  }
};

}  // namespace train
}  // namespace attnmix
