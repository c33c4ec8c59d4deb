#pragma once
// The blocked, flash-style softmax-attention loop of the CPU backend: each task is one query
// tile of one (sequence, query head); it walks the key tiles with an online softmax, using
// Eigen products per tile, and never forms more than a block_q x block_k score tile.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/parallel.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// Forget-gate bias z_ij += coef * (G_i - G_j). G is the inclusive cumsum of g over the
// sequence, kept in double: float cumsums of long sequences lose the small differences that
// matter. cumsum[t * stride] is G at token t of this (sequence, query head).
// reset[t * stride] (nullptr: no hard resets) is the first key token t may see (see
// gate_cumsum in cpu/fox.hpp).
struct gate_bias {
  const double* cumsum = nullptr;
  index_t stride = 0;
  double coef = 0;
  const index_t* reset = nullptr;
};

// Keys before each row's last hard reset get weight 0: scores of columns j0 + c < reset[i]
// become -inf. The diagonal key is never cut, so every row keeps a finite maximum.
template <class M>
void cut_at_resets(M& s, const gate_bias& gate, index_t i0, index_t j0) {
  if (gate.reset == nullptr) return;
  for (index_t r = 0; r < s.rows(); ++r) {
    const index_t cut = std::clamp<index_t>(gate.reset[(i0 + r) * gate.stride] - j0, 0, s.cols());
    s.row(r).head(cut).setConstant(-std::numeric_limits<typename M::Scalar>::infinity());
  }
}

// One (sequence, query head). Pointers address token 0 of the sequence in that head (of its
// keys for k and v). Query row i sits at key position i + key_offset (bottom-right aligned:
// 0 when keys and queries have the same length); the gate is indexed by key position.
template <class T>
struct flash_head {
  const T* q;
  index_t q_stride;
  const T* k;
  index_t k_stride;
  const T* v;
  index_t v_stride;
  T* out;
  index_t out_stride;
  T* lse;  // nullptr when not requested
  index_t lse_stride;
  index_t length, key_length, key_offset, head_dim, value_dim;
  T scale;
  index_t window;  // 0: none
  bool causal;
  gate_bias gate;  // gate.cumsum == nullptr: no gate
};

// Per-thread scratch: O(block_q * (D + block_k + Dv)) elements.
template <class T>
struct flash_scratch {
  matrix<T> q, s, acc;
  column<T> m, l, m_new, shift, alpha, gi, gj;
};

// Rows [i0, i1) of one head.
template <class T>
void flash_tile(const flash_head<T>& h, index_t i0, index_t i1, index_t block_k,
                flash_scratch<T>& ws) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const index_t rows = i1 - i0, W = h.window, L = h.key_length;
  const index_t p0 = i0 + h.key_offset, p1 = i1 + h.key_offset;  // key positions of the rows
  const index_t j_lo = W > 0 ? std::max<index_t>(0, p0 - W + 1) : 0;
  const index_t j_hi = h.causal ? p1 : (W > 0 ? std::min(L, p1 + W - 1) : L);
  const bool gated = h.gate.cumsum != nullptr;
  // Gate values relative to G at p0, so that what is rounded to T is small near the diagonal.
  const double g_ref = gated ? h.gate.cumsum[p0 * h.gate.stride] : 0.0;

  ws.q.noalias() = h.scale * rows_of(h.q + i0 * h.q_stride, rows, h.head_dim, h.q_stride);
  ws.m.setConstant(rows, ninf);
  ws.l.setZero(rows);
  ws.acc.setZero(rows, h.value_dim);
  if (gated) {
    ws.gi.resize(rows);
    for (index_t r = 0; r < rows; ++r)
      ws.gi(r) = static_cast<T>(h.gate.coef * (h.gate.cumsum[(p0 + r) * h.gate.stride] - g_ref));
  }

  for (index_t j0 = j_lo; j0 < j_hi; j0 += block_k) {
    const index_t j1 = std::min(j0 + block_k, j_hi), cols = j1 - j0;
    ws.s.noalias() =
        ws.q * rows_of(h.k + j0 * h.k_stride, cols, h.head_dim, h.k_stride).transpose();
    auto S = ws.s.array();
    if (gated) {
      ws.gj.resize(cols);
      for (index_t c = 0; c < cols; ++c)
        ws.gj(c) = static_cast<T>(h.gate.coef * (h.gate.cumsum[(j0 + c) * h.gate.stride] - g_ref));
      S.colwise() += ws.gi;
      S.rowwise() -= ws.gj.transpose();
      cut_at_resets(ws.s, h.gate, p0, j0);
    }
    // Mask only the tiles that cross the diagonal or a window edge.
    const bool cut_right = h.causal ? (j1 - 1 > p0) : (W > 0 && (j1 - 1) - p0 >= W);
    const bool cut_left = W > 0 && (p1 - 1) - j0 >= W;
    if (cut_right || cut_left) {
      for (index_t r = 0; r < rows; ++r) {
        const index_t i = p0 + r;
        const index_t lo = W > 0 ? i - W + 1 : j0;
        const index_t hi = h.causal ? i : (W > 0 ? i + W - 1 : j1 - 1);
        const index_t c_lo = std::clamp<index_t>(lo - j0, 0, cols);
        const index_t c_hi = std::clamp<index_t>(hi - j0 + 1, c_lo, cols);
        ws.s.row(r).head(c_lo).setConstant(ninf);
        ws.s.row(r).tail(cols - c_hi).setConstant(ninf);
      }
    }
    // Online softmax. A row with no visible key yet keeps m = -inf; shift by 0 then, which
    // avoids -inf - -inf and gives it zero weight.
    ws.m_new = ws.m.max(S.rowwise().maxCoeff());
    ws.shift = (ws.m_new == ninf).select(T(0), ws.m_new);
    S.colwise() -= ws.shift;
    S = S.exp();
    ws.alpha = (ws.m - ws.shift).exp();
    ws.l = ws.alpha * ws.l + S.rowwise().sum();
    ws.acc.array().colwise() *= ws.alpha;
    ws.acc.noalias() += ws.s * rows_of(h.v + j0 * h.v_stride, cols, h.value_dim, h.v_stride);
    ws.m = ws.m_new;
  }

  // Every row sees at least the key at its own position (bidirectional: some key), so l > 0.
  rows_of(h.out + i0 * h.out_stride, rows, h.value_dim, h.out_stride) =
      (ws.acc.array().colwise() / ws.l).matrix();
  if (h.lse != nullptr)
    for (index_t r = 0; r < rows; ++r) h.lse[(i0 + r) * h.lse_stride] = ws.m(r) + std::log(ws.l(r));
}

