#pragma once
// A decoder stack: blocks of causal self-attention, cross-attention to a memory (an encoder's
// output) and an MLP, each in a pre-norm residual block, and a final RMSNorm:
//   h1 = x  + attn( attn_norm(x) )
//   h2 = h1 + cross_attn( cross_attn_norm(h1), memory )
//   x' = h2 + mlp( mlp_norm(h2) )
// Parameter names: "layers.{i}.attn_norm.weight", "layers.{i}.attn.<...>",
// "layers.{i}.cross_attn_norm.weight", "layers.{i}.cross_attn.<...>", "layers.{i}.mlp_norm.weight",
// "layers.{i}.mlp.<...>", "norm.weight".
//
//   attnmix::decoder<float> dec(cfg, 1);                 // one block
//   dec.forward(x, memory, out);                          // x, out [B, T, D]; memory [B, Tm, D]
//   auto mem = dec.make_memory_cache(users, Tm);          // decoding: the memory projected once
//   dec.remember(memory, mem);                            // user n -> slot n
//   dec.forward(prefixes, out, mem, slots);               // row n reads slot slots[n]
//
// The residual stream is accum_t<T>. Written once over layers::ops<Backend> and the front doors;
// decoding from a remembered memory runs on host backends for now.

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/cross_attention_layer.hpp"
#include "attnmix/layers/mlp.hpp"
#include "attnmix/layers/norm.hpp"
#include "attnmix/layers/ops.hpp"
#include "attnmix/stack/residual.hpp"

namespace attnmix {

// Knobs of a decoder: the policies of its self-attention and cross-attention layers, its MLP.
struct decoder_policy {
  using self_attention = layers::causal_sa_layer_policy;
  using cross_attention = layers::cross_attention_layer_policy;
  static constexpr layers::mlp_kind mlp = layers::mlp_kind::swiglu;
};

// Runtime inputs of a decoder call besides x, the memory and out: packed offsets of x and of the
// memory (both or neither; as many sequences).
struct decoder_inputs {
  view1<const std::int32_t> cu_seqlens{};
  view1<const std::int32_t> cu_seqlens_memory{};
};

template <class T, class Policy = decoder_policy, class Backend = backend::cpu>
class decoder {
  static_assert(layers::has_layer_ops_v<Backend>,
                "attnmix::decoder: layers::ops<Backend> lacks an operation of its forward half "
                "(the list is in attnmix/layers/ops.hpp)");
  static_assert(layers::ops<Backend>::template computes<T>,
                "attnmix::decoder: the layers do not compute in this type on this backend");
  static_assert(Policy::self_attention::mask == mask_type::causal,
                "attnmix::decoder: the self-attention of a decoder is causal");
  using O = layers::ops<Backend>;
  using space = typename Backend::memory_space;
  using R = accum_t<T>;  // the residual stream
  template <class, class, class>
  friend class decoder;

 public:
  using scalar = T;
  using backend_type = Backend;
  using self_attention_type = layers::attention_layer<T, typename Policy::self_attention, Backend>;
  using cross_attention_type =
      layers::cross_attention_layer<T, typename Policy::cross_attention, Backend>;
  using mlp_type = layers::mlp<T, Policy::mlp, Backend>;

  struct block {
    layers::rms_norm<T, Backend> attn_norm;
    self_attention_type attn;
    layers::rms_norm<T, Backend> cross_attn_norm;
    cross_attention_type cross_attn;
    layers::rms_norm<T, Backend> mlp_norm;
    mlp_type mlp;
    explicit block(const layers::config& c)
        : attn_norm(c.hidden_size, c.norm_eps),
          attn(c),
          cross_attn_norm(c.hidden_size, c.norm_eps),
          cross_attn(c),
          mlp_norm(c.hidden_size, c.norm_eps),
          mlp(c) {}
    template <class Other>
    explicit block(const Other& b, int)
        : attn_norm(b.attn_norm),
          attn(b.attn),
          cross_attn_norm(b.cross_attn_norm),
          cross_attn(b.cross_attn),
          mlp_norm(b.mlp_norm),
          mlp(b.mlp) {}
  };
  // The memory of each sequence projected by every block's cross-attention, for decoding.
  using memory_cache = std::vector<typename cross_attention_type::cache_type>;

