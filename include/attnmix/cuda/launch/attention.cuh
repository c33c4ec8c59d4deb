#pragma once
// Host side of the CUDA softmax-family kernels: the kernel parameters, the stream-ordered scratch
// and the gate cumsum, then the kernel plan/attention.hpp chose.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/dispatch.cuh"
#include "attnmix/cuda/kernels/attention_decode.cuh"
#include "attnmix/cuda/kernels/attention_simt.cuh"
#include "attnmix/cuda/kernels/gate_cumsum.cuh"
#include "attnmix/cuda/kernels/sm80_attention.cuh"
#include "attnmix/cuda/kernels/sm90_attention.cuh"
#include "attnmix/cuda/launch/split_decode.cuh"
#include "attnmix/cuda/plan/attention.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// mma.sync (sm_80 and later): a CTA a 64-row tile, a 1-D grid of work items.
template <class Dev, int D, int Dv>
void launch_mma(const attention_kernel_params& kp, const attention_plan& plan,
                cudaStream_t stream) {
  constexpr int warps = attention_mma_warps, m_tiles = attention_mma_m_tiles,
                bc = attention_mma_key_tile;
  using tile = mma_tile<D, Dv, warps, m_tiles, bc>;
  static_assert(tile::br == attention_mma_rows && tile::threads == attention_mma_threads,
                "plan/attention.hpp and the kernel's tile agree");
  auto kernel = attention_mma_kernel<Dev, D, Dv, warps, m_tiles, bc>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp, static_cast<int>(plan.row_tiles));
}

// Hopper: persistent, one CTA an SM walks the (row tile, head, sequence) items.
template <class Dev, int D, int Dv>
void launch_wgmma(const attention_kernel_params& kp, const attention_plan& plan,
                  cudaStream_t stream) {
  constexpr int WGs = attention_wgmma_consumers(D, Dv);
  constexpr int bc = attention_wgmma_key_tile, stages = attention_wgmma_stages;
  using tile = wgmma_tile<D, Dv, WGs, bc, stages>;
  static_assert(tile::br == 64 * WGs, "plan/attention.hpp and the kernel's tile agree");
  auto kernel = attention_wgmma_kernel<Dev, D, Dv, WGs, bc, stages>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  check(cudaMemsetAsync(kp.work_counter, 0, sizeof(int), stream), "cudaMemsetAsync");
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp, static_cast<int>(plan.row_tiles),
                                                            static_cast<int>(plan.items));
}

template <class Dev, int MaxChunks>
void launch_simt(const attention_kernel_params& kp, const attention_plan& plan,
                 cudaStream_t stream) {
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  attention_simt_kernel<Dev, MaxChunks><<<grid, attention_simt_threads, 0, stream>>>(kp);
}

// Decoding: the split kernel's blocks, then their merge into a.out and a.lse.
template <class T>
void launch_decode(const attention_args<T>& a, const attention_kernel_params& kp,
                   const attention_plan& plan, cudaStream_t stream) {
  using Dev = device_t<T>;
  const split_decode_plan& split = plan.split;
  stream_buffer work(split.ml_bytes + split.o_bytes, stream);
  const split_decode_parts parts = split_parts(a, split, work.get());
  auto kernel =
      split.dmax == 64 ? attention_decode_kernel<Dev, 64> : attention_decode_kernel<Dev, 128>;
  if (plan.raise_smem_limit) allow_dynamic_smem(kernel, plan.smem);  // wide groups only
  const dim3 grid(split.grid.x, split.grid.y, split.grid.z);
  kernel<<<grid, split_decode_threads, plan.smem, stream>>>(kp, parts, split.block_keys);
  check(cudaGetLastError(), "attention_decode_kernel launch");
  launch_split_combine<Dev>(parts, split, stream);
}

// Everything a softmax-family kernel reads, set up on `stream`: the kernel parameters, the
// device copies of cu_seqlens and of the keys' offsets, slots and lengths where they differ from
// the queries', and, with a gate, its cumsum G over the keys in double (gate_coef: the factor of
// G_i - G_j). The scratch lives as long as the object (stream-ordered, so kernels launched before
// it goes are safe).
struct attention_setup {
  index_t max_len;
  attention_scratch_layout layout;
  stream_buffer scratch;
  attention_kernel_params kp{};

