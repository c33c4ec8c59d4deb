#pragma once
// Hybrid stacks: a compile-time list of mixer layers, each in a pre-norm residual block
// (spec/gbla.md §5.2, fla's blocks):
//   h  = x + attn( attn_norm(x) )
//   x' = h + mlp( mlp_norm(h) )
// and a final RMSNorm "norm". Parameter names follow fla's models: "layers.{i}.attn_norm.weight",
// "layers.{i}.attn.<mixer parameter>", "layers.{i}.mlp_norm.weight", "layers.{i}.mlp.<...>",
// "norm.weight".
//
//   using encoder = attnmix::stack<float, attnmix::repeat<3, attnmix::layer::sa,
//                                  attnmix::layer::gbla, attnmix::layer::gbla>>;
//   encoder enc(cfg);                       // cfg: attnmix::layers::config
//   attnmix::layers::randomize_parameters(enc, seed);   // or attnmix::io::load(enc, file)
//   enc.forward(x, out, {mask});            // x, out: [B, T, D]; mask [B, T] optional
//
// Causal stacks (every layer causal) also prefill a cache and decode token by token; an optional
// slot mapping (layers::cache_slots) lets the rows of a call use any slots of the cache.
// A layer whose kind has no implementation on the stack's backend is a compile-time error that
// names the layer.
//
// The same stack runs on any backend with layers::ops<Backend> and the attention front doors:
// stack_on<Stack, Backend, T> is that stack there, made from a host stack by copying every weight
// once (attnmix::device_stack<Stack, D> = stack_on<Stack, backend::cuda, D>, attnmix/cuda.cuh).
// The residual stream is accum_t<T>. Prefill and decoding run on host backends for now.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/core/traits.hpp"
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/linear_layer.hpp"
#include "attnmix/layers/mlp.hpp"
#include "attnmix/layers/norm.hpp"
#include "attnmix/layers/ops.hpp"
#include "attnmix/layers/path_layer.hpp"
#include "attnmix/stack/residual.hpp"

