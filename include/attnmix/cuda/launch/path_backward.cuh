#pragma once
// Host side of the CUDA PaTH / PaTH-FoX backward (kernels/path_backward_tiled.cuh): the scratch
// that plan/path_backward.hpp lays out, the forward's float chunk preparation, then the query
// kernel, the chunk kernel and (PaTH-FoX) the gate's reverse cumsum, all on the backend's stream.
// The tensor-core query kernel has the chunks' dense transitions and its super-chunks' keys and
// products made before it, and their gradients folded into dK~, dW and dU after it.
// The query kernel is the plan's (tensor cores where they apply, else register-blocked), the chunk
// kernel the register-blocked one; path_backward_kernel_override() may ask for either set.

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/path_backward_gate.cuh"
#include "attnmix/cuda/kernels/path_backward_tiled.cuh"
#include "attnmix/cuda/kernels/sm80_path_backward.cuh"
#include "attnmix/cuda/launch/path.cuh"
#include "attnmix/cuda/plan/path_backward.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <class V>
void copy_strides(index_t (&to)[3], const V& v) {
  for (int i = 0; i < 3; ++i) to[i] = v.stride(i);
}

// The PaTH / PaTH-FoX backward. gate_coef: factor of (G_i - G_j), ignored without a.g. Throws
// attnmix::error for head dims whose tiles do not fit the device's shared memory.
template <class T>
void run_path_backward(const std::string& fn, const attention_grad_args<T>& a,
                       const attention_problem& p, const backend::cuda& be, double gate_coef) {
  using Dev = device_t<T>;
  check_launch_sizes(fn, p, 128, "PaTH backward kernels");
  const index_t max_len = longest_sequence(p);
  if (max_len == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const bool gated = a.g.has_value();
  const device_properties& props = current_properties();

  path_shape shape;
  shape.batch = p.batch, shape.tokens = p.tokens;
  shape.head_dim = p.head_dim, shape.value_dim = p.value_dim;
  shape.max_len = max_len, shape.q_heads = p.q_heads, shape.kv_heads = p.kv_heads;
  shape.sequences = p.num_sequences;
  shape.sixteen_bit = sizeof(T) == 2;
  const path_backward_plan plan =
      plan_path_backward(shape, gated, props, path_backward_kernel_override());
  require(plan.fits, fn, "q", "has head dim D = ", p.head_dim, " whose backward tiles need ",
          std::max(plan.query_smem, plan.chunk_smem),
          " bytes of shared memory a block, but the device allows ", props.smem_per_block_optin);

  stream_buffer offsets(offsets_bytes(p), stream);
  stream_buffer scratch(plan.scratch_bytes, stream);
  unsigned char* base = scratch.get();
  const path_backward_layout& l = plan.layout;

  path_backward_params bp{};
  path_kernel_params& kp = bp.kp;
  kp.a.q = a.q.data(), kp.a.k = a.k.data(), kp.a.v = a.v.data();
  copy_strides(kp.a.q_stride, a.q);
  copy_strides(kp.a.k_stride, a.k);
  copy_strides(kp.a.v_stride, a.v);
  kp.a.cu_seqlens = upload_offsets(offsets.get(), p, stream);
  kp.a.tokens = p.tokens;
  kp.a.q_heads = static_cast<int>(p.q_heads), kp.a.group = static_cast<int>(p.group());
  kp.a.head_dim = static_cast<int>(p.head_dim), kp.a.value_dim = static_cast<int>(p.value_dim);
  kp.a.causal = true;
  set_householder(kp, a.w, a.beta, p.kv_heads);
  kp.kt = base + plan.forward.chunks.kt;
  kp.u = base + plan.forward.chunks.u;
  kp.m = base + plan.forward.chunks.m;

  bp.out = a.out.data(), bp.dout = a.dout.data(), bp.lse = a.lse.data();
  bp.dq = a.dq.data(), bp.dk = a.dk.data(), bp.dv = a.dv.data();
  bp.dw = a.dw.data(), bp.dbeta = a.dbeta.data();
  copy_strides(bp.out_stride, a.out);
  copy_strides(bp.dout_stride, a.dout);
  copy_strides(bp.lse_stride, a.lse);
  copy_strides(bp.dq_stride, a.dq);
  copy_strides(bp.dk_stride, a.dk);
  copy_strides(bp.dv_stride, a.dv);
  copy_strides(bp.dw_stride, a.dw);
  copy_strides(bp.dbeta_stride, a.dbeta);
  bp.scale = static_cast<float>(p.scale);
  bp.slices = plan.slices;
  const auto floats = [&](std::size_t at) {
    return reinterpret_cast<float*>(base + at);
  };
  bp.dkt = floats(l.dkt), bp.dws = floats(l.dw), bp.dus = floats(l.du);
  bp.states = floats(l.states), bp.e = floats(l.e), bp.dvs = floats(l.dv);
  bp.dk_diag = floats(l.dk), bp.dm = floats(l.dm);
  bp.slice_d = static_cast<index_t>(l.slice_d / sizeof(float));
  bp.slice_dv = static_cast<index_t>(l.slice_dv / sizeof(float));
  bp.slice_own = l.own_copies > 1 ? bp.slice_d : 0;
  bp.slice_pi = static_cast<index_t>(l.slice_pi / sizeof(float));
  const bool mma = plan.query_kernel == path_backward_kernel::mma;
  bp.slice_align = mma ? path_bwd_mma_layout::super : 1;
  if (mma) {
    bp.trans = floats(l.trans), bp.dtrans = floats(l.dtrans);
    bp.khat = floats(l.khat), bp.pis = floats(l.pis);
    bp.dkhat = floats(l.dkhat), bp.dpis = floats(l.dpis);
    bp.v_vectors = aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8);
  }
  check(cudaMemsetAsync(base + l.zeroed, 0, l.zeroed_bytes, stream), "cudaMemsetAsync");

  const dim3 gate_grid(plan.gate_grid.x, plan.gate_grid.y);
  if (gated) {
    auto* G = reinterpret_cast<double*>(base + l.gate);
    auto* reset = reinterpret_cast<std::int32_t*>(base + l.reset);
    path_backward_gate_kernel<<<gate_grid, 32 * path_gate_warps, 0, stream>>>(
        a.g.data(), a.g.stride(0), a.g.stride(1), a.g.stride(2), kp.a, G, reset);
    check(cudaGetLastError(), "path_backward_gate_kernel launch");
    bp.G = G, bp.reset = reset, bp.coef = gate_coef;
    bp.dgate = reinterpret_cast<double*>(base + l.dgate);
    bp.slice_gate = static_cast<index_t>(l.slice_gate / sizeof(double));
  }

  // The chunk data in float; on tensor cores where the query kernel is (16-bit keys; 3.3 -> 1 ms
  // at (32, 2048, 32, 64), the same errors), keys whose rows are not 16-byte aligned read
  // elementwise, so that strided views take the same path (and bits) as dense ones.
  if (mma) {
    kp.k_scalar = !aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8);
    if constexpr (!std::is_same_v<T, float>)
      launch_path_prepare_mma<Dev, true>(kp, plan.forward, stream);
  } else {
    launch_path_prepare<Dev, float, float>(kp, plan.forward, stream);
  }
  const dim3 chunk_grid(plan.chunk_grid.x, plan.chunk_grid.y, plan.chunk_grid.z);
  const dim3 super_grid(plan.super_grid.x, plan.super_grid.y, plan.super_grid.z);
  // The tensor-core set's transition and super-chunk kernels: a CTA a chunk or super-chunk.
  const auto launch_mma_part = [&](auto kernel, dim3 grid, int smem, const char* what) {
    allow_dynamic_smem(kernel, smem);
    kernel<<<grid, path_bwd_mma_layout::threads, smem, stream>>>(bp);
    check(cudaGetLastError(), what);
  };
  constexpr int fold_smem = path_bwd_mma_layout::fold_smem;
  if (mma) {
    launch_mma_part(path_backward_transitions_kernel<Dev>, chunk_grid, fold_smem,
                    "path_backward_transitions_kernel launch");
    launch_mma_part(path_backward_super_kernel<Dev>, super_grid, fold_smem,
                    "path_backward_super_kernel launch");
  }

  {
    static_assert(path_backward_threads == path_tile_threads,
                  "the tiled query kernel's thread grid is 16 x 16");
    const int smem = static_cast<int>(plan.query_smem);
    const dim3 grid(plan.query_grid.x, plan.query_grid.y, plan.query_grid.z);
    if (mma) {
      if constexpr (std::is_same_v<T, float>) {
        require(false, fn, "q", "is float, but the tensor-core PaTH backward takes 16-bit inputs");
      } else {
        allow_dynamic_smem(path_backward_query_mma_kernel<Dev>, smem);
        path_backward_query_mma_kernel<Dev>
            <<<grid, path_bwd_mma_layout::threads, smem, stream>>>(bp);
        check(cudaGetLastError(), "path_backward_query_mma_kernel launch");
      }
    } else {
      allow_dynamic_smem(path_backward_query_tiled_kernel<Dev>, smem);
      path_backward_query_tiled_kernel<Dev><<<grid, path_backward_threads, smem, stream>>>(bp);
      check(cudaGetLastError(), "path_backward_query_tiled_kernel launch");
    }
  }
  if (mma) {
    launch_mma_part(path_backward_super_fold_kernel<Dev>, super_grid,
                    path_bwd_mma_layout::super_smem, "path_backward_super_fold_kernel launch");
    launch_mma_part(path_backward_fold_transitions_kernel<Dev>, chunk_grid, fold_smem,
                    "path_backward_fold_transitions_kernel launch");
  }
  {
    auto kernel = mma ? path_backward_chunk_mma_kernel<Dev> : path_backward_chunk_tiled_kernel<Dev>;
    const int smem = static_cast<int>(plan.chunk_smem);
    allow_dynamic_smem(kernel, smem);
    if (!mma) prefer_shared_memory(kernel);  // two CTAs a multiprocessor at D = 64
    kernel<<<chunk_grid, path_backward_threads, smem, stream>>>(bp);
    check(cudaGetLastError(), mma ? "path_backward_chunk_mma_kernel launch"
                                  : "path_backward_chunk_tiled_kernel launch");
  }
  if (gated) {
    path_backward_dg_kernel<<<gate_grid, 32 * path_gate_warps, 0, stream>>>(
        a.g.data(), a.g.stride(0), a.g.stride(1), a.g.stride(2), kp.a, bp.dgate, bp.slice_gate,
        bp.slices, a.dg.data(), a.dg.stride(0), a.dg.stride(1), a.dg.stride(2));
    check(cudaGetLastError(), "path_backward_dg_kernel launch");
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
