#pragma once
// Host side of the CUDA PaTH kernels: argument checks that only the CUDA backend needs, the
// stream-ordered chunk data, and the launches of what plan/path.hpp chose: wgmma on Hopper
// (D = Dv = 64), mma.sync elsewhere or when asked (backend::cuda::portable), CUDA cores for
// float and other dims.

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/dispatch.cuh"
#include "attnmix/cuda/kernels/path_decode.cuh"
#include "attnmix/cuda/kernels/path_simt.cuh"
#include "attnmix/cuda/kernels/sm80_path.cuh"
#include "attnmix/cuda/kernels/sm80_path_key_cache.cuh"
#include "attnmix/cuda/kernels/sm80_path_prepare.cuh"
#include "attnmix/cuda/kernels/sm90_path.cuh"
#include "attnmix/cuda/launch/attention.cuh"
#include "attnmix/cuda/launch/split_decode.cuh"
#include "attnmix/cuda/plan/path.hpp"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

template <class W, class B>
void set_householder(path_kernel_params& kp, const W& w, const B& beta, index_t kv_heads) {
  kp.w = w.data(), kp.beta = beta.data();
  for (int i = 0; i < 3; ++i) kp.w_stride[i] = w.stride(i), kp.beta_stride[i] = beta.stride(i);
  kp.kv_heads = static_cast<int>(kv_heads);
}

// The per-chunk data of one call (plan/path.hpp lays it out): K~ in KT, U and M in TU,
// optionally W in half and the dense transitions E in half.
class path_chunk_data {
 public:
  path_chunk_data(const path_chunk_layout& layout, cudaStream_t stream)
      : layout_(layout), buffer_(layout.bytes, stream) {}
  void attach(path_kernel_params& kp) const {
    unsigned char* at = buffer_.get();
    kp.kt = at + layout_.kt, kp.u = at + layout_.u, kp.m = at + layout_.m;
    kp.wh = layout_.half_w ? at + layout_.wh : nullptr;
    kp.e = layout_.dense ? at + layout_.e : nullptr;
  }

 private:
  path_chunk_layout layout_;
  stream_buffer buffer_;
};

template <class T, class KT, class TU>
void launch_path_prepare(const path_kernel_params& kp, const path_plan& plan, cudaStream_t stream) {
  const int smem = path_prepare_smem_bytes(kp.a.head_dim);
  auto kernel = plan.prepare_dim == 64 ? path_prepare_kernel<T, KT, TU, 64>
                                       : path_prepare_kernel<T, KT, TU, 128>;
  allow_dynamic_smem(kernel, smem);
  const dim3 grid(plan.prepare_grid.x, plan.prepare_grid.y, plan.prepare_grid.z);
  kernel<<<grid, path_prepare_threads, smem, stream>>>(kp);
  check(cudaGetLastError(), "path_prepare_kernel launch");
}

// The tensor-core preparation (16-bit keys, rows 16-byte aligned, D = 64 or 128): U, M, W in half,
// K~ in T; with Float, U, M and K~ in float.
template <class T, bool Float = false>
void launch_path_prepare_mma(const path_kernel_params& kp, const path_plan& plan,
                             cudaStream_t stream) {
  const bool narrow = plan.prepare_dim == 64;
  const int smem =
      narrow ? path_prepare_mma_layout<64>::smem_bytes : path_prepare_mma_layout<128>::smem_bytes;
  auto kernel =
      narrow ? path_prepare_mma_kernel<T, 64, Float> : path_prepare_mma_kernel<T, 128, Float>;
  allow_dynamic_smem(kernel, smem);
  prefer_shared_memory(kernel);  // occupancy is bound by it (four CTAs at D = 64)
  const dim3 grid(plan.prepare_grid.x, plan.prepare_grid.y, plan.prepare_grid.z);
  kernel<<<grid, path_prepare_threads, smem, stream>>>(kp);
  check(cudaGetLastError(), "path_prepare_mma_kernel launch");
}

// Where the prefill key cache goes (keys == nullptr: nowhere): [B, T, H, D] with these strides,
// or, with slot_of (device), the slots of a decoding cache, whose values, gate cumsum, recent
// keys and transitions are filled too.
template <class Out>
struct key_cache_target {
  Out* keys = nullptr;
  index_t stride[3] = {0, 0, 0};
  const std::int32_t* slot_of = nullptr;
  Out* values = nullptr;
  double* gates = nullptr;
  float* recent = nullptr;
  float* transitions = nullptr;
  index_t capacity = 0;
};

// Whether the prefill key cache of 16-bit chunk data at D = 64 runs on tensor cores
// (path_key_cache_mma_kernel); off: the CUDA-core walk (bench_path_cuda times both). Not
// synchronised: set it only while no prefill is being launched.
inline bool& path_key_cache_tensor_cores() {
  static bool on = true;
  return on;
}

