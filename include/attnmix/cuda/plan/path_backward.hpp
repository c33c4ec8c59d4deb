#pragma once
// The plan of the PaTH / PaTH-FoX backward (kernels/path_backward.cuh): how many slices each
// (sequence, KV head) is cut into, the grids, the shared memory of the two big kernels, and the
// scratch (chunk data, per-slice sums, gate sums) with its offsets. Pure C++: unit-tested without
// a GPU (tests/plan/).

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attnmix/config.hpp"
#include "attnmix/cuda/kernels/shapes.hpp"
#include "attnmix/cuda/plan/device_properties.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/path.hpp"
#include "attnmix/cuda/plan/scratch.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

constexpr int path_backward_threads = 256;
constexpr int path_backward_max_slices = 8;

// Which query and chunk kernels run, all with the same grids: the query and chunk kernels on
// tensor cores (kernels/sm80_path_backward.cuh: 16-bit inputs, D = Dv = 64, sm_80 and later; with
// their chunk transitions and super-chunks, and the scratch for them); or the register-blocked
// ones on CUDA cores in float (kernels/path_backward_tiled.cuh: every dtype, head dims up to 128,
// any GPU). `automatic` lets the plan choose: the first that applies.
enum class path_backward_kernel { automatic, tiled, mma };

// A process-wide override read by the launcher (tests run both kernels on the same inputs);
// automatic unless set. Not synchronised: set it only while no backward is being launched.
inline path_backward_kernel& path_backward_kernel_override() {
  static path_backward_kernel k = path_backward_kernel::automatic;
  return k;
}

// Shared memory (floats) of the CUDA-core query kernel: Qs, dQs, R, Rbar (C x (D+1)); X, S, dZ,
// dX, Tmp (C x (C+1)); lse, delta, gate, reset (C each).
inline std::size_t path_backward_query_smem(index_t D) {
  constexpr std::size_t C = path_chunk;
  return sizeof(float) * (4 * C * std::size_t(D + 1) + 5 * C * (C + 1) + 4 * C);
}
// The CUDA-core chunk kernel keeps no dK and puts Lbar in dK~'s tile: dK~ then Lbar (C x
// max(D+1, C+1)), dW, dU (C x (D+1)); dM, WW, XK (C x (C+1)); beta (C). Two CTAs a
// multiprocessor at D = 64.
inline std::size_t path_backward_chunk_tiled_smem(index_t D) {
  constexpr std::size_t C = path_chunk;
  const std::size_t first = C * std::max(std::size_t(D + 1), C + 1);
  return sizeof(float) * (first + 2 * C * std::size_t(D + 1) + 3 * C * (C + 1) + C);
}

// Scratch offsets (bytes, each part 256-byte aligned) beyond the forward's chunk data.
// rows = B * H * tokens (rows of the [B, H, tokens, .] layout); per slice: dK~, dW, dU, the scan
// states and their dZ K~ ([rows, D] each) and dv ([rows, Dv]); once: the diagonal tiles' dk
// ([rows, D]) and dM ([rows, C]); the gate cumsum G (double), its resets (int32) and the
// per-slice dG (double), each [B, tokens, HQ]. The tensor-core query kernel adds the chunks'
// transitions N = W^T U (once) and their gradients dP (per slice), D x D at each chunk's rows
// of a [rows, D] part; its super-chunks' keys K^ and products I - Pi (once) and their
// gradients (per slice), [rows, D] parts too (Pi at the rows of chunk s for super-chunk s).
struct path_backward_layout {
  std::size_t dkt = 0, dw = 0, du = 0, states = 0, e = 0, dv = 0;  // slice 0; slices follow
  std::size_t slice_d = 0, slice_dv = 0;  // bytes between slices of a [rows, D] / [rows, Dv] part
  std::size_t dk = 0, dm = 0, gate = 0, reset = 0, dgate = 0, slice_gate = 0;
  // Tensor-core query kernel only (else 0).
  std::size_t trans = 0, dtrans = 0, khat = 0, pis = 0, dkhat = 0, dpis = 0;
  std::size_t slice_pi = 0;  // bytes between slices' dPi (rows / super + C rows of D)
  int own_copies = 0;        // copies of dK~, dW, dU (and dP): 1 with the tensor-core kernels
  std::size_t zeroed = 0, zeroed_bytes = 0;  // the sums that start at 0: one contiguous range
  std::size_t bytes = 0;
};

// The tensor-core query kernel's shapes: 16-bit inputs, D = Dv = 64, sm_80 and later.
inline bool path_backward_mma_applies(const path_shape& s, const device_properties& d) {
  return s.sixteen_bit && s.head_dim == 64 && s.value_dim == 64 && d.cc_major >= 8 &&
         std::size_t(path_bwd_mma_layout::smem) <= d.smem_per_block_optin;
}

struct path_backward_plan {
  int slices = 1;
  // Never automatic.
  path_backward_kernel query_kernel = path_backward_kernel::tiled;
  launch_grid query_grid;  // (slice, KV head, sequence)
  launch_grid chunk_grid;  // (chunk, KV head, sequence)
  launch_grid super_grid;  // (super-chunk, KV head, sequence): the tensor-core kernel's
  launch_grid gate_grid;   // (query-head blocks of path_gate_warps, sequence)
  std::size_t query_smem = 0, chunk_smem = 0;
  bool fits = false;  // both kernels' shared memory fits the device
  path_plan forward;  // its preparation kernel and chunk data (float)
  path_backward_layout layout;
  std::size_t scratch_bytes = 0;  // the chunk data plus the layout
};

