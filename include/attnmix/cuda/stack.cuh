#pragma once
// attnmix::device_stack: a host stack's weights on the GPU, and the stack's full-sequence
// forward there (the encoder forward of stack/stack.hpp, block for block).
//
//   attnmix::stack<float, attnmix::repeat<3, layer::sa, layer::gbla, layer::gbla>> enc(cfg);
//   attnmix::layers::randomize_parameters(enc, seed);          // or attnmix::io::load(enc, file)
//   attnmix::device_stack<decltype(enc), attnmix::bfloat16> gpu(enc);  // uploads the weights
//   gpu.forward(x, out, {mask}, attnmix::backend::cuda{stream});       // device [B, T, D] views
//
// The host stack stays the owner of the weights (loading, saving, initialising); a device_stack
// is a snapshot of them, rounded to D (float, half or bfloat16) for the projections and kept in
// float for norms, conv taps and biases. The residual stream is float; what the blocks read
// and write between steps is D. Prefill and decoding caches stay on the host stack.

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/cuda/launch/attention.cuh"
#include "attnmix/cuda/runtime/cublas.cuh"
#include "attnmix/cuda/launch/rows.cuh"
#include "attnmix/cuda/layers.cuh"
#include "attnmix/cuda/runtime.cuh"
#include "attnmix/stack/stack.hpp"

namespace attnmix {

template <class Stack, class D = float>
class device_stack;

template <class T, class Policy, class... Layers, class D>
class device_stack<basic_stack_impl<T, Policy, backend::cpu, layer_list<Layers...>>, D> {
  static_assert(std::is_same_v<D, float> || std::is_same_v<D, half> || std::is_same_v<D, bfloat16>,
                "attnmix::device_stack: activations on the GPU are float, half or bfloat16");
  static_assert((Layers::template check_backend<backend::cuda>() && ...),
                "attnmix::device_stack: a layer has no CUDA implementation");

  using host_type = basic_stack_impl<T, Policy, backend::cpu, layer_list<Layers...>>;

  template <class Layer>
  struct block {
    layers::device_norm attn_norm;
    layers::device_mixer<typename Layer::template type<T>, D> attn;
    layers::device_norm mlp_norm;
    layers::device_mlp<D, Policy::mlp> mlp;
    template <class HostBlock>
    block(const HostBlock& b, const layers::config& c)
        : attn_norm(b.attn_norm), attn(b.attn, c), mlp_norm(b.mlp_norm), mlp(b.mlp) {}
  };

 public:
  using scalar = D;
  static constexpr std::size_t num_layers = sizeof...(Layers);

  // Copies (and rounds) every weight of `host` to the current device. Later changes to the host
  // stack's parameters need a new device_stack.
  explicit device_stack(const host_type& host)
      : device_stack(host, std::index_sequence_for<Layers...>{}) {}

  const layers::config& config() const { return cfg_; }
  static std::vector<const char*> layer_names() { return {Layers::name...}; }