namespace attnmix {

// Layer tags: what a stack is a list of. Each names its mixer type for a scalar T and checks,
// at compile time, that it runs on a backend.
namespace layer {

#define ATTNMIX_DEFINE_LAYER(tag, kind_, mixer_, policy_)                                     \
  struct tag {                                                                                \
    static constexpr const char* name = #tag;                                                 \
    using kind = kind_;                                                                       \
    template <class T, class Backend = backend::cpu>                                          \
    using type = mixer_<T, policy_, Backend>;                                                 \
    template <class Backend>                                                                  \
    static constexpr bool check_backend() {                                                   \
      static_assert(is_implemented_v<kind_, Backend>,                                         \
                    "attnmix::stack: layer::" #tag                                            \
                    " has no implementation on this backend (its header is not included, or " \
                    "the backend has no such kind)");                                         \
      return true;                                                                            \
    }                                                                                         \
  }

ATTNMIX_DEFINE_LAYER(sa, attnmix::kind::softmax, layers::attention_layer, layers::sa_layer_policy);
ATTNMIX_DEFINE_LAYER(causal_sa, attnmix::kind::softmax, layers::attention_layer,
                     layers::causal_sa_layer_policy);
ATTNMIX_DEFINE_LAYER(causal_sa_rope, attnmix::kind::softmax, layers::attention_layer,
                     layers::causal_sa_rope_layer_policy);
ATTNMIX_DEFINE_LAYER(fox, attnmix::kind::fox, layers::attention_layer, layers::fox_layer_policy);
ATTNMIX_DEFINE_LAYER(path, attnmix::kind::path, layers::path_layer, layers::path_layer_policy);
ATTNMIX_DEFINE_LAYER(path_fox, attnmix::kind::path_fox, layers::path_layer,
                     layers::path_fox_layer_policy);
ATTNMIX_DEFINE_LAYER(bla, attnmix::kind::bla, layers::linear_layer, layers::bla_layer_policy);
ATTNMIX_DEFINE_LAYER(gbla, attnmix::kind::gbla, layers::linear_layer, layers::gbla_layer_policy);
ATTNMIX_DEFINE_LAYER(linear_causal, attnmix::kind::linear_causal, layers::linear_layer,
                     layers::linear_causal_layer_policy);

#undef ATTNMIX_DEFINE_LAYER

// A user-defined layer from any mixer template over (scalar, backend) and a kind, e.g.
//   template <class T, class Backend = attnmix::backend::cpu>
//   using my_gbla_mixer = attnmix::layers::linear_layer<T, my_policy, Backend>;
//   using my_gbla = attnmix::layer::custom<attnmix::kind::gbla, my_gbla_mixer>;
// A mixer written on layers::ops<Backend> and the front doors runs on every backend. (Its
// compile-time backend check names the kind instead of the tag.)
template <class Kind, template <class, class> class Mixer>
struct custom {
  static constexpr const char* name = Kind::name;
  using kind = Kind;
  template <class T, class Backend = backend::cpu>
  using type = Mixer<T, Backend>;
  template <class Backend>
  static constexpr bool check_backend() {
    static_assert(is_implemented_v<Kind, Backend>,
                  "attnmix::stack: a custom layer's kind has no implementation on this backend");
    return true;
  }
};

}  // namespace layer

// A list of layer tags; repeat<N, L...> is L... repeated N times.
template <class... Layers>
struct layer_list {
  static constexpr std::size_t size = sizeof...(Layers);
};

namespace detail {
template <class A, class B>
struct concat_lists;
template <class... A, class... B>
struct concat_lists<layer_list<A...>, layer_list<B...>> {
  using type = layer_list<A..., B...>;
};
template <int N, class List>
struct repeat_list {
  using type = typename concat_lists<List, typename repeat_list<N - 1, List>::type>::type;
};
template <class List>
struct repeat_list<0, List> {
  using type = layer_list<>;
};
// Flattens nested layer_lists.
template <class... L>
struct flatten;
template <>
struct flatten<> {
  using type = layer_list<>;
};
template <class... In, class... Rest>
struct flatten<layer_list<In...>, Rest...> {
  using type =
      typename concat_lists<typename flatten<In...>::type, typename flatten<Rest...>::type>::type;
};
template <class L, class... Rest>
struct flatten<L, Rest...> {
  using type = typename concat_lists<layer_list<L>, typename flatten<Rest...>::type>::type;
};
}  // namespace detail

template <int N, class... Layers>
using repeat = typename detail::repeat_list<N, typename detail::flatten<Layers...>::type>::type;

// Knobs of a stack.
struct stack_policy {
  static constexpr layers::mlp_kind mlp = layers::mlp_kind::swiglu;
};
template <layers::mlp_kind M>
struct with_mlp : stack_policy {
  static constexpr layers::mlp_kind mlp = M;
};

// Runtime inputs of a stack forward besides x and out.
struct stack_inputs {
  // Encoder batches: [B, T] validity mask (nonzero = real token), any pattern (right or left
  // padding); pad rows of `out` are written as zeros and never influence valid ones.
  tensor_view<const std::uint8_t, 2> mask{};
  // Packed batch (B == 1): [N+1] sequence offsets. Not together with mask.
  view1<const std::int32_t> cu_seqlens{};
  // Called after each block with (block index, layer name, seconds).
  std::function<void(index_t, const char*, double)> on_layer{};
};

template <class T, class Policy, class Backend, class List>
class basic_stack_impl;

template <class T, class Policy, class Backend, class... Layers>
class basic_stack_impl<T, Policy, Backend, layer_list<Layers...>> {
  static_assert(sizeof...(Layers) >= 1, "attnmix::stack: a stack needs at least one layer");
  static_assert(is_backend_v<Backend>,
                "attnmix::stack: Backend must be a backend tag (a name and a memory_space)");
  static_assert(layers::has_layer_ops_v<Backend>,
                "attnmix::stack: layers::ops<Backend> lacks an operation of its forward half "
                "(the list is in attnmix/layers/ops.hpp)");
  static_assert(layers::ops<Backend>::template computes<T>,
                "attnmix::stack: the layers do not compute in this type on this backend (the CPU "
                "layers compute in float or double; the CUDA ones in float, half or bfloat16)");
  static_assert((Layers::template check_backend<Backend>() && ...),
                "attnmix::stack: a layer has no implementation on this backend");

  using O = layers::ops<Backend>;
  using space = typename Backend::memory_space;
  using R = accum_t<T>;  // the residual stream
  template <class, class, class, class>
  friend class basic_stack_impl;

  template <class Layer>
  struct block {
    using mixer_type = typename Layer::template type<T, Backend>;
    layers::rms_norm<T, Backend> attn_norm;
    mixer_type attn;
    layers::rms_norm<T, Backend> mlp_norm;
    layers::mlp<T, Policy::mlp, Backend> mlp;
    explicit block(const layers::config& c)
        : attn_norm(c.hidden_size, c.norm_eps),
          attn(c),
          mlp_norm(c.hidden_size, c.norm_eps),
          mlp(c) {}
    template <class Other>
    explicit block(const Other& b, int)
        : attn_norm(b.attn_norm), attn(b.attn), mlp_norm(b.mlp_norm), mlp(b.mlp) {}
  };

