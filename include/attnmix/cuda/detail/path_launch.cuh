#pragma once
// Host side of the CUDA PaTH kernels: argument checks that only the CUDA backend needs, the
// stream-ordered chunk data, and the choice between the tensor-core and the portable forward.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/cuda/detail/attention_launch.cuh"
#include "attnmix/cuda/detail/path_kernels.cuh"
#include "attnmix/cuda/detail/path_mma.cuh"
#include "attnmix/cuda/detail/types.cuh"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

inline void check_path_dims(const std::string& fn, const attention_problem& p) {
  require(p.head_dim <= 128, fn, "q", "has head dim D = ", p.head_dim,
          " but the CUDA PaTH kernels support D <= 128");
  require(p.value_dim <= 128, fn, "v", "has head dim Dv = ", p.value_dim,
          " but the CUDA PaTH kernels support Dv <= 128");
  require(p.num_sequences <= 65535, fn, "cu_seqlens", "holds ", p.num_sequences,
          " sequences but the CUDA backend supports at most 65535");
}

template <class W, class B>
void set_householder(path_kernel_params& kp, const W& w, const B& beta, index_t kv_heads) {
  kp.w = w.data(), kp.beta = beta.data();
  for (int i = 0; i < 3; ++i) kp.w_stride[i] = w.stride(i), kp.beta_stride[i] = beta.stride(i);
  kp.kv_heads = static_cast<int>(kv_heads);
}

// The per-chunk data of one call: K~ in KT, U and M in TU, optionally W in half.
template <class KT, class TU>
class path_chunk_data {
 public:
  path_chunk_data(const attention_problem& p, bool half_w, cudaStream_t stream)
      : rows_(static_cast<std::size_t>(p.batch * p.kv_heads * p.tokens)),
        buffer_(bytes(rows_, p.head_dim, half_w), stream) {
    const auto D = static_cast<std::size_t>(p.head_dim);
    unsigned char* at = buffer_.get();
    kt_ = at, at += align(rows_ * D * sizeof(KT));
    u_ = at, at += align(rows_ * D * sizeof(TU));
    m_ = at, at += align(rows_ * path_chunk * sizeof(TU));
    wh_ = half_w ? at : nullptr;
  }
  void attach(path_kernel_params& kp) const { kp.kt = kt_, kp.u = u_, kp.m = m_, kp.wh = wh_; }

 private:
  static std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }
  static std::size_t bytes(std::size_t rows, index_t D, bool half_w) {
    const auto d = static_cast<std::size_t>(D);
    return align(rows * d * sizeof(KT)) + align(rows * d * sizeof(TU)) +
           align(rows * path_chunk * sizeof(TU)) + (half_w ? align(rows * d * sizeof(__half)) : 0);
  }
  std::size_t rows_;
  stream_buffer buffer_;
  void *kt_ = nullptr, *u_ = nullptr, *m_ = nullptr, *wh_ = nullptr;
};

template <class T, class KT, class TU>
void launch_path_prepare(const path_kernel_params& kp, index_t max_len, index_t sequences,
                         cudaStream_t stream) {
  const int smem = path_prepare_smem_bytes(kp.a.head_dim);
  auto kernel = kp.a.head_dim <= 64 ? path_prepare_kernel<T, KT, TU, 64>
                                    : path_prepare_kernel<T, KT, TU, 128>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute");
  const dim3 grid(static_cast<unsigned>((max_len + path_chunk - 1) / path_chunk),
                  static_cast<unsigned>(kp.kv_heads), static_cast<unsigned>(sequences));
  kernel<<<grid, 256, smem, stream>>>(kp);
  check(cudaGetLastError(), "path_prepare_kernel launch");
}

// Where the prefill key cache goes (keys == nullptr: nowhere): [B, T, H, D] with these strides,
// or, with slot_of (device), the slots of a decoding cache, whose values and gate cumsum are
// filled too.
template <class Out>
struct key_cache_target {
  Out* keys = nullptr;
  index_t stride[3] = {0, 0, 0};
  const std::int32_t* slot_of = nullptr;
  Out* values = nullptr;
  double* gates = nullptr;
  index_t capacity = 0;
};

template <class T, class KT, class TU, class Out>
void launch_path_key_cache(const path_kernel_params& kp, index_t sequences,
                           const key_cache_target<Out>& target, cudaStream_t stream) {
  const int smem = path_key_cache_smem_bytes(kp.a.head_dim);
  auto kernel = path_key_cache_kernel<KT, TU, Out>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute");
  kernel<<<dim3(static_cast<unsigned>(kp.kv_heads), static_cast<unsigned>(sequences)), 256, smem,
           stream>>>(kp, target.keys, target.stride[0], target.stride[1], target.stride[2],
                     target.slot_of);
  check(cudaGetLastError(), "path_key_cache_kernel launch");
  if (target.values != nullptr) {
    path_cache_fill_kernel<T, Out><<<dim3(64, static_cast<unsigned>(sequences)), 128, 0, stream>>>(
        kp, target.values, target.gates, target.capacity, target.slot_of);
    check(cudaGetLastError(), "path_cache_fill_kernel launch");
  }
}

template <class Dev, int D, int Dv>
void launch_path_mma(const path_kernel_params& kp, index_t max_len, index_t sequences,
                     cudaStream_t stream) {
  using tile = path_mma_tile<D, Dv>;
  auto kernel = path_forward_mma_kernel<Dev, D, Dv>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tile::smem_bytes),
        "cudaFuncSetAttribute");
  const dim3 grid(static_cast<unsigned>((max_len + path_chunk - 1) / path_chunk),
                  static_cast<unsigned>(kp.a.q_heads), static_cast<unsigned>(sequences));
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp);
}

