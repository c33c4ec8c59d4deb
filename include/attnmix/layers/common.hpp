#pragma once
// Shared vocabulary of the parameterised layers: the runtime configuration, named parameters,
// the token layout of a (dense or packed) batch, and argument checks.
//
// Activations inside the layers are contiguous row-major [rows, features] buffers with
// rows = B * T (token-major, as [B, T, D] is laid out); every layer reads and writes whole rows.
// Parameters follow PyTorch's (and flash-linear-attention's) shapes: a linear map in -> out
// holds weight [out, in] and computes y = x W^T + b.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/memory_space.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/core/validate.hpp"

namespace attnmix {
namespace layers {

// Runtime sizes and constants shared by every layer of a model (fla's model config).
struct config {
  index_t hidden_size = 256;
  index_t num_heads = 4;          // query heads HQ
  index_t num_kv_heads = 0;       // KV heads H; 0: num_heads
  index_t head_dim = 0;           // d; 0: hidden_size / num_heads
  index_t intermediate_size = 0;  // MLP width; 0: fla's rule (see mlp_width)
  double norm_eps = 1e-6;         // block RMSNorms (attn_norm, mlp_norm, norm)
  double head_norm_eps = 1e-5;    // qk-norm and the gated RMSNorm of linear layers
  double rope_theta = 10000.0;    // RoPE base (attention layers whose policy enables RoPE)
  index_t w_rank = 32;            // PaTH: rank of the low-rank w projection (MHA only)
  std::optional<double> scale;    // softmax-family scale; default 1/sqrt(d)
  // SA / FoX layers: sliding window (a causal query i sees keys i-window < j <= i, a
  // bidirectional one |i-j| < window); 0: none. The other layers ignore it.
  index_t window = 0;

  index_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  index_t dim() const { return head_dim > 0 ? head_dim : hidden_size / num_heads; }
};

// Throws attnmix::error when a config cannot describe a layer: every size, head count, head
// dim, constant and window is checked, and the largest weight ([widest, widest] elements of 8
// bytes) must be addressable, so that no layer divides by zero, overflows a size or allocates
// a negative count while it is being built.
inline void validate_config(const std::string& fn, const config& c) {
  using attnmix::detail::require;
  require(c.hidden_size >= 1, fn, "config.hidden_size", "must be >= 1 but is ", c.hidden_size);
  require(c.num_heads >= 1, fn, "config.num_heads", "must be >= 1 but is ", c.num_heads);
  require(c.num_kv_heads >= 0, fn, "config.num_kv_heads", "must be >= 0 (0: num_heads) but is ",
          c.num_kv_heads);
  require(c.num_heads % c.kv_heads() == 0, fn, "config.num_kv_heads",
          "must divide num_heads = ", c.num_heads, " but is ", c.kv_heads());
  require(c.head_dim >= 0, fn, "config.head_dim",
          "must be >= 0 (0: hidden_size / num_heads) but is ", c.head_dim);
  require(c.dim() >= 1, fn, "config.head_dim", "must be >= 1 but resolves to ", c.dim(),
          " (hidden_size ", c.hidden_size, " / num_heads ", c.num_heads, ")");
  require(c.intermediate_size >= 0, fn, "config.intermediate_size",
          "must be >= 0 (0: the default width) but is ", c.intermediate_size);
  require(c.w_rank >= 1, fn, "config.w_rank", "must be >= 1 but is ", c.w_rank);
  require(c.window >= 0, fn, "config.window", "must be >= 0 (0: no window) but is ", c.window);
  const auto positive = [](double x) {
    return std::isfinite(x) && x > 0;
  };
  require(positive(c.norm_eps), fn, "config.norm_eps", "must be finite and > 0 but is ",
          c.norm_eps);
  require(positive(c.head_norm_eps), fn, "config.head_norm_eps", "must be finite and > 0 but is ",
          c.head_norm_eps);
  require(positive(c.rope_theta), fn, "config.rope_theta", "must be finite and > 0 but is ",
          c.rope_theta);
  require(!c.scale || std::isfinite(*c.scale), fn, "config.scale",
          "must be finite when given but is ", c.scale.value_or(0.0));
  // Every width a layer multiplies: hidden, HQ * d, H * d, the MLP's, the PaTH rank.
  const index_t max = std::numeric_limits<index_t>::max() / 8;
  const index_t mlp_default = c.hidden_size <= max / 4 ? 4 * c.hidden_size + 256 : max;
  index_t widest = std::max({c.hidden_size, mlp_default, c.intermediate_size, c.w_rank});
  index_t qd = 0, sq = 0;
  bool fits = attnmix::detail::checked_mul(c.num_heads, c.dim(), qd, max);
  widest = std::max(widest, qd);
  fits = fits && attnmix::detail::checked_mul(widest, widest, sq, max);
  require(fits, fn, "config.hidden_size", "with num_heads ", c.num_heads, ", head_dim ", c.dim(),
          ", intermediate_size ", c.intermediate_size, " and w_rank ", c.w_rank,
          " makes weights too large to address");
}

// c, once validate_config(fn, c) has passed: for the first member initialiser of a layer, so
// that a bad config is rejected before any member is built from it.
inline const config& checked(const std::string& fn, const config& c) {
  validate_config(fn, c);
  return c;
}

// One named tensor of a layer, owned, row-major, with a dynamic shape (rank 1-3), in the memory
// of Space. The host one (here) is what io::save / io::load and randomize_parameters read and
// write; the device one (attnmix/cuda/layer_ops.cuh) is made from it by copying it once.
inline std::string shape_string(const std::vector<index_t>& s);

template <class T, class Space = host_space>
struct parameter;

template <class T>
struct parameter<T, host_space> {
  std::vector<index_t> shape;
  std::vector<T> data;
  // d loss / d data, added to by the backward passes; empty until first used (grad_ptr()) or
  // zero_grad(). In accum_t<T> (float for half and bfloat16 weights).
  std::vector<accum_t<T>> grad;