  // `layers` blocks of the config's sizes. Throws attnmix::error on a bad config or count.
  decoder(const layers::config& c, index_t layers)
      : cfg_(layers::checked("attnmix::decoder", c)), norm(c.hidden_size, c.norm_eps) {
    attnmix::detail::require(layers >= 1, "attnmix::decoder", "layers", "must be >= 1 but is ",
                             layers);
    blocks.reserve(static_cast<std::size_t>(layers));
    for (index_t i = 0; i < layers; ++i) blocks.emplace_back(c);
  }
  // The same decoder on Backend in T: every weight of `other` copied (and rounded) once.
  template <class U, class B>
  explicit decoder(const decoder<U, Policy, B>& other) : cfg_(other.cfg_), norm(other.norm) {
    blocks.reserve(other.blocks.size());
    for (const auto& b : other.blocks) blocks.emplace_back(b, 0);
  }

  const layers::config& config() const { return cfg_; }
  index_t hidden_size() const { return cfg_.hidden_size; }
  index_t num_layers() const { return static_cast<index_t>(blocks.size()); }
  // The sizes a saved state records of the decoder that made it.
  std::array<index_t, 6> sizes() const {
    return {cfg_.hidden_size, cfg_.num_heads,         cfg_.kv_heads(),
            cfg_.dim(),       cfg_.intermediate_size, num_layers()};
  }

  // out = decoder(x, memory). x, out: [B, T, D]; memory [B, Tm, D], or both packed (see
  // decoder_inputs). Throws attnmix::error on bad arguments, before anything is written.
  void forward(const view3<const T>& x, const view3<const T>& memory, const view3<T>& out,
               const decoder_inputs& in = {}, const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::decoder::forward";
    const layouts L = check(fn, x, memory, out, "out", in);
    run(L.x, be, x.data(), out.data(),
        [&](std::size_t i, const layers::context<Backend>& c, const T* in_rows, T* out_rows) {
          blocks[i].cross_attn.forward_rows(c, in_rows, {memory.data(), L.memory}, out_rows);
        });
  }

  // ---- Training ---------------------------------------------------------------------------
  struct block_saved {
    layers::buffer<R, space> mid, mid2;  // the residual after the self- and cross-attention
    layers::buffer<T, space> attn_in, cross_in, mlp_in;  // the normed inputs of the three layers
    typename self_attention_type::saved_type attn;
    typename cross_attention_type::saved_type cross_attn;
    typename mlp_type::saved_type mlp;
  };
  struct saved_type {
    std::array<index_t, 3> shape{}, memory_shape{};  // x's and the memory's [B, T, D]
    layers::token_layout layout, memory_layout;
    layers::buffer<std::int32_t, space> positions;  // [rows]
    std::vector<layers::buffer<R, space>> h;        // h[i]: block i's input; h[L]: the norm's
    std::vector<block_saved> blocks;
    std::array<index_t, 6> made_by{};  // the sizes of the decoder that filled it; 0 until then
  };

