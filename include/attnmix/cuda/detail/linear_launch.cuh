#pragma once
// Host side of the CUDA linear-attention kernels: checks, stream-ordered workspace, launches.

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "attnmix/attention/linear_args.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/detail/attention_launch.cuh"
#include "attnmix/cuda/detail/linear_causal_kernels.cuh"
#include "attnmix/cuda/detail/linear_kernels.cuh"
#include "attnmix/cuda/detail/linear_mma.cuh"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int N, class V>
void copy_strides(index_t (&dst)[N], const V& view) {
  for (int i = 0; i < N; ++i) dst[i] = view.has_value() ? view.stride(i) : 0;
}

// Calls f(std::integral_constant<int, C>) with C the number of 32-wide chunks covering n (<= 128).
template <class F>
void chunk_switch(index_t n, F&& f) {
  if (n <= 32)
    f(std::integral_constant<int, 1>{});
  else if (n <= 64)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 4>{});
}

// The chunked causal kernel for value width Dv (its row epilogue holds ceil(Dv / 32) values a
// lane).
template <class Dev, class Policy>
auto causal_kernel(index_t Dv) {
  if (Dv <= 32) return linear_causal_kernel<Dev, Policy, 1>;
  if (Dv <= 64) return linear_causal_kernel<Dev, Policy, 2>;
  return linear_causal_kernel<Dev, Policy, 4>;
}

