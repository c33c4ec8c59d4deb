#pragma once
// A test-only mixer written the way a user would add one: a bidirectional multi-head softmax
// attention with an output gate,
//   o = softmax(q k^T / sqrt(d)) v,   y = o_proj( o * sigmoid(g_proj x) ),
// q, k, v, g = {q,k,v,g}_proj x ([H*d] each, no bias). It is written once on
// attnmix::layers::ops<Backend> and the attention front door, with no code of its own for any
// backend, so the same template runs in a stack on the CPU, on the GPU and on any backend that
// specialises the operations.

#include <string>
#include <type_traits>

#include "attnmix/attnmix.hpp"

namespace attnmix_test {

template <class T, class Backend = attnmix::backend::cpu>
class gated_softmax_mixer
    : public attnmix::layers::mixer_api<gated_softmax_mixer<T, Backend>, T, Backend> {
  using index_t = attnmix::index_t;
  using O = attnmix::layers::ops<Backend>;
  using policy = attnmix::with_mask<attnmix::default_policy_t<attnmix::kind::softmax>,
                                    attnmix::mask_type::bidirectional>;
  template <class, class>
  friend class gated_softmax_mixer;

 public:
  static constexpr const char* name = "gated_softmax";
  static constexpr bool causal = false;
  struct cache_type {};  // an encoder layer: no decoding state

  explicit gated_softmax_mixer(const attnmix::layers::config& c)
      : D_(c.hidden_size),
        H_(c.num_heads),
        d_(c.dim()),
        q_proj(D_, H_ * d_),
        k_proj(D_, H_ * d_),
        v_proj(D_, H_ * d_),
        g_proj(D_, H_ * d_),
        o_proj(H_ * d_, D_) {}
  // Backend conversion: every projection copied once.
  template <class U, class B>
  explicit gated_softmax_mixer(const gated_softmax_mixer<U, B>& o)
      : D_(o.D_),
        H_(o.H_),
        d_(o.d_),
        q_proj(o.q_proj),
        k_proj(o.k_proj),
        v_proj(o.v_proj),
        g_proj(o.g_proj),
        o_proj(o.o_proj) {}

  index_t hidden_size() const { return D_; }

  void forward_rows(const attnmix::layers::context<Backend>& c, const T* x, T* y) const {
    using attnmix::layers::as_heads;
    using attnmix::layers::scratch_bytes;
    const auto& L = c.layout;
    const index_t rows = c.rows(), n = rows * H_ * d_;
    typename O::scratch s(c.be, scratch_bytes<T>(n) * 5);
    T *q = s.template take<T>(n), *k = s.template take<T>(n), *v = s.template take<T>(n),
      *o = s.template take<T>(n), *g = s.template take<T>(n);
    q_proj.apply(c, x, rows, q);
    k_proj.apply(c, x, rows, k);
    v_proj.apply(c, x, rows, v);
    attnmix::attention_args<T> a;
    a.q = as_heads<Backend, const T>(q, L, H_, d_);
    a.k = as_heads<Backend, const T>(k, L, H_, d_);
    a.v = as_heads<Backend, const T>(v, L, H_, d_);
    a.out = as_heads<Backend, T>(o, L, H_, d_);
    attnmix::attention<attnmix::kind::softmax, policy>(a, L.attention({}), c.be);
    g_proj.apply(c, x, rows, g);
    O::template map<attnmix::layers::fn::times_sigmoid>(c, o, o, g, n);
    o_proj.apply(c, o, rows, y);
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
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.k_proj.visit_parameters(f, prefix + "k_proj.");
    s.v_proj.visit_parameters(f, prefix + "v_proj.");
    s.g_proj.visit_parameters(f, prefix + "g_proj.");
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
  }

  index_t D_, H_, d_;
  attnmix::layers::linear<T, Backend> q_proj, k_proj, v_proj, g_proj, o_proj;
};

using gated_softmax = attnmix::layer::custom<attnmix::kind::softmax, gated_softmax_mixer>;

}  // namespace attnmix_test
