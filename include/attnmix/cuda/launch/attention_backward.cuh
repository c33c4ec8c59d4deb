#pragma once
// Host side of the CUDA softmax-family backward: the kernel parameters and the stream-ordered
// scratch, then the kernels plan/attention_backward.hpp sized: delta, with a gate the gate
// cumsum, the dk/dv and dq kernels, and with a gate dg.

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/error.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/dispatch.cuh"
#include "attnmix/cuda/kernels/attention_backward_mma.cuh"
#include "attnmix/cuda/kernels/attention_backward_simt.cuh"
#include "attnmix/cuda/kernels/sm80_attention_backward.cuh"
#include "attnmix/cuda/plan/attention_backward.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// The variant every backward call takes where it applies, instead of the plan's own choice (for
// the tests, which run each variant on the same inputs). Not thread-safe: set it between calls.
struct attention_backward_override {
  bool forced = false;
  attention_backward_variant variant = attention_backward_variant::simt;
};
inline attention_backward_override& backward_variant_override() {
  static attention_backward_override o;
  return o;
}

template <class DkDv, class Dq>
void launch_backward_kernels(DkDv dkdv, Dq dq, const attention_backward_params& kp,
                             const attention_backward_plan& plan, cudaStream_t stream) {
  allow_dynamic_smem(dkdv, plan.smem_bytes);
  allow_dynamic_smem(dq, plan.smem_bytes);
  const dim3 g1(plan.dkdv.x, plan.dkdv.y, plan.dkdv.z), g2(plan.dq.x, plan.dq.y, plan.dq.z);
  dkdv<<<g1, plan.threads, plan.smem_bytes, stream>>>(kp);
  check(cudaGetLastError(), "attention backward dk/dv kernel launch");
  if (g2.x == 0) return;  // keys but no query (they get zero gradients above)
  dq<<<g2, plan.threads, plan.smem_bytes, stream>>>(kp);
  check(cudaGetLastError(), "attention backward dq kernel launch");
}

// The dk/dv and dq kernels of the plan's variant (TensorCores: sm80_mma).
template <class Dev, int Chunks, bool TensorCores>
void launch_attention_backward_tiles(const attention_backward_params& kp,
                                     const attention_backward_plan& plan, cudaStream_t stream) {
  if constexpr (TensorCores)
    launch_backward_kernels(sm80_attention_backward_dkdv_kernel<Dev, Chunks>,
                            sm80_attention_backward_dq_kernel<Dev, Chunks>, kp, plan, stream);
  else
    launch_backward_kernels(attention_backward_dkdv_kernel<Dev, Chunks>,
                            attention_backward_dq_kernel<Dev, Chunks>, kp, plan, stream);
}