// Slices: (sequence, KV head) pairs are few when B * H is small; cut each into up to
// path_backward_max_slices ranges of query chunks so that the CTAs cover the SMs twice.
// The tiled kernels take every shape; the tensor-core query kernel where it applies. `automatic`
// takes the fastest that applies; `force` picks (mma where it does not apply: the tiled ones).
inline path_backward_plan plan_path_backward(
    const path_shape& s, bool gated, const device_properties& d,
    path_backward_kernel force = path_backward_kernel::automatic) {
  path_backward_plan p;
  const bool mma = path_backward_mma_applies(s, d);
  p.query_kernel = force != path_backward_kernel::tiled && mma ? path_backward_kernel::mma
                                                               : path_backward_kernel::tiled;
  path_shape fs = s;
  fs.sixteen_bit = false;  // the float chunk data of the portable forward
  p.forward = plan_path(fs, d);
  const index_t pairs = std::max<index_t>(1, s.sequences * s.kv_heads);
  const index_t want = std::max<index_t>(1, 2 * index_t(d.sms));
  p.slices = int(std::clamp<index_t>((want + pairs - 1) / pairs, 1, path_backward_max_slices));
  const index_t chunks = (s.max_len + path_chunk - 1) / path_chunk;
  p.slices = int(std::min<index_t>(p.slices, std::max<index_t>(1, chunks / 4)));
  p.query_grid = {unsigned(p.slices), unsigned(s.kv_heads), unsigned(s.sequences)};
  p.chunk_grid = {unsigned(std::max<index_t>(chunks, 1)), unsigned(s.kv_heads),
                  unsigned(s.sequences)};
  p.super_grid = {unsigned(std::max<index_t>(
                      (chunks + path_bwd_mma_layout::super - 1) / path_bwd_mma_layout::super, 1)),
                  unsigned(s.kv_heads), unsigned(s.sequences)};
  p.gate_grid = {unsigned((s.q_heads + path_gate_warps - 1) / path_gate_warps),
                 unsigned(s.sequences)};
  p.query_smem = p.query_kernel == path_backward_kernel::mma
                     ? std::size_t(path_bwd_mma_layout::smem)
                     : path_backward_query_smem(s.head_dim);
  p.chunk_smem = p.query_kernel == path_backward_kernel::mma
                     ? std::size_t(path_bwd_mma_layout::chunk_smem)
                     : path_backward_chunk_tiled_smem(s.head_dim);
  p.fits = std::max(p.query_smem, p.chunk_smem) <= d.smem_per_block_optin;

  const auto rows = static_cast<std::size_t>(s.batch * s.kv_heads * s.tokens);
  const auto S = static_cast<std::size_t>(p.slices);
  const auto D = static_cast<std::size_t>(s.head_dim), Dv = static_cast<std::size_t>(s.value_dim);
  const auto gate_elems = static_cast<std::size_t>(s.batch * s.tokens * s.q_heads);
  path_backward_layout& l = p.layout;
  l.slice_d = padded_bytes(rows * D * sizeof(float));
  l.slice_dv = padded_bytes(rows * Dv * sizeof(float));
  std::size_t at = padded_bytes(p.forward.chunks.bytes);
  // Zeroed: dK~, dW, dU, dv of every slice, dk, dM and the per-slice dG. With the tensor-core
  // kernels, slices cut at super-chunks: one copy of dK~, dW, dU and dP (one slice writes each
  // chunk's rows).
  const bool mma_sums = p.query_kernel == path_backward_kernel::mma;
  l.own_copies = mma_sums ? 1 : p.slices;
  const auto So = static_cast<std::size_t>(l.own_copies);
  l.slice_pi = padded_bytes((rows / path_bwd_mma_layout::super + std::size_t(path_chunk)) * D *
                            sizeof(float));
  l.zeroed = at;
  l.dkt = at, at += So * l.slice_d;
  l.dw = at, at += So * l.slice_d;
  l.du = at, at += So * l.slice_d;
  l.dv = at, at += S * l.slice_dv;
  l.dk = at, at += padded_bytes(rows * D * sizeof(float));
  l.dm = at, at += padded_bytes(rows * std::size_t(path_chunk) * sizeof(float));
  if (mma_sums) {
    l.dtrans = at, at += l.slice_d;
    l.dkhat = at, at += S * l.slice_d;
    l.dpis = at, at += S * l.slice_pi;
  }
  if (gated) {
    l.slice_gate = padded_bytes(gate_elems * sizeof(double));
    l.dgate = at, at += S * l.slice_gate;
  }
  l.zeroed_bytes = at - l.zeroed;
  l.states = at, at += S * l.slice_d;
  l.e = at, at += S * l.slice_d;
  if (mma_sums) {
    l.trans = at, at += l.slice_d;
    l.khat = at, at += l.slice_d;
    l.pis = at, at += l.slice_pi;
  }
  if (gated) {
    l.gate = at, at += padded_bytes(gate_elems * sizeof(double));
    l.reset = at, at += padded_bytes(gate_elems * sizeof(std::int32_t));
  }
  l.bytes = at;
  p.scratch_bytes = at;
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
