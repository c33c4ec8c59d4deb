#pragma once
// The per-backend operations the layers are written on, and what one layer call carries.
//
// Every layer's forward is one function template over a Backend; it reaches the backend only
// through the attention front doors and layers::ops<Backend>:
//   gemm(c, x, ldx, rows, W, in, out, bias, y, ldy)    y = x W^T (+ bias), row-major rows
//   norm(c, x, y, groups, width, w, per_group, groups_per_row, mean, eps)
//                                                      RMSNorm (mean) or L2 norm over groups
//   short_conv(c, x, y, channels, w, K, silu[, state_in, state_out])
//   rope(c, x, rows, heads, d, theta)                  rotate-half RoPE at c.positions
//   map<Fn>(c, y, a, b, n)                             y = Fn(a, b) element-wise (fn:: tags)
//   move_rows(c, x, y, src, dst, rows, width)          row gather / scatter
//   positions(be, pos, layout), upload(be, dst, src, n), zero(be, p, n)
//   check_memory(fn, arg, view)                        the pointer is in the backend's memory
//   scratch(be, bytes) with take<S>(n)                 one allocation, carved in order
//   timer(be, on) with start(), seconds()              a block's time for stack_inputs::on_layer
//   handles                                            long-lived library state (cuBLAS)
//   computes<T>                                        the compute types of the backend
//   for_each(be, n, body)                              host backends: the decoding loops
// and their backwards (training): activation gradients written, or added with `accumulate`;
// parameter gradients added to; sums over rows in an order that does not depend on threads:
//   gemm_dx(c, dy, lddy, rows, W, in, out, dx, lddx, acc)    dx = dy W
//   gemm_dw(c, x, ldx, rows, dy, lddy, in, out, dW, dbias)   dW += dy^T x, dbias += colsum dy
//   norm_backward(c, x, dy, dx, groups, width, w, per_group, groups_per_row, mean, eps, dw, acc)
//   short_conv_backward(c, x, dy, dx, channels, w, K, silu, dw, acc)
//   rope_backward(c, dx, rows, heads, d, theta)               the inverse rotation, in place
//   map_backward<Fn>(c, dy, a, b, da, db, n, acc)             da = dy dFn/da, db = dy dFn/db
//   gather_rows(c, W, ids, rows, width, y), scatter_add_rows(c, dy, ids, rows, width, dW)
//                                                             embeddings and their backward
// and the training steps:
//   cross_entropy(c, logits, ld, rows, V, labels, ignore, dlogits, ldd, scale, total)
//                                                             *total += the summed loss
//   adamw(be, p, g, m, v, n, lr, beta1, beta2, eps, wd, step[, copy])
//                                                             one AdamW step in place (and the
//                                                             new p rounded into copy)
//   sum_squares(be, g, n, total), clip(be, g, n, sum_squares, max_norm)
//                                                             gradient clipping
//   download(be, dst, src, n)                                 n values to the host (waits)
// Totals (double) stay in the backend's memory, so that a training step reads a device value
// only where it returns one: the loss, the gradient norm.
// The CPU specialisation is in attnmix/cpu/layer_ops.hpp, the CUDA one in
// attnmix/cuda/layer_ops.cuh; a new backend specialises ops<> (and the attention front doors'
// implementations) and runs every layer and stack.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "attnmix/core/error.hpp"
#include "attnmix/core/memory_space.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/core/traits.hpp"
#include "attnmix/layers/common.hpp"