 public:
  using scalar = T;
  using backend_type = Backend;
  static constexpr std::size_t num_layers = sizeof...(Layers);
  static constexpr bool causal = (Layers::template type<T, Backend>::causal && ...);
  using cache_type = std::conditional_t<
      causal, std::tuple<typename Layers::template type<T, Backend>::cache_type...>, std::tuple<>>;

  explicit basic_stack_impl(const layers::config& c)
      : cfg_(layers::checked("attnmix::stack", c)),
        blocks_(block<Layers>(c)...),
        norm(c.hidden_size, c.norm_eps) {}
  // The same stack on Backend in T: every weight of `other` copied (and rounded) once, the
  // projections in T, norm weights, conv taps and biases in accum_t<T>. Later changes to
  // `other`'s parameters need a new copy.
  template <class U, class B>
  explicit basic_stack_impl(const basic_stack_impl<U, Policy, B, layer_list<Layers...>>& other)
      : basic_stack_impl(other, std::index_sequence_for<Layers...>{}) {}

  const layers::config& config() const { return cfg_; }
  // The sizes a saved state records of the stack that made it.
  std::array<index_t, 7> sizes() const {
    return {cfg_.hidden_size,       cfg_.num_heads, cfg_.kv_heads(), cfg_.dim(),
            cfg_.intermediate_size, cfg_.w_rank,    cfg_.window};
  }
  index_t hidden_size() const { return cfg_.hidden_size; }
  // Layer names in order, e.g. {"sa", "gbla", "gbla", ...}.
  static std::vector<const char*> layer_names() { return {Layers::name...}; }

  // Encoder / full-sequence forward. x, out: [B, T, D] contiguous, distinct, in the backend's
  // memory; see stack_inputs (mask and cu_seqlens in host memory). Pad rows of out are zeros.
  // With in.on_layer each block is timed (on the GPU with events, waiting for each block).
  // Throws attnmix::error on bad arguments.
  void forward(const view3<const T>& x, const view3<T>& out, const stack_inputs& in = {},
               const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::stack::forward";
    const index_t D = cfg_.hidden_size;
    check_rows(fn, x, out);

    std::vector<std::int64_t> src;  // mask: packed row -> row of x
    const layers::token_layout L = rows_layout(fn, x, in, src);
    const index_t rows = L.rows();
    // Pad rows of out are zeroed last, once every block has run (a failing call writes nothing).
    if (rows == 0) {
      if (in.mask.has_value()) O::zero(be, out.data(), out.size());
      return;
    }

    // One allocation: the residual stream h, the blocks' input t and output m, the positions and
    // the packed rows' sources.
    using layers::scratch_bytes;
    typename O::scratch s(be, scratch_bytes<R>(rows * D) + scratch_bytes<T>(rows * D) * 2 +
                                  scratch_bytes<std::int32_t>(rows) +
                                  scratch_bytes<std::int64_t>(index_t(src.size())));
    R* h = s.template take<R>(rows * D);
    T *t = s.template take<T>(rows * D), *m = s.template take<T>(rows * D);
    std::int32_t* pos = s.template take<std::int32_t>(rows);
    std::int64_t* dsrc = s.template take<std::int64_t>(index_t(src.size()));
    O::positions(be, pos, L);
    if (!src.empty())
      O::upload(be, dsrc, src.data(), index_t(src.size()));
    else
      dsrc = nullptr;  // every row of x, in order
    const layers::context<Backend> c{be, L, pos, handles_};
    O::move_rows(c, x.data(), h, dsrc, static_cast<const std::int64_t*>(nullptr), rows, D);
    run_blocks(c, h, t, m, nullptr, nullptr, in.on_layer);
    if (dsrc != nullptr) {
      norm.apply(c, h, rows, t);
      O::zero(be, out.data(), out.size());
      O::move_rows(c, t, out.data(), static_cast<const std::int64_t*>(nullptr), dsrc, rows, D);
    } else {
      norm.apply(c, h, rows, out.data());
    }
  }

