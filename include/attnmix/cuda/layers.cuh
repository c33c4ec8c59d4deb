#pragma once
// The layers on the GPU: device copies of a host layer's weights and its forward, on device
// row buffers. Projections run on cuBLAS, the row-wise steps on the kernels of
// cuda/detail/layer_kernels.cuh, the attention cores through the CUDA backend's front doors.
//
//   layers::device_mixer<Mixer, D>   one per host mixer template (attention_layer, linear_layer,
//                                    path_layer); D: the activations' storage type on the device
//   layers::device_mlp<D, Kind>, device_linear<D>, device_weights
//
// Weights keep the host layer's values, rounded once to D (projections) or kept in float
// (norm weights, conv taps, biases). Activations between steps are D; gates, beta and w are
// float, as the attention kernels take them. These are what attnmix::device_stack is built
// from; a device layer is a forward only (prefill and decoding caches stay on the host path).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/linear_attention.hpp"
#include "attnmix/cuda/launch/attention.cuh"
#include "attnmix/cuda/runtime/cublas.cuh"
#include "attnmix/cuda/launch/rows.cuh"
#include "attnmix/layers/attention_layer.hpp"
#include "attnmix/layers/linear_layer.hpp"
#include "attnmix/layers/mlp.hpp"
#include "attnmix/layers/path_layer.hpp"