  // out = stack(x). x, out: [B, T, D] contiguous device views (distinct); in.mask ([B, T], host)
  // or in.cu_seqlens ([N+1], host, B == 1) as for the host stack; pad rows of out are zeros.
  // Runs on be.stream. With in.on_layer, each block is timed with CUDA events and the call
  // waits for each block to finish before reporting it.
  void forward(const view3<const D>& x, const view3<D>& out, const stack_inputs& in = {},
               const backend::cuda& be = backend::cuda{}) const {
    namespace k = attnmix::detail::cuda;
    const std::string fn = "attnmix::device_stack::forward";
    const index_t Dm = cfg_.hidden_size;
    layers::detail::check_activation(fn, "x", x, Dm, memory_space::device);
    layers::detail::check_activation(fn, "out", out, Dm, memory_space::device);
    layers::detail::check_same_shape(fn, out, x);
    attnmix::detail::check_no_alias(fn, "out", out, "x", x);
    k::check_device_pointer(fn, "x", x);
    k::check_device_pointer(fn, "out", out);
    const cudaStream_t stream = static_cast<cudaStream_t>(be.stream);

    // The rows the blocks run on: the batch as it is, or its valid tokens packed (mask).
    layers::token_layout L;
    std::vector<std::int64_t> src;  // mask: packed row -> row of x
    if (in.mask.has_value()) {
      attnmix::detail::check_not_given(fn, "cu_seqlens", in.cu_seqlens, "'mask' was given too");
      attnmix::detail::check_layout(fn, "mask", in.mask);
      attnmix::detail::check_space(fn, "mask", in.mask, memory_space::host, "packing");
      attnmix::detail::check_shape(fn, "mask", in.mask, {x.extent(0), x.extent(1)}, "[B, T]");
      L = layers::token_layout{1, 0, {0}};
      for (index_t b = 0; b < x.extent(0); ++b) {
        for (index_t t = 0; t < x.extent(1); ++t)
          if (in.mask(b, t) != 0) src.push_back(b * x.extent(1) + t);
        L.cu_seqlens.push_back(static_cast<std::int32_t>(src.size()));
      }
      L.tokens = static_cast<index_t>(src.size());
    } else {
      L = layers::detail::make_layout(fn, x, in.cu_seqlens);
    }
    const index_t rows = L.rows();
    if (in.mask.has_value())
      k::check(cudaMemsetAsync(out.data(), 0, out.size() * sizeof(D), stream), "cudaMemsetAsync");
    if (rows == 0) return;

    using scratch = layers::device_scratch;
    scratch s(scratch::bytes<float>(rows * Dm) + scratch::bytes<D>(rows * Dm) * 2 +
                  scratch::bytes<std::int32_t>(rows) + scratch::bytes<std::int64_t>(src.size()),
              stream);
    float* h = s.take<float>(rows * Dm);
    D *t = s.take<D>(rows * Dm), *m = s.take<D>(rows * Dm);
    std::int32_t* dpos = s.take<std::int32_t>(rows);
    std::int64_t* dsrc = s.take<std::int64_t>(static_cast<index_t>(src.size()));
    // Each row's position in its sequence: computed on the device for a dense batch; a packed
    // one uploads them (a copy from pageable memory, which waits for the stream).
    if (L.packed()) {
      std::vector<std::int32_t> pos;
      for (const index_t p : layers::detail::positions(L)) pos.push_back(std::int32_t(p));
      k::check(cudaMemcpyAsync(dpos, pos.data(), pos.size() * sizeof(std::int32_t),
                               cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync");
    } else {
      k::dense_positions(dpos, rows, L.tokens, stream);
    }
    if (!src.empty())
      k::check(cudaMemcpyAsync(dsrc, src.data(), src.size() * sizeof(std::int64_t),
                               cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync");
    else
      dsrc = nullptr;  // every row of x, in order
    k::move_rows(x.data(), h, dsrc, static_cast<const std::int64_t*>(nullptr), rows, Dm, stream);

    const layers::device_context c{blas_.get(), be, L, dpos};
    const char* names[] = {Layers::name...};
    event_pair timer(static_cast<bool>(in.on_layer));
    for_each_block([&](const auto& b, auto I) {
      timer.start(stream);
      b.attn_norm.apply(c, h, rows, t);
      b.attn.forward(c, t, m);
      k::map<k::plus>(h, h, m, rows * Dm, stream);
      b.mlp_norm.apply(c, h, rows, t);
      b.mlp.apply(c, t, rows, m);
      k::map<k::plus>(h, h, m, rows * Dm, stream);
      if (in.on_layer) {
        constexpr std::size_t i = decltype(I)::value;
        in.on_layer(static_cast<index_t>(i), names[i], timer.seconds(stream));
      }
    });
    if (dsrc != nullptr) {
      norm_.apply(c, h, rows, t);
      k::move_rows(t, out.data(), static_cast<const std::int64_t*>(nullptr), dsrc, rows, Dm,
                   stream);
    } else {
      norm_.apply(c, h, rows, out.data());
    }
  }

 private:
  template <std::size_t... I>
  device_stack(const host_type& host, std::index_sequence<I...>)
      : cfg_(host.config()),
        blocks_(block<Layers>(host.template block_at<I>(), host.config())...),
        norm_(host.norm) {}

  template <class F, std::size_t... I>
  void for_each_block_impl(F& f, std::index_sequence<I...>) const {
    (f(std::get<I>(blocks_), std::integral_constant<std::size_t, I>{}), ...);
  }
  template <class F>
  void for_each_block(F&& f) const {
    for_each_block_impl(f, std::index_sequence_for<Layers...>{});
  }

  // Block timing for on_layer; inert when not asked for.
  class event_pair {
   public:
    explicit event_pair(bool on) : on_(on) {
      if (!on_) return;
      attnmix::detail::cuda::check(cudaEventCreate(&a_), "cudaEventCreate");
      attnmix::detail::cuda::check(cudaEventCreate(&b_), "cudaEventCreate");
    }
    ~event_pair() {
      if (!on_) return;
      (void)cudaEventDestroy(a_);
      (void)cudaEventDestroy(b_);
    }
    event_pair(const event_pair&) = delete;
    event_pair& operator=(const event_pair&) = delete;
    void start(cudaStream_t s) {
      if (on_) attnmix::detail::cuda::check(cudaEventRecord(a_, s), "cudaEventRecord");
    }
    double seconds(cudaStream_t s) {
      namespace k = attnmix::detail::cuda;
      k::check(cudaEventRecord(b_, s), "cudaEventRecord");
      k::check(cudaEventSynchronize(b_), "cudaEventSynchronize");
      float ms = 0.f;
      k::check(cudaEventElapsedTime(&ms, a_, b_), "cudaEventElapsedTime");
      return ms * 1e-3;
    }

   private:
    bool on_;
    cudaEvent_t a_ = nullptr, b_ = nullptr;
  };

  layers::config cfg_;
  attnmix::detail::cuda::blas_handle blas_;
  std::tuple<block<Layers>...> blocks_;
  layers::device_norm norm_;
};

}  // namespace attnmix