// Runs one softmax-family backward. gate_coef: factor of (G_i - G_j), ignored without a.g.
template <class Policy, class T>
void run_attention_backward(const std::string& fn, const attention_grad_args<T>& a,
                            const attention_problem& p, const backend::cuda& be, double gate_coef) {
  using Dev = device_t<T>;
  check_launch_sizes(fn, p, 256, "softmax backward kernels");
  const index_t max_len = longest_sequence(p), max_keys = longest_key_row(p, max_len);
  if (max_keys == 0) return;  // no key (so no query): nothing to write
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const bool gated = a.g.has_value();

  attention_backward_shape shape;
  shape.head_dim = p.head_dim, shape.value_dim = p.value_dim, shape.max_len = max_len;
  shape.q_heads = p.q_heads, shape.kv_heads = p.kv_heads, shape.sequences = p.num_sequences;
  shape.sixteen_bit = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
  shape.portable = be.portable;
  shape.aligned =
      aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 8) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8) &&
      aligned_for_vectors(a.dout.data(), a.dout.stride(0), a.dout.stride(1), a.dout.stride(2), 8) &&
      aligned_for_vectors(a.dq.data(), a.dq.stride(0), a.dq.stride(1), a.dq.stride(2), 2) &&
      aligned_for_vectors(a.dk.data(), a.dk.stride(0), a.dk.stride(1), a.dk.stride(2), 2) &&
      aligned_for_vectors(a.dv.data(), a.dv.stride(0), a.dv.stride(1), a.dv.stride(2), 2);
  shape.forced = backward_variant_override().forced;
  shape.force = backward_variant_override().variant;
  shape.keys_differ = !p.keys_match_queries();
  shape.max_key_len = max_keys;
  const attention_backward_plan plan = plan_attention_backward(shape, current_properties());
  require(plan.fits, fn, "q", "has head dims D = ", p.head_dim, ", Dv = ", p.value_dim,
          " whose backward tiles need ", plan.smem_bytes,
          " bytes of shared memory, more than this GPU gives a block (",
          current_properties().smem_per_block_optin, ")");

  const bool fused = plan.variant == attention_backward_variant::sm90_wgmma_fused;
  const attention_backward_scratch_layout layout(p, gated, fused ? plan.dq_tiles : 0);
  const stream_buffer scratch(layout.bytes, stream);
  attention_backward_params kp{};
  attention_kernel_params& f = kp.f;
  f.q = a.q.data(), f.k = a.k.data(), f.v = a.v.data();
  f.out = const_cast<T*>(a.out.data());  // read only: the kernels take it as const
  for (int i = 0; i < 3; ++i) {
    f.q_stride[i] = a.q.stride(i), f.k_stride[i] = a.k.stride(i), f.v_stride[i] = a.v.stride(i);
    f.out_stride[i] = a.out.stride(i);
    kp.lse_stride[i] = a.lse.stride(i), kp.dout_stride[i] = a.dout.stride(i);
    kp.dq_stride[i] = a.dq.stride(i), kp.dk_stride[i] = a.dk.stride(i);
    kp.dv_stride[i] = a.dv.stride(i);
  }
  f.tokens = p.tokens;
  f.q_heads = static_cast<int>(p.q_heads), f.group = static_cast<int>(p.group());
  f.head_dim = static_cast<int>(p.head_dim), f.value_dim = static_cast<int>(p.value_dim);
  f.window = p.window;
  f.causal = Policy::mask == mask_type::causal;
  f.cu_seqlens = upload_offsets(scratch.get(), p, stream);
  if (shape.keys_differ) {  // Tk, or cu_seqlens_k (the front door passes no slots or lengths)
    f.keys_differ = true;
    f.key_tokens = p.key_tokens;
    f.cu_seqlens_k = upload_key_offsets(scratch.get() + layout.keys, p, f.cu_seqlens, stream);
  }
  kp.lse = a.lse.data(), kp.dout = a.dout.data();
  kp.dq = a.dq.data(), kp.dk = a.dk.data(), kp.dv = a.dv.data();
  kp.scale = static_cast<float>(p.scale);
  kp.delta = reinterpret_cast<float*>(scratch.get() + layout.delta);
  if (gated) {
    kp.gate_coef = gate_coef;
    kp.g = a.g.data(), kp.dg = a.dg.data();
    for (int i = 0; i < 3; ++i) kp.g_stride[i] = a.g.stride(i), kp.dg_stride[i] = a.dg.stride(i);
    kp.colsum = reinterpret_cast<float*>(scratch.get() + layout.colsum);
    kp.rowsum = reinterpret_cast<float*>(scratch.get() + layout.rowsum);
    kp.G = reinterpret_cast<double*>(scratch.get() + layout.gate);
    kp.reset = reinterpret_cast<int*>(scratch.get() + layout.reset);
  }
  if (fused) {  // the sums start at 0; so do FoX's row sums, which the key blocks add to
    kp.dq_acc = reinterpret_cast<float*>(scratch.get() + layout.dq_acc);
    kp.dq_turn = reinterpret_cast<int*>(scratch.get() + layout.dq_turn);
    kp.dq_tiles = plan.dq_tiles;
    kp.dq_rows = p.batch * p.tokens;
    check(cudaMemsetAsync(kp.dq_acc, 0, layout.dq_acc_bytes, stream), "dq sums zeroing");
    check(cudaMemsetAsync(kp.dq_turn, 0, layout.dq_turn_bytes, stream), "dq turns zeroing");
    if (gated)
      check(cudaMemsetAsync(kp.rowsum, 0,
                            sizeof(float) * std::size_t(p.batch * p.tokens * p.q_heads), stream),
            "row sums zeroing");
  }

  const dim3 pre(plan.preprocess.x, plan.preprocess.y, plan.preprocess.z);
  if (max_len > 0) {
    attention_backward_delta_kernel<Dev><<<pre, attention_backward_threads, 0, stream>>>(kp);
    check(cudaGetLastError(), "attention_backward_delta_kernel launch");
  }
  const dim3 gate(plan.gate.x, plan.gate.y, plan.gate.z);
  if (gated) {
    attention_backward_gate_cumsum_kernel<attention_backward_threads>
        <<<gate, attention_backward_threads, 0, stream>>>(kp);
    check(cudaGetLastError(), "attention_backward_gate_cumsum_kernel launch");
  }
  bool launched = false;
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    const auto launch_v2 = [&](auto products) {
      using Products = decltype(products);
      return with_value<64, 128>(p.head_dim, [&](auto d) {
        constexpr int D = decltype(d)::value;
        launch_backward_kernels(attention_backward_dkdv_mma_kernel<Products, Dev, D>,
                                attention_backward_dq_mma_kernel<Products, Dev, D>, kp, plan,
                                stream);
      });
    };
    if (plan.variant == attention_backward_variant::sm90_wgmma)
      launched = launch_v2(sm90_backward_products{});
    if (fused)
      launched = with_value<64, 128>(p.head_dim, [&](auto d) {
        constexpr int D = decltype(d)::value;
        const auto kernel =
            attention_backward_dkdv_mma_kernel<sm90_backward_products, Dev, D, true>;
        allow_dynamic_smem(kernel, plan.smem_bytes);
        const dim3 g1(plan.dkdv.x, plan.dkdv.y, plan.dkdv.z);
        kernel<<<g1, plan.threads, plan.smem_bytes, stream>>>(kp);
        check(cudaGetLastError(), "attention backward fused dk/dv/dq kernel launch");
        attention_backward_dq_convert_kernel<Dev>
            <<<pre, attention_backward_threads, 0, stream>>>(kp);
        check(cudaGetLastError(), "attention_backward_dq_convert_kernel launch");
      });
    if (plan.variant == attention_backward_variant::sm80_mma_v2)
      launched = launch_v2(sm80_backward_products{});
    if (plan.variant == attention_backward_variant::sm80_mma)
      launched = with_value<2, 4>(plan.chunks, [&](auto chunks) {
        launch_attention_backward_tiles<Dev, decltype(chunks)::value, true>(kp, plan, stream);
      });
  }
  if (plan.variant == attention_backward_variant::simt)
    launched = with_value<2, 4, 8>(plan.chunks, [&](auto chunks) {
      launch_attention_backward_tiles<Dev, decltype(chunks)::value, false>(kp, plan, stream);
    });
  require(launched, fn, "q", "has head dims the CUDA backward does not take");
  if (gated) {
    attention_backward_gate_grad_kernel<attention_backward_threads>
        <<<gate, attention_backward_threads, 0, stream>>>(kp);
    check(cudaGetLastError(), "attention_backward_gate_grad_kernel launch");
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