  // ---- Training ---------------------------------------------------------------------------
  // What backward() reads of one forward: the rows' layout, the residual stream before every
  // block and after its mixer, every block's normed inputs and what its mixer and MLP saved.
  template <class Layer>
  struct block_saved {
    layers::buffer<R, space> mid;              // the residual after the mixer [rows, D]
    layers::buffer<T, space> attn_in, mlp_in;  // the normed inputs of the mixer and the MLP
    typename block<Layer>::mixer_type::saved_type attn;
    typename layers::mlp<T, Policy::mlp, Backend>::saved_type mlp;
  };
  struct saved_type {
    std::array<index_t, 3> shape{};  // x's [B, T, D]
    layers::token_layout layout;
    std::vector<std::int64_t> src;                  // mask: packed row -> row of x
    layers::buffer<std::int64_t, space> src_rows;   // the same in the backend's memory
    layers::buffer<std::int32_t, space> positions;  // [rows]
    std::vector<layers::buffer<R, space>> h;        // h[i]: block i's input; h[L]: the norm's
    std::tuple<block_saved<Layers>...> blocks;
    // The sizes of the stack whose forward filled it (all 0 until one has).
    std::array<index_t, 7> made_by{};
  };

  // The forward of training: the same as forward(x, out, in, be), also keeping in `saved` what
  // backward() reads. (on_layer is not called.)
  void forward(const view3<const T>& x, const view3<T>& out, saved_type& sv,
               const stack_inputs& in = {}, const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::stack::forward";
    const index_t D = cfg_.hidden_size;
    check_rows(fn, x, out);
    sv.made_by = {};
    sv.shape = {x.extent(0), x.extent(1), x.extent(2)};
    sv.layout = rows_layout(fn, x, in, sv.src);
    const layers::token_layout& L = sv.layout;
    const index_t rows = L.rows(), n = rows * D;
    sv.positions.resize(rows);
    sv.src_rows.resize(index_t(sv.src.size()));
    sv.h.resize(num_layers + 1);
    for (auto& b : sv.h) b.resize(n);
    if (rows == 0) {
      if (in.mask.has_value()) O::zero(be, out.data(), out.size());
      sv.made_by = sizes();
      return;
    }
    O::positions(be, sv.positions.data(), L);
    O::upload(be, sv.src_rows.data(), sv.src.data(), index_t(sv.src.size()));
    const std::int64_t* src = sv.src.empty() ? nullptr : sv.src_rows.data();
    const layers::context<Backend> c{be, L, sv.positions.data(), handles_};
    O::move_rows(c, x.data(), sv.h[0].data(), src, static_cast<const std::int64_t*>(nullptr), rows,
                 D);
    for_each_block_and_saved(sv, [&](const auto& b, auto& bs, std::size_t i) {
      for (auto* buf : {&bs.attn_in, &bs.mlp_in}) buf->resize(n);
      bs.mid.resize(n);
      typename O::scratch s(be, layers::scratch_bytes<T>(n));
      T* m = s.template take<T>(n);
      b.attn_norm.apply(c, sv.h[i].data(), rows, bs.attn_in.data());
      b.attn.forward_rows(c, bs.attn_in.data(), m, &bs.attn);
      O::template map<layers::fn::plus>(c, bs.mid.data(), sv.h[i].data(), m, n);
      b.mlp_norm.apply(c, bs.mid.data(), rows, bs.mlp_in.data());
      b.mlp.apply(c, bs.mlp_in.data(), rows, m, &bs.mlp);
      O::template map<layers::fn::plus>(c, sv.h[i + 1].data(), bs.mid.data(), m, n);
    });
    if (src != nullptr) {
      typename O::scratch s(be, layers::scratch_bytes<T>(n));
      T* t = s.template take<T>(n);
      norm.apply(c, sv.h[num_layers].data(), rows, t);
      O::zero(be, out.data(), out.size());
      O::move_rows(c, t, out.data(), static_cast<const std::int64_t*>(nullptr), src, rows, D);
    } else {
      norm.apply(c, sv.h[num_layers].data(), rows, out.data());
    }
    sv.made_by = sizes();
  }

