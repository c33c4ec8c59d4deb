#pragma once
// layers::ops<backend::cuda>: the layers' row operations on the GPU, on contiguous device
// [rows, features] buffers: projections on cuBLAS, the row-wise steps on the kernels of
// cuda/launch/rows.cuh, scratch from the stream-ordered pool; and parameter<T,
// device_space>, a host parameter's values copied once to the device. Statistics and
// activations are computed in float whatever the storage type.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/launch/rows.cuh"
#include "attnmix/cuda/launch/rows_backward.cuh"
#include "attnmix/cuda/runtime.cuh"
#include "attnmix/cuda/runtime/cublas.cuh"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace layers {

// One parameter's values on the device, converted (through float, or directly for double) to T
// when it is made from a host one; nothing is allocated for an empty one. Its gradient `.grad`
// (in accum_t<T>, as the host one's) is allocated, zero, on first use (grad_ptr() or
// zero_grad()). Host copies: get_values / set_values (io::save and io::load of a device model
// go through a host model, layers::transfer_parameters).
template <class T>
struct parameter<T, device_space> {
  using value_type = T;
  using grad_type = accum_t<T>;
  std::vector<index_t> shape;

  parameter() = default;
  // `fill` in every value (zero by default).
  explicit parameter(std::vector<index_t> s, T fill = static_cast<T>(0.f)) : shape(std::move(s)) {
    if (numel() == 0) return;
    const std::vector<T> staged(static_cast<std::size_t>(numel()), fill);
    upload(staged);
  }
  template <class U>
  explicit parameter(const parameter<U, host_space>& host) : shape(host.shape) {
    if (host.empty() || host.numel() == 0) return;
    std::vector<T> staged(host.data.size());
    for (std::size_t i = 0; i < staged.size(); ++i) staged[i] = convert<T>(host.data[i]);
    upload(staged);
  }

  index_t numel() const {
    index_t n = 1;
    for (index_t e : shape) n *= e;
    return n;
  }
  bool empty() const { return shape.empty(); }
  const T* ptr() const { return static_cast<const T*>(mem_.get()); }
  T* ptr() { return static_cast<T*>(mem_.get()); }

  // The gradient buffer, allocated (zero) on first use. (The zeroing runs on the legacy default
  // stream, which orders it before work on blocking streams.)
  grad_type* grad_ptr() {
    if (grad_mem_.get() == nullptr && numel() > 0) zero_grad();
    return static_cast<grad_type*>(grad_mem_.get());
  }
  const grad_type* grad_ptr() const { return static_cast<const grad_type*>(grad_mem_.get()); }
  bool has_grad() const { return grad_mem_.get() != nullptr; }
  void zero_grad() {
    const std::size_t bytes = static_cast<std::size_t>(numel()) * sizeof(grad_type);
    if (bytes == 0) return;
    if (grad_mem_.get() == nullptr)
      grad_mem_ = attnmix::detail::cuda::device_memory(bytes, "cudaMalloc(gradients)");
    attnmix::detail::cuda::check(cudaMemset(grad_mem_.get(), 0, bytes), "cudaMemset(gradients)");
  }

