#pragma once
// Host side of the CUDA linear-attention backward: the kernel parameters, the stream-ordered
// scratch and the launches of what plan/linear_backward.hpp chose (kernels in
// kernels/linear_backward_simt.cuh, kernels/sm80_linear_backward.cuh and
// kernels/linear_backward_causal.cuh).

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/linear_args.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/linear_backward_causal.cuh"
#include "attnmix/cuda/kernels/linear_backward_causal_gated.cuh"
#include "attnmix/cuda/kernels/linear_backward_simt.cuh"
#include "attnmix/cuda/kernels/sm80_linear_backward.cuh"
#include "attnmix/cuda/kernels/sm80_linear_backward_causal.cuh"
#include "attnmix/cuda/launch/linear.cuh"
#include "attnmix/cuda/plan/linear_backward.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Bidirectional calls take the CUDA-core kernels even where the tensor-core ones apply (for the
// tests, which run both on the same inputs). Not thread-safe: set it between calls.
inline bool& linear_backward_force_simt() {
  static bool forced = false;
  return forced;
}
// Causal tensor-core calls walk this many chunks a CTA where it is positive (the tests' long walks
// on short sequences). Not thread-safe either.
inline int& linear_backward_force_super() {
  static int forced = 0;
  return forced;
}

// The policy of a causal gated norm's core (the forward that recomputes o).
template <class Policy>
struct backward_core_policy : Policy {
  static constexpr gated_norm norm = gated_norm::off;
};

// `kernel` on `grid` with `smem` dynamic shared bytes.
template <class Kernel, class... Args>
void launch_pass(Kernel kernel, const char* name, dim3 grid, int threads, int smem,
                 cudaStream_t stream, const Args&... args) {
  allow_dynamic_smem(kernel, smem);
  kernel<<<grid, dim3(unsigned(threads)), smem, stream>>>(args...);
  check(cudaGetLastError(), (std::string(name) + " launch").c_str());
}

// A tensor-core pass: all of the SM's shared memory for it (their CTAs a multiprocessor are
// bounded by shared memory and registers together).
template <class Kernel, class... Args>
void launch_mma_pass(Kernel kernel, const char* name, dim3 grid, int threads, int smem,
                     cudaStream_t stream, const Args&... args) {
  prefer_shared_memory(kernel);
  launch_pass(kernel, name, grid, threads, smem, stream, args...);
}

// dgamma from `groups` partial rows of [HQ][Dv] terms (norm_weight::shared sums the heads too):
// column sums in passes of linear_fold_run rows, each pass folding a run into its first row.
template <class Policy>
void fold_dgamma(const linear_backward_params& bp, float* parts, index_t groups,
                 cudaStream_t stream) {
  constexpr bool per_head = Policy::weight == norm_weight::per_head;
  const index_t HQ = bp.f.q_heads, Dv = bp.f.value_dim;
  const index_t cols = per_head ? HQ * Dv : Dv;
  index_t rows = per_head ? groups : groups * HQ, stride = 1;
  const unsigned gx = unsigned((cols + 31) / 32);
  const dim3 threads(linear_bwd_threads);
  for (; rows > linear_fold_run; stride *= linear_fold_run) {
    const index_t runs = (rows + linear_fold_run - 1) / linear_fold_run;
    linear_bwd_fold_columns_kernel<<<dim3(gx, unsigned(std::min<index_t>(runs, 65535))), threads, 0,
                                     stream>>>(parts, rows, cols, stride, nullptr, 0);
    check(cudaGetLastError(), "linear_bwd_fold_columns_kernel launch");
    rows = runs;
  }
  linear_bwd_fold_columns_kernel<<<dim3(gx, 1), threads, 0, stream>>>(parts, rows, cols, stride,
                                                                      bp.dgamma, bp.dgamma_stride);
  check(cudaGetLastError(), "linear_bwd_fold_columns_kernel launch");
}

// A shared gate's da: the per-head rows da_heads[h, b, t] summed over the heads, in order.
inline void fold_da(const linear_backward_params& bp, const float* da_heads, index_t max_len,
                    unsigned sequences, cudaStream_t stream) {
  if (max_len == 0) return;
  const dim3 grid(unsigned((max_len + linear_bwd_threads - 1) / linear_bwd_threads), sequences);
  linear_bwd_fold_da_kernel<<<grid, linear_bwd_threads, 0, stream>>>(bp, da_heads);
  check(cudaGetLastError(), "linear_bwd_fold_da_kernel launch");
}