  // Training: from `saved` (the training forward) and dout = dL/d(out) [B, T, D], writes dL/dx
  // into dx (pad rows 0 under a mask) and adds every parameter's gradient to its .grad.
  // Throws attnmix::error on bad arguments.
  void backward(const view3<const T>& dout, const view3<T>& dx, const saved_type& sv,
                const Backend& be = Backend{}) {
    static_assert(layers::has_training_ops_v<Backend>,
                  "attnmix::stack::backward: layers::ops<Backend> lacks an operation of its "
                  "backward half (the list is in attnmix/layers/ops.hpp)");
    const std::string fn = "attnmix::stack::backward";
    const index_t D = cfg_.hidden_size;
    attnmix::detail::require(sv.made_by != std::array<index_t, 7>{}, fn, "saved",
                             "was not filled by a training forward");
    attnmix::detail::require(sv.made_by == sizes(), fn, "saved", "was saved by a stack of sizes ",
                             attnmix::detail::shape_string(sv.made_by.data(), 7),
                             " but this stack has ",
                             attnmix::detail::shape_string(sizes().data(), 7),
                             " (hidden, heads, KV heads, head dim, MLP width, w_rank, window)");
    for (const auto& [name, v] : {std::pair<const char*, view3<const T>>{"dout", dout},
                                  std::pair<const char*, view3<const T>>{"dx", dx}}) {
      layers::detail::check_activation(fn, name, v, D, space_of_v<Backend>, Backend::name);
      attnmix::detail::require(v.shape() == sv.shape, fn, name, "has shape ",
                               attnmix::detail::shape_of(v), " but the forward's x had ",
                               attnmix::detail::shape_string(sv.shape.data(), 3));
      O::check_memory(fn, name, v);
    }
    attnmix::detail::check_no_alias(fn, "dx", dx, "dout", dout);
    const layers::token_layout& L = sv.layout;
    const index_t rows = L.rows(), n = rows * D;
    const std::int64_t* src = sv.src.empty() ? nullptr : sv.src_rows.data();
    if (src != nullptr) O::zero(be, dx.data(), dx.size());
    if (rows == 0) return;
    const layers::context<Backend> c{be, L, sv.positions.data(), handles_};
    // The gradient of the residual stream, dh, is in R; the layers take and give T. In mixed
    // precision (T 16-bit, R float) it is rounded to T for each layer, and a layer's dx is
    // widened to R before the norm's backward adds it to dh.
    using grad = detail::residual_grad<T, R, Backend>;
    typename O::scratch s(
        be, layers::scratch_bytes<R>(n) + layers::scratch_bytes<T>(n) * 2 + grad::scratch_bytes(n));
    R* dh = s.template take<R>(n);
    T *dt = s.template take<T>(n), *dm = s.template take<T>(n);
    const grad rg(c, rows, D, s);
    const std::int64_t* same = nullptr;  // move_rows without a row map
    const T* dy = dout.data();
    if (src != nullptr) {
      O::move_rows(c, dout.data(), dm, src, same, rows, D);
      dy = dm;
    }
    norm.backward(c, sv.h[num_layers].data(), rows, rg.wide(dy), dh);
    for_each_block_and_saved_reversed(sv, [&](auto& b, const auto& bs, std::size_t i) {
      b.mlp.backward(c, bs.mlp_in.data(), rows, rg.narrow(dh), dt, bs.mlp);
      b.mlp_norm.backward(c, bs.mid.data(), rows, rg.wide(dt), dh, true);
      b.attn.backward_rows(c, bs.attn_in.data(), rg.narrow(dh), dt, bs.attn);
      b.attn_norm.backward(c, sv.h[i].data(), rows, rg.wide(dt), dh, true);
    });
    O::move_rows(c, dh, dx.data(), static_cast<const std::int64_t*>(nullptr), src, rows, D);
  }

  // Causal stacks: a cache for `sequences` sequences of up to `capacity` tokens, in the
  // backend's memory.
  cache_type make_cache(index_t sequences, index_t capacity) const {
    static_assert(causal, "attnmix::stack: only stacks of causal layers have a decoding cache");
    return make_cache_impl(sequences, capacity, std::index_sequence_for<Layers...>{});
  }

  // Causal stacks: forward over prompts (x [B, T, D], or packed with cu_seqlens) that fills
  // `cache`: sequence n -> slot n, replacing its content.
  void prefill(const view3<const T>& x, const view3<T>& out, cache_type& cache,
               const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    prefill_impl(x, out, cache, {}, cu_seqlens, be);
  }
  // The same with a slot mapping: sequence n -> slot slots[n] of every layer's cache (distinct,
  // in range, one per sequence); only those slots are replaced, the others keep their sequences.
  // Throws attnmix::error naming 'slots' (and changes neither `out` nor the cache) on a bad one.
  void prefill(const view3<const T>& x, const view3<T>& out, cache_type& cache,
               const layers::cache_slots& slots, const view1<const std::int32_t>& cu_seqlens = {},
               const Backend& be = Backend{}) const {
    prefill_impl(x, out, cache, slots.slots, cu_seqlens, be);
  }

