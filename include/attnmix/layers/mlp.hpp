#pragma once
// layers::mlp: the feed-forward half of a block, D -> I -> D.
//   swiglu: down_proj( SiLU(gate_proj x) * up_proj x )     (fla's GatedMLP, no bias)
//   gelu:   down_proj( GELU(up_proj x) )                    (exact erf GELU)
//   relu:   down_proj( ReLU(up_proj x) )                    (T5 / TIGER)
// gate_proj, up_proj: [I, D]; down_proj: [D, I].

#include <string>
#include <vector>

#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

enum class mlp_kind { swiglu, gelu, relu };

inline const char* to_string(mlp_kind k) {
  return k == mlp_kind::swiglu ? "swiglu" : k == mlp_kind::gelu ? "gelu" : "relu";
}

// fla's default width: 256 * ceil(D * 4 * 2/3 / 256) for SwiGLU (same parameter count as a
// 4D plain MLP), 4 D for GELU and ReLU. config.intermediate_size > 0 overrides it.
inline index_t mlp_width(const config& c, mlp_kind k) {
  if (c.intermediate_size > 0) return c.intermediate_size;
  if (k != mlp_kind::swiglu) return 4 * c.hidden_size;
  const index_t x = c.hidden_size * 4 * 2 / 3;
  return 256 * ((x + 255) / 256);
}

template <class T, mlp_kind Kind = mlp_kind::swiglu, class Backend = backend::cpu>
class mlp {
 public:
  static constexpr mlp_kind kind = Kind;

  mlp() = default;
  explicit mlp(const config& c)
      : D_(checked("attnmix::layers::mlp", c).hidden_size),
        I_(mlp_width(c, Kind)),
        gate_proj(Kind == mlp_kind::swiglu ? linear<T, Backend>(D_, I_) : linear<T, Backend>()),
        up_proj(D_, I_),
        down_proj(I_, D_) {}
  template <class U, class B>
  explicit mlp(const mlp<U, Kind, B>& other)
      : D_(other.up_proj.in_features()),
        I_(other.width()),
        gate_proj(other.gate_proj),
        up_proj(other.up_proj),
        down_proj(other.down_proj) {}

  index_t width() const { return I_; }

  // What the backward reads: the hidden rows before the activation.
  struct saved_type {
    buffer<T, typename Backend::memory_space> up, gate;  // [rows, I]; gate: SwiGLU only
  };

  // x, y: [rows, D] (distinct buffers). One scratch allocation for the hidden rows; with
  // `saved`, they go there instead, for backward().
  void apply(const context<Backend>& c, const T* x, index_t rows, T* y,
             saved_type* saved = nullptr) const {
    using O = ops<Backend>;
    constexpr bool gated = Kind == mlp_kind::swiglu;
    const index_t n = rows * I_;
    typename O::scratch s(c.be, scratch_bytes<T>(n) * (saved ? 1 : gated ? 2 : 1));
    T* h = s.template take<T>(n);
    T* u = h;
    if (saved != nullptr) saved->up.resize(n), u = saved->up.data();
    up_proj.apply(c, x, rows, u);
    if constexpr (gated) {
      T* g = saved != nullptr ? (saved->gate.resize(n), saved->gate.data()) : s.template take<T>(n);
      gate_proj.apply(c, x, rows, g);
      O::template map<fn::silu_times>(c, h, g, u, n);
    } else {
      activate(c, h, u, n);
    }
    down_proj.apply(c, h, rows, y);
  }

  // Backward of apply(c, x, rows, y, &saved): every weight's .grad added to, dx written (or added
  // with `accumulate`). x: the forward's input; dy, dx: [rows, D].
  void backward(const context<Backend>& c, const T* x, index_t rows, const T* dy, T* dx,
                const saved_type& saved, bool accumulate = false) {
    using O = ops<Backend>;
    constexpr bool gated = Kind == mlp_kind::swiglu;
    const index_t n = rows * I_;
    typename O::scratch s(c.be, scratch_bytes<T>(n) * 2);
    T *h = s.template take<T>(n), *dh = s.template take<T>(n);
    const T* u = saved.up.data();
    if constexpr (gated)
      O::template map<fn::silu_times>(c, h, saved.gate.data(), u, n);
    else
      activate(c, h, u, n);
    down_proj.backward(c, h, rows, dy, dh);
    if constexpr (gated) {
      // d(gate) into h (free again), d(up) in place of dh.
      O::template map_backward<fn::silu_times>(c, dh, saved.gate.data(), u, h, dh, n);
      up_proj.backward(c, x, rows, dh, dx, accumulate);
      gate_proj.backward(c, x, rows, h, dx, true);
    } else {
      if constexpr (Kind == mlp_kind::gelu)
        O::template map_backward<fn::gelu>(c, dh, u, static_cast<const T*>(nullptr), dh,
                                           static_cast<T*>(nullptr), n);
      else
        O::template map_backward<fn::relu>(c, dh, u, static_cast<const T*>(nullptr), dh,
                                           static_cast<T*>(nullptr), n);
      up_proj.backward(c, x, rows, dh, dx, accumulate);
    }
  }
  void apply(const T* x, index_t rows, T* y, const Backend& be) const {
    const typename ops<Backend>::handles hd{};
    const token_layout L{1, rows, {}};
    apply(context<Backend>{be, L, nullptr, hd}, x, rows, y);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    if constexpr (Kind == mlp_kind::swiglu) s.gate_proj.visit_parameters(f, prefix + "gate_proj.");
    s.up_proj.visit_parameters(f, prefix + "up_proj.");
    s.down_proj.visit_parameters(f, prefix + "down_proj.");
  }

  // h = GELU(u) or ReLU(u).
  static void activate(const context<Backend>& c, T* h, const T* u, index_t n) {
    using O = ops<Backend>;
    if constexpr (Kind == mlp_kind::gelu)
      O::template map<fn::gelu>(c, h, u, static_cast<const float*>(nullptr), n);
    else
      O::template map<fn::relu>(c, h, u, static_cast<const float*>(nullptr), n);
  }

  index_t D_ = 0, I_ = 0;

 public:
  linear<T, Backend> gate_proj, up_proj, down_proj;
};

}  // namespace layers
}  // namespace attnmix