namespace attnmix {
namespace layers {

template <class Backend, class Enable = void>
struct ops {
  static_assert(attnmix::detail::dependent_false<Backend>,
                "attnmix::layers::ops: no layer operations for this backend. For backend::cpu "
                "include <attnmix/cpu/layer_ops.hpp> (or attnmix/attnmix.hpp); for backend::cuda "
                "include <attnmix/cuda/layer_ops.cuh> (or attnmix/cuda.cuh) under nvcc.");
};

// Element-wise functions of ops::map, as tags each backend implements (statistics in float or
// wider): y = f(a, b); a unary function ignores b.
namespace fn {
struct silu_times {};     // SwiGLU: SiLU(a) * b
struct times_sigmoid {};  // output gate: a * sigmoid(b)
struct gelu {};           // exact (erf) GELU of a
struct relu {};           // max(a, 0)
struct log_sigmoid {};    // log(sigmoid(a)) without overflow
struct two_sigmoid {};    // PaTH's beta = 2 sigmoid(a)
struct plus {};           // the residual update a + b
}  // namespace fn

// Whether a backend's kernels read host memory: prefill and decoding caches live there (for now).
template <class Backend>
inline constexpr bool on_host_v =
    std::is_same_v<typename Backend::memory_space, attnmix::host_space>;

// Bytes that scratch::take<S>(n) uses: rounded to 256 so that every array starts aligned.
template <class S>
constexpr std::size_t scratch_bytes(index_t n) {
  return (static_cast<std::size_t>(n) * sizeof(S) + 255) / 256 * 256;
}

namespace detail {
// Carves typed arrays in order from one allocation of `bytes` (each backend's scratch). A take
// past the end is a bug in the caller's size sum: it throws std::logic_error instead of handing
// out memory beyond the allocation.
class scratch_cursor {
 public:
  scratch_cursor(unsigned char* base, std::size_t bytes) : base_(base), bytes_(bytes) {}
  template <class S>
  S* take(index_t n) {
    const std::size_t need = scratch_bytes<S>(n);
    if (n < 0 || need > bytes_ - used_)
      throw std::logic_error(attnmix::detail::concat(
          "attnmix::layers::scratch::take: ", n, " elements of ", sizeof(S), " bytes need ", need,
          " bytes, but only ", bytes_ - used_, " of the ", bytes_, " allocated are left"));
    S* p = reinterpret_cast<S*>(base_ + used_);
    used_ += need;
    return p;
  }

 private:
  unsigned char* base_;
  std::size_t bytes_, used_ = 0;
};
}  // namespace detail

// What one layer call needs besides its rows: the backend, how the rows split into sequences,
// each row's position in its sequence ([rows], in the backend's memory; null where no step of
// the call needs it), and the backend's long-lived handles.
template <class Backend>
struct context {
  const Backend& be;
  const token_layout& layout;
  const std::int32_t* positions;
  const typename ops<Backend>::handles& handles;