  // Causal stacks: one new token per cached sequence. x, out: [N, 1, D], N = the cache's
  // sequences. Row n of out equals the full forward's output at that token.
  void decode(const view3<const T>& x, const view3<T>& out, cache_type& cache,
              const Backend& be = Backend{}) const {
    decode_impl(x, out, cache, {}, be);
  }
  // The same with a slot mapping: x, out [N, 1, D] with N = slots' length; row n is the next
  // token of the sequence in slot slots[n] (any distinct slots, in any order); the other slots
  // do not move. Throws attnmix::error naming 'slots' (and changes neither `out` nor the cache)
  // on a bad mapping.
  void decode(const view3<const T>& x, const view3<T>& out, cache_type& cache,
              const layers::cache_slots& slots, const Backend& be = Backend{}) const {
    decode_impl(x, out, cache, slots.slots, be);
  }

  // Visits every parameter as f(name, parameter<T>&) (or parameter<accum_t<T>>&).
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

  // Block i's mixer (e.g. to read a parameter).
  template <std::size_t I>
  auto& mixer() {
    return std::get<I>(blocks_).attn;
  }
  template <std::size_t I>
  const auto& mixer() const {
    return std::get<I>(blocks_).attn;
  }
  // Block i whole: its attn_norm, attn (the mixer), mlp_norm and mlp.
  template <std::size_t I>
  const auto& block_at() const {
    return std::get<I>(blocks_);
  }
  using layers_type = layer_list<Layers...>;
  using policy_type = Policy;

 private:
  template <class Other, std::size_t... I>
  basic_stack_impl(const Other& other, std::index_sequence<I...>)
      : cfg_(other.config()),
        blocks_(block<Layers>(other.template block_at<I>(), 0)...),
        norm(other.norm) {}

  layers::config cfg_;
  typename O::handles handles_{};
  std::tuple<block<Layers>...> blocks_;

 public:
  layers::rms_norm<T, Backend> norm;

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.for_each_block_of(s, [&](auto& b, auto I) {
      const std::string p = prefix + "layers." + std::to_string(decltype(I)::value) + ".";
      b.attn_norm.visit_parameters(f, p + "attn_norm.");
      b.attn.visit_parameters(f, p + "attn.");
      b.mlp_norm.visit_parameters(f, p + "mlp_norm.");
      b.mlp.visit_parameters(f, p + "mlp.");
    });
    s.norm.visit_parameters(f, prefix + "norm.");
  }

  template <class Self, class F, std::size_t... I>
  static void for_each_block_impl(Self& s, F& f, std::index_sequence<I...>) {
    (f(std::get<I>(s.blocks_), std::integral_constant<std::size_t, I>{}), ...);
  }
  template <class Self, class F>
  static void for_each_block_of(Self& s, F&& f) {
    for_each_block_impl(s, f, std::index_sequence_for<Layers...>{});
  }
  template <class F>
  void for_each_block(F&& f) const {
    for_each_block_of(*this, f);
  }
  // f(block i, its saved state, i) in order, and in reverse order.
  template <class F, std::size_t... I>
  void for_each_saved_impl(saved_type& sv, F& f, std::index_sequence<I...>) const {
    (f(std::get<I>(blocks_), std::get<I>(sv.blocks), I), ...);
  }
  template <class F>
  void for_each_block_and_saved(saved_type& sv, F&& f) const {
    for_each_saved_impl(sv, f, std::index_sequence_for<Layers...>{});
  }
  template <class F, std::size_t... I>
  void for_each_saved_reversed_impl(const saved_type& sv, F& f, std::index_sequence<I...>) {
    constexpr std::size_t last = sizeof...(Layers) - 1;
    (f(std::get<last - I>(blocks_), std::get<last - I>(sv.blocks), last - I), ...);
  }
  template <class F>
  void for_each_block_and_saved_reversed(const saved_type& sv, F&& f) {
    for_each_saved_reversed_impl(sv, f, std::index_sequence_for<Layers...>{});
  }