  // Host copies (wait for the device): the values, and the gradient (zeros if none yet).
  std::vector<T> values() const { return download<T>(mem_.get(), numel()); }
  std::vector<grad_type> grad_values() const {
    if (grad_mem_.get() == nullptr)
      return std::vector<grad_type>(static_cast<std::size_t>(numel()), grad_type(0));
    return download<grad_type>(grad_mem_.get(), numel());
  }
  // As doubles (exact for every storage type), and back (rounded to T); sizes must match.
  void get_values(std::vector<double>& out) const {
    const std::vector<T> v = values();
    out.resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = convert<double>(v[i]);
  }
  void set_values(const std::vector<double>& in) {
    attnmix::detail::require(static_cast<index_t>(in.size()) == numel(),
                             "attnmix::layers::parameter::set_values", "values", "has ", in.size(),
                             " values but the parameter holds ", numel());
    if (in.empty()) return;
    std::vector<T> staged(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) staged[i] = convert<T>(in[i]);
    if (mem_.get() == nullptr)
      upload(staged);
    else
      attnmix::detail::cuda::check(
          cudaMemcpy(mem_.get(), staged.data(), staged.size() * sizeof(T), cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }

 private:
  // U -> V directly between built-in types, through float for half and bfloat16.
  template <class V, class U>
  static V convert(const U& u) {
    if constexpr (std::is_arithmetic_v<U> && std::is_arithmetic_v<V>)
      return static_cast<V>(u);
    else
      return static_cast<V>(static_cast<float>(u));
  }
  void upload(const std::vector<T>& staged) {
    mem_ = attnmix::detail::cuda::device_memory(staged.size() * sizeof(T), "cudaMalloc(weights)");
    attnmix::detail::cuda::check(
        cudaMemcpy(mem_.get(), staged.data(), staged.size() * sizeof(T), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  }
  template <class S>
  static std::vector<S> download(const void* p, index_t n) {
    std::vector<S> h(static_cast<std::size_t>(n));
    if (n > 0 && p != nullptr)
      attnmix::detail::cuda::check(
          cudaMemcpy(h.data(), p, h.size() * sizeof(S), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return h;
  }

  attnmix::detail::cuda::device_memory mem_, grad_mem_;
};

// An owned array in device memory: the activations a layer's training forward saves. Grows
// on resize (contents then unspecified), never shrinks.
template <class S>
class buffer<S, device_space> {
 public:
  void resize(index_t n) {
    if (n > capacity_) {
      mem_ = attnmix::detail::cuda::device_memory(static_cast<std::size_t>(n) * sizeof(S),
                                                  "cudaMalloc(saved activations)");
      capacity_ = n;
    }
    size_ = n;
  }
  // n copies of value (what a decoding cache starts from): copied in, synchronously.
  void assign(index_t n, S value) {
    resize(n);
    if (n == 0) return;
    const std::vector<S> staged(static_cast<std::size_t>(n), value);
    attnmix::detail::cuda::check(
        cudaMemcpy(mem_.get(), staged.data(), staged.size() * sizeof(S), cudaMemcpyHostToDevice),
        "cudaMemcpy(buffer)");
  }
  index_t size() const { return size_; }
  S* data() { return static_cast<S*>(mem_.get()); }
  const S* data() const { return static_cast<const S*>(mem_.get()); }

 private:
  attnmix::detail::cuda::device_memory mem_;
  index_t size_ = 0, capacity_ = 0;
};

namespace detail {
// The device functor of each element-wise function tag.
template <class Fn>
struct device_fn;
template <>
struct device_fn<fn::silu_times> {
  using type = attnmix::detail::cuda::silu_times;
};
template <>
struct device_fn<fn::times_sigmoid> {
  using type = attnmix::detail::cuda::times_sigmoid;
};
template <>
struct device_fn<fn::gelu> {
  using type = attnmix::detail::cuda::gelu_of;
};
template <>
struct device_fn<fn::relu> {
  using type = attnmix::detail::cuda::relu_of;
};
template <>
struct device_fn<fn::log_sigmoid> {
  using type = attnmix::detail::cuda::log_sigmoid_of;
};
template <>
struct device_fn<fn::two_sigmoid> {
  using type = attnmix::detail::cuda::two_sigmoid_of;
};
template <>
struct device_fn<fn::plus> {
  using type = attnmix::detail::cuda::plus;
};
}  // namespace detail

template <>
struct ops<backend::cuda> {
  static cudaStream_t stream(const backend::cuda& be) {
    return static_cast<cudaStream_t>(be.stream);
  }

  // A cuBLAS handle (creating one costs milliseconds: a stack makes it once).
  struct handles {
    attnmix::detail::cuda::blas_handle blas;
  };

  template <class T>
  static constexpr bool computes = std::is_same_v<T, float> || std::is_same_v<T, attnmix::half> ||
                                   std::is_same_v<T, attnmix::bfloat16>;

  // Stream-ordered scratch of several typed arrays, carved from one allocation.
  class scratch {
   public:
    scratch(const backend::cuda& be, std::size_t bytes)
        : buf_(bytes, stream(be)), at_(buf_.get(), bytes) {}
    template <class S>
    S* take(index_t n) {
      return at_.template take<S>(n);
    }

   private:
    attnmix::detail::cuda::stream_buffer buf_;
    detail::scratch_cursor at_;
  };

  // y = x W^T (+ bias): W in x's type, bias in float, y in x's type or float.
  template <class C, class X, class B, class Y>
  static void gemm(const C& c, const X* x, index_t ldx, index_t rows, const X* W, index_t in,
                   index_t out, const B* bias, Y* y, index_t ldy) {
    attnmix::detail::cuda::gemm_rows(c.handles.blas.get(), stream(c.be), x, ldx, rows, W, in, out,
                                     y, ldy);
    if (bias != nullptr) attnmix::detail::cuda::add_bias(y, bias, rows, out, ldy, stream(c.be));
  }

  template <class C, class In, class Out>
  static void norm(const C& c, const In* x, Out* y, index_t groups, index_t width, const float* w,
                   bool per_group, index_t groups_per_row, bool mean, double eps) {
    attnmix::detail::cuda::norm_groups(x, y, groups, width, w, per_group, groups_per_row, mean, eps,
                                       stream(c.be));
  }

  // Restarts at every sequence start (c.positions), or continues from state_in (device, [N,
  // K - 1, C] for the N sequences of c.layout); state_out receives each sequence's last K - 1
  // inputs. Layouts with states need no positions.
  template <class C, class In, class Out>
  static void short_conv(const C& c, const In* x, Out* y, index_t channels, const float* w,
                         index_t K, bool silu, const In* state_in = nullptr,
                         In* state_out = nullptr) {
    namespace k = attnmix::detail::cuda;
    if (state_in == nullptr && state_out == nullptr) {
      k::short_conv(x, y, c.rows(), channels, w, K, silu, c.positions, stream(c.be));
      return;
    }
    // The sequences' row offsets (those of a dense batch too: it may have no tokens).
    const token_layout& L = c.layout;
    const index_t N = L.num_sequences();
    std::vector<std::int32_t> offsets(static_cast<std::size_t>(N + 1));
    for (index_t n = 0; n <= N; ++n)
      offsets[std::size_t(n)] =
          L.packed() ? L.cu_seqlens[std::size_t(n)] : std::int32_t(n * L.tokens);
    k::stream_buffer cu(offsets.size() * sizeof(std::int32_t), stream(c.be));
    k::upload_host(cu.get(), offsets.data(), offsets.size() * sizeof(std::int32_t), stream(c.be),
                   "cudaMemcpyAsync(conv offsets)");
    k::short_conv(x, y, c.rows(), channels, w, K, silu, static_cast<const std::int32_t*>(nullptr),
                  stream(c.be), state_in, state_out, N,
                  reinterpret_cast<const std::int32_t*>(cu.get()));
  }

  template <class C, class T>
  static void rope(const C& c, T* x, index_t rows, index_t heads, index_t d, double theta) {
    attnmix::detail::cuda::rope(x, rows, heads, d, c.positions, theta, stream(c.be));
  }

  template <class Fn, class C, class Y, class X, class Z = float>
  static void map(const C& c, Y* y, const X* a, const Z* b, index_t n) {
    attnmix::detail::cuda::map<typename detail::device_fn<Fn>::type>(y, a, b, n, stream(c.be));
  }

  template <class C, class X, class Y>
  static void move_rows(const C& c, const X* x, Y* y, const std::int64_t* src,
                        const std::int64_t* dst, index_t rows, index_t width) {
    attnmix::detail::cuda::move_rows(x, y, src, dst, rows, width, stream(c.be));
  }

  // Each row's position in its sequence: computed on the device for a dense batch; a packed one
  // uploads them.
  static void positions(const backend::cuda& be, std::int32_t* pos, const token_layout& L) {
    namespace k = attnmix::detail::cuda;
    if (L.packed()) {
      std::vector<std::int32_t> p;
      for (const index_t v : layers::detail::positions(L)) p.push_back(std::int32_t(v));
      k::upload_host(pos, p.data(), p.size() * sizeof(std::int32_t), stream(be), "cudaMemcpyAsync");
    } else {
      k::dense_positions(pos, L.rows(), L.tokens, stream(be));
    }
  }
  template <class S>
  static void upload(const backend::cuda& be, S* dst, const S* src, index_t n) {
    if (n == 0) return;  // dst and src may be null then
    attnmix::detail::cuda::upload_host(dst, src, std::size_t(n) * sizeof(S), stream(be),
                                       "cudaMemcpyAsync");
  }
  template <class S>
  static void zero(const backend::cuda& be, S* p, index_t n) {
    if (n == 0) return;
    attnmix::detail::cuda::check(cudaMemsetAsync(p, 0, std::size_t(n) * sizeof(S), stream(be)),
                                 "cudaMemsetAsync");
  }

  // A view marked as device memory must really point to it.
  template <class V>
  static void check_memory(const std::string& fn, const char* arg, const V& v) {
    attnmix::detail::cuda::check_device_pointer(fn, arg, v);
  }

  // ---- Backward (see layers/ops.hpp; the semantics of ops<cpu>) ----
  // dx = dy W (+ dx with accumulate): cuBLAS.
  template <class C, class Y, class W, class X>
  static void gemm_dx(const C& c, const Y* dy, index_t lddy, index_t rows, const W* w, index_t in,
                      index_t out, X* dx, index_t lddx, bool accumulate = false) {
    attnmix::detail::cuda::gemm_rows_dx(c.handles.blas.get(), stream(c.be), dy, lddy, rows, w, in,
                                        out, dx, lddx, accumulate);
  }
  // dW += dy^T x (cuBLAS, into the float gradient), dbias += colsum(dy) (one thread a column).
  template <class C, class X, class Y>
  static void gemm_dw(const C& c, const X* x, index_t ldx, index_t rows, const Y* dy, index_t lddy,
                      index_t in, index_t out, float* dW, float* dbias) {
    attnmix::detail::cuda::gemm_rows_dw(c.handles.blas.get(), stream(c.be), x, ldx, rows, dy, lddy,
                                        in, out, dW);
    if (dbias != nullptr)
      attnmix::detail::cuda::bias_backward(dy, lddy, rows, out, dbias, stream(c.be));
  }
  template <class C, class X, class Y>
  static void norm_backward(const C& c, const X* x, const Y* dy, Y* dx, index_t groups,
                            index_t width, const float* w, bool per_group, index_t groups_per_row,
                            bool mean, double eps, float* dw, bool accumulate = false) {
    attnmix::detail::cuda::norm_groups_backward(x, dy, dx, groups, width, w, per_group,
                                                groups_per_row, mean, eps, dw, accumulate,
                                                stream(c.be));
  }
  template <class C, class X, class Y>
  static void short_conv_backward(const C& c, const X* x, const Y* dy, Y* dx, index_t channels,
                                  const float* w, index_t K, bool silu, float* dw,
                                  bool accumulate = false) {
    attnmix::detail::cuda::short_conv_backward(x, dy, dx, c.rows(), channels, w, K, silu,
                                               c.positions, dw, accumulate, stream(c.be));
  }
  template <class C, class T>
  static void rope_backward(const C& c, T* dx, index_t rows, index_t heads, index_t d,
                            double theta) {
    attnmix::detail::cuda::rope(dx, rows, heads, d, c.positions, theta, stream(c.be), true);
  }
  template <class Fn, class C, class Y, class X, class Z = Y>
  static void map_backward(const C& c, const Y* dy, const X* a, const Z* b, X* da, Z* db, index_t n,
                           bool accumulate = false) {
    attnmix::detail::cuda::map_backward<typename detail::device_fn<Fn>::type>(
        dy, a, b, da, db, n, accumulate, stream(c.be));
  }

  // ---- Training (see layers/ops.hpp) ----
  // Adds the summed loss (double, fixed order) to *total (device memory); reads nothing back.
  template <class C, class T>
  static void cross_entropy(const C& c, const T* logits, index_t ld, index_t rows, index_t V,
                            const std::int32_t* labels, std::int32_t ignore, T* dlogits,
                            index_t ldd, double scale, double* total) {
    attnmix::detail::cuda::cross_entropy(logits, ld, rows, V, labels, ignore, dlogits, ldd, scale,
                                         total, stream(c.be));
  }
  template <class P, class G, class S, class Q = P>
  static void adamw(const backend::cuda& be, P* p, const G* g, S* m, S* v, index_t n, double lr,
                    double beta1, double beta2, double eps, double wd, index_t step,
                    Q* copy = nullptr) {
    const double c1 = 1 - std::pow(beta1, double(step)), c2 = 1 - std::pow(beta2, double(step));
    attnmix::detail::cuda::adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, c1, c2, copy,
                                 stream(be));
  }
  template <class G>
  static void sum_squares(const backend::cuda& be, const G* g, index_t n, double* total) {
    attnmix::detail::cuda::sum_values<true>(g, n, total, stream(be));
  }
  template <class G>
  static void clip(const backend::cuda& be, G* g, index_t n, const double* sum_squares,
                   double max_norm) {
    attnmix::detail::cuda::clip(g, n, sum_squares, max_norm, stream(be));
  }
  // Waits for the stream.
  template <class S>
  static void download(const backend::cuda& be, S* dst, const S* src, index_t n) {
    attnmix::detail::cuda::download(dst, src, n, stream(be));
  }
  template <class C, class W, class Y>
  static void gather_rows(const C& c, const W* w, const std::int32_t* ids, index_t rows,
                          index_t width, Y* y) {
    attnmix::detail::cuda::gather_rows(w, ids, rows, width, y, stream(c.be));
  }
  // In row order for every element (one thread per column): deterministic.
  template <class C, class Y>
  static void scatter_add_rows(const C& c, const Y* dy, const std::int32_t* ids, index_t rows,
                               index_t width, float* dw) {
    attnmix::detail::cuda::scatter_add_rows(dy, ids, rows, width, dw, stream(c.be));
  }

  // A block's time with CUDA events, for stack_inputs::on_layer (waits for the block); inert
  // when not asked for.
  class timer {
   public:
    timer(const backend::cuda& be, bool on) : on_(on), stream_(stream(be)) {
      if (!on_) return;
      attnmix::detail::cuda::check(cudaEventCreate(&a_), "cudaEventCreate");
      attnmix::detail::cuda::check(cudaEventCreate(&b_), "cudaEventCreate");
    }
    ~timer() {
      if (!on_) return;
      (void)cudaEventDestroy(a_);
      (void)cudaEventDestroy(b_);
    }
    timer(const timer&) = delete;
    timer& operator=(const timer&) = delete;
    void start() {
      if (on_) attnmix::detail::cuda::check(cudaEventRecord(a_, stream_), "cudaEventRecord");
    }
    double seconds() {
      namespace k = attnmix::detail::cuda;
      k::check(cudaEventRecord(b_, stream_), "cudaEventRecord");
      k::check(cudaEventSynchronize(b_), "cudaEventSynchronize");
      float ms = 0.f;
      k::check(cudaEventElapsedTime(&ms, a_, b_), "cudaEventElapsedTime");
      return ms * 1e-3;
    }

   private:
    bool on_;
    cudaStream_t stream_;
    cudaEvent_t a_ = nullptr, b_ = nullptr;
  };
};

static_assert(has_training_ops_v<backend::cuda>, "ops<backend::cuda> lacks an operation");

}  // namespace layers
}  // namespace attnmix
