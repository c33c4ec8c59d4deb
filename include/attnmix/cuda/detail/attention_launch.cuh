#pragma once
// Host side of the CUDA softmax-family kernels: device-memory checks, stream-ordered scratch,
// the gate cumsum, and the choice between the tensor-core and the CUDA-core kernel.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "attnmix/attention/args.hpp"
#include "attnmix/attention/device_pointers.cuh"  // the front doors' pointer check
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cuda/detail/attention_mma.cuh"
#include "attnmix/cuda/detail/attention_simt.cuh"
#include "attnmix/cuda/detail/attention_wgmma.cuh"
#include "attnmix/cuda/detail/gate.cuh"
#include "attnmix/cuda/detail/types.cuh"
#include "attnmix/cuda/runtime.cuh"

namespace attnmix {
namespace detail {
namespace cuda {

// Stream-ordered scratch from attnmix's pool, released on the same stream when it goes out of
// scope.
class stream_buffer {
 public:
  stream_buffer(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0)
      check(cudaMallocFromPoolAsync(&ptr_, bytes, current_device().scratch_pool, stream),
            "cudaMallocFromPoolAsync");
  }
  ~stream_buffer() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  stream_buffer(const stream_buffer&) = delete;
  stream_buffer& operator=(const stream_buffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// The longest sequence of a problem (attention_problem or linear_attention_problem).
template <class Problem>
index_t longest_sequence(const Problem& p) {
  index_t longest = 0;
  for (index_t n = 0; n < p.num_sequences; ++n) longest = std::max(longest, p.seq(n).length);
  return longest;
}

// Scratch bytes for the device copy of a problem's cu_seqlens: 0 for a dense batch, else padded
// to 256 so that what follows it stays aligned.
template <class Problem>
std::size_t offsets_bytes(const Problem& p) {
  if (p.cu_seqlens == nullptr) return 0;
  return (static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t) + 255) / 256 * 256;
}

// Copies cu_seqlens (validated host memory) to dst on `stream`; returns the device copy, or
// nullptr for a dense batch.
template <class Problem>
const std::int32_t* upload_offsets(unsigned char* dst, const Problem& p, cudaStream_t stream) {
  if (p.cu_seqlens == nullptr) return nullptr;
  check(cudaMemcpyAsync(dst, p.cu_seqlens,
                        static_cast<std::size_t>(p.num_sequences + 1) * sizeof(std::int32_t),
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(cu_seqlens)");
  return reinterpret_cast<const std::int32_t*>(dst);
}

// What every CUDA launch relies on: head dims up to what the `kernels` hold on chip, and at most
// 65535 sequences (a grid's y / z extent).
template <class Problem>
void check_launch_sizes(const std::string& fn, const Problem& p, index_t max_dim,
                        const char* kernels) {
  require(p.head_dim <= max_dim, fn, "q", "has head dim D = ", p.head_dim, " but the CUDA ",
          kernels, " support D <= ", max_dim);
  require(p.value_dim <= max_dim, fn, "v", "has head dim Dv = ", p.value_dim, " but the CUDA ",
          kernels, " support Dv <= ", max_dim);
  require(p.num_sequences <= 65535, fn, "cu_seqlens", "holds ", p.num_sequences,
          " sequences but the CUDA backend supports at most 65535");
}

// True when `elems` consecutive elements of `elem_bytes` at every (batch, token, head) start
// can be moved as one aligned vector.
inline bool aligned_for_vectors(const void* p, index_t s0, index_t s1, index_t s2, int elems,
                                int elem_bytes = 2) {
  return reinterpret_cast<std::uintptr_t>(p) % (elem_bytes * elems) == 0 && s0 % elems == 0 &&
         s1 % elems == 0 && s2 % elems == 0;
}

template <class Dev, int D, int Dv>
void launch_mma(const attention_kernel_params& kp, index_t max_len, index_t sequences,
                cudaStream_t stream) {
  // One 16-row tile per warp: two (m_tiles = 2) measured the same on an H200 at D = 64 and
  // need 255 registers.
  constexpr int warps = 4, m_tiles = 1, bc = 64;
  using tile = mma_tile<D, Dv, warps, m_tiles, bc>;
  auto kernel = attention_mma_kernel<Dev, D, Dv, warps, m_tiles, bc>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  // A 1-D grid of attention_work items, row tiles first.
  const index_t row_tiles = (max_len + tile::br - 1) / tile::br;
  const dim3 grid(static_cast<unsigned>(row_tiles * kp.q_heads * sequences));
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp, static_cast<int>(row_tiles));
}

// Hopper: 128-key tiles, 3 stages, WGs consumer warpgroups of 64 query rows each.
template <class Dev, int D, int Dv, int WGs>
void launch_wgmma(const attention_kernel_params& kp, index_t max_len, index_t sequences,
                  cudaStream_t stream) {
  using tile = wgmma_tile<D, Dv, WGs, 128, 3>;
  auto kernel = attention_wgmma_kernel<Dev, D, Dv, WGs, 128, 3>;
  allow_dynamic_smem(kernel, tile::smem_bytes);
  // Persistent: one CTA an SM walks the (row tile, head, sequence) items.
  const index_t row_tiles = (max_len + tile::br - 1) / tile::br;
  const index_t items = row_tiles * kp.q_heads * sequences;
  const dim3 grid(static_cast<unsigned>(std::min<index_t>(items, current_device().sms)));
  check(cudaMemsetAsync(kp.work_counter, 0, sizeof(int), stream), "cudaMemsetAsync");
  kernel<<<grid, tile::threads, tile::smem_bytes, stream>>>(kp, static_cast<int>(row_tiles),
                                                            static_cast<int>(items));
}

// Whether a call may take the Hopper (wgmma) softmax-family and PaTH kernels: on Hopper, unless
// the portable kernels were asked for, and with a positive scale (those kernels take a row's
// maximum over the raw scores and fold the scale into the exponent; PaTH's gate bias is the gate
// over the scale).
inline bool hopper_kernels_apply(const attention_problem& p, const backend::cuda& be) {
  return !be.portable && current_device().hopper && p.scale > 0;
}

// The tensor-core kernel for D x Dv: wgmma on Hopper, mma.sync elsewhere (or when asked). At
// D = Dv = 64 three consumer warpgroups hide more latency than two (measured 1-12 % faster on an
// H200); larger dims need the registers of two.
template <class Dev, int D, int Dv>
void launch_tensor_cores(const attention_kernel_params& kp, index_t max_len, index_t sequences,
                         bool hopper, cudaStream_t stream) {
  if (!hopper) return launch_mma<Dev, D, Dv>(kp, max_len, sequences, stream);
  launch_wgmma<Dev, D, Dv, (D == 64 && Dv == 64 ? 3 : 2)>(kp, max_len, sequences, stream);
}

template <class Dev, int MaxChunks>
void launch_simt(const attention_kernel_params& kp, index_t max_len, index_t sequences,
                 cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((max_len + 3) / 4), static_cast<unsigned>(kp.q_heads),
                  static_cast<unsigned>(sequences));
  attention_simt_kernel<Dev, MaxChunks><<<grid, 128, 0, stream>>>(kp);
}

// Scratch of a softmax-family call: the cu_seqlens copy, with a gate its cumsum G and G's part
// sums, then the work counter of the persistent kernels; each part padded to 256 bytes.
struct attention_scratch_layout {
  std::size_t gate = 0, part_sums = 0, counter = 0, bytes = 0;  // offsets, then the total
  index_t gate_parts = 1;  // parts of gate_part tokens of the longest sequence
  attention_scratch_layout(const attention_problem& p, bool gated, index_t max_len) {
    auto padded = [](std::size_t n) {
      return (n + 255) / 256 * 256;
    };
    gate_parts = std::max<index_t>(1, (max_len + gate_part - 1) / gate_part);
    gate = offsets_bytes(p);
    part_sums =
        gate +
        (gated ? padded(static_cast<std::size_t>(p.batch * p.tokens * p.q_heads) * sizeof(double))
               : 0);
    counter = part_sums +
              (gated ? padded(static_cast<std::size_t>(p.num_sequences * gate_parts * p.q_heads) *
                              sizeof(double))
                     : 0);
    bytes = counter + 256;
  }
};

// Everything a softmax-family kernel reads, set up on `stream`: the kernel parameters, the
// device copy of cu_seqlens and, with a gate, its cumsum G in double (gate_coef: the factor of
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
    if (!a.g.has_value()) return;
    auto* G = reinterpret_cast<double*>(scratch.get() + layout.gate);
    auto* part_sums = reinterpret_cast<double*>(scratch.get() + layout.part_sums);
    kp.gate_cumsum = G;
    kp.gate_coef_log2 = static_cast<float>(gate_coef * log2e);
    kp.gate_bias_coef = p.scale > 0 ? static_cast<float>(-gate_coef / p.scale) : 0.f;
    const dim3 grid(static_cast<unsigned>(layout.gate_parts),
                    static_cast<unsigned>((p.q_heads + 31) / 32),
                    static_cast<unsigned>(p.num_sequences));
    gate_part_sum_kernel<<<grid, gate_part, 0, stream>>>(a.g.data(), a.g.stride(0), a.g.stride(1),
                                                         a.g.stride(2), kp, part_sums);
    check(cudaGetLastError(), "gate_part_sum_kernel launch");
    gate_cumsum_kernel<<<grid, gate_part, 0, stream>>>(a.g.data(), a.g.stride(0), a.g.stride(1),
                                                       a.g.stride(2), kp, part_sums, G);
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
  const bool aligned =
      aligned_for_vectors(a.q.data(), a.q.stride(0), a.q.stride(1), a.q.stride(2), 8) &&
      aligned_for_vectors(a.k.data(), a.k.stride(0), a.k.stride(1), a.k.stride(2), 8) &&
      aligned_for_vectors(a.v.data(), a.v.stride(0), a.v.stride(1), a.v.stride(2), 8) &&
      aligned_for_vectors(a.out.data(), a.out.stride(0), a.out.stride(1), a.out.stride(2), 2);
  const index_t D = p.head_dim, Dv = p.value_dim;
  bool launched = false;
  if constexpr (tensor_cores) {
    const bool hopper = hopper_kernels_apply(p, be);
    if (aligned) {
      launched = true;
      if (D == 64 && Dv == 64)
        launch_tensor_cores<Dev, 64, 64>(kp, max_len, p.num_sequences, hopper, stream);
      else if (D == 128 && Dv == 128)
        launch_tensor_cores<Dev, 128, 128>(kp, max_len, p.num_sequences, hopper, stream);
      else if (D == 64 && Dv == 128)
        launch_tensor_cores<Dev, 64, 128>(kp, max_len, p.num_sequences, hopper, stream);
      else if (D == 128 && Dv == 64)
        launch_tensor_cores<Dev, 128, 64>(kp, max_len, p.num_sequences, hopper, stream);
      else
        launched = false;
    }
  }
  if (!launched) {
    const index_t widest = std::max(D, Dv);
    if (widest <= 64)
      launch_simt<Dev, 2>(kp, max_len, p.num_sequences, stream);
    else if (widest <= 128)
      launch_simt<Dev, 4>(kp, max_len, p.num_sequences, stream);
    else
      launch_simt<Dev, 8>(kp, max_len, p.num_sequences, stream);
  }
  check(cudaGetLastError(), "attention kernel launch");
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