template <class T, class KT, class TU, class Out>
void launch_path_key_cache(const path_kernel_params& kp, index_t sequences,
                           const key_cache_target<Out>& target, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(kp.kv_heads), static_cast<unsigned>(sequences));
  const auto launch = [&](auto kernel, int threads, int smem) {
    allow_dynamic_smem(kernel, smem);
    kernel<<<grid, threads, smem, stream>>>(kp, target.keys, target.stride[0], target.stride[1],
                                            target.stride[2], target.slot_of, target.recent,
                                            target.transitions);
  };
  // The tensor-core forward's chunk data (16-bit K~, U in half) at D = 64: on tensor cores.
  constexpr bool mma = !std::is_same_v<KT, float> && std::is_same_v<TU, __half>;
  bool done = false;
  if constexpr (mma) {
    if (kp.a.head_dim == 64 && path_key_cache_tensor_cores()) {
      launch(path_key_cache_mma_kernel<KT, Out>, split_tile::threads,
             path_key_cache_mma_layout::smem);
      done = true;
    }
  }
  if (!done)
    launch(path_key_cache_kernel<KT, TU, Out>, 256, path_key_cache_smem_bytes(kp.a.head_dim));
  check(cudaGetLastError(), "path_key_cache_kernel launch");
  if (target.values != nullptr) {
    path_cache_fill_kernel<T, Out><<<dim3(64, static_cast<unsigned>(sequences)), 128, 0, stream>>>(
        kp, target.values, target.gates, target.capacity, target.slot_of);
    check(cudaGetLastError(), "path_cache_fill_kernel launch");
  }
}

template <class Dev, int D, int Dv>
void launch_path_mma(const path_kernel_params& kp, const path_plan& plan, cudaStream_t stream) {
  using tile = path_mma_tile<D, Dv>;
  auto kernel = path_forward_mma_kernel<Dev, D, Dv>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp);
}

// Hopper, D = Dv = 64: persistent, a CTA an SM over the items (pairs of query chunks, heads,
// sequences), a ring of four stages.
template <class Dev>
void launch_path_wgmma(const path_kernel_params& kp, const path_plan& plan, cudaStream_t stream) {
  using tile = path_wgmma_tile<64, 64, 4>;
  auto kernel = path_wgmma_kernel<Dev, 64, 64, 4>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  check(cudaMemsetAsync(kp.a.work_counter, 0, sizeof(int), stream), "cudaMemsetAsync");
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp, static_cast<int>(plan.pairs),
                                                            static_cast<int>(plan.items));
}

template <class Dev>
void launch_path_simt(const path_kernel_params& kp, const path_plan& plan, cudaStream_t stream) {
  const dim3 grid(plan.grid.x, plan.grid.y, plan.grid.z);
  with_value<64, 128>(plan.simt_dim, [&](auto dim) {
    path_forward_simt_kernel<Dev, decltype(dim)::value><<<grid, path_simt_threads, 0, stream>>>(kp);
  });
}

// The PaTH / PaTH-FoX forward (and, when `cache.keys` is set, the prefill key cache from the same
// chunk data). gate_coef: factor of (G_i - G_j), ignored without a.g.
template <class T, class Out = device_t<T>>
void run_path(const std::string& fn, const attention_args<T>& a, const attention_problem& p,
              const backend::cuda& be, double gate_coef, key_cache_target<Out> cache = {}) {
  using Dev = device_t<T>;
  check_launch_sizes(fn, p, 128, "PaTH kernels");

  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const attention_setup setup(a, p, true, gate_coef, stream);
  if (setup.max_len == 0) return;
  path_kernel_params kp{};
  kp.a = setup.kp;
  set_householder(kp, a.w, a.beta, p.kv_heads);

  constexpr bool tensor_cores = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
  path_shape shape;
  shape.batch = p.batch, shape.tokens = p.tokens;
  shape.head_dim = p.head_dim, shape.value_dim = p.value_dim;
  shape.max_len = setup.max_len, shape.q_heads = p.q_heads, shape.kv_heads = p.kv_heads;
  shape.sequences = p.num_sequences;
  shape.sixteen_bit = tensor_cores;
  shape.aligned =
      aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 2) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8) &&
      aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1), a.out.stride(2), 2);
  // The Hopper kernel also stages the queries with 16-byte copies, and takes each chunk's
  // transition as E (D = C).
  shape.q_vectors = aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 8);
  shape.positive_scale = p.scale > 0;
  shape.portable = be.portable;
  const path_plan plan = plan_path(shape, current_properties());
  if constexpr (tensor_cores) {
    if (plan.variant != path_variant::simt) {
      path_chunk_data chunks(plan.chunks, stream);
      chunks.attach(kp);
      launch_path_prepare_mma<Dev>(kp, plan, stream);
      if (plan.variant == path_variant::sm90_wgmma)
        launch_path_wgmma<Dev>(kp, plan, stream);
      else
        with_head_dims<64, 128>(plan.head_dim, plan.value_dim, [&](auto d, auto dv) {
          launch_path_mma<Dev, decltype(d)::value, decltype(dv)::value>(kp, plan, stream);
        });
      check(cudaGetLastError(), "PaTH tensor-core forward launch");
      if (cache.keys != nullptr)
        launch_path_key_cache<Dev, Dev, __half>(kp, p.num_sequences, cache, stream);
      return;
    }
  }
  path_chunk_data chunks(plan.chunks, stream);
  chunks.attach(kp);
  launch_path_prepare<Dev, float, float>(kp, plan, stream);
  launch_path_simt<Dev>(kp, plan, stream);
  check(cudaGetLastError(), "path_forward_simt_kernel launch");
  if (cache.keys != nullptr)
    launch_path_key_cache<Dev, float, float>(kp, p.num_sequences, cache, stream);
}

