#pragma once
// Host side of the CUDA linear-attention kernels: the kernel parameters, the stream-ordered
// scratch, and the launches of what plan/linear.hpp chose.

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "attnmix/attention/linear_args.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/dispatch.cuh"
#include "attnmix/cuda/kernels/linear_causal.cuh"
#include "attnmix/cuda/kernels/linear_simt.cuh"
#include "attnmix/cuda/kernels/sm80_linear.cuh"
#include "attnmix/cuda/kernels/sm80_linear_causal.cuh"
#include "attnmix/cuda/kernels/sm90_linear_cluster.cuh"
#include "attnmix/cuda/launch/launch_attributes.cuh"
#include "attnmix/cuda/plan/linear.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <int N, class V>
void copy_strides(index_t (&dst)[N], const V& view) {
  for (int i = 0; i < N; ++i) dst[i] = view.has_value() ? view.stride(i) : 0;
}

// The chunked causal kernel: on tensor cores (mma), or on CUDA cores for `chunks` 32-wide value
// chunks (its row epilogue holds that many values a lane; plan/linear.hpp picks 1, 2 or 4).
template <class Dev, class Policy>
auto causal_kernel(bool mma, int chunks) {
  auto kernel = linear_causal_kernel<Dev, Policy, 4>;
  if constexpr (std::is_same_v<Dev, __nv_bfloat16>)
    if (mma) return linear_causal_mma_kernel<Dev, Policy>;
  with_value<1, 2>(chunks,
                   [&](auto c) { kernel = linear_causal_kernel<Dev, Policy, decltype(c)::value>; });
  return kernel;
}