// fn(std::integral_constant<int, 64>) for a plan on tensor cores (16-bit only: the other types
// never take them).
template <class Dev, class Fn>
void with_mma_dim(const linear_backward_plan&, Fn&& fn) {
  if constexpr (sizeof(Dev) == 2) fn(std::integral_constant<int, 64>{});
}

template <class Kind, class Policy, class T>
void run_linear_backward(const std::string& fn, const linear_attention_grad_args<T>& a,
                         const linear_attention_problem& p, const backend::cuda& be) {
  static_assert(Policy::norm != gated_norm::full_width,
                "attnmix: the CUDA backend has the per-head gated RMSNorm only; full_width runs on "
                "the CPU backend");
  using Dev = device_t<T>;
  constexpr bool causal = linear_kind_traits<Kind>::causal;
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  check_launch_sizes(fn, p, linear_bwd_max_dim, "linear-attention backward kernels");
  const index_t D = p.head_dim, Dv = p.value_dim, N = p.num_sequences, H = p.kv_heads,
                HQ = p.q_heads, B = p.batch, Tn = p.tokens;
  if (N == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const device_properties& props = current_properties();

  linear_backward_shape shape;
  shape.causal = causal, shape.gated = gated, shape.normed = normed;
  shape.shared_gate_sum = gated && p.gate_heads == 1 && H > 1;
  shape.saved = !causal && a.saved.S.has_value();
  shape.batch = B, shape.tokens = Tn, shape.head_dim = D, shape.value_dim = Dv;
  shape.max_len = longest_sequence(p);
  shape.sequences = N, shape.kv_heads = H, shape.q_heads = HQ;
  shape.gate_heads = gated ? p.gate_heads : 0;
  shape.offsets_bytes = offsets_bytes(p);
  if constexpr (sizeof(T) == 2) {
    auto rows16 = [](const auto& x) {
      return aligned_for_vectors(x.data(), x.stride(0), x.stride(1), x.stride(2), 8, 2);
    };
    auto pairs = [](const auto& x) {
      return !x.has_value() ||
             aligned_for_vectors(x.data(), x.stride(0), x.stride(1), x.stride(2), 2, 2);
    };
    shape.mma_inputs = props.cc_major >= 8 && rows16(a.q) && rows16(a.k) && rows16(a.v) &&
                       pairs(a.dout) && pairs(a.dq) && pairs(a.dk) && pairs(a.dv) &&
                       (!normed || (pairs(a.gate) && pairs(a.dgate)));
  }
  shape.half_inputs = std::is_same_v<Dev, __half>;
  shape.force_simt = linear_backward_force_simt();
  shape.force_super = linear_backward_force_super();
  std::vector<int> slot_offsets;  // causal slot passes: the first state slot of each sequence
  const linear_bwd_causal_layout layout = causal_layout(shape, props);
  if (causal && layout.slots(shape)) {
    const index_t span = layout.slot_tokens();
    slot_offsets.resize(std::size_t(N + 1));
    slot_offsets[0] = 0;
    for (index_t n = 0; n < N; ++n)
      slot_offsets[std::size_t(n + 1)] =
          slot_offsets[std::size_t(n)] + int((p.seq(n).length + span - 1) / span);
    shape.total_slots = slot_offsets.back();
  }
  const linear_backward_plan plan = plan_linear_backward(shape, props);
  const linear_backward_scratch& sc = plan.scratch;
  stream_buffer scratch(sc.bytes, stream);
  unsigned char* base = scratch.get();
  auto at = [&](std::size_t off) {
    return reinterpret_cast<float*>(base + off);
  };

  linear_backward_params bp{};
  linear_kernel_params& kp = bp.f;
  kp.q = a.q.data(), kp.k = a.k.data(), kp.v = a.v.data(), kp.out = nullptr;
  kp.mask = a.mask.has_value() ? a.mask.data() : nullptr;
  kp.a = a.a.has_value() ? a.a.data() : nullptr;
  kp.gate = a.gate.has_value() ? a.gate.data() : nullptr;
  kp.gamma = a.gamma.has_value() ? a.gamma.data() : nullptr;
  copy_strides(kp.q_stride, a.q), copy_strides(kp.k_stride, a.k), copy_strides(kp.v_stride, a.v);
  copy_strides(kp.gate_stride, a.gate);
  copy_strides(kp.mask_stride, a.mask), copy_strides(kp.a_stride, a.a);
  kp.gamma_stride = a.gamma.has_value() ? a.gamma.stride(0) : 0;
  kp.tokens = Tn;
  kp.q_heads = int(HQ), kp.kv_heads = int(H), kp.group = int(p.group());
  kp.gate_heads = int(gated ? p.gate_heads : 1), kp.head_dim = int(D), kp.value_dim = int(Dv);
  kp.scale = float(p.scale), kp.eps = float(p.eps), kp.norm_eps = float(p.norm_eps);
  const auto& si = a.state_in;
  kp.S_in = si.S.has_value() ? si.S.data() : nullptr;
  kp.z_in = si.z.has_value() ? si.z.data() : nullptr;
  kp.lse_in = si.lse.has_value() ? si.lse.data() : nullptr;
  copy_strides(kp.S_in_stride, si.S), copy_strides(kp.z_in_stride, si.z);
  copy_strides(kp.lse_in_stride, si.lse);
  kp.cu_seqlens = upload_offsets(base + sc.offsets, p, stream);
  bp.batch = B;
  bp.dout = a.dout.data();
  copy_strides(bp.dout_stride, a.dout);
  auto rows16 = [](const auto& x) {
    return aligned_for_vectors(x.data(), x.stride(0), x.stride(1), x.stride(2), 8, sizeof(T));
  };
  bp.rows16 = rows16(a.dout) && (!normed || !a.gate.has_value() || rows16(a.gate));
  bp.dkv_rows16 = rows16(a.dk) && rows16(a.dv);
  bp.dq_rows16 = rows16(a.dq);
  bp.dq = a.dq.data(), bp.dk = a.dk.data(), bp.dv = a.dv.data();
  bp.dgate = a.dgate.has_value() ? a.dgate.data() : nullptr;
  copy_strides(bp.dq_stride, a.dq), copy_strides(bp.dk_stride, a.dk);
  copy_strides(bp.dv_stride, a.dv), copy_strides(bp.dgate_stride, a.dgate);
  bp.da = a.da.has_value() ? a.da.data() : nullptr;
  copy_strides(bp.da_stride, a.da);
  bp.dgamma = a.dgamma.has_value() ? a.dgamma.data() : nullptr;
  bp.dgamma_stride = a.dgamma.has_value() ? a.dgamma.stride(0) : 0;
  bp.saved_S = a.saved.S.has_value() ? a.saved.S.data() : nullptr;
  bp.saved_z = a.saved.z.has_value() ? a.saved.z.data() : nullptr;
  bp.saved_lse = a.saved.lse.has_value() ? a.saved.lse.data() : nullptr;
  copy_strides(bp.saved_S_stride, a.saved.S), copy_strides(bp.saved_z_stride, a.saved.z);
  copy_strides(bp.saved_lse_stride, a.saved.lse);
  bp.dS_out = a.dstate_out.S.has_value() ? a.dstate_out.S.data() : nullptr;
  bp.dz_out = a.dstate_out.z.has_value() ? a.dstate_out.z.data() : nullptr;
  bp.dS_in = a.dstate_in.S.has_value() ? a.dstate_in.S.data() : nullptr;
  bp.dz_in = a.dstate_in.z.has_value() ? a.dstate_in.z.data() : nullptr;
  copy_strides(bp.dS_out_stride, a.dstate_out.S), copy_strides(bp.dz_out_stride, a.dstate_out.z);
  copy_strides(bp.dS_in_stride, a.dstate_in.S), copy_strides(bp.dz_in_stride, a.dstate_in.z);
  bp.dlse_out = a.dstate_out.lse.has_value() ? a.dstate_out.lse.data() : nullptr;
  bp.dlse_in = a.dstate_in.lse.has_value() ? a.dstate_in.lse.data() : nullptr;
  copy_strides(bp.dlse_out_stride, a.dstate_out.lse);
  copy_strides(bp.dlse_in_stride, a.dstate_in.lse);

  const dim3 threads(linear_bwd_threads);
  const index_t SS = plan.state_size;
  const unsigned n_grid = unsigned(N);

  if constexpr (!causal) {
    float* stats = at(sc.stats);
    float* state = at(sc.state);
    float* partial = at(sc.partial);
    float* dstate = at(sc.dstate);
    float* jac = at(sc.jac);
    float* dgamma_part = normed && a.dgamma.has_value() ? at(sc.dgamma) : nullptr;
    float* da_heads = shape.shared_gate_sum ? at(sc.da_heads) : nullptr;
    if constexpr (gated) {
      linear_bwd_stats_kernel<Policy><<<as_dim3(plan.stats_grid), threads, 0, stream>>>(bp, stats);
      check(cudaGetLastError(), "linear_bwd_stats_kernel launch");
    }
    if (shape.saved) {
      linear_bwd_load_saved_kernel<<<as_dim3(plan.combine_grid), threads, 0, stream>>>(bp, state);
      check(cudaGetLastError(), "linear_bwd_load_saved_kernel launch");
    } else {
      const dim3 grid = as_dim3(plan.reduce_grid);
      if (plan.mma)
        with_mma_dim<Dev>(plan, [&](auto dim) {
          constexpr int Dm = decltype(dim)::value;
          launch_mma_pass(linear_bwd_reduce_mma_kernel<Dev, Policy, Dm, Dm>,
                          "linear_bwd_reduce_mma_kernel", grid, plan.mma_threads, plan.reduce_smem,
                          stream, bp, plan.part_tokens, plan.parts, stats, partial);
        });
      else
        launch_pass(linear_bwd_reduce_kernel<Dev, Policy>, "linear_bwd_reduce_kernel", grid,
                    linear_bwd_threads, plan.reduce_smem, stream, bp, plan.part_tokens, plan.parts,
                    stats, partial);
      linear_bwd_combine_kernel<<<as_dim3(plan.combine_grid), threads, 0, stream>>>(
          partial, plan.parts, int(H), SS, state);
      check(cudaGetLastError(), "linear_bwd_combine_kernel launch");
    }
    const dim3 pass_grid = as_dim3(plan.pass_grid);
    if (plan.mma)
      with_mma_dim<Dev>(plan, [&](auto dim) {
        constexpr int Dm = decltype(dim)::value;
        launch_mma_pass(linear_bwd_query_mma_kernel<Dev, Policy, Dm, Dm>,
                        "linear_bwd_query_mma_kernel", pass_grid, plan.mma_threads,
                        plan.pass_a_smem, stream, bp, plan.part_tokens, plan.parts, state, partial,
                        dgamma_part);
      });
    else
      launch_pass(linear_bwd_query_kernel<Dev, Policy>, "linear_bwd_query_kernel", pass_grid,
                  linear_bwd_threads, plan.pass_a_smem, stream, bp, plan.part_tokens, plan.parts,
                  state, partial, dgamma_part);
    linear_bwd_combine_kernel<<<as_dim3(plan.combine_grid), threads, 0, stream>>>(
        partial, plan.parts, int(H), SS, dstate);
    check(cudaGetLastError(), "linear_bwd_combine_kernel launch");
    if constexpr (gated) {
      linear_bwd_jac_kernel<<<as_dim3(plan.jac_grid), threads, 0, stream>>>(state, dstate, int(H),
                                                                            SS, jac);
      check(cudaGetLastError(), "linear_bwd_jac_kernel launch");
    }
    if (plan.mma)
      with_mma_dim<Dev>(plan, [&](auto dim) {
        constexpr int Dm = decltype(dim)::value;
        launch_mma_pass(linear_bwd_key_mma_kernel<Dev, Policy, Dm, Dm>, "linear_bwd_key_mma_kernel",
                        as_dim3(plan.key_grid), plan.key_threads, plan.pass_b_smem, stream, bp,
                        plan.key_part_tokens, stats, dstate, jac, da_heads);
      });
    else
      launch_pass(linear_bwd_key_kernel<Dev, Policy>, "linear_bwd_key_kernel", pass_grid,
                  linear_bwd_threads, plan.pass_b_smem, stream, bp, plan.part_tokens, stats, dstate,
                  jac, da_heads);
    if (da_heads != nullptr) fold_da(bp, da_heads, shape.max_len, n_grid, stream);
    if (normed && a.dgamma.has_value()) {  // with no tokens it writes zeros
      fold_dgamma<Policy>(bp, dgamma_part, N * plan.parts, stream);
    }
  } else {
    // A gated norm: recompute the core's output, then do (and dgate, dgamma) row by row; the
    // core's backward then runs on do.
    const std::size_t rows = std::size_t(B * Tn * HQ) * std::size_t(Dv);
    stream_buffer norm_scratch(
        normed ? padded_bytes(rows * sizeof(T)) * 2 +
                     padded_bytes(
                         std::size_t(N) *
                         std::size_t((shape.max_len + linear_bwd_tile - 1) / linear_bwd_tile) *
                         std::size_t(HQ * Dv) * sizeof(float))
               : 0,
        stream);
    if constexpr (normed) {
      T* o = reinterpret_cast<T*>(norm_scratch.get());
      T* dO = reinterpret_cast<T*>(norm_scratch.get() + padded_bytes(rows * sizeof(T)));
      float* dgamma_part =
          a.dgamma.has_value()
              ? reinterpret_cast<float*>(norm_scratch.get() + 2 * padded_bytes(rows * sizeof(T)))
              : nullptr;
      linear_attention_args<T> fa;
      fa.q = a.q, fa.k = a.k, fa.v = a.v, fa.mask = a.mask, fa.a = a.a;
      fa.state_in.S = a.state_in.S, fa.state_in.z = a.state_in.z, fa.state_in.lse = a.state_in.lse;
      fa.out = view4<T>(o, {B, Tn, HQ, Dv}, {Tn * HQ * Dv, HQ * Dv, Dv, 1}, memory_space::device);
      run_linear<Kind, backward_core_policy<Policy>>(fn, fa, p, be);
      const index_t tiles = (shape.max_len + linear_bwd_tile - 1) / linear_bwd_tile;
      if (tiles > 0) {
        const int smem = int(3 * linear_bwd_tile * Dv * sizeof(float));
        auto norm = linear_bwd_norm_kernel<Dev, Policy>;
        allow_dynamic_smem(norm, smem);
        norm<<<dim3(unsigned(tiles), n_grid), threads, smem, stream>>>(
            bp, reinterpret_cast<const Dev*>(o), reinterpret_cast<Dev*>(dO), tiles, dgamma_part);
        check(cudaGetLastError(), "linear_bwd_norm_kernel launch");
      }
      if (a.dgamma.has_value()) {  // with no tokens (tiles == 0) it writes zeros
        fold_dgamma<Policy>(bp, dgamma_part, N * tiles, stream);
      }
      bp.dout = dO;
      bp.dout_stride[0] = Tn * HQ * Dv, bp.dout_stride[1] = HQ * Dv, bp.dout_stride[2] = Dv;
    }

    if (gated && !layout.slots(shape)) {
      // The prefix key gate on CUDA cores: one walk a (KV head, sequence).
      if constexpr (gated) {
        float* da_heads = shape.shared_gate_sum ? at(sc.da_heads) : nullptr;
        auto kernel = linear_bwd_causal_gated_kernel<Dev, Policy>;
        allow_dynamic_smem(kernel, plan.gated_smem);
        kernel<<<as_dim3(plan.chunk_grid), linear_bwd_gated_threads, plan.gated_smem, stream>>>(
            bp, int(plan.gated_K), plan.gated_task_floats, at(sc.gated_states), da_heads);
        check(cudaGetLastError(), "linear_bwd_causal_gated_kernel launch");
        if (da_heads != nullptr) fold_da(bp, da_heads, shape.max_len, n_grid, stream);
      }
    } else {
      int* offsets = reinterpret_cast<int*>(base + sc.slot_offsets);
      upload_host(offsets, slot_offsets.data(), slot_offsets.size() * sizeof(int), stream,
                  "cudaMemcpyAsync(slot offsets)");
      float* state = at(sc.state);
      float* dstate = at(sc.dstate);
      float* inv_den = at(sc.inv_den);
      float* delta = at(sc.delta);
      // Under the key gate (tensor cores only): rows' maxima and masses, the scans' totals and
      // sums, and a shared gate's per-head da.
      float* mass = gated ? at(sc.mass) : nullptr;
      float* totals = gated ? at(sc.gate_totals) : nullptr;
      float* parts = gated ? at(sc.gate_parts) : nullptr;
      float* parts2 = gated ? parts + N * H * plan.scan_grid.x : nullptr;
      float* da_heads = gated && shape.shared_gate_sum ? at(sc.da_heads) : nullptr;
      const dim3 chunk_grid = as_dim3(plan.chunk_grid);
      // The tensor-core kernels (sm80_linear_backward_causal.cuh) take bfloat16 alone.
      constexpr bool bf16 = std::is_same_v<Dev, __nv_bfloat16>;
      const bool mma = bf16 && plan.mma;
      const dim3 chunk_threads(unsigned(mma ? plan.mma_threads : linear_bwd_threads));
      const int walk = int(plan.super);  // chunks a tensor-core CTA walks
      if (shape.total_slots > 0) {
        if (mma) {
          if constexpr (bf16) {
            auto kernel = linear_bwd_chunk_sums_mma_kernel<Policy>;
            allow_dynamic_smem(kernel, plan.reduce_smem);
            kernel<<<chunk_grid, chunk_threads, plan.reduce_smem, stream>>>(bp, offsets, walk,
                                                                            state);
          }
        } else if constexpr (!gated) {
          auto sums = linear_bwd_chunk_sums_kernel<Dev, Policy>;
          allow_dynamic_smem(sums, plan.reduce_smem);
          sums<<<chunk_grid, threads, plan.reduce_smem, stream>>>(bp, plan.chunk, offsets, state);
        }
        check(cudaGetLastError(), "linear_bwd_chunk_sums_kernel launch");
      }
      if constexpr (gated)
        linear_bwd_gated_scan_kernel<Policy>
            <<<as_dim3(plan.scan_grid), linear_bwd_scan_threads, 0, stream>>>(bp, offsets, state,
                                                                              totals, parts);
      else
        linear_bwd_scan_kernel<<<as_dim3(plan.scan_grid), linear_bwd_scan_threads, 0, stream>>>(
            bp, offsets, state);
      check(cudaGetLastError(), "linear_bwd_scan_kernel launch");
      if (shape.total_slots > 0) {
        if (mma) {
          if constexpr (bf16) {
            auto kernel = linear_bwd_causal_query_mma_kernel<Policy>;
            allow_dynamic_smem(kernel, plan.causal_q_smem);
            kernel<<<chunk_grid, chunk_threads, plan.causal_q_smem, stream>>>(
                bp, offsets, walk, state, dstate, inv_den, delta, mass);
          }
        } else if constexpr (!gated) {
          auto query = linear_bwd_causal_query_kernel<Dev, Policy>;
          allow_dynamic_smem(query, plan.causal_q_smem);
          query<<<chunk_grid, threads, plan.causal_q_smem, stream>>>(bp, plan.chunk, offsets, state,
                                                                     dstate, inv_den, delta);
        }
        check(cudaGetLastError(), "linear_bwd_causal_query_kernel launch");
      }
      if constexpr (gated)
        linear_bwd_gated_reverse_scan_kernel<<<as_dim3(plan.scan_grid), linear_bwd_scan_threads, 0,
                                               stream>>>(bp, offsets, state, dstate, totals, parts,
                                                         parts2);
      else
        linear_bwd_reverse_scan_kernel<<<as_dim3(plan.scan_grid), linear_bwd_scan_threads, 0,
                                         stream>>>(bp, offsets, dstate);
      check(cudaGetLastError(), "linear_bwd_reverse_scan_kernel launch");
      if (shape.total_slots > 0) {
        if (mma) {
          if constexpr (bf16) {
            auto kernel = linear_bwd_causal_key_mma_kernel<Policy>;
            allow_dynamic_smem(kernel, plan.causal_k_smem);
            kernel<<<chunk_grid, chunk_threads, plan.causal_k_smem, stream>>>(
                bp, offsets, walk, dstate, inv_den, delta, mass, da_heads);
          }
        } else if constexpr (!gated) {
          auto key = linear_bwd_causal_key_kernel<Dev, Policy>;
          allow_dynamic_smem(key, plan.causal_k_smem);
          key<<<chunk_grid, threads, plan.causal_k_smem, stream>>>(bp, plan.chunk, offsets, dstate,
                                                                   inv_den, delta);
        }
        check(cudaGetLastError(), "linear_bwd_causal_key_kernel launch");
      }
      if constexpr (gated) {
        if (bp.dlse_in != nullptr) {
          linear_bwd_gated_dlse_kernel<<<dim3(unsigned(H), n_grid), 32, 0, stream>>>(
              bp, totals, parts2, int(plan.scan_grid.x));
          check(cudaGetLastError(), "linear_bwd_gated_dlse_kernel launch");
        }
        if (da_heads != nullptr) fold_da(bp, da_heads, shape.max_len, n_grid, stream);
      }
    }
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