// The prefill key cache alone (path_prefill_key_cache): the chunk data, then the suffix-product
// walk; for 16-bit keys whose rows take 16-byte copies at D = 64 or 128 both as the tensor-core
// forward makes them, otherwise in float on CUDA cores.
template <class T>
void run_path_key_cache(const std::string& fn, const path_key_cache_args<T>& a,
                        const attention_problem& p, const backend::cuda& be) {
  using Dev = device_t<T>;
  check_launch_sizes(fn, p, 128, "PaTH kernels");
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);
  const index_t max_len = longest_sequence(p);
  if (max_len == 0) return;
  stream_buffer offsets(offsets_bytes(p), stream);
  path_kernel_params kp{};
  kp.a.k = a.k.data();
  for (int i = 0; i < 3; ++i) kp.a.k_stride[i] = a.k.stride(i);
  kp.a.tokens = p.tokens;
  kp.a.head_dim = static_cast<int>(p.head_dim);
  kp.a.cu_seqlens = upload_offsets(offsets.get(), p, stream);
  set_householder(kp, a.w, a.beta, p.kv_heads);
  path_shape shape;
  shape.batch = p.batch, shape.tokens = p.tokens;
  shape.head_dim = shape.value_dim = p.head_dim;
  shape.max_len = max_len, shape.q_heads = p.q_heads, shape.kv_heads = p.kv_heads;
  shape.sequences = p.num_sequences;
  // The chunk data of the mma.sync forward (no dense transitions), if it applies.
  shape.sixteen_bit = !std::is_same_v<T, float>;
  shape.aligned = shape.q_vectors =
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8);
  shape.portable = true;
  const path_plan plan = plan_path(shape, current_properties());
  path_chunk_data chunks(plan.chunks, stream);
  chunks.attach(kp);
  key_cache_target<Dev> target;
  target.keys = reinterpret_cast<Dev*>(a.key_cache.data());
  for (int i = 0; i < 3; ++i) target.stride[i] = a.key_cache.stride(i);
  if constexpr (!std::is_same_v<T, float>) {
    if (plan.variant != path_variant::simt) {
      launch_path_prepare_mma<Dev>(kp, plan, stream);
      launch_path_key_cache<Dev, Dev, __half>(kp, p.num_sequences, target, stream);
      return;
    }
  }
  launch_path_prepare<Dev, float, float>(kp, plan, stream);
  launch_path_key_cache<Dev, float, float>(kp, p.num_sequences, target, stream);
}

// A device decoding cache as run_path_decode sees it; rows[n] = {slot, tokens held} of step row n.
struct decode_cache {
  void* keys;
  void* values;
  double* gates;
  float* recent;
  float* transitions;
  index_t capacity;
  std::vector<std::array<std::int32_t, 2>> rows;
};

