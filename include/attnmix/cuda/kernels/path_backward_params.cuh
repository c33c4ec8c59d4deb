#pragma once
// The parameters of the PaTH / PaTH-FoX backward kernels (path_backward_tiled.cuh,
// sm80_path_backward.cuh, path_backward_gate.cuh) and what every variant's CTA derives from them:
// its slice of query chunks, its (sequence, KV head) rows and chunk data, a query head's rows.

#include <cstdint>

#include "attnmix/cuda/arch/types.cuh"
#include "attnmix/cuda/kernels/attention_params.cuh"
#include "attnmix/cuda/kernels/path_params.cuh"
#include "attnmix/cuda/kernels/shapes.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

struct path_backward_params {
  path_kernel_params kp;  // q, k, v, strides, sequences, w, beta, chunk data (float)
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  float* dw;
  float* dbeta;
  index_t out_stride[3], dout_stride[3], lse_stride[3], dq_stride[3], dk_stride[3], dv_stride[3],
      dw_stride[3], dbeta_stride[3];
  float scale;
  // The gate (nullptr without): G and reset [B, tokens, HQ] contiguous; coef: factor of G_i - G_j.
  const double* G;
  const std::int32_t* reset;
  double coef;
  double* dgate;       // slice 0's dG [B, tokens, HQ]; slices follow at slice_gate
  index_t slice_gate;  // elements between slices' dG
  int slices;
  // Sums ([B, H, tokens, .] rows): slice s of a [rows, D] part at + s * slice_d (elements).
  float *dkt, *dws, *dus, *states, *e, *dvs, *dk_diag, *dm;
  index_t slice_d, slice_dv;
  // dK~, dW, dU (and dP below): a copy a slice, slice_own elements apart. The tensor-core
  // kernels cut slices at super-chunks (slice_align chunks), so that only one slice writes each
  // chunk's rows of these: one copy (slice_own = 0). Else one a slice, as the other sums.
  int slice_align;
  index_t slice_own;
  // The tensor-core query kernel's chunk transitions: N = W^T U of each chunk (P = I - N), D x D
  // at the chunk's rows of a [rows, D] part, and the slices' sums of dP (same layout, per slice);
  // null for the other query kernels.
  float* trans;
  float* dtrans;
  // Its super-chunks (path_bwd_mma_layout::super chunks): the keys of each chunk transformed to
  // the end of their super-chunk, K^ [rows, D] (in two bfloat16 parts, each row's hi then lo in
  // its float row's bytes); each super-chunk's product as I - Pi (D x D at path_super_pi_row),
  // and the slices' sums of dK^ and dPi (slice_pi elements apart).
  float* khat;
  float* pis;
  float* dkhat;
  float* dpis;
  index_t slice_pi;
  bool v_vectors;  // v rows 16-byte aligned (the tensor-core query kernel copies them so)
};

// Row of the D x D Pi of the super-chunk whose first token is at row `first` of the [rows, .]
// layout: first / S. Walked super-chunks start more than S chunks apart (a chunk follows each),
// so their C rows there do not overlap; a part of rows / S + C rows holds them all.
__host__ __device__ inline index_t path_super_pi_row(index_t first) {
  return first / path_bwd_mma_layout::super;
}

// Query chunks [lo, hi) of slice s of a (sequence, KV head) of `chunks` chunks: the CPU's cut
// (cpu/detail/path_backward.hpp), where query chunk ci costs ci + 1 tiles, each cut moved to the
// nearest multiple of `align` chunks (a slice may then be empty).
__device__ inline void path_backward_slice(index_t chunks, int slices, int s, index_t& lo,
                                           index_t& hi, int align) {
  index_t count = chunks / 4 > 1 ? chunks / 4 : 1;
  count = count < slices ? count : slices;
  lo = hi = 0;
  if (s >= count) return;
  const double total = 0.5 * double(chunks) * double(chunks + 1);
  index_t at = 0;
  for (int k = 1; k <= s + 1; ++k) {
    index_t end = at;
    while (end < chunks &&
           (k == count || 0.5 * double(end) * double(end + 1) < total * double(k) / double(count)))
      ++end;
    end = k == count ? chunks : (end + align / 2) / align * align;
    if (end > chunks) end = chunks;
    lo = at, hi = end;
    at = end;
  }
}