  parameter() = default;
  // Throws attnmix::error for a negative extent or more elements than can be addressed.
  explicit parameter(std::vector<index_t> s, T fill = T(0)) : shape(std::move(s)) {
    const index_t max = std::numeric_limits<index_t>::max() / index_t(sizeof(double));
    index_t n = 1;
    for (index_t e : shape)
      attnmix::detail::require(e >= 0 && attnmix::detail::checked_mul(n, e, n, max),
                               "attnmix::layers::parameter", "shape", shape_string(shape),
                               " must have extents >= 0 whose product can be addressed");
    data.assign(static_cast<std::size_t>(n), fill);
  }
  index_t numel() const {
    return std::accumulate(shape.begin(), shape.end(), index_t{1},
                           [](index_t a, index_t b) { return a * b; });
  }
  bool empty() const { return shape.empty(); }
  const T* ptr() const { return data.data(); }
  T* ptr() { return data.data(); }
  // The gradient buffer, allocated (zero) on first use.
  accum_t<T>* grad_ptr() {
    if (grad.size() != data.size()) grad.assign(data.size(), accum_t<T>(0));
    return grad.data();
  }
  void zero_grad() { grad.assign(data.size(), accum_t<T>(0)); }
  // The values as doubles (exact for every storage type), and back (rounded to T): what
  // transfer_parameters moves between a host and a device model.
  void get_values(std::vector<double>& out) const {
    out.resize(data.size());
    for (std::size_t i = 0; i < data.size(); ++i) {
      if constexpr (std::is_arithmetic_v<T>)
        out[i] = static_cast<double>(data[i]);
      else  // half, bfloat16: exactly through float
        out[i] = static_cast<double>(static_cast<float>(data[i]));
    }
  }
  void set_values(const std::vector<double>& in) {
    attnmix::detail::require(in.size() == data.size(), "attnmix::layers::parameter::set_values",
                             "values", "has ", in.size(), " values but the parameter holds ",
                             data.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      if constexpr (std::is_arithmetic_v<T>)
        data[i] = static_cast<T>(in[i]);
      else  // half, bfloat16: rounded from float (a double rounds once to float first)
        data[i] = static_cast<T>(static_cast<float>(in[i]));
    }
  }
};

// An owned array of values in Space's memory: the activations a layer's forward saves for its
// backward. Sized by resize(); its contents are unspecified until written.
template <class S, class Space = host_space>
class buffer;

template <class S>
class buffer<S, host_space> {
 public:
  void resize(index_t n) { data_.resize(static_cast<std::size_t>(n)); }
  // n copies of value (what a decoding cache starts from).
  void assign(index_t n, S value) { data_.assign(static_cast<std::size_t>(n), value); }
  index_t size() const { return static_cast<index_t>(data_.size()); }
  S* data() { return data_.data(); }
  const S* data() const { return data_.data(); }