  template <class T>
  attention_setup(const attention_args<T>& a, const attention_problem& p, bool causal,
                  double gate_coef, cudaStream_t stream)
      : max_len(longest_sequence(p)),
        layout(p, a.g.has_value(), max_len),
        scratch(layout.bytes, stream) {
    kp.q = a.q.data(), kp.k = a.k.data(), kp.v = a.v.data(), kp.out = a.out.data();
    kp.lse = a.lse.has_value() ? a.lse.data() : nullptr;
    for (int i = 0; i < 3; ++i) {
      kp.q_stride[i] = a.q.stride(i), kp.k_stride[i] = a.k.stride(i),
      kp.v_stride[i] = a.v.stride(i);
      kp.out_stride[i] = a.out.stride(i);
      kp.lse_stride[i] = a.lse.has_value() ? a.lse.stride(i) : 0;
    }
    kp.tokens = p.tokens;
    kp.q_heads = static_cast<int>(p.q_heads), kp.group = static_cast<int>(p.group());
    kp.head_dim = static_cast<int>(p.head_dim), kp.value_dim = static_cast<int>(p.value_dim);
    constexpr double log2e = 1.4426950408889634;
    kp.scale_log2 = static_cast<float>(p.scale * log2e);
    kp.window = p.window;
    kp.causal = causal;
    if (max_len == 0) return;
    kp.cu_seqlens = upload_offsets(scratch.get(), p, stream);
    kp.work_counter = reinterpret_cast<int*>(scratch.get() + layout.counter);
    if (!p.keys_match_queries()) {
      const auto put = [&](std::size_t at, const std::int32_t* src, index_t n) {
        upload_host(scratch.get() + at, src, static_cast<std::size_t>(n) * sizeof(std::int32_t),
                    stream, "cudaMemcpyAsync(keys)");
        return reinterpret_cast<const std::int32_t*>(scratch.get() + at);
      };
      const index_t N = p.num_sequences;
      kp.keys_differ = true;
      kp.key_tokens = p.key_tokens;
      kp.cu_seqlens_k = upload_key_offsets(scratch.get() + layout.cu_k, p, kp.cu_seqlens, stream);
      kp.key_slots = p.key_slots == nullptr ? nullptr : put(layout.slots, p.key_slots, N);
      kp.key_lengths = p.key_lengths == nullptr ? nullptr : put(layout.lengths, p.key_lengths, N);
    }
    if (!a.g.has_value()) return;
    auto* G = reinterpret_cast<double*>(scratch.get() + layout.gate);
    auto* reset = reinterpret_cast<int*>(scratch.get() + layout.reset);
    auto* part_sums = reinterpret_cast<double*>(scratch.get() + layout.part_sums);
    kp.gate_cumsum = G;
    kp.gate_reset = reset;
    kp.gate_coef_log2 = static_cast<float>(gate_coef * log2e);
    kp.gate_bias_coef = p.scale > 0 ? static_cast<float>(-gate_coef / p.scale) : 0.f;
    const launch_grid g = gate_cumsum_grid(p, layout.gate_parts);
    const dim3 grid(g.x, g.y, g.z);
    gate_part_sum_kernel<<<grid, gate_part, 0, stream>>>(a.g.data(), a.g.stride(0), a.g.stride(1),
                                                         a.g.stride(2), kp, part_sums);
    check(cudaGetLastError(), "gate_part_sum_kernel launch");
    gate_cumsum_kernel<<<grid, gate_part, 0, stream>>>(a.g.data(), a.g.stride(0), a.g.stride(1),
                                                       a.g.stride(2), kp, part_sums, G, reset);
    check(cudaGetLastError(), "gate_cumsum_kernel launch");
  }
};

// Runs one softmax-family forward. gate_coef: factor of (G_i - G_j), ignored without a.g.
template <class Policy, class T>
void run_attention(const std::string& fn, const attention_args<T>& a, const attention_problem& p,
                   const backend::cuda& be, double gate_coef) {
  using Dev = device_t<T>;
  check_launch_sizes(fn, p, 256, "softmax kernels");

  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const attention_setup setup(a, p, Policy::mask == mask_type::causal, gate_coef, stream);
  const attention_kernel_params& kp = setup.kp;
  const index_t max_len = setup.max_len;
  if (max_len == 0) return;

  constexpr bool tensor_cores = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
  attention_shape shape;
  shape.head_dim = p.head_dim, shape.value_dim = p.value_dim;
  shape.max_len = max_len, shape.q_heads = p.q_heads, shape.sequences = p.num_sequences;
  shape.sixteen_bit = tensor_cores;
  shape.aligned =
      aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 8) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8) &&
      aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1), a.out.stride(2), 2);
  shape.positive_scale = p.scale > 0;
  shape.portable = be.portable;
  shape.group = p.group();
  shape.decode =
      p.tokens == 1 && p.cu_seqlens == nullptr && !p.keys_match_queries() && p.head_dim % 8 == 0 &&
      p.value_dim % 8 == 0 && std::max(p.head_dim, p.value_dim) <= 128 &&
      (!a.g.has_value() || p.group() <= 32) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8, sizeof(T)) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8, sizeof(T));
  if (shape.decode) shape.decode_keys = decode_keys(p);
  const attention_plan plan = plan_attention(shape, current_properties());
  if (plan.variant == attention_variant::decode) {
    launch_decode(a, kp, plan, stream);
    return;
  }
  if constexpr (tensor_cores) {
    if (plan.variant != attention_variant::simt) {
      with_head_dims<64, 128>(plan.head_dim, plan.value_dim, [&](auto d, auto dv) {
        constexpr int D = decltype(d)::value, Dv = decltype(dv)::value;
        if (plan.variant == attention_variant::sm90_wgmma)
          launch_wgmma<Dev, D, Dv>(kp, plan, stream);
        else
          launch_mma<Dev, D, Dv>(kp, plan, stream);
      });
    }
  }
  if (plan.variant == attention_variant::simt) {
    with_value<2, 4, 8>(plan.simt_chunks, [&](auto chunks) {
      launch_simt<Dev, decltype(chunks)::value>(kp, plan, stream);
    });
  }
  check(cudaGetLastError(), "attention kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