template <class Kind, class Policy, class T>
void run_linear(const std::string& fn, const linear_attention_args<T>& a,
                const linear_attention_problem& p, const backend::cuda& be) {
  static_assert(Policy::norm != gated_norm::full_width,
                "attnmix: the CUDA backend has the per-head gated RMSNorm only; full_width runs on "
                "the CPU backend");
  using Dev = device_t<T>;
  constexpr bool causal = linear_kind_traits<Kind>::causal;
  check_launch_sizes(fn, p, 128, "linear-attention kernels");
  const index_t D = p.head_dim, Dv = p.value_dim;
  require(D % 4 == 0, fn, "q", "has head dim D = ", D,
          " but the CUDA backend needs a multiple of 4");
  require(Dv % 4 == 0, fn, "v", "has head dim Dv = ", Dv,
          " but the CUDA backend needs a multiple of 4");
  if (p.num_sequences == 0) return;

  const index_t max_len = longest_sequence(p);
  const index_t N = p.num_sequences, H = p.kv_heads;
  // Without tokens only the states have something to say (fresh, or passed through).
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);

  // Causal: the chunked kernel's shared memory and how many of its CTAs one SM holds; the
  // sequences are cut into as many segments as fill the GPU's CTA slots once (at least 4 chunks
  // a segment), so that few long sequences still use every SM.
  const int causal_smem = causal ? causal_smem_floats(int(D), int(Dv)) * int(sizeof(float)) : 0;
  index_t segments = 1, segment_tokens = std::max<index_t>(max_len, 1);
  if constexpr (causal) {
    const int sms = current_device().sms;
    int per_sm = 0;
    auto kernel = causal_kernel<Dev, Policy>(Dv);
    allow_dynamic_smem(kernel, causal_smem);
    check(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, causal_threads, causal_smem),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    const index_t slots = index_t(sms) * std::max(per_sm, 1);
    const index_t min_tokens = 4 * causal_chunk;
    segments = std::clamp<index_t>(slots / (N * H), 1,
                                   std::max<index_t>(1, (max_len + min_tokens - 1) / min_tokens));
    segment_tokens =
        std::max<index_t>(causal_chunk, ((max_len + segments - 1) / segments + causal_chunk - 1) /
                                            causal_chunk * causal_chunk);
    segments = std::max<index_t>(1, (max_len + segment_tokens - 1) / segment_tokens);
  }

  // Tensor cores for half and bfloat16 when the rows allow 16-byte loads and the dims tile.
  constexpr bool sixteen_bit = std::is_same_v<Dev, __half> || std::is_same_v<Dev, __nv_bfloat16>;
  constexpr index_t per_vector = 16 / sizeof(T);
  const bool kv_vectors = D % per_vector == 0 && Dv % per_vector == 0 &&
                          aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1),
                                              a.k.stride(2), int(per_vector), int(sizeof(T))) &&
                          aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1),
                                              a.v.stride(2), int(per_vector), int(sizeof(T)));
  const bool q_vectors =
      D % per_vector == 0 && aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1),
                                                 a.q.stride(2), int(per_vector), int(sizeof(T)));
  const bool mma_reduce = sixteen_bit && kv_vectors && linear_mma_dims(D, Dv);
  const bool mma_read = mma_reduce && q_vectors &&
                        aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1),
                                            a.out.stride(2), 2, int(sizeof(T))) &&
                        (Policy::norm != gated_norm::per_head ||
                         aligned_for_vectors(a.gate.data(), a.gate.stride(0), a.gate.stride(1),
                                             a.gate.stride(2), int(per_vector), int(sizeof(T))));

  // Blocks of the bidirectional reduce pass (whole 64-token tiles for the tensor-core kernel).
  // The tensor-core kernel for D, Dv <= 64 runs one wave: as many blocks as the GPU holds CTAs
  // of it at once (linear_mma_reduce_ctas an SM), so that no CTA waits for a second wave and
  // each streams a long run of tiles; the others fill the GPU several times over. The causal kind
  // reduces every segment but the last.
  const bool one_wave = mma_reduce && !linear_mma_wide(D, Dv);
  const index_t target = one_wave ? index_t(current_device().sms) * linear_mma_reduce_ctas
                                  : (mma_reduce ? 8 : 4) * 132,
                round = mma_reduce ? 64 : 32;
  index_t partials =
      std::clamp<index_t>(one_wave ? target / (H * N) : (target + H * N - 1) / (H * N), 1,
                          std::max<index_t>(1, (max_len + 63) / 64));
  index_t block_tokens =
      std::max<index_t>(round, ((max_len + partials - 1) / partials + round - 1) / round * round);
  partials = std::max<index_t>(1, (max_len + block_tokens - 1) / block_tokens);
  if constexpr (causal) partials = segments - 1, block_tokens = segment_tokens;

  // The bidirectional tensor-core path merges the partial states in the reduce kernel's last CTA
  // of each head, and the read kernel of head dims 64 copies the state that CTA staged.
  const bool fused = !causal && mma_reduce && partials <= linear_fused_partials;
  const bool fast_read = mma_read && linear_fast_dims(D, Dv) &&
                         aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1),
                                             a.out.stride(2), int(per_vector), int(sizeof(T)));
  // The D = Dv = 64 kernels on compute capability 9.0 and later: one kernel, a cluster of CTAs a
  // head (its shared memory holds the norm weights of a group of query heads).
  const bool clustered = !causal && fast_read && current_device().clusters && max_len > 0 &&
                         p.group() <= linear_cluster_max_group;
  const std::size_t cu_padded = offsets_bytes(p);
  // Every part of the scratch starts 256-byte aligned (the staged state is read 16 bytes a load).
  auto padded = [](std::size_t bytes) {
    return (bytes + 255) / 256 * 256;
  };
  // The one-kernel path needs no scratch but the sequence offsets.
  std::size_t partial_bytes = 0, state_bytes = 0, staged_bytes = 0, done_bytes = 0;
  if (!clustered) {
    const auto floats = [](index_t count) {
      return static_cast<std::size_t>(count) * sizeof(float);
    };
    partial_bytes = padded(floats(N * H * partials * partial_floats(int(D), int(Dv))));
    if constexpr (causal)
      state_bytes =
          segments > 1 ? padded(floats(N * H * segments * partial_floats(int(D), int(Dv)))) : 0;
    else
      state_bytes = padded(floats(N * H * (D * Dv + D)));
    if (fused && fast_read)
      staged_bytes = static_cast<std::size_t>(N * H * staged_state_bytes(int(D), int(Dv)));
    if (fused) done_bytes = static_cast<std::size_t>(N * H) * sizeof(unsigned);
  }
  stream_buffer scratch(cu_padded + partial_bytes + state_bytes + staged_bytes + done_bytes,
                        stream);

  linear_kernel_params kp{};
  kp.q = a.q.data(), kp.k = a.k.data(), kp.v = a.v.data(), kp.out = a.out.data();
  kp.mask = a.mask.has_value() ? a.mask.data() : nullptr;
  kp.a = a.a.has_value() ? a.a.data() : nullptr;
  kp.gate = a.gate.has_value() ? a.gate.data() : nullptr;
  kp.gamma = a.gamma.has_value() ? a.gamma.data() : nullptr;
  copy_strides(kp.q_stride, a.q), copy_strides(kp.k_stride, a.k), copy_strides(kp.v_stride, a.v);
  copy_strides(kp.out_stride, a.out), copy_strides(kp.gate_stride, a.gate);
  copy_strides(kp.mask_stride, a.mask), copy_strides(kp.a_stride, a.a);
  kp.gamma_stride = a.gamma.has_value() ? a.gamma.stride(0) : 0;
  kp.tokens = p.tokens;
  kp.q_heads = int(p.q_heads), kp.kv_heads = int(H), kp.group = int(p.group());
  kp.gate_heads = int(p.gate_heads), kp.head_dim = int(D), kp.value_dim = int(Dv);
  kp.scale = float(p.scale), kp.eps = float(p.eps), kp.norm_eps = float(p.norm_eps);
  kp.vector_loads = kv_vectors;
  kp.q_vector_loads = q_vectors;
  const auto& si = a.state_in;
  const auto& so = a.state_out;
  kp.S_in = si.S.has_value() ? si.S.data() : nullptr;
  kp.z_in = si.z.has_value() ? si.z.data() : nullptr;
  kp.lse_in = si.lse.has_value() ? si.lse.data() : nullptr;
  kp.S_out = so.S.has_value() ? so.S.data() : nullptr;
  kp.z_out = so.z.has_value() ? so.z.data() : nullptr;
  kp.lse_out = so.lse.has_value() ? so.lse.data() : nullptr;
  copy_strides(kp.S_in_stride, si.S), copy_strides(kp.z_in_stride, si.z),
      copy_strides(kp.lse_in_stride, si.lse);
  copy_strides(kp.S_out_stride, so.S), copy_strides(kp.z_out_stride, so.z),
      copy_strides(kp.lse_out_stride, so.lse);
  kp.cu_seqlens = upload_offsets(scratch.get(), p, stream);

  if constexpr (sixteen_bit && !causal) {
    if (clustered) {
      // As many CTAs a head (up to a cluster's 8) as fill the GPU's CTA slots about once.
      const index_t tiles = (max_len + linear_mma_tokens - 1) / linear_mma_tokens;
      const index_t slots = index_t(current_device().sms) * linear_cluster_ctas;
      const index_t ctas =
          std::clamp<index_t>(slots / (N * H), 1, std::min<index_t>(linear_cluster_max, tiles));
      const index_t tokens = (tiles + ctas - 1) / ctas * linear_mma_tokens;
      const index_t used = (max_len + tokens - 1) / tokens;
      const int smem = linear_cluster_smem(p.group());
      auto kernel = linear_cluster_fast_kernel<Dev, Policy>;
      allow_dynamic_smem(kernel, smem);
      launch_clustered(kernel, dim3(unsigned(used), unsigned(H), unsigned(N)), unsigned(used),
                       dim3(linear_fast_threads), smem, stream, "linear_cluster_fast_kernel launch",
                       kp, tokens);
      return;
    }
  }
  float* partial = reinterpret_cast<float*>(scratch.get() + cu_padded);
  float* state = reinterpret_cast<float*>(scratch.get() + cu_padded + partial_bytes);
  unsigned char* staged =
      staged_bytes > 0 ? scratch.get() + cu_padded + partial_bytes + state_bytes : nullptr;
  unsigned* done = fused ? reinterpret_cast<unsigned*>(scratch.get() + cu_padded + partial_bytes +
                                                       state_bytes + staged_bytes)
                         : nullptr;
  if (fused) check(cudaMemsetAsync(done, 0, done_bytes, stream), "cudaMemsetAsync");
  auto reduce = [&](auto blocks) {
    constexpr int Blocks = decltype(blocks)::value;
    const int reduce_smem = int((32 * (D + Dv) + 32) * sizeof(float));
    linear_reduce_kernel<Dev, Policy, Blocks>
        <<<dim3(unsigned(partials), unsigned(H), unsigned(N)), 256, reduce_smem, stream>>>(
            kp, block_tokens, partial, partials);
    check(cudaGetLastError(), "linear_reduce_kernel launch");
  };
  auto reduce_all = [&] {
    if constexpr (sixteen_bit) {
      if (mma_reduce) {
        auto kernel = linear_mma_wide(D, Dv) ? linear_reduce_mma_kernel<Dev, Policy, true>
                                             : linear_reduce_mma_kernel<Dev, Policy, false>;
        if constexpr (!causal)
          if (linear_reduce_fast_dims(D, Dv)) kernel = linear_reduce_fast_kernel<Dev, Policy>;
        const int smem = linear_mma_reduce_smem(D, Dv);
        allow_dynamic_smem(kernel, smem);
        kernel<<<dim3(unsigned(H), unsigned(partials), unsigned(N)), linear_mma_reduce_threads,
                 smem, stream>>>(kp, block_tokens, partial, partials, done, state, staged);
        check(cudaGetLastError(), "linear_reduce_mma_kernel launch");
        return;
      }
    }
    const index_t tiles = (D / 4) * (Dv / 4);
    if (tiles <= 256)
      reduce(std::integral_constant<int, 1>{});
    else if (tiles <= 512)
      reduce(std::integral_constant<int, 2>{});
    else
      reduce(std::integral_constant<int, 4>{});
  };
  if constexpr (causal) {
    if (segments > 1) {
      reduce_all();
      linear_causal_prefix_kernel<Policy>
          <<<dim3(unsigned(H), unsigned(N)), 256, 0, stream>>>(kp, partial, segments, state);
      check(cudaGetLastError(), "linear_causal_prefix_kernel launch");
    }
    causal_kernel<Dev, Policy>(Dv)<<<dim3(unsigned(segments), unsigned(H), unsigned(N)),
                                     causal_threads, causal_smem, stream>>>(
        kp, segment_tokens, segments > 1 ? state : nullptr, segments);
  } else {
    reduce_all();
    if (!fused) {
      linear_combine_kernel<Policy>
          <<<dim3(unsigned(H), unsigned(N),
                  unsigned((D * Dv + D + linear_combine_slice - 1) / linear_combine_slice)),
             256, 0, stream>>>(kp, partial, partials, state);
      check(cudaGetLastError(), "linear_combine_kernel launch");
    }
    bool read_done = false;
    if constexpr (sixteen_bit) {
      if (fast_read && max_len > 0) {
        // 16-row groups: a warp takes about groups / (resident warps * 2) of them (about two
        // waves of 2 CTAs an SM; at least 1, at most 64), so that the state is staged rarely and
        // the grid still balances.
        const index_t groups = (max_len + 15) / 16;
        const index_t warps = index_t(current_device().sms) * 2 * (linear_fast_threads / 32);
        const index_t per_warp =
            std::max(std::clamp<index_t>(groups * p.q_heads * N / (warps * 2), 1, 64),
                     (groups + 8 * 65535 - 1) / (8 * 65535));
        const index_t per_cta = per_warp * (linear_fast_threads / 32);
        launch_dependent(
            linear_read_fast_kernel<Dev, Policy, 64, 64>,
            dim3(unsigned(p.q_heads), unsigned((groups + per_cta - 1) / per_cta), unsigned(N)),
            dim3(linear_fast_threads), 0, stream, "linear_read_fast_kernel launch", kp,
            static_cast<const float*>(state), static_cast<const unsigned char*>(staged),
            int(per_cta));
        read_done = true;
      }
      if (mma_read && max_len > 0 && !read_done) {
        // Several query tiles a CTA (about two waves of 3 CTAs an SM), so that S is staged
        // less often.
        const index_t tiles = (max_len + linear_mma_rows - 1) / linear_mma_rows;
        const index_t per_cta =
            std::max(std::clamp<index_t>(tiles * p.q_heads * N / (132 * 3 * 2), 1, 16),
                     (tiles + 65534) / 65535);
        const int smem = linear_mma_read_smem(D, Dv, Policy::norm == gated_norm::per_head);
        auto kernel = linear_mma_wide(D, Dv) ? linear_read_mma_kernel<Dev, Policy, true>
                                             : linear_read_mma_kernel<Dev, Policy, false>;
        allow_dynamic_smem(kernel, smem);
        kernel<<<dim3(unsigned(p.q_heads), unsigned((tiles + per_cta - 1) / per_cta), unsigned(N)),
                 linear_mma_read_threads, smem, stream>>>(kp, state, int(per_cta));
        read_done = true;
      }
    }
    if (max_len > 0 && !read_done) {
      const int read_smem = linear_read_smem_floats(int(D), int(Dv)) * int(sizeof(float));
      chunk_switch(Dv, [&](auto vc) {
        constexpr int VC = decltype(vc)::value;
        // 4x4 tiles of the 64-row tile per thread: 64 * Dv / 16 / 128.
        auto kernel = linear_read_kernel<Dev, Policy, VC, (VC == 4 ? 4 : VC == 2 ? 2 : 1)>;
        allow_dynamic_smem(kernel, read_smem);
        kernel<<<dim3(unsigned((max_len + linear_read_rows - 1) / linear_read_rows),
                      unsigned(p.q_heads), unsigned(N)),
                 128, read_smem, stream>>>(kp, state);
      });
    }
  }
  check(cudaGetLastError(), "linear attention kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