// What a query kernel's CTA works on (slice blockIdx.x of KV head blockIdx.y of sequence
// blockIdx.z): its query chunks [lo, hi), the head's chunk data, w, k and v from the sequence's
// token 0, and the slice's sums there. `active` is false when the slice has no query chunk.
template <class T>
struct path_backward_cta {
  bool active = false;
  index_t batch = 0, start = 0, length = 0, lo = 0, hi = 0;
  const float *KT = nullptr, *UU = nullptr, *MM = nullptr;  // K~, U [., D]; M [., C]
  const float* W = nullptr;
  const T *K = nullptr, *V = nullptr;
  index_t ws1 = 0, ks1 = 0, vs1 = 0;  // row strides of W, K, V
  // Sums: the slice's dK~, dW, dU, scan states, e ([., D]), dv ([., Dv]); dk and dM of the
  // diagonal tiles.
  float *dkt = nullptr, *dws = nullptr, *dus = nullptr, *states = nullptr, *es = nullptr,
        *dvs = nullptr, *dkd = nullptr, *dm = nullptr;
  const float* NN = nullptr;  // chunk transitions N = W^T U (tensor-core kernel only)
  float* dP = nullptr;        // the slice's dP of each chunk transition (idem)
  const float *KH = nullptr, *PIS = nullptr;  // K^ and the super-chunks' I - Pi (idem)
  float *dKH = nullptr, *dPI = nullptr;       // the slice's dK^ and dPi (idem)
  index_t seq_row = 0;                        // the sequence's first row
  // Row offset (elements) of super-chunk s's Pi and dPi from PIS and dPI.
  __device__ index_t pi_at(index_t s) const {
    return path_super_pi_row(seq_row + s * path_bwd_mma_layout::super * path_chunk) *
           path_bwd_mma_layout::C;
  }

  __device__ explicit path_backward_cta(const path_backward_params& p) {
    constexpr int C = path_chunk;
    const path_kernel_params& kp = p.kp;
    const int slice = blockIdx.x, h = blockIdx.y;
    const index_t D = kp.a.head_dim, Dv = kp.a.value_dim;
    kp.a.sequence(blockIdx.z, batch, start, length);
    if (length <= 0) return;
    path_backward_slice((length + C - 1) / C, p.slices, slice, lo, hi, p.slice_align);
    if (lo >= hi) return;
    active = true;
    const index_t row0 = kp.row(batch, h, start);  // [B, H, tokens, .] row of token 0
    KT = static_cast<const float*>(kp.kt) + row0 * D;
    UU = static_cast<const float*>(kp.u) + row0 * D;
    MM = static_cast<const float*>(kp.m) + row0 * C;
    W = kp.w + batch * kp.w_stride[0] + start * kp.w_stride[1] + h * kp.w_stride[2];
    ws1 = kp.w_stride[1];
    K = static_cast<const T*>(kp.a.k) + batch * kp.a.k_stride[0] + start * kp.a.k_stride[1] +
        h * kp.a.k_stride[2];
    ks1 = kp.a.k_stride[1];
    V = static_cast<const T*>(kp.a.v) + batch * kp.a.v_stride[0] + start * kp.a.v_stride[1] +
        h * kp.a.v_stride[2];
    vs1 = kp.a.v_stride[1];
    dkt = p.dkt + slice * p.slice_own + row0 * D;
    dws = p.dws + slice * p.slice_own + row0 * D;
    dus = p.dus + slice * p.slice_own + row0 * D;
    states = p.states + slice * p.slice_d + row0 * D;
    es = p.e + slice * p.slice_d + row0 * D;
    dvs = p.dvs + slice * p.slice_dv + row0 * Dv;
    dkd = p.dk_diag + row0 * D;
    dm = p.dm + row0 * C;
    if (p.trans != nullptr) {
      NN = p.trans + row0 * D, dP = p.dtrans + slice * p.slice_own + row0 * D;
      KH = p.khat + row0 * D, PIS = p.pis;
      dKH = p.dkhat + slice * p.slice_d + row0 * D, dPI = p.dpis + slice * p.slice_pi;
      seq_row = row0;
    }
  }
};

// Query head hq's rows of the CTA's sequence from token 0: q, out, dout; and, with a gate, its
// cumsum G, last resets R and the slice's dG (null without).
template <class T>
struct path_backward_query_rows {
  const T *Q, *O, *dO;
  index_t qs1, os1, dos1;  // their row strides
  const double* G = nullptr;
  const std::int32_t* R = nullptr;
  double* dG = nullptr;

