#pragma once
// layers::short_conv: causal depthwise convolution over time (fla's ShortConvolution, an
// nn.Conv1d with groups = channels, no bias), optionally followed by SiLU:
//   y[t, c] = act( sum_{r<K} weight[c, 0, r] x[t-(K-1)+r, c] ),   weight [C, 1, K]
// Tap K-1 multiplies the current token. Inputs before a sequence's start are zero, so the
// convolution restarts at every sequence (and cu_seqlens segment) boundary. For decoding it
// keeps a rolling state of each sequence's last K-1 inputs in the backend's memory. The taps are
// in accum_t<T>.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/core/scalar.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

// Rolling state of N sequences: their last K-1 inputs, [N, K-1, C], oldest first, in Space's
// memory: zeros when made, or (zeros false) left for the caller to write whole.
template <class T, class Space = host_space>
struct conv_state {
  index_t sequences = 0, taps = 0, channels = 0;  // taps = K-1
  buffer<T, Space> data;
  conv_state() = default;
  conv_state(index_t n, index_t k, index_t c, bool zeros = true)
      : sequences(n), taps(k - 1), channels(c) {
    if (zeros)
      data.assign(n * (k - 1) * c, T(0));
    else
      data.resize(n * (k - 1) * c);
  }
  index_t width() const { return taps * channels; }  // of one sequence's row
};

namespace detail {
// Rows of `width` values on c's backend: rows slots[n] of `from` into rows n of `to` (gather),
// or rows n of `from` into rows slots[n] of `to` (scatter); slots (host) distinct.
template <class Backend, class S>
void move_slots(const context<Backend>& c, const S* from, S* to, const std::vector<index_t>& slots,
                index_t width, bool gather) {
  using O = ops<Backend>;
  const auto N = static_cast<index_t>(slots.size());
  const std::vector<std::int64_t> idx(slots.begin(), slots.end());
  typename O::scratch s(c.be, scratch_bytes<std::int64_t>(N));
  std::int64_t* d = s.template take<std::int64_t>(N);
  O::upload(c.be, d, idx.data(), N);
  const std::int64_t* none = nullptr;
  O::move_rows(c, from, to, gather ? d : none, gather ? none : d, N, width);
}
}  // namespace detail

// The states of slots[0..N) of `from` as a state of N sequences (in that order), and back.
template <class Backend, class T, class Space>
conv_state<T, Space> gather(const context<Backend>& c, const conv_state<T, Space>& from,
                            const std::vector<index_t>& slots) {
  conv_state<T, Space> out(static_cast<index_t>(slots.size()), from.taps + 1, from.channels, false);
  detail::move_slots(c, from.data.data(), out.data.data(), slots, from.width(), true);
  return out;
}
// Sequence n of `from` into slot slots[n] of `to`; the other slots are left as they are.
template <class Backend, class T, class Space>
void scatter(const context<Backend>& c, const conv_state<T, Space>& from, conv_state<T, Space>& to,
             const std::vector<index_t>& slots) {
  detail::move_slots(c, from.data.data(), to.data.data(), slots, from.width(), false);
}

template <class T, class Backend = backend::cpu>
class short_conv {
  using space = typename Backend::memory_space;

 public:
  short_conv() = default;
  // Throws attnmix::error unless kernel >= 1 (and channels >= 0).
  short_conv(index_t channels, index_t kernel, bool silu = true)
      : weight({channels, 1, kernel}), channels_(channels), kernel_(kernel), silu_(silu) {
    attnmix::detail::require(kernel >= 1, "attnmix::layers::short_conv", "kernel",
                             "must be >= 1 but is ", kernel);
  }
  template <class U, class B>
  explicit short_conv(const short_conv<U, B>& other)
      : weight(other.weight),
        channels_(other.channels()),
        kernel_(other.kernel_size()),
        silu_(other.silu()) {}

  index_t channels() const { return channels_; }
  index_t kernel_size() const { return kernel_; }
  bool silu() const { return silu_; }

  // x: [rows, C] split into sequences by c.layout, y: [rows, C] in T or accum_t<T> (distinct
  // buffers). If `final` is given it receives each sequence's rolling state (sized for
  // c.layout.num_sequences()).
  template <class Y>
  void apply(const context<Backend>& c, const T* x, Y* y,
             conv_state<T, space>* final = nullptr) const {
    ops<Backend>::short_conv(c, x, y, channels_, weight.ptr(), kernel_, silu_,
                             static_cast<const T*>(nullptr),
                             final != nullptr ? final->data.data() : nullptr);
  }
  // The same as one call of its own, on the CPU-style host signature.
  void apply(const T* x, T* y, const token_layout& L, const Backend& be,
             conv_state<T, space>* final = nullptr) const {
    const typename ops<Backend>::handles h{};
    apply(context<Backend>{be, L, nullptr, h}, x, y, final);
  }

  // Backward of apply (without states), from the forward's input x: the taps' gradient added
  // to weight.grad, dx written (or added with `accumulate`); dx and dy distinct.
  void backward(const context<Backend>& c, const T* x, const T* dy, T* dx,
                bool accumulate = false) {
    ops<Backend>::short_conv_backward(c, x, dy, dx, channels_, weight.ptr(), kernel_, silu_,
                                      weight.grad_ptr(), accumulate);
  }
  // The same with dy in another type (in mixed precision, a float gradient): rounded to T first.
  template <class G, std::enable_if_t<!std::is_same_v<G, T>, int> = 0>
  void backward(const context<Backend>& c, const T* x, const G* dy, T* dx,
                bool accumulate = false) {
    const index_t n = c.rows() * channels_;
    typename ops<Backend>::scratch s(c.be, scratch_bytes<T>(n));
    T* d = s.template take<T>(n);
    const std::int64_t* same = nullptr;
    ops<Backend>::move_rows(c, dy, d, same, same, c.rows(), channels_);
    backward(c, x, d, dx, accumulate);
  }

  // One decoding step for the N = c.rows() sequences of c (one token each): x, y [N, C] (y in T
  // or accum_t<T>); `state` moves on by one token.
  template <class Y>
  void step(const context<Backend>& c, const T* x, Y* y, conv_state<T, space>& state) const {
    const index_t n = state.data.size();
    typename ops<Backend>::scratch s(c.be, scratch_bytes<T>(n));
    T* next = s.template take<T>(n);
    ops<Backend>::short_conv(c, x, y, channels_, weight.ptr(), kernel_, silu_,
                             static_cast<const T*>(state.data.data()), next);
    const std::int64_t* same = nullptr;
    ops<Backend>::move_rows(c, next, state.data.data(), same, same, state.sequences, state.width());
  }

  conv_state<T, space> make_state(index_t sequences) const {
    return conv_state<T, space>(sequences, kernel_, channels_);
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
  index_t channels_ = 0, kernel_ = 0;
  bool silu_ = true;
};

}  // namespace layers
}  // namespace attnmix