  // The rows the blocks run on: the batch as it is, or its valid tokens packed (mask), with
  // src[r] the row of x that packed row r comes from.
  static layers::token_layout rows_layout(const std::string& fn, const view3<const T>& x,
                                          const stack_inputs& in, std::vector<std::int64_t>& src) {
    src.clear();
    if (!in.mask.has_value()) return layers::detail::make_layout(fn, x, in.cu_seqlens);
    attnmix::detail::check_not_given(fn, "cu_seqlens", in.cu_seqlens, "'mask' was given too");
    attnmix::detail::check_layout(fn, "mask", in.mask);
    attnmix::detail::check_space(fn, "mask", in.mask, memory_space::host, "packing");
    attnmix::detail::check_shape(fn, "mask", in.mask, {x.extent(0), x.extent(1)}, "[B, T]");
    layers::token_layout L{1, 0, {0}};
    for (index_t b = 0; b < x.extent(0); ++b) {
      for (index_t t = 0; t < x.extent(1); ++t)
        if (in.mask(b, t) != 0) src.push_back(b * x.extent(1) + t);
      L.cu_seqlens.push_back(static_cast<std::int32_t>(src.size()));
    }
    L.tokens = static_cast<index_t>(src.size());
    return L;
  }

  void check_rows(const std::string& fn, const view3<const T>& x, const view3<T>& out) const {
    const index_t D = cfg_.hidden_size;
    layers::detail::check_activation(fn, "x", x, D, space_of_v<Backend>, Backend::name);
    layers::detail::check_activation(fn, "out", out, D, space_of_v<Backend>, Backend::name);
    layers::detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "out", out);
  }

  // Every layer's cache fits its layer (heads, dims, conv widths, slots and capacity of the
  // first), checked before any of them is written.
  template <std::size_t... I>
  void check_caches(const std::string& fn, const cache_type& cache,
                    std::index_sequence<I...>) const {
    const char* names[] = {Layers::name...};
    const auto& c0 = std::get<0>(cache);
    const auto one = [&](const auto& b, const auto& lc, std::size_t i) {
      const std::string what = "of layer " + std::to_string(i) + " (" + names[i] + ")";
      b.attn.check_cache(fn, "cache", what, lc);
      attnmix::detail::require(lc.sequences() == c0.sequences() && lc.capacity() == c0.capacity(),
                               fn, "cache", what, " holds ", lc.sequences(), " sequences of ",
                               lc.capacity(), " tokens but layer 0's holds ", c0.sequences(),
                               " of ", c0.capacity());
    };
    (one(std::get<I>(blocks_), std::get<I>(cache), I), ...);
  }

  // Everything is checked before any layer runs, so a rejected call writes nothing.
  void prefill_impl(const view3<const T>& x, const view3<T>& out, cache_type& cache,
                    const view1<const std::int32_t>& slots,
                    const view1<const std::int32_t>& cu_seqlens, const Backend& be) const {
    static_assert(causal, "attnmix::stack: only stacks of causal layers prefill a cache");
    const std::string fn = "attnmix::stack::prefill";
    const index_t D = cfg_.hidden_size;
    check_rows(fn, x, out);
    const layers::token_layout L = layers::detail::make_layout(fn, x, cu_seqlens);
    check_caches(fn, cache, std::index_sequence_for<Layers...>{});
    const auto& c0 = std::get<0>(cache);
    const std::vector<index_t> where =
        layers::detail::prefill_slots(fn, slots, L.num_sequences(), c0.sequences());
    for (index_t n = 0; n < L.num_sequences(); ++n)
      attnmix::detail::require(L.seq(n).length <= c0.capacity(), fn, "cache", "has capacity ",
                               c0.capacity(), " but sequence ", n, " has ", L.seq(n).length,
                               " tokens");
    const index_t rows = L.rows();  // may be 0: the slots are still emptied
    using layers::scratch_bytes;
    typename O::scratch s(be, scratch_bytes<R>(rows * D) + scratch_bytes<T>(rows * D) * 2 +
                                  scratch_bytes<std::int32_t>(rows));
    R* h = s.template take<R>(rows * D);
    T *t = s.template take<T>(rows * D), *m = s.template take<T>(rows * D);
    std::int32_t* pos = s.template take<std::int32_t>(rows);
    O::positions(be, pos, L);
    const layers::context<Backend> c{be, L, pos, handles_};
    O::move_rows(c, x.data(), h, static_cast<const std::int64_t*>(nullptr),
                 static_cast<const std::int64_t*>(nullptr), rows, D);
    run_blocks(c, h, t, m, &cache, &where, {});
    norm.apply(c, h, rows, out.data());
  }

  void decode_impl(const view3<const T>& x, const view3<T>& out, cache_type& cache,
                   const view1<const std::int32_t>& slots, const Backend& be) const {
    static_assert(causal, "attnmix::stack: only stacks of causal layers decode");
    const std::string fn = "attnmix::stack::decode";
    const index_t D = cfg_.hidden_size;
    check_rows(fn, x, out);
    check_caches(fn, cache, std::index_sequence_for<Layers...>{});
    const std::vector<index_t> where =
        layers::detail::decode_slots(fn, slots, x, std::get<0>(cache));
    // Every layer's slots have room for the token (their lengths may differ from layer 0's).
    std::apply([&](const auto&... lc) { (layers::detail::decode_slots(fn, slots, x, lc), ...); },
               cache);
    const index_t N = x.extent(0);
    if (N == 0) return;
    const layers::token_layout L{N, 1, {}};
    const layers::context<Backend> c{be, L, nullptr, handles_};
    using layers::scratch_bytes;
    typename O::scratch s(be, scratch_bytes<R>(N * D) + scratch_bytes<T>(N * D) * 2);
    R* h = s.template take<R>(N * D);
    T *t = s.template take<T>(N * D), *m = s.template take<T>(N * D);
    O::move_rows(c, x.data(), h, static_cast<const std::int64_t*>(nullptr),
                 static_cast<const std::int64_t*>(nullptr), N, D);
    for_each_block([&](auto& b, auto I) {
      b.attn_norm.apply(c, h, N, t);
      b.attn.decode_rows(c, t, m, std::get<decltype(I)::value>(cache), where);
      O::template map<layers::fn::plus>(c, h, h, m, N * D);
      b.mlp_norm.apply(c, h, N, t);
      b.mlp.apply(c, t, N, m);
      O::template map<layers::fn::plus>(c, h, h, m, N * D);
    });
    norm.apply(c, h, N, out.data());
  }

  template <std::size_t... I>
  cache_type make_cache_impl(index_t n, index_t cap, std::index_sequence<I...>) const {
    return cache_type(std::get<I>(blocks_).attn.make_cache(n, cap)...);
  }

  // h: [rows, D] residual stream, updated in place through every block; t, m: [rows, D].
  // cache, slots: prefill (sequence n -> slot (*slots)[n]); both null: forward only.
  void run_blocks(const layers::context<Backend>& c, R* h, T* t, T* m, cache_type* cache,
                  const std::vector<index_t>* slots,
                  const std::function<void(index_t, const char*, double)>& on_layer) const {
    const index_t rows = c.rows(), n = rows * cfg_.hidden_size;
    const char* names[] = {Layers::name...};
    typename O::timer timer(c.be, static_cast<bool>(on_layer));
    for_each_block([&](auto& b, auto I) {
      timer.start();
      b.attn_norm.apply(c, h, rows, t);
      if constexpr (causal) {
        if (cache != nullptr)
          b.attn.prefill_rows(c, t, m, std::get<decltype(I)::value>(*cache), *slots);
        else
          b.attn.forward_rows(c, t, m);
      } else {
        b.attn.forward_rows(c, t, m);
      }
      O::template map<layers::fn::plus>(c, h, h, m, n);
      b.mlp_norm.apply(c, h, rows, t);
      b.mlp.apply(c, t, rows, m);
      O::template map<layers::fn::plus>(c, h, h, m, n);
      if (on_layer) {
        constexpr std::size_t i = decltype(I)::value;
        on_layer(static_cast<index_t>(i), names[i], timer.seconds());
      }
    });
    (void)cache;
    (void)slots;
  }
};

// A stack of Layers (tags, layer_lists or repeat<...>) in scalar T, with an explicit policy and
// backend.
template <class T, class Policy, class Backend, class... Layers>
using basic_stack = basic_stack_impl<T, Policy, Backend, typename detail::flatten<Layers...>::type>;

// The usual CPU stack with SwiGLU MLPs: attnmix::stack<float, repeat<3, layer::sa, layer::gbla,
// layer::gbla>>.
template <class T, class... Layers>
using stack = basic_stack<T, stack_policy, backend::cpu, Layers...>;

namespace detail {
template <class Stack, class Backend, class T>
struct stack_on;
template <class S, class P, class B, class List, class Backend, class T>
struct stack_on<basic_stack_impl<S, P, B, List>, Backend, T> {
  using type = basic_stack_impl<T, P, Backend, List>;
};
}  // namespace detail

// Stack (the same layers and policy) on Backend in T, e.g.
//   attnmix::stack_on<encoder, attnmix::backend::cuda, attnmix::bfloat16> gpu(enc);
// whose constructor copies enc's weights once.
template <class Stack, class Backend, class T = typename Stack::scalar>
using stack_on = typename detail::stack_on<Stack, Backend, T>::type;

}  // namespace attnmix