  __device__ path_backward_query_rows(const path_backward_params& p, const path_backward_cta<T>& b,
                                      int hq) {
    const attention_kernel_params& a = p.kp.a;
    Q = static_cast<const T*>(a.q) + b.batch * a.q_stride[0] + b.start * a.q_stride[1] +
        hq * a.q_stride[2];
    O = static_cast<const T*>(p.out) + b.batch * p.out_stride[0] + b.start * p.out_stride[1] +
        hq * p.out_stride[2];
    dO = static_cast<const T*>(p.dout) + b.batch * p.dout_stride[0] + b.start * p.dout_stride[1] +
         hq * p.dout_stride[2];
    qs1 = a.q_stride[1], os1 = p.out_stride[1], dos1 = p.dout_stride[1];
    const index_t gate_at = (b.batch * a.tokens + b.start) * a.q_heads + hq;  // token 0
    if (p.G != nullptr) G = p.G + gate_at;
    if (p.reset != nullptr) R = p.reset + gate_at;
    if (p.dgate != nullptr) dG = p.dgate + blockIdx.x * p.slice_gate + gate_at;
  }

  // The terms of query chunk c0's rows (n of them; C entries, 0 past n), by the CTA's threads:
  // delta = dO . O, lse, the gate terms coef (G - g_ref) and the last hard resets. No barrier.
  __device__ __forceinline__ void row_terms(const path_backward_params& p,
                                            const path_backward_cta<T>& b, int hq, index_t c0,
                                            int n, double g_ref, float* lse, float* delta,
                                            float* gi, int* reset) const {
    const int Dv = p.kp.a.value_dim;
    const index_t HQ = p.kp.a.q_heads;
    for (int a = threadIdx.x; a < path_chunk; a += blockDim.x) {
      float dl = 0.f, l = 0.f, gg = 0.f;
      int rs = 0;
      if (a < n) {
        for (int e = 0; e < Dv; ++e)
          dl += to_float(dO[(c0 + a) * dos1 + e]) * to_float(O[(c0 + a) * os1 + e]);
        l = p.lse[b.batch * p.lse_stride[0] + (b.start + c0 + a) * p.lse_stride[1] +
                  hq * p.lse_stride[2]];
        if (G != nullptr) gg = static_cast<float>(p.coef * (G[(c0 + a) * HQ] - g_ref));
        if (R != nullptr) rs = R[(c0 + a) * HQ];
      }
      delta[a] = dl, lse[a] = l, gi[a] = gg, reset[a] = rs;
    }
  }
};

// f(r, c) for every (r, c) of rows x cols, spread over the CTA.
template <class F>
__device__ __forceinline__ void for_tile(int rows, int cols, F&& f) {
  const int total = rows * cols;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) f(idx / cols, idx % cols);
}

// The shared memory of the CUDA-core query kernel (path_backward_tiled.cuh) as
// plan/path_backward.hpp's path_backward_query_smem, ld = D + 1, lc = C + 1 floats a row; and a
// query chunk's rows loaded into it.
struct path_backward_float_tiles {
  static constexpr int C = path_chunk, lc = C + 1;
  int ld;
  float* qs;     // scale * Q                        [C][ld]
  float* dqs;    // d Qs                             [C][ld]
  float* r;      // the running queries              [C][ld]
  float* rbar;   // their adjoint                    [C][ld]
  float* x;      // tril(Qs W^T)                     [C][lc]
  float* s;      // scores, then p                   [C][lc]
  float* dz;     // dZ (the tiled kernel: dO V^T first) [C][lc]
  float* dx;     // dX                               [C][lc]
  float* tmp;    // r W^T or rbar U^T                [C][lc]
  float* lse;    // [C]
  float* delta;  // [C]
  float* gi;     // [C]
  int* reset_i;  // [C] each row's last hard reset

  __device__ path_backward_float_tiles(float* smem, int D)
      : ld(D + 1),
        qs(smem),
        dqs(qs + C * ld),
        r(dqs + C * ld),
        rbar(r + C * ld),
        x(rbar + C * ld),
        s(x + C * lc),
        dz(s + C * lc),
        dx(dz + C * lc),
        tmp(dx + C * lc),
        lse(tmp + C * lc),
        delta(lse + C),
        gi(delta + C),
        reset_i(reinterpret_cast<int*>(gi + C)) {}

  // Query chunk c0 (n rows) of head hq: Qs, lse, delta, the rows' gate terms (relative to g_ref)
  // and their last resets; rows past n are 0. Ends with a barrier.
  template <class T>
  __device__ __forceinline__ void load_rows(const path_backward_params& p,
                                            const path_backward_cta<T>& cta,
                                            const path_backward_query_rows<T>& qr, int hq,
                                            index_t c0, int n, double g_ref) const {
    const int D = p.kp.a.head_dim;
    const float scale = p.scale;
    for_tile(C, D, [&](int a, int d) {
      qs[a * ld + d] = a < n ? scale * to_float(qr.Q[(c0 + a) * qr.qs1 + d]) : 0.f;
    });
    qr.row_terms(p, cta, hq, c0, n, g_ref, lse, delta, gi, reset_i);
    __syncthreads();
  }
};

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