inline dim3 as_dim3(const launch_grid& g) {
  return dim3(g.x, g.y, g.z);
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
  const device_properties& props = current_properties();

  linear_shape shape;
  shape.causal = causal;
  shape.head_dim = D, shape.value_dim = Dv, shape.max_len = max_len;
  shape.sequences = N, shape.kv_heads = H, shape.q_heads = p.q_heads;
  shape.offsets_bytes = offsets_bytes(p);
  constexpr bool sixteen_bit = std::is_same_v<Dev, __half> || std::is_same_v<Dev, __nv_bfloat16>;
  constexpr index_t per_vector = 16 / sizeof(T);
  shape.sixteen_bit = sixteen_bit;
  shape.per_head_norm = Policy::norm == gated_norm::per_head;
  shape.kv_vectors = D % per_vector == 0 && Dv % per_vector == 0 &&
                     aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2),
                                         int(per_vector), int(sizeof(T))) &&
                     aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2),
                                         int(per_vector), int(sizeof(T)));
  shape.q_vectors =
      D % per_vector == 0 && aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1),
                                                 a.q.stride(2), int(per_vector), int(sizeof(T)));
  shape.out_pairs = aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1),
                                        a.out.stride(2), 2, int(sizeof(T)));
  shape.out_vectors = aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1),
                                          a.out.stride(2), int(per_vector), int(sizeof(T)));
  shape.gate_vectors = Policy::norm == gated_norm::per_head &&
                       aligned_for_vectors(a.gate.data(), a.gate.stride(0), a.gate.stride(1),
                                           a.gate.stride(2), int(per_vector), int(sizeof(T)));
  shape.bf16 = std::is_same_v<Dev, __nv_bfloat16>;
  // Causal: how many CTAs of the chunked kernel one SM holds (the plan cuts the sequences into
  // segments that fill the GPU's CTA slots).
  if constexpr (causal) {
    const bool mma =
        linear_causal_mma_applies(shape.bf16, D, Dv, shape.kv_vectors, shape.q_vectors);
    const int smem =
        mma ? causal_mma_smem_bytes : causal_smem_floats(int(D), int(Dv)) * int(sizeof(float));
    auto kernel = causal_kernel<Dev, Policy>(mma, linear_value_chunks(Dv));
    allow_dynamic_smem(kernel, smem);
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
              &shape.causal_ctas_per_sm, kernel, mma ? causal_mma_threads : causal_threads, smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  }
  const linear_plan plan = plan_linear(shape, props);
  stream_buffer scratch(plan.scratch.bytes, stream);

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
  kp.vector_loads = plan.kv_vectors;
  kp.q_vector_loads = plan.q_vectors;
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
    if (plan.read == linear_read_variant::sm90_cluster) {
      auto kernel = linear_cluster_fast_kernel<Dev, Policy>;
      allow_dynamic_smem(kernel, plan.read_smem);
      launch_clustered(kernel, as_dim3(plan.read_grid), plan.cluster, dim3(linear_fast_threads),
                       plan.read_smem, stream, "linear_cluster_fast_kernel launch", kp,
                       plan.cluster_tokens);
      return;
    }
  }
  const linear_scratch_layout& sc = plan.scratch;
  float* partial = reinterpret_cast<float*>(scratch.get() + sc.partial);
  float* state = reinterpret_cast<float*>(scratch.get() + sc.state);
  unsigned char* staged = sc.staged_bytes > 0 ? scratch.get() + sc.staged : nullptr;
  unsigned* done = plan.fused ? reinterpret_cast<unsigned*>(scratch.get() + sc.done) : nullptr;
  if (plan.fused) check(cudaMemsetAsync(done, 0, sc.done_bytes, stream), "cudaMemsetAsync");
  auto reduce = [&] {
    if constexpr (sixteen_bit) {
      if (plan.reduce != linear_reduce_variant::simt) {
        auto kernel = plan.reduce == linear_reduce_variant::sm80_mma_wide
                          ? linear_reduce_mma_kernel<Dev, Policy, true>
                          : linear_reduce_mma_kernel<Dev, Policy, false>;
        if constexpr (!causal)
          if (plan.reduce == linear_reduce_variant::sm80_fast)
            kernel = linear_reduce_fast_kernel<Dev, Policy>;
        allow_dynamic_smem(kernel, plan.reduce_smem);
        kernel<<<as_dim3(plan.reduce_grid), linear_mma_reduce_threads, plan.reduce_smem, stream>>>(
            kp, plan.block_tokens, partial, plan.partials, done, state, staged);
        check(cudaGetLastError(), "linear_reduce_mma_kernel launch");
        return;
      }
    }
    with_value<1, 2, 4>(plan.reduce_blocks, [&](auto blocks) {
      linear_reduce_kernel<Dev, Policy, decltype(blocks)::value>
          <<<as_dim3(plan.reduce_grid), linear_reduce_threads, plan.reduce_smem, stream>>>(
              kp, plan.block_tokens, partial, plan.partials);
      check(cudaGetLastError(), "linear_reduce_kernel launch");
    });
  };
  if constexpr (causal) {
    if (plan.prefix) {
      reduce();
      linear_causal_prefix_kernel<Policy>
          <<<as_dim3(plan.prefix_grid), linear_prefix_threads, 0, stream>>>(kp, partial,
                                                                            plan.segments, state);
      check(cudaGetLastError(), "linear_causal_prefix_kernel launch");
    }
    const bool mma = plan.causal == linear_causal_variant::sm80_mma;
    auto kernel = causal_kernel<Dev, Policy>(mma, plan.causal_chunks);
    kernel<<<as_dim3(plan.causal_grid), mma ? causal_mma_threads : causal_threads,
             plan.causal_smem, stream>>>(kp, plan.segment_tokens, plan.prefix ? state : nullptr,
                                         plan.segments);
    check(cudaGetLastError(), "linear_causal_kernel launch");
  } else {
    reduce();
    if (plan.combine) {
      linear_combine_kernel<Policy>
          <<<as_dim3(plan.combine_grid), linear_combine_threads, 0, stream>>>(kp, partial,
                                                                              plan.partials, state);
      check(cudaGetLastError(), "linear_combine_kernel launch");
    }
    if constexpr (sixteen_bit) {
      if (plan.read == linear_read_variant::sm80_fast) {
        launch_dependent(linear_read_fast_kernel<Dev, Policy, 64, 64>, as_dim3(plan.read_grid),
                         dim3(linear_fast_threads), 0, stream, "linear_read_fast_kernel launch", kp,
                         static_cast<const float*>(state),
                         static_cast<const unsigned char*>(staged), int(plan.read_per_cta));
      }
      if (plan.read == linear_read_variant::sm80_mma ||
          plan.read == linear_read_variant::sm80_mma_wide) {
        auto kernel = plan.read == linear_read_variant::sm80_mma_wide
                          ? linear_read_mma_kernel<Dev, Policy, true>
                          : linear_read_mma_kernel<Dev, Policy, false>;
        allow_dynamic_smem(kernel, plan.read_smem);
        kernel<<<as_dim3(plan.read_grid), linear_mma_read_threads, plan.read_smem, stream>>>(
            kp, state, int(plan.read_per_cta));
      }
    }
    if (plan.read == linear_read_variant::simt) {
      with_value<1, 2, 4>(plan.read_chunks, [&](auto vc) {
        constexpr int VC = decltype(vc)::value;
        // 4x4 tiles of the 64-row tile per thread: 64 * Dv / 16 / 128.
        auto kernel = linear_read_kernel<Dev, Policy, VC, (VC == 4 ? 4 : VC == 2 ? 2 : 1)>;
        allow_dynamic_smem(kernel, plan.read_smem);
        kernel<<<as_dim3(plan.read_grid), linear_read_threads, plan.read_smem, stream>>>(kp, state);
      });
    }
  }
  check(cudaGetLastError(), "linear attention kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
