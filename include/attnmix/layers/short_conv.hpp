#pragma once
// layers::short_conv: causal depthwise convolution over time (fla's ShortConvolution, an
// nn.Conv1d with groups = channels, no bias), optionally followed by SiLU:
//   y[t, c] = act( sum_{r<K} weight[c, 0, r] x[t-(K-1)+r, c] ),   weight [C, 1, K]
// Tap K-1 multiplies the current token. Inputs before a sequence's start are zero, so the
// convolution restarts at every sequence (and cu_seqlens segment) boundary. For decoding it
// keeps a rolling state of each sequence's last K-1 inputs.

#include <algorithm>
#include <string>
#include <vector>

#include "attnmix/layers/common.hpp"
#include "attnmix/layers/detail/cpu_ops.hpp"

namespace attnmix {
namespace layers {

// Rolling state of N sequences: their last K-1 inputs, [N, K-1, C], oldest first.
template <class T>
struct conv_state {
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

template <class T>
class short_conv {
 public:
  short_conv() = default;
  short_conv(index_t channels, index_t kernel, bool silu = true)
      : weight({channels, 1, kernel}), channels_(channels), kernel_(kernel), silu_(silu) {}

  index_t channels() const { return channels_; }
  index_t kernel_size() const { return kernel_; }

  // x, y: [rows, C] split into sequences by L (distinct buffers). If `final` is given it
  // receives each sequence's rolling state (sized for L.num_sequences()).
  void apply(const T* x, T* y, const token_layout& L, const backend::cpu& be,
             conv_state<T>* final = nullptr) const {
    detail::short_conv_rows<T>(x, y, L, channels_, weight.ptr(), kernel_, silu_, nullptr,
                               final ? final->data.data() : nullptr, be);
  }

  // One decoding step for N sequences: x, y [N, C]; `state` moves on by one token.
  void step(const T* x, T* y, index_t N, conv_state<T>& state, const backend::cpu& be) const {
    token_layout L{N, 1, {}};
    std::vector<T> next(state.data.size());
    detail::short_conv_rows(x, y, L, channels_, weight.ptr(), kernel_, silu_, state.data.data(),
                            next.data(), be);
    state.data.swap(next);
  }

  conv_state<T> make_state(index_t sequences) const {
    return conv_state<T>(sequences, kernel_, channels_);
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
  index_t channels_ = 0, kernel_ = 0;
  bool silu_ = true;
};

}  // namespace layers
}  // namespace attnmix