namespace attnmix {
namespace layers {

// One parameter's values on the device, converted to S; empty when the host one is.
template <class S>
class device_weights {
 public:
  device_weights() = default;
  template <class T>
  explicit device_weights(const parameter<T>& host) {
    if (host.empty() || host.numel() == 0) return;
    std::vector<S> staged(host.data.size());
    for (std::size_t i = 0; i < staged.size(); ++i)
      staged[i] = static_cast<S>(static_cast<float>(host.data[i]));
    mem_ = attnmix::detail::cuda::device_memory(staged.size() * sizeof(S), "cudaMalloc(weights)");
    attnmix::detail::cuda::check(
        cudaMemcpy(mem_.get(), staged.data(), staged.size() * sizeof(S), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  }
  const S* get() const { return static_cast<const S*>(mem_.get()); }
  explicit operator bool() const { return mem_.get() != nullptr; }

 private:
  attnmix::detail::cuda::device_memory mem_;
};

// What a device layer's forward needs besides its input rows.
struct device_context {
  cublasHandle_t blas;
  backend::cuda be;
  const token_layout& layout;
  const std::int32_t* positions;  // device [rows]: each row's position in its sequence
  cudaStream_t stream() const { return static_cast<cudaStream_t>(be.stream); }
};

// Stream-ordered scratch of several typed arrays, carved from one allocation.
class device_scratch {
 public:
  device_scratch(std::size_t bytes, cudaStream_t s) : buf_(bytes, s) {}
  template <class S>
  static std::size_t bytes(index_t n) {
    return (static_cast<std::size_t>(n) * sizeof(S) + 255) / 256 * 256;
  }
  template <class S>
  S* take(index_t n) {
    S* p = reinterpret_cast<S*>(buf_.get() + used_);
    used_ += bytes<S>(n);
    return p;
  }

 private:
  attnmix::detail::cuda::stream_buffer buf_;
  std::size_t used_ = 0;
};

// Row buffer p ([rows, heads * d]) as the [B, T, heads, d] device view the attention front doors
// take.
template <class S>
view4<S> as_heads(S* p, const token_layout& L, index_t heads, index_t d) {
  return view4<S>(p, {L.batch, L.tokens, heads, d}, memory_space::device);
}

// nn.Linear on the device: y = x W^T (+ b); W in D, b in float; y in D or float.
template <class D>
class device_linear {
 public:
  device_linear() = default;
  template <class T>
  explicit device_linear(const linear<T>& host)
      : W_(host.weight), b_(host.bias()), in_(host.in_features()), out_(host.out_features()) {}

  index_t out_features() const { return out_; }

  // x [rows, in] (row stride in), y [rows, out] (row stride out).
  template <class Y>
  void apply(const device_context& c, const D* x, index_t rows, Y* y) const {
    attnmix::detail::cuda::gemm_rows(c.blas, c.stream(), x, in_, rows, W_.get(), in_, out_, y,
                                     out_);
    if (b_) attnmix::detail::cuda::add_bias(y, b_.get(), rows, out_, out_, c.stream());
  }

 private:
  device_weights<D> W_;
  device_weights<float> b_;
  index_t in_ = 0, out_ = 0;
};

// q = x Wq^T, k, v of one mixer call and its attention output o, carved from the call's scratch.
template <class D>
struct device_qkv {
  D *q, *k, *v, *o;
  index_t q_heads, kv_heads, d;

  // Points the q, k, v and out views of attention arguments (either family) at the buffers.
  template <class Args>
  void point(Args& a, const token_layout& L) const {
    a.q = as_heads<const D>(q, L, q_heads, d);
    a.k = as_heads<const D>(k, L, kv_heads, d);
    a.v = as_heads<const D>(v, L, kv_heads, d);
    a.out = as_heads<D>(o, L, q_heads, d);
  }
};

template <class D>
device_qkv<D> project_qkv(const device_context& c, device_scratch& s, const D* x,
                          const device_linear<D>& q_proj, const device_linear<D>& k_proj,
                          const device_linear<D>& v_proj, index_t q_heads, index_t kv_heads,
                          index_t d) {
  const index_t rows = c.layout.rows(), nq = rows * q_heads * d, nk = rows * kv_heads * d;
  device_qkv<D> qkv{
      s.take<D>(nq), s.take<D>(nk), s.take<D>(nk), s.take<D>(nq), q_heads, kv_heads, d};
  q_proj.apply(c, x, rows, qkv.q);
  k_proj.apply(c, x, rows, qkv.k);
  v_proj.apply(c, x, rows, qkv.v);
  return qkv;
}

// An RMSNorm (or per-head RMSNorm) on the device; the weight in float.
struct device_norm {
  device_weights<float> weight;
  index_t width = 0, groups_per_row = 1;
  bool per_group = false;
  double eps = 1e-6;

  device_norm() = default;
  template <class T>
  explicit device_norm(const rms_norm<T>& host)
      : weight(host.weight), width(host.width()), eps(host.eps()) {}
  template <class T>
  device_norm(const head_rms_norm<T>& host, index_t heads, index_t d, bool per_head, double e)
      : weight(host.weight), width(d), groups_per_row(heads), per_group(per_head), eps(e) {}

  // x, y: [rows, groups_per_row * width] (may be the same buffer).
  template <class In, class Out>
  void apply(const device_context& c, const In* x, index_t rows, Out* y) const {
    attnmix::detail::cuda::norm_groups(x, y, rows * groups_per_row, width, weight.get(), per_group,
                                       groups_per_row, true, eps, c.stream());
  }
};

template <class D, mlp_kind Kind>
class device_mlp {
 public:
  template <class T>
  explicit device_mlp(const mlp<T, Kind>& host)
      : gate_proj(host.gate_proj),
        up_proj(host.up_proj),
        down_proj(host.down_proj),
        I_(host.width()) {}

  // x, y: [rows, D] device rows (distinct).
  void apply(const device_context& c, const D* x, index_t rows, D* y) const {
    namespace k = attnmix::detail::cuda;
    const bool gated = Kind == mlp_kind::swiglu;
    device_scratch s(device_scratch::bytes<D>(rows * I_) * (gated ? 2 : 1), c.stream());
    D* h = s.take<D>(rows * I_);
    up_proj.apply(c, x, rows, h);
    if constexpr (Kind == mlp_kind::swiglu) {
      D* g = s.take<D>(rows * I_);
      gate_proj.apply(c, x, rows, g);
      k::map<k::silu_times>(h, g, h, rows * I_, c.stream());
    } else if constexpr (Kind == mlp_kind::gelu) {
      k::map<k::gelu_of>(h, h, static_cast<const float*>(nullptr), rows * I_, c.stream());
    } else {
      k::map<k::relu_of>(h, h, static_cast<const float*>(nullptr), rows * I_, c.stream());
    }
    down_proj.apply(c, h, rows, y);
  }

 private:
  device_linear<D> gate_proj, up_proj, down_proj;
  index_t I_ = 0;
};

// The device twin of a host mixer: device_mixer<attention_layer<T, P>, D> and so on. A mixer
// template without a specialisation has no GPU forward.
template <class Mixer, class D>
class device_mixer;

// Softmax attention and FoX (layers/attention_layer.hpp).
template <class T, class P, class D>
class device_mixer<attention_layer<T, P>, D> {
  using host_type = attention_layer<T, P>;
  using K = typename host_type::kind;
  static constexpr bool fox = std::is_same_v<K, attnmix::kind::fox>;

 public:
  device_mixer(const host_type& host, const config& c)
      : HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        theta_(c.rope_theta),
        scale_(c.scale),
        window_(c.window),
        q_proj(host.q_proj),
        k_proj(host.k_proj),
        v_proj(host.v_proj),
        o_proj(host.o_proj),
        f_proj(host.f_proj),
        g_proj(host.g_proj) {
    if constexpr (P::qk_norm) {
      q_norm = device_norm(host.q_norm, HQ_, d_, fox, c.head_norm_eps);
      k_norm = device_norm(host.k_norm, H_, d_, fox, c.head_norm_eps);
    }
  }

  void forward(const device_context& c, const D* x, D* y) const {
    namespace k = attnmix::detail::cuda;
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    device_scratch s(device_scratch::bytes<D>(nq) * 2 + device_scratch::bytes<D>(nk) * 2 +
                         device_scratch::bytes<float>(rows * HQ_),
                     c.stream());
    const device_qkv<D> qkv = project_qkv(c, s, x, q_proj, k_proj, v_proj, HQ_, H_, d_);
    if constexpr (P::qk_norm) {
      q_norm.apply(c, qkv.q, rows, qkv.q);
      k_norm.apply(c, qkv.k, rows, qkv.k);
    }
    if constexpr (P::rope) {
      k::rope(qkv.q, rows, HQ_, d_, c.positions, theta_, c.stream());
      k::rope(qkv.k, rows, H_, d_, c.positions, theta_, c.stream());
    }
    attention_args<D> a;
    qkv.point(a, L);
    if constexpr (fox) {
      float* g = s.take<float>(rows * HQ_);
      f_proj.apply(c, x, rows, g);
      k::map<k::log_sigmoid_of>(g, g, static_cast<const float*>(nullptr), rows * HQ_, c.stream());
      a.g = view3<const float>(g, {L.batch, L.tokens, HQ_}, memory_space::device);
    }
    attnmix::attention<K, typename host_type::attention_policy>(a, L.attention(scale_, window_),
                                                                c.be);
    if constexpr (P::output_gate) {
      g_proj.apply(c, x, rows, qkv.q);  // q is free again: the gate logits
      k::map<k::times_sigmoid>(qkv.o, qkv.o, qkv.q, nq, c.stream());
    }
    o_proj.apply(c, qkv.o, rows, y);
  }

 private:
  index_t HQ_, H_, d_;
  double theta_;
  std::optional<double> scale_;
  index_t window_;
  device_linear<D> q_proj, k_proj, v_proj, o_proj, f_proj, g_proj;
  device_norm q_norm, k_norm;
};

// BLA, GBLA and causal linear attention (layers/linear_layer.hpp).
template <class T, class P, class D>
class device_mixer<linear_layer<T, P>, D> {
  using host_type = linear_layer<T, P>;
  using K = typename P::kind;
  using Core = typename P::core;
  static constexpr bool gated = Core::gate != key_gate::off;
  static constexpr bool normed = Core::norm != gated_norm::off;

 public:
  device_mixer(const host_type& host, const config& c)
      : HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        Dm_(c.hidden_size),
        norm_eps_(c.head_norm_eps),
        conv_w_(host.conv1d.weight),
        q_proj(host.q_proj),
        k_proj(host.k_proj),
        v_proj(host.v_proj),
        o_proj(host.o_proj),
        a_proj(host.a_proj),
        g_proj(host.g_proj),
        gamma_(host.o_norm_weight),
        gamma_size_(host.o_norm_weight.numel()) {}

  void forward(const device_context& c, const D* u, D* y) const {
    namespace k = attnmix::detail::cuda;
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    const index_t Hg = gated ? a_proj.out_features() : 0;
    device_scratch s(device_scratch::bytes<D>(P::use_conv ? rows * Dm_ : 0) +
                         device_scratch::bytes<D>(nq) * (normed ? 3 : 2) +
                         device_scratch::bytes<D>(nk) * 2 + device_scratch::bytes<float>(rows * Hg),
                     c.stream());
    const D* cin = u;
    if constexpr (P::use_conv) {
      D* conv = s.take<D>(rows * Dm_);
      k::short_conv(u, conv, rows, Dm_, conv_w_.get(), P::conv_size, P::conv_silu, c.positions,
                    c.stream());
      cin = conv;
    }
    const device_qkv<D> qkv = project_qkv(c, s, cin, q_proj, k_proj, v_proj, HQ_, H_, d_);
    linear_attention_args<D> a;
    qkv.point(a, L);
    if constexpr (gated) {
      float* logits = s.take<float>(rows * Hg);
      a_proj.apply(c, u, rows, logits);
      a.a = view3<const float>(logits, {L.batch, L.tokens, Hg}, memory_space::device);
    }
    if constexpr (normed) {
      D* g = s.take<D>(nq);
      g_proj.apply(c, u, rows, g);
      a.gate = as_heads<const D>(g, L, HQ_, d_);
      a.gamma = view1<const float>(gamma_.get(), {gamma_size_}, memory_space::device);
    }
    linear_attention_params p;
    p.norm_eps = norm_eps_;
    p.cu_seqlens = L.cu_view();
    attnmix::linear_attention<K, Core>(a, p, c.be);
    o_proj.apply(c, qkv.o, rows, y);
  }

 private:
  index_t HQ_, H_, d_, Dm_;
  double norm_eps_;
  device_weights<float> conv_w_;
  device_linear<D> q_proj, k_proj, v_proj, o_proj, a_proj, g_proj;
  device_weights<float> gamma_;
  index_t gamma_size_;
};

// PaTH and PaTH-FoX (layers/path_layer.hpp).
template <class T, class P, class D>
class device_mixer<path_layer<T, P>, D> {
  using host_type = path_layer<T, P>;
  using K = typename P::kind;
  static constexpr bool gated = kind_traits<K>::uses_forget_gate;

 public:
  device_mixer(const host_type& host, const config& c)
      : HQ_(c.num_heads),
        H_(c.kv_heads()),
        d_(c.dim()),
        scale_(c.scale),
        low_rank_(host.w_proj_down.out_features() > 0),
        rank_(host.w_proj_down.out_features()),
        q_proj(host.q_proj),
        k_proj(host.k_proj),
        v_proj(host.v_proj),
        o_proj(host.o_proj),
        bt_proj(host.bt_proj),
        g_proj(host.g_proj),
        w_proj_down(host.w_proj_down),
        w_proj(host.w_proj),
        conv_w_(host.w_conv1d.weight) {
    if constexpr (P::qk_norm) {
      q_norm = device_norm(host.maybe_q_norm);
      k_norm = device_norm(host.maybe_k_norm);
    }
  }

  void forward(const device_context& c, const D* x, D* y) const {
    namespace k = attnmix::detail::cuda;
    const token_layout& L = c.layout;
    const index_t rows = L.rows(), nq = rows * HQ_ * d_, nk = rows * H_ * d_;
    device_scratch s(device_scratch::bytes<D>(nq) * 2 + device_scratch::bytes<D>(nk) * 3 +
                         device_scratch::bytes<D>(rows * rank_) + device_scratch::bytes<float>(nk) +
                         device_scratch::bytes<float>(rows * (H_ + HQ_)),
                     c.stream());
    const device_qkv<D> qkv = project_qkv(c, s, x, q_proj, k_proj, v_proj, HQ_, H_, d_);
    if constexpr (P::qk_norm) {
      q_norm.apply(c, qkv.q, rows, qkv.q);
      k_norm.apply(c, qkv.k, rows, qkv.k);
    }
    // w: low-rank (or full) projection, short conv with SiLU, then per-head L2 norm, in float.
    D* wd = s.take<D>(nk);
    if (low_rank_) {
      D* r = s.take<D>(rows * rank_);
      w_proj_down.apply(c, x, rows, r);
      w_proj.apply(c, r, rows, wd);
    } else {
      w_proj.apply(c, x, rows, wd);
    }
    float* w = s.take<float>(nk);
    if constexpr (P::w_shortconv)
      k::short_conv(wd, w, rows, H_ * d_, conv_w_.get(), P::conv_size, true, c.positions,
                    c.stream());
    else
      k::move_rows(wd, w, static_cast<const std::int64_t*>(nullptr),
                   static_cast<const std::int64_t*>(nullptr), rows, H_ * d_, c.stream());
    k::norm_groups(w, w, rows * H_, d_, nullptr, false, 1, false, 1e-6, c.stream());
    float* beta = s.take<float>(rows * (H_ + HQ_));
    bt_proj.apply(c, x, rows, beta);
    k::map<k::two_sigmoid_of>(beta, beta, static_cast<const float*>(nullptr), rows * H_,
                              c.stream());
    attention_args<D> a;
    qkv.point(a, L);
    a.w = as_heads<const float>(w, L, H_, d_);
    a.beta = view3<const float>(beta, {L.batch, L.tokens, H_}, memory_space::device);
    if constexpr (gated) {
      float* g = beta + rows * H_;
      g_proj.apply(c, x, rows, g);
      k::map<k::log_sigmoid_of>(g, g, static_cast<const float*>(nullptr), rows * HQ_, c.stream());
      a.g = view3<const float>(g, {L.batch, L.tokens, HQ_}, memory_space::device);
    }
    attnmix::attention<K, typename P::attention_policy>(a, L.attention(scale_), c.be);
    o_proj.apply(c, qkv.o, rows, y);
  }

 private:
  index_t HQ_, H_, d_;
  std::optional<double> scale_;
  bool low_rank_;
  index_t rank_;
  device_linear<D> q_proj, k_proj, v_proj, o_proj, bt_proj, g_proj, w_proj_down, w_proj;
  device_weights<float> conv_w_;
  device_norm q_norm, k_norm;
};

}  // namespace layers
}  // namespace attnmix