  // The forward of training: the same as forward(x, memory, out, in, be), also keeping in `saved`
  // what backward() reads.
  void forward(const view3<const T>& x, const view3<const T>& memory, const view3<T>& out,
               saved_type& sv, const decoder_inputs& in = {}, const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::decoder::forward";
    const layouts L = check(fn, x, memory, out, "out", in);
    sv.made_by = {};
    sv.shape = {x.extent(0), x.extent(1), x.extent(2)};
    sv.memory_shape = {memory.extent(0), memory.extent(1), memory.extent(2)};
    sv.layout = L.x, sv.memory_layout = L.memory;
    const index_t rows = L.x.rows(), n = rows * cfg_.hidden_size;
    sv.positions.resize(rows);
    sv.h.resize(blocks.size() + 1);
    for (auto& b : sv.h) b.resize(n);
    sv.blocks.resize(blocks.size());
    if (rows > 0) {
      O::positions(be, sv.positions.data(), sv.layout);
      const layers::context<Backend> c{be, sv.layout, sv.positions.data(), handles_};
      const std::int64_t* same = nullptr;
      O::move_rows(c, x.data(), sv.h[0].data(), same, same, rows, cfg_.hidden_size);
      typename O::scratch s(be, layers::scratch_bytes<T>(n));
      T* m = s.template take<T>(n);
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const block& b = blocks[i];
        block_saved& bs = sv.blocks[i];
        for (auto* buf : {&bs.attn_in, &bs.cross_in, &bs.mlp_in}) buf->resize(n);
        for (auto* buf : {&bs.mid, &bs.mid2}) buf->resize(n);
        b.attn_norm.apply(c, sv.h[i].data(), rows, bs.attn_in.data());
        b.attn.forward_rows(c, bs.attn_in.data(), m, &bs.attn);
        O::template map<layers::fn::plus>(c, bs.mid.data(), sv.h[i].data(), m, n);
        b.cross_attn_norm.apply(c, bs.mid.data(), rows, bs.cross_in.data());
        b.cross_attn.forward_rows(c, bs.cross_in.data(), {memory.data(), sv.memory_layout}, m,
                                  &bs.cross_attn);
        O::template map<layers::fn::plus>(c, bs.mid2.data(), bs.mid.data(), m, n);
        b.mlp_norm.apply(c, bs.mid2.data(), rows, bs.mlp_in.data());
        b.mlp.apply(c, bs.mlp_in.data(), rows, m, &bs.mlp);
        O::template map<layers::fn::plus>(c, sv.h[i + 1].data(), bs.mid2.data(), m, n);
      }
      norm.apply(c, sv.h[blocks.size()].data(), rows, out.data());
    }
    sv.made_by = sizes();
  }