// Runs flash_tile over every query tile of every (sequence, query head). `cumsum` is the
// gate cumsum laid out like g ([key_batch, Tk, HQ], contiguous), or nullptr without a gate.
template <class Policy, class T>
void flash_forward(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be,
                   const double* cumsum = nullptr, double coef = 0,
                   const index_t* reset = nullptr) {
  constexpr index_t bq = Policy::block_q, bk = Policy::block_k;
  static_assert(bq >= 1 && bk >= 1, "attnmix: block_q and block_k must be positive");
  constexpr bool causal = Policy::mask == mask_type::causal;

  struct task {
    index_t seq, head, i0, cost;
  };
  std::vector<task> tasks;
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const sequence s = p.seq(n);
    for (index_t hq = 0; hq < p.q_heads; ++hq)
      for (index_t i0 = 0; i0 < s.length; i0 += bq) {
        const index_t i1 = std::min(i0 + bq, s.length);
        index_t keys = causal ? i1 + p.key_offset(n) : p.key_seq(n).length;
        if (p.window > 0) keys = std::min(keys, p.window + (i1 - i0) + (causal ? 0 : p.window));
        tasks.push_back({n, hq, i0, keys});
      }
  }
  // Longest tiles first: dynamic scheduling then balances the causal triangle.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const task& x, const task& y) { return x.cost > y.cost; });

  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<flash_scratch<T>> scratch(static_cast<std::size_t>(workers));
  parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t t, int worker) {
    const task& tk = tasks[static_cast<std::size_t>(t)];
    const sequence s = p.seq(tk.seq), ks = p.key_seq(tk.seq);
    const index_t hkv = tk.head / p.group();
    flash_head<T> h{&a.q(s.batch, s.start, tk.head, 0),
                    a.q.stride(1),
                    &a.k(ks.batch, ks.start, hkv, 0),
                    a.k.stride(1),
                    &a.v(ks.batch, ks.start, hkv, 0),
                    a.v.stride(1),
                    &a.out(s.batch, s.start, tk.head, 0),
                    a.out.stride(1),
                    a.lse.has_value() ? &a.lse(s.batch, s.start, tk.head) : nullptr,
                    a.lse.has_value() ? a.lse.stride(1) : 0,
                    s.length,
                    ks.length,
                    ks.length - s.length,
                    p.head_dim,
                    p.value_dim,
                    static_cast<T>(p.scale),
                    p.window,
                    causal,
                    {}};
    if (cumsum != nullptr) {
      const index_t at = (ks.batch * p.key_tokens + ks.start) * p.q_heads + tk.head;
      h.gate = {cumsum + at, p.q_heads, coef, reset != nullptr ? reset + at : nullptr};
    }
    flash_tile(h, tk.i0, std::min(tk.i0 + bq, s.length), bk,
               scratch[static_cast<std::size_t>(worker)]);
  });
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
