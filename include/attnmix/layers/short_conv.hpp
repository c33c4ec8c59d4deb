#pragma once
// layers::short_conv: causal depthwise convolution over time (fla's ShortConvolution, an
// nn.Conv1d with groups = channels, no bias), optionally followed by SiLU:
//   y[t, c] = act( sum_{r<K} weight[c, 0, r] x[t-(K-1)+r, c] ),   weight [C, 1, K]
// Tap K-1 multiplies the current token. Inputs before a sequence's start are zero, so the
// convolution restarts at every sequence (and cu_seqlens segment) boundary. For decoding it
// keeps a rolling state of each sequence's last K-1 inputs (host memory: decoding runs on host
// backends for now). The taps are in accum_t<T>.

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

// Rolling state of N sequences: their last K-1 inputs, [N, K-1, C], oldest first, in Space.
template <class T, class Space = host_space>
struct conv_state;

template <class T>
struct conv_state<T, host_space> {
  index_t sequences = 0, taps = 0, channels = 0;  // taps = K-1
  std::vector<T> data;
  conv_state() = default;
  conv_state(index_t n, index_t k, index_t c)
      : sequences(n),
        taps(k - 1),
        channels(c),
        data(static_cast<std::size_t>(n * (k - 1) * c), T(0)) {}

  T* row(index_t n) { return data.data() + n * taps * channels; }
  const T* row(index_t n) const { return data.data() + n * taps * channels; }

  // The states of slots[0..N) as a state of N sequences (in that order).
  conv_state gather(const std::vector<index_t>& slots) const {
    conv_state out(static_cast<index_t>(slots.size()), taps + 1, channels);
    for (std::size_t n = 0; n < slots.size(); ++n)
      std::copy_n(row(slots[n]), taps * channels, out.row(static_cast<index_t>(n)));
    return out;
  }
  // Sequence n of `from` into slot slots[n]; the other slots are left as they are.
  void scatter(const conv_state& from, const std::vector<index_t>& slots) {
    for (std::size_t n = 0; n < slots.size(); ++n)
      std::copy_n(from.row(static_cast<index_t>(n)), taps * channels, row(slots[n]));
  }
};

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
  // buffers). If `final` is given (host backends) it receives each sequence's rolling state
  // (sized for c.layout.num_sequences()).
  template <class Y>
  void apply(const context<Backend>& c, const T* x, Y* y,
             conv_state<T, space>* final = nullptr) const {
    if constexpr (on_host_v<Backend>) {
      if (final != nullptr) {
        ops<Backend>::short_conv(c, x, y, channels_, weight.ptr(), kernel_, silu_,
                                 static_cast<const T*>(nullptr), final->data.data());
        return;
      }
    }
    (void) final;  // states live on the host: a device call has none
    ops<Backend>::short_conv(c, x, y, channels_, weight.ptr(), kernel_, silu_);
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

  // One decoding step for N sequences: x, y [N, C]; `state` moves on by one token (host).
  void step(const T* x, T* y, index_t N, conv_state<T, space>& state, const Backend& be) const {
    static_assert(on_host_v<Backend>, "attnmix::layers::short_conv: decoding runs on the host");
    const token_layout L{N, 1, {}};
    const typename ops<Backend>::handles h{};
    std::vector<T> next(state.data.size());
    ops<Backend>::short_conv(context<Backend>{be, L, nullptr, h}, x, y, channels_, weight.ptr(),
                             kernel_, silu_, static_cast<const T*>(state.data.data()), next.data());
    state.data.swap(next);
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