// One decoding step (cuda/kernels/path_decode.cuh) over the cache's rows: transitions, step,
// combine, and the flush where a row's step flushes; DevStore is the cache's element type.
// gate_coef: factor of (G_t - G_j), ignored without a.g.
template <class DevStore, class T>
void run_path_decode(const std::string& fn, const attention_args<T>& a,
                     const attention_problem& prob, const decode_cache& cache, double gate_coef,
                     const backend::cuda& be) {
  using Dev = device_t<T>;
  const bool gated = a.g.has_value();
  const device_properties& props = current_properties();
  require(prob.batch <= props.max_grid_z, fn, "q", "holds ", prob.batch,
          " sequences but a CUDA decoding step takes at most ", props.max_grid_z);
  require(!gated || prob.group() <= 32, fn, "q", "has ", prob.group(),
          " query heads per key/value head; decoding with a forget gate supports <= 32");
  cudaStream_t stream = static_cast<cudaStream_t>(be.stream);

  index_t longest = 0;
  for (const auto& r : cache.rows) longest = std::max<index_t>(longest, r[1] + 1);
  path_decode_shape shape;
  shape.longest = longest, shape.batch = prob.batch;
  shape.q_heads = prob.q_heads, shape.kv_heads = prob.kv_heads;
  shape.head_dim = prob.head_dim, shape.value_dim = prob.value_dim;
  shape.row_bytes = cache.rows.size() * sizeof(cache.rows[0]);
  const path_decode_plan plan = plan_path_decode(shape, props);
  path_decode_params p{};
  const split_decode_plan& split = plan.split;
  p.block_keys = split.block_keys;
  const index_t HQ = prob.q_heads, Dv = prob.value_dim;
  const std::size_t rows_bytes = shape.row_bytes;
  stream_buffer work(plan.bytes, stream);
  p.parts = split_parts(a, split, work.get());
  p.qm = reinterpret_cast<float*>(work.get() + split.ml_bytes + split.o_bytes);
  auto* rows_dev =
      reinterpret_cast<std::int32_t*>(work.get() + split.ml_bytes + split.o_bytes + plan.qm_bytes);
  upload_host(rows_dev, cache.rows.data(), rows_bytes, stream, "cudaMemcpyAsync(rows)");
  p.rows = rows_dev;

  p.q = a.q.data(), p.k = a.k.data(), p.v = a.v.data();
  p.w = a.w.data(), p.beta = a.beta.data();
  p.g = gated ? a.g.data() : nullptr;
  p.q_s[0] = a.q.stride(0), p.q_s[1] = a.q.stride(2);
  p.k_s[0] = a.k.stride(0), p.k_s[1] = a.k.stride(2);
  p.v_s[0] = a.v.stride(0), p.v_s[1] = a.v.stride(2);
  p.w_s[0] = a.w.stride(0), p.w_s[1] = a.w.stride(2);
  p.beta_s[0] = a.beta.stride(0), p.beta_s[1] = a.beta.stride(2);
  if (gated) p.g_s[0] = a.g.stride(0), p.g_s[1] = a.g.stride(2);
  p.keys = cache.keys, p.values = cache.values, p.gates = cache.gates;
  p.recent = cache.recent, p.transitions = cache.transitions;
  p.capacity = cache.capacity;
  p.q_heads = static_cast<int>(HQ), p.kv_heads = static_cast<int>(prob.kv_heads);
  p.group = static_cast<int>(prob.group());
  p.head_dim = static_cast<int>(prob.head_dim), p.value_dim = static_cast<int>(Dv);
  constexpr double log2e = 1.4426950408889634;
  p.scale_log2 = static_cast<float>(prob.scale * log2e);
  p.gate_coef_log2 = static_cast<float>(gate_coef * log2e);

  const dim3 grid(split.grid.x, split.grid.y, split.grid.z);
  const bool narrow = split.dmax == 64;
  auto transition =
      narrow ? path_decode_transition_kernel<Dev, 64> : path_decode_transition_kernel<Dev, 128>;
  transition<<<dim3(plan.transition_grid.x, plan.transition_grid.y), split.dmax, 0, stream>>>(p);
  check(cudaGetLastError(), "path_decode_transition_kernel launch");
  auto kernel =
      narrow ? path_decode_kernel<Dev, DevStore, 64> : path_decode_kernel<Dev, DevStore, 128>;
  if (plan.raise_smem_limit)  // above the default limit: only wide GQA groups (not per step)
    allow_dynamic_smem(kernel, plan.smem);
  kernel<<<grid, split_decode_threads, plan.smem, stream>>>(p);
  check(cudaGetLastError(), "path_decode_kernel launch");
  launch_split_combine<Dev>(p.parts, split, stream);
  const bool flushes = std::any_of(cache.rows.begin(), cache.rows.end(),
                                   [](const auto& r) { return path_decode_flushes(r[1]); });
  if (flushes) {  // one step in path_decode_flush; the other rows' blocks return at once
    auto flush =
        narrow ? path_decode_flush_kernel<DevStore, 64> : path_decode_flush_kernel<DevStore, 128>;
    if (plan.raise_flush_smem_limit) allow_dynamic_smem(flush, plan.flush_smem);  // D = 128
    flush<<<grid, split_decode_threads, plan.flush_smem, stream>>>(p);
    check(cudaGetLastError(), "path_decode_flush_kernel launch");
  }
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