 private:
  std::vector<S> data_;
};

inline std::string shape_string(const std::vector<index_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// How the rows of an activation buffer split into sequences: a dense batch of B sequences of T
// tokens, or a packed batch (B == 1) with cu_seqlens offsets.
struct token_layout {
  index_t batch = 0, tokens = 0;
  std::vector<std::int32_t> cu_seqlens;  // empty: dense

  index_t rows() const { return batch * tokens; }
  bool packed() const { return !cu_seqlens.empty(); }
  index_t num_sequences() const {
    return packed() ? static_cast<index_t>(cu_seqlens.size()) - 1 : batch;
  }
  // Sequence n as (batch row, first token, length); rows of its tokens start at
  // batch * tokens + start.
  sequence seq(index_t n) const {
    if (!packed()) return {n, 0, tokens};
    return {0, cu_seqlens[static_cast<std::size_t>(n)],
            index_t{cu_seqlens[static_cast<std::size_t>(n) + 1]} -
                cu_seqlens[static_cast<std::size_t>(n)]};
  }
  index_t first_row(index_t n) const {
    const sequence s = seq(n);
    return s.batch * tokens + s.start;
  }
  view1<const std::int32_t> cu_view() const {
    if (!packed()) return {};
    return {cu_seqlens.data(), {static_cast<index_t>(cu_seqlens.size())}};
  }
  attention_params attention(const std::optional<double>& scale, index_t window = 0) const {
    attention_params p;
    p.scale = scale;
    p.window = window;
    p.cu_seqlens = cu_view();
    return p;
  }
};

// What a training forward ran on, kept in the saved state it fills, so that a backward can check
// that the state belongs to its call: the token layout and the sizes of the layer that made it
// (a state of fewer tokens or of another configuration would be read past its end).
struct saved_origin {
  bool made = false;
  token_layout layout;
  std::array<index_t, 6> sizes{};

  void record(const token_layout& L, const std::array<index_t, 6>& layer_sizes) {
    made = true, layout = L, sizes = layer_sizes;
  }
  // Throws attnmix::error naming `arg` unless a forward on L by a layer of these sizes made it.
  void check(const std::string& fn, const char* arg, const token_layout& L,
             const std::array<index_t, 6>& layer_sizes) const {
    using attnmix::detail::require;
    require(made, fn, arg, "was not filled by a training forward");
    require(
        layout.batch == L.batch && layout.tokens == L.tokens && layout.cu_seqlens == L.cu_seqlens,
        fn, arg, "was saved by a forward over ", layout.batch, " x ", layout.tokens, " tokens (",
        layout.num_sequences(), " sequences) but this call has ", L.batch, " x ", L.tokens, " (",
        L.num_sequences(), ")");
    require(sizes == layer_sizes, fn, arg, "was saved by a layer of sizes ",
            attnmix::detail::shape_string(sizes.data(), 6), " but this layer has ",
            attnmix::detail::shape_string(layer_sizes.data(), 6));
  }
};

// The cache slot of each sequence of a prefill or decoding call: slots[n] for sequence n (a
// batch row, or a cu_seqlens segment). Host int32 indices, distinct, in [0, the cache's
// sequences). Built from a view or a std::vector, which must outlive the call. Without one,
// sequence n uses slot n.
struct cache_slots {
  view1<const std::int32_t> slots;

  // No default constructor on purpose: `{}` in an argument list keeps meaning cu_seqlens.
  // NOLINTNEXTLINE(google-explicit-constructor)
  cache_slots(const view1<const std::int32_t>& s) : slots(s) {}
  // NOLINTNEXTLINE(google-explicit-constructor)
  cache_slots(const std::vector<std::int32_t>& s)
      : slots(s.data(), {static_cast<index_t>(s.size())}) {}
};

namespace detail {

// A [B, T, D] activation view the layers can read as whole rows: contiguous, in the memory of
// the backend that runs them.
template <class T>
void check_activation(const std::string& fn, const char* arg, const view3<T>& v, index_t D,
                      memory_space space, const char* backend) {
  attnmix::detail::check_given(fn, arg, v);
  attnmix::detail::check_layout(fn, arg, v);
  attnmix::detail::check_space(fn, arg, v, space, backend);
  attnmix::detail::require(v.extent(2) == D, fn, arg, "has shape ", attnmix::detail::shape_of(v),
                           " but its last dimension must be hidden_size = ", D);
  attnmix::detail::require(
      v.stride(2) == 1 && v.stride(1) == D && (v.extent(0) <= 1 || v.stride(0) == v.extent(1) * D),
      fn, arg, "must be contiguous ([B, T, D] row-major) but has strides [", v.stride(0), ", ",
      v.stride(1), ", ", v.stride(2), "]");
}

// out (named `arg`) must have the shape of x.
template <class T, class U>
void check_same_shape(const std::string& fn, const view3<T>& out, const view3<U>& x,
                      const char* arg = "out") {
  attnmix::detail::require(out.shape() == x.shape(), fn, arg, "has shape ",
                           attnmix::detail::shape_of(out), " but must have the shape of 'x', ",
                           attnmix::detail::shape_of(x));
}

// Resolves the token layout of x ([B, T, D]) and optional cu_seqlens (then B == 1).
template <class T>
token_layout make_layout(const std::string& fn, const view3<T>& x,
                         const view1<const std::int32_t>& cu_seqlens) {
  token_layout L{x.extent(0), x.extent(1), {}};
  if (cu_seqlens.has_value()) {
    attnmix::detail::check_space(fn, "cu_seqlens", cu_seqlens, memory_space::host,
                                 "offset validation");
    attnmix::detail::require(L.batch == 1, fn, "x",
                             "must have B = 1 when cu_seqlens is given but has B = ", L.batch);
    attnmix::detail::check_offsets(fn, "cu_seqlens", cu_seqlens, L.tokens);
    for (index_t i = 0; i < cu_seqlens.extent(0); ++i) L.cu_seqlens.push_back(cu_seqlens(i));
  }
  return L;
}

// Position of every row within its sequence (plus an offset per sequence).
inline std::vector<index_t> positions(const token_layout& L,
                                      const std::vector<index_t>& offset = {}) {
  std::vector<index_t> pos(static_cast<std::size_t>(L.rows()), 0);
  for (index_t n = 0; n < L.num_sequences(); ++n) {
    const index_t r0 = L.first_row(n), o = offset.empty() ? 0 : offset[static_cast<std::size_t>(n)];
    for (index_t t = 0; t < L.seq(n).length; ++t) pos[static_cast<std::size_t>(r0 + t)] = o + t;
  }
  return pos;
}

}  // namespace detail

// Copies the values of every parameter of `from` into the parameter of the same name and size of
// `to` (both anything with visit_parameters whose parameters have get_values / set_values: host
// and device parameters, in any storage types), e.g. a device model into a host one for
// io::save, or a host model just loaded into a device one. Throws attnmix::error naming the
// parameter when `to` has one that `from` lacks, or of another size.
template <class From, class To>
void transfer_parameters(const From& from, To& to) {
  const std::string fn = "attnmix::layers::transfer_parameters";
  std::vector<std::pair<std::string, std::vector<double>>> values;
  from.visit_parameters([&](const std::string& name, const auto& p) {
    values.emplace_back(name, std::vector<double>());
    p.get_values(values.back().second);
  });
  std::size_t i = 0;
  to.visit_parameters([&](const std::string& name, auto& p) {
    // Parameters come in the same order when both models have the same layout: look further
    // only when they do not.
    std::size_t j = i < values.size() && values[i].first == name ? i : values.size();
    if (j == values.size())
      for (std::size_t k = 0; k < values.size(); ++k)
        if (values[k].first == name) j = k;
    attnmix::detail::require(j < values.size(), fn, "from", "has no parameter '", name, "'");
    attnmix::detail::require(static_cast<index_t>(values[j].second.size()) == p.numel(), fn, "from",
                             "has ", values[j].second.size(), " values in '", name,
                             "' but 'to' holds ", p.numel());
    p.set_values(values[j].second);
    i = j + 1;
  });
}

// Fills every parameter of `model` (anything with visit_parameters) as fla initialises a
// fresh model: weights N(0, stddev), biases 0, norm weights 1. `jitter` > 0 perturbs the
// biases and norm weights by N(0, jitter) so that tests see them.
template <class Model>
void randomize_parameters(Model& model, std::uint64_t seed, double stddev = 0.02,
                          double jitter = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  model.visit_parameters([&](const std::string& name, auto& p) {
    using T = typename std::decay_t<decltype(p.data)>::value_type;
    const auto ends_with = [&](const char* suffix) {
      const std::string s(suffix);
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    const bool is_norm = ends_with("norm.weight");
    const bool is_bias = ends_with(".bias");
    for (auto& x : p.data) {
      const double r = normal(gen);
      x = static_cast<T>(is_norm ? 1.0 + jitter * r : is_bias ? jitter * r : stddev * r);
    }
  });
}

}  // namespace layers
}  // namespace attnmix