template <class Dev>
void launch_path_simt(const path_kernel_params& kp, index_t max_len, index_t sequences,
                      cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((max_len + path_chunk - 1) / path_chunk),
                  static_cast<unsigned>(kp.a.q_heads), static_cast<unsigned>(sequences));
  if (std::max(kp.a.head_dim, kp.a.value_dim) <= 64)
    path_forward_simt_kernel<Dev, 64><<<grid, 256, 0, stream>>>(kp);
  else
    path_forward_simt_kernel<Dev, 128><<<grid, 256, 0, stream>>>(kp);
}

// The PaTH / PaTH-FoX forward (and, when `cache.keys` is set, the prefill key cache from the same
// chunk data). gate_coef: factor of (G_i - G_j), ignored without a.g.
template <class T, class Out = device_t<T>>
void run_path(const std::string& fn, const attention_args<T>& a, const attention_problem& p,
              const backend::cuda& be, double gate_coef, key_cache_target<Out> cache = {}) {
  using Dev = device_t<T>;
  check_device_pointer(fn, "q", a.q);
  check_device_pointer(fn, "k", a.k);
  check_device_pointer(fn, "v", a.v);
  check_device_pointer(fn, "w", a.w);
  check_device_pointer(fn, "beta", a.beta);
  check_device_pointer(fn, "out", a.out);
  check_device_pointer(fn, "g", a.g);
  check_device_pointer(fn, "lse", a.lse);
  check_path_dims(fn, p);

  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  attention_setup setup(attention_scratch_bytes(a, p), stream);
  setup_attention(setup, a, p, true, gate_coef, stream);
  if (setup.max_len == 0) return;
  path_kernel_params kp{};
  kp.a = setup.kp;
  set_householder(kp, a.w, a.beta, p.kv_heads);

  constexpr bool tensor_cores = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
  const index_t D = p.head_dim, Dv = p.value_dim;
  const bool mma =
      tensor_cores && (D == 64 || D == 128) && (Dv == 64 || Dv == 128) &&
      aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 2) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8) &&
      aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1), a.out.stride(2), 2);
  if constexpr (tensor_cores) {
    if (mma) {
      path_chunk_data<Dev, __half> chunks(p, true, stream);
      chunks.attach(kp);
      launch_path_prepare<Dev, Dev, __half>(kp, setup.max_len, p.num_sequences, stream);
      if (D == 64 && Dv == 64)
        launch_path_mma<Dev, 64, 64>(kp, setup.max_len, p.num_sequences, stream);
      else if (D == 128 && Dv == 128)
        launch_path_mma<Dev, 128, 128>(kp, setup.max_len, p.num_sequences, stream);
      else if (D == 64)
        launch_path_mma<Dev, 64, 128>(kp, setup.max_len, p.num_sequences, stream);
      else
        launch_path_mma<Dev, 128, 64>(kp, setup.max_len, p.num_sequences, stream);
      check(cudaGetLastError(), "path_forward_mma_kernel launch");
      if (cache.keys != nullptr)
        launch_path_key_cache<Dev, Dev, __half>(kp, p.num_sequences, cache, stream);
      return;
    }
  }
  path_chunk_data<float, float> chunks(p, false, stream);
  chunks.attach(kp);
  launch_path_prepare<Dev, float, float>(kp, setup.max_len, p.num_sequences, stream);
  launch_path_simt<Dev>(kp, setup.max_len, p.num_sequences, stream);
  check(cudaGetLastError(), "path_forward_simt_kernel launch");
  if (cache.keys != nullptr)
    launch_path_key_cache<Dev, float, float>(kp, p.num_sequences, cache, stream);
}

// The prefill key cache alone (path_prefill_key_cache): the chunk data in float, then the
// suffix-product walk.
template <class T>
void run_path_key_cache(const std::string& fn, const path_key_cache_args<T>& a,
                        const attention_problem& p, const backend::cuda& be) {
  using Dev = device_t<T>;
  check_device_pointer(fn, "k", a.k);
  check_device_pointer(fn, "w", a.w);
  check_device_pointer(fn, "beta", a.beta);
  check_device_pointer(fn, "key_cache", a.key_cache);
  check_path_dims(fn, p);
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  index_t max_len = 0;
  for (index_t n = 0; n < p.num_sequences; ++n) max_len = std::max(max_len, p.seq(n).length);
  if (max_len == 0) return;
  const std::size_t cu_bytes =
      p.cu_seqlens != nullptr ? static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t)
                              : 0;
  stream_buffer offsets(cu_bytes, stream);
  path_kernel_params kp{};
  kp.a.k = a.k.data();
  for (int i = 0; i < 3; ++i) kp.a.k_stride[i] = a.k.stride(i);
  kp.a.tokens = p.tokens;
  kp.a.head_dim = static_cast<int>(p.head_dim);
  if (cu_bytes > 0) {
    check(cudaMemcpyAsync(offsets.get(), p.cu_seqlens, cu_bytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(cu_seqlens)");
    kp.a.cu_seqlens = reinterpret_cast<const std::int32_t*>(offsets.get());
  }
  set_householder(kp, a.w, a.beta, p.kv_heads);
  path_chunk_data<float, float> chunks(p, false, stream);
  chunks.attach(kp);
  launch_path_prepare<Dev, float, float>(kp, max_len, p.num_sequences, stream);
  key_cache_target<Dev> target;
  target.keys = reinterpret_cast<Dev*>(a.key_cache.data());
  for (int i = 0; i < 3; ++i) target.stride[i] = a.key_cache.stride(i);
  launch_path_key_cache<Dev, float, float>(kp, p.num_sequences, target, stream);
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