  index_t rows() const { return layout.rows(); }
};

// Row buffer p ([rows, heads * d]) as the [B, T, heads, d] view the attention front doors take.
template <class Backend, class S>
view4<S> as_heads(S* p, const token_layout& L, index_t heads, index_t d) {
  return view4<S>(p, {L.batch, L.tokens, heads, d}, space_of_v<Backend>);
}
template <class Backend, class S>
view3<S> as_rows(S* p, const token_layout& L, index_t width) {
  return view3<S>(p, {L.batch, L.tokens, width}, space_of_v<Backend>);
}

// Whether ops<Backend> has every operation listed at the top of this file, called with float
// rows: has_layer_ops_v the forward half (what a stack's forward calls; for_each, which only host
// backends have, for their decoding loops, is not asked for), has_training_ops_v the backward
// half and the training steps as well. Each backend checks itself with them where it specialises
// ops<>; stacks, models and optimisers check the backend they are given, so that a missing
// operation is named once instead of deep in a layer.
namespace detail {
template <class B, class = void>
struct has_layer_ops : std::false_type {};
template <class B, class = void>
struct has_training_ops : std::false_type {};

template <class B, class O = ops<B>, class C = const context<B>&, class F = float>
using layer_ops_calls = decltype(
    O::gemm(std::declval<C>(), std::declval<const F*>(), index_t{}, index_t{},
            std::declval<const F*>(), index_t{}, index_t{}, std::declval<const F*>(),
            std::declval<F*>(), index_t{}),
    O::norm(std::declval<C>(), std::declval<const F*>(), std::declval<F*>(), index_t{}, index_t{},
            std::declval<const float*>(), true, index_t{}, true, 1.0),
    O::short_conv(std::declval<C>(), std::declval<const F*>(), std::declval<F*>(), index_t{},
                  std::declval<const float*>(), index_t{}, true),
    O::rope(std::declval<C>(), std::declval<F*>(), index_t{}, index_t{}, index_t{}, 1.0),
    O::template map<fn::plus>(std::declval<C>(), std::declval<F*>(), std::declval<const F*>(),
                              std::declval<const F*>(), index_t{}),
    O::move_rows(std::declval<C>(), std::declval<const F*>(), std::declval<F*>(),
                 std::declval<const std::int64_t*>(), std::declval<const std::int64_t*>(),
                 index_t{}, index_t{}),
    O::positions(std::declval<const B&>(), std::declval<std::int32_t*>(),
                 std::declval<const token_layout&>()),
    O::upload(std::declval<const B&>(), std::declval<F*>(), std::declval<const F*>(), index_t{}),
    O::zero(std::declval<const B&>(), std::declval<F*>(), index_t{}),
    O::check_memory(std::declval<const char*>(), std::declval<const char*>(),
                    std::declval<const view3<const F>&>()),
    std::declval<typename O::scratch&>().template take<F>(index_t{}),
    typename O::scratch(std::declval<const B&>(), std::size_t{}),
    std::declval<typename O::timer&>().start(),
    double(std::declval<typename O::timer&>().seconds()),
    typename O::timer(std::declval<const B&>(), true),
    std::integral_constant<bool, O::template computes<F>>{});

template <class B, class O = ops<B>, class C = const context<B>&, class F = float>
using training_ops_calls =
    decltype(O::gemm_dx(std::declval<C>(), std::declval<const F*>(), index_t{}, index_t{},
                        std::declval<const F*>(), index_t{}, index_t{}, std::declval<F*>(),
                        index_t{}, true),
             O::gemm_dw(std::declval<C>(), std::declval<const F*>(), index_t{}, index_t{},
                        std::declval<const F*>(), index_t{}, index_t{}, index_t{},
                        std::declval<F*>(), std::declval<F*>()),
             O::norm_backward(std::declval<C>(), std::declval<const F*>(), std::declval<const F*>(),
                              std::declval<F*>(), index_t{}, index_t{},
                              std::declval<const float*>(), true, index_t{}, true, 1.0,
                              std::declval<float*>(), true),
             O::short_conv_backward(std::declval<C>(), std::declval<const F*>(),
                                    std::declval<const F*>(), std::declval<F*>(), index_t{},
                                    std::declval<const float*>(), index_t{}, true,
                                    std::declval<float*>(), true),
             O::rope_backward(std::declval<C>(), std::declval<F*>(), index_t{}, index_t{},
                              index_t{}, 1.0),
             O::template map_backward<fn::plus>(
                 std::declval<C>(), std::declval<const F*>(), std::declval<const F*>(),
                 std::declval<const F*>(), std::declval<F*>(), std::declval<F*>(), index_t{}, true),
             O::gather_rows(std::declval<C>(), std::declval<const F*>(),
                            std::declval<const std::int32_t*>(), index_t{}, index_t{},
                            std::declval<F*>()),
             O::scatter_add_rows(std::declval<C>(), std::declval<const F*>(),
                                 std::declval<const std::int32_t*>(), index_t{}, index_t{},
                                 std::declval<float*>()),
             O::cross_entropy(std::declval<C>(), std::declval<const F*>(), index_t{}, index_t{},
                              index_t{}, std::declval<const std::int32_t*>(), std::int32_t{},
                              std::declval<F*>(), index_t{}, 1.0, std::declval<double*>()),
             O::adamw(std::declval<const B&>(), std::declval<float*>(),
                      std::declval<const float*>(), std::declval<double*>(),
                      std::declval<double*>(), index_t{}, 1.0, 1.0, 1.0, 1.0, 1.0, index_t{}),
             O::sum_squares(std::declval<const B&>(), std::declval<const float*>(), index_t{},
                            std::declval<double*>()),
             O::clip(std::declval<const B&>(), std::declval<float*>(), index_t{},
                     std::declval<const double*>(), 1.0),
             O::download(std::declval<const B&>(), std::declval<double*>(),
                         std::declval<const double*>(), index_t{}));

template <class B>
struct has_layer_ops<B, std::void_t<layer_ops_calls<B>>> : std::true_type {};
template <class B>
struct has_training_ops<B, std::void_t<layer_ops_calls<B>, training_ops_calls<B>>>
    : std::true_type {};
}  // namespace detail

template <class Backend>
inline constexpr bool has_layer_ops_v = detail::has_layer_ops<Backend>::value;
template <class Backend>
inline constexpr bool has_training_ops_v = detail::has_training_ops<Backend>::value;

// Where a layer's forward leaves what its backward will need (the training issue fills these
// in); forwards take `saved* = nullptr` and write nothing to it yet.
struct no_saved {};

}  // namespace layers
}  // namespace attnmix