  // Training: from `saved` (the training forward of x and memory) and dout = dL/d(out), writes
  // dL/dx into dx and dL/d(memory) into dmemory, and adds every parameter's gradient to its
  // .grad. `memory` is the forward's. Throws attnmix::error on bad arguments.
  void backward(const view3<const T>& memory, const view3<const T>& dout, const view3<T>& dx,
                const view3<T>& dmemory, const saved_type& sv, const Backend& be = Backend{}) {
    static_assert(layers::has_training_ops_v<Backend>,
                  "attnmix::decoder::backward: layers::ops<Backend> lacks an operation of its "
                  "backward half (the list is in attnmix/layers/ops.hpp)");
    using attnmix::detail::require;
    const std::string fn = "attnmix::decoder::backward";
    const index_t D = cfg_.hidden_size;
    require(sv.made_by != std::array<index_t, 6>{}, fn, "saved",
            "was not filled by a training forward");
    require(sv.made_by == sizes(), fn, "saved", "was saved by a decoder of sizes ",
            attnmix::detail::shape_string(sv.made_by.data(), 6), " but this decoder has ",
            attnmix::detail::shape_string(sizes().data(), 6),
            " (hidden, heads, KV heads, head dim, MLP width, layers)");
    const auto check = [&](const char* name, const auto& v, const std::array<index_t, 3>& shape,
                           const char* of) {
      layers::detail::check_activation(fn, name, v, D, space_of_v<Backend>, Backend::name);
      require(v.shape() == shape, fn, name, "has shape ", attnmix::detail::shape_of(v),
              " but the forward's ", of, " had ", attnmix::detail::shape_string(shape.data(), 3));
      O::check_memory(fn, name, v);
    };
    check("memory", memory, sv.memory_shape, "memory");
    check("dout", dout, sv.shape, "x");
    check("dx", dx, sv.shape, "x");
    check("dmemory", dmemory, sv.memory_shape, "memory");
    attnmix::detail::check_no_alias(fn, "dx", dx, "dout", dout);
    attnmix::detail::check_no_alias(fn, "dx", dx, "memory", memory);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "dout", dout);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "memory", memory);
    attnmix::detail::check_no_alias(fn, "dmemory", dmemory, "dx", dx);
    const layers::token_layout& L = sv.layout;
    const index_t rows = L.rows(), n = rows * D, mn = sv.memory_layout.rows() * D;
    // The residual gradient dh and the memory's, summed over the blocks, in R.
    using grad = detail::residual_grad<T, R, Backend>;
    typename O::scratch s(be, layers::scratch_bytes<R>(n) + layers::scratch_bytes<T>(n) +
                                  grad::scratch_bytes(n) + layers::scratch_bytes<R>(mn) +
                                  layers::scratch_bytes<T>(mn));
    R* dh = s.template take<R>(n);
    T* dt = s.template take<T>(n);
    R* dmem = s.template take<R>(mn);
    T* dmem_t = s.template take<T>(mn);
    O::zero(be, dmem, mn);
    if (rows == 0) {
      O::zero(be, dx.data(), dx.size());
      O::zero(be, dmemory.data(), dmemory.size());
      return;
    }
    const layers::context<Backend> c{be, L, sv.positions.data(), handles_};
    const grad rg(c, rows, D, s);
    const std::int64_t* same = nullptr;  // move_rows without a row map: a copy that converts
    norm.backward(c, sv.h[blocks.size()].data(), rows, rg.wide(dout.data()), dh);
    for (std::size_t i = blocks.size(); i-- > 0;) {
      block& b = blocks[i];
      const block_saved& bs = sv.blocks[i];
      b.mlp.backward(c, bs.mlp_in.data(), rows, rg.narrow(dh), dt, bs.mlp);
      b.mlp_norm.backward(c, bs.mid2.data(), rows, rg.wide(dt), dh, true);
      b.cross_attn.backward_rows(c, bs.cross_in.data(), {memory.data(), sv.memory_layout},
                                 rg.narrow(dh), dt, dmem_t, bs.cross_attn);
      O::template map<layers::fn::plus>(c, dmem, dmem, dmem_t, mn);
      b.cross_attn_norm.backward(c, bs.mid.data(), rows, rg.wide(dt), dh, true);
      b.attn.backward_rows(c, bs.attn_in.data(), rg.narrow(dh), dt, bs.attn);
      b.attn_norm.backward(c, sv.h[i].data(), rows, rg.wide(dt), dh, true);
    }
    O::move_rows(c, dh, dx.data(), same, same, rows, D);
    O::move_rows(c, dmem, dmemory.data(), same, same, sv.memory_layout.rows(), D);
  }

  // ---- Decoding from a remembered memory ---------------------------------------------------
  // A cache of `sequences` slots of up to `capacity` memory tokens, for every block.
  memory_cache make_memory_cache(index_t sequences, index_t capacity) const {
    memory_cache cache;
    cache.reserve(blocks.size());
    for (const block& b : blocks) cache.push_back(b.cross_attn.make_cache(sequences, capacity));
    return cache;
  }
  // Projects the memory [N, Tm, D] (or packed with cu_seqlens_memory) into every block's cache,
  // sequence n -> slot n: computed once per user, read by every decoding step. Throws
  // attnmix::error (and leaves the cache as it was) on bad arguments.
  void remember(const view3<const T>& memory, memory_cache& cache,
                const view1<const std::int32_t>& cu_seqlens_memory = {},
                const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::decoder::remember";
    check_memory_cache(fn, cache);
    // Every block checks the same memory against a cache of the same slots: the first check
    // runs before any block writes.
    for (std::size_t i = 0; i < blocks.size(); ++i)
      blocks[i].cross_attn.remember(memory, cache[i], cu_seqlens_memory, be);
  }
  // out = decoder(x) for x, out [N, T, D] (dense), row n reading the memory of slot slots[n] of
  // `cache` (slots may repeat: the beams of one user). Every row is a whole prefix: the
  // self-attention runs over it anew (no self-attention cache). Throws attnmix::error on bad
  // arguments.
  void forward(const view3<const T>& x, const view3<T>& out, const memory_cache& cache,
               const std::vector<std::int32_t>& slots, const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::decoder::forward";
    const index_t D = cfg_.hidden_size;
    layers::detail::check_activation(fn, "x", x, D, space_of_v<Backend>, Backend::name);
    layers::detail::check_activation(fn, "out", out, D, space_of_v<Backend>, Backend::name);
    layers::detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    O::check_memory(fn, "x", x);
    O::check_memory(fn, "out", out);
    check_memory_cache(fn, cache);
    const index_t N = x.extent(0);
    const std::vector<index_t> where = blocks.front().cross_attn.reading_slots(
        fn, view1<const std::int32_t>(slots.data(), {index_t(slots.size())}), N, x.extent(1),
        cache[0]);
    run(layers::token_layout{N, x.extent(1), {}}, be, x.data(), out.data(),
        [&](std::size_t i, const layers::context<Backend>& c, const T* in_rows, T* out_rows) {
          blocks[i].cross_attn.attend_rows(c, in_rows, out_rows, cache[i], where);
        });
  }

  // Visits every parameter as f(name, parameter&).
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

 private:
  layers::config cfg_;
  typename O::handles handles_{};

 public:
  std::vector<block> blocks;
  layers::rms_norm<T, Backend> norm;

 private:
  struct layouts {
    layers::token_layout x, memory;
  };

  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    for (std::size_t i = 0; i < s.blocks.size(); ++i) {
      auto& b = s.blocks[i];
      const std::string p = prefix + "layers." + std::to_string(i) + ".";
      b.attn_norm.visit_parameters(f, p + "attn_norm.");
      b.attn.visit_parameters(f, p + "attn.");
      b.cross_attn_norm.visit_parameters(f, p + "cross_attn_norm.");
      b.cross_attn.visit_parameters(f, p + "cross_attn.");
      b.mlp_norm.visit_parameters(f, p + "mlp_norm.");
      b.mlp.visit_parameters(f, p + "mlp.");
    }
    s.norm.visit_parameters(f, prefix + "norm.");
  }

  // Every block, then the final norm, on x's rows (layout L) into out; cross(i, c, in, out) runs
  // block i's cross-attention. The residual stream h is updated in place.
  template <class Cross>
  void run(const layers::token_layout& L, const Backend& be, const T* x, T* out,
           Cross&& cross) const {
    const index_t rows = L.rows(), n = rows * cfg_.hidden_size;
    if (rows == 0) return;
    using layers::scratch_bytes;
    typename O::scratch s(
        be, scratch_bytes<R>(n) + scratch_bytes<T>(n) * 2 + scratch_bytes<std::int32_t>(rows));
    R* h = s.template take<R>(n);
    T *t = s.template take<T>(n), *m = s.template take<T>(n);
    std::int32_t* pos = s.template take<std::int32_t>(rows);
    O::positions(be, pos, L);
    const layers::context<Backend> c{be, L, pos, handles_};
    const std::int64_t* same = nullptr;
    O::move_rows(c, x, h, same, same, rows, cfg_.hidden_size);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const block& b = blocks[i];
      b.attn_norm.apply(c, h, rows, t);
      b.attn.forward_rows(c, t, m);
      O::template map<layers::fn::plus>(c, h, h, m, n);
      b.cross_attn_norm.apply(c, h, rows, t);
      cross(i, c, t, m);
      O::template map<layers::fn::plus>(c, h, h, m, n);
      b.mlp_norm.apply(c, h, rows, t);
      b.mlp.apply(c, t, rows, m);
      O::template map<layers::fn::plus>(c, h, h, m, n);
    }
    norm.apply(c, h, rows, out);
  }

  // x, memory and out (named `arg`) through the cross-attention's checks (the first block's: they
  // all have the same sizes), and both layouts.
  layouts check(const std::string& fn, const view3<const T>& x, const view3<const T>& memory,
                const view3<T>& out, const char* arg, const decoder_inputs& in) const {
    const auto L = blocks.front().cross_attn.check_call(fn, x, memory, out, arg, in.cu_seqlens,
                                                        in.cu_seqlens_memory);
    return {L.x, L.memory};
  }

  void check_memory_cache(const std::string& fn, const memory_cache& cache) const {
    attnmix::detail::require(cache.size() == blocks.size(), fn, "cache", "holds ", cache.size(),
                             " layers' memory but the decoder has ", blocks.size());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      blocks[i].cross_attn.check_cache(fn, "cache", "layer " + std::to_string(i) + "'s memory",
                                       cache[i]);
      attnmix::detail::require(cache[i].sequences() == cache[0].sequences() &&
                                   cache[i].capacity() == cache[0].capacity(),
                               fn, "cache", "layer ", i, " holds ", cache[i].sequences(), " x ",
                               cache[i].capacity(), " slots but layer 0 ", cache[0].sequences(),
                               " x ", cache[0].capacity());
    }
  }
};

}  // namespace attnmix
