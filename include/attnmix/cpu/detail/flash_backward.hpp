#pragma once
// The blocked, FlashAttention-2-style backward of the softmax kinds on the CPU. P is recomputed
// per tile from the saved log-sum-exp, so nothing larger than a block_q x block_k tile is formed:
//   delta_i = dout_i . out_i
//   dS_ij   = P_ij (dout_i . v_j - delta_i)
//   dv_j   += P_ij dout_i,  dk_j += scale dS_ij q_i,  dq_i += scale dS_ij k_j
//   gate:   dG_i += coef rowsum_j(dS),  dG_j -= coef colsum_i(dS)
// A task is a run of key tiles of one (sequence, KV head), with the group's query heads inside:
// it owns dk and dv of its keys outright. dq and dG of a row collect from every key, so the first
// run of a head accumulates them into the output and the others into their own buffers, added in
// a fixed order afterwards. How a head is split depends on the problem only, so the result has
// the same bits on every run and for every thread count.
// Keys may have other lengths than the queries (cross-attention, a prompt against a longer
// prefix): query row i sits at key position i + key_offset, as in the forward, and masks and the
// gate use that position.

#include <algorithm>
#include <cstddef>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/flash.hpp"
#include "attnmix/cpu/detail/parallel.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// Runs of key tiles per head are sized so that a problem has about this many tasks; a head is
// split into at most max_key_runs runs (each but the first costs a dq-sized buffer) of at least
// two key tiles.
inline constexpr index_t backward_task_target = 64;
inline constexpr index_t max_key_runs = 4;

// Per-thread scratch: O(block_q * block_k + block_k * (D + Dv)) elements.
template <class T>
struct flash_backward_scratch {
  matrix<T> s, dp, ks, dk, dv;
  column<T> lse, delta, rowsum, colsum;
  std::vector<double> gi, gj;
};

// The query rows [lo, hi) of a sequence of `length` queries, the first at key position `offset`,
// that see some key of [j0, j1) (possibly none: lo == hi).
struct row_range {
  index_t lo, hi;
};
inline row_range rows_seeing(index_t j0, index_t j1, index_t length, index_t offset, index_t window,
                             bool causal) {
  const index_t lo = causal ? j0 : (window > 0 ? j0 - window + 1 : offset);
  const index_t hi = window > 0 ? j1 + window - 1 : offset + length;
  const index_t r_lo = std::clamp<index_t>(lo - offset, 0, length);
  return {r_lo, std::clamp<index_t>(hi - offset, r_lo, length)};
}

// The gradients of one (sequence, KV head) restricted to its keys [k0, k1). Pointers address
// token 0 of the sequence (k, v, dk, dv, dG and the gate: of its keys) and, for q, out, dout and
// lse, the group's first query head; the next head is *_head elements on.
template <class T>
struct flash_grad_task {
  const T *q, *k, *v, *out, *dout, *lse;
  index_t q_stride, k_stride, v_stride, out_stride, dout_stride, lse_stride;
  index_t q_head, out_head, dout_head, lse_head;
  T *dk, *dv;
  index_t dk_stride, dv_stride;
  // dq of head g, row i: dq[g * dq_head + (i - row0) * dq_stride], rows [zero_lo, zero_hi) zeroed
  // first. dG of head g, key position j: dG[g * dG_head + (j - pos0) * dG_stride], positions
  // [pos0, pos1) zeroed first (no gate: unused).
  T* dq;
  index_t dq_head, dq_stride;
  double* dG;
  index_t dG_head, dG_stride;
  index_t row0, zero_lo, zero_hi, pos0, pos1;
  index_t group, length, key_offset, head_dim, value_dim, k0, k1, window;
  T scale;
  bool causal;
  gate_bias gate;  // of the first query head, the next one element on; cumsum == nullptr: no gate

  T* dq_at(index_t g, index_t i) const { return dq + g * dq_head + (i - row0) * dq_stride; }
  double& dG_at(index_t g, index_t j) const { return dG[g * dG_head + (j - pos0) * dG_stride]; }
};

// dk and dv of keys [k0, k1); dq and dG contributions of those keys added to the zeroed rows.
template <class T>
void flash_backward_task(const flash_grad_task<T>& t, index_t block_q, index_t block_k,
                         flash_backward_scratch<T>& ws) {
  const index_t L = t.length, off = t.key_offset, W = t.window, D = t.head_dim, Dv = t.value_dim;
  const bool gated = t.gate.cumsum != nullptr;
  const row_range all = rows_seeing(t.k0, t.k1, L, off, W, t.causal);
  const index_t n_rows = all.hi - all.lo;

  // delta of every row the task reads, per query head.
  std::vector<T> delta(static_cast<std::size_t>(t.group * n_rows));
  for (index_t g = 0; g < t.group; ++g) {
    const auto o =
        rows_of(t.out + g * t.out_head + all.lo * t.out_stride, n_rows, Dv, t.out_stride);
    const auto dout =
        rows_of(t.dout + g * t.dout_head + all.lo * t.dout_stride, n_rows, Dv, t.dout_stride);
    Eigen::Map<column<T>>(delta.data() + g * n_rows, n_rows) =
        (o.array() * dout.array()).rowwise().sum();
    if (t.zero_hi > t.zero_lo)
      rows_of(t.dq_at(g, t.zero_lo), t.zero_hi - t.zero_lo, D, t.dq_stride).setZero();
    if (gated)
      for (index_t j = t.pos0; j < t.pos1; ++j) t.dG_at(g, j) = 0;
  }

  for (index_t j0 = t.k0; j0 < t.k1; j0 += block_k) {
    const index_t j1 = std::min(j0 + block_k, t.k1), cols = j1 - j0;
    const row_range rr = rows_seeing(j0, j1, L, off, W, t.causal);
    // Scaled keys serve both the scores and dq = scale dS k.
    ws.ks.noalias() = t.scale * rows_of(t.k + j0 * t.k_stride, cols, D, t.k_stride);
    const auto vj = rows_of(t.v + j0 * t.v_stride, cols, Dv, t.v_stride);
    ws.dk.setZero(cols, D);
    ws.dv.setZero(cols, Dv);

    for (index_t g = 0; g < t.group; ++g) {
      const T* q = t.q + g * t.q_head;
      const T* dout = t.dout + g * t.dout_head;
      gate_bias gate = t.gate;
      if (gated) {
        gate.cumsum += g;
        if (gate.reset != nullptr) gate.reset += g;
        ws.gj.resize(static_cast<std::size_t>(cols));
        for (index_t c = 0; c < cols; ++c)
          ws.gj[c] = gate.coef * gate.cumsum[(j0 + c) * gate.stride];
        ws.colsum.setZero(cols);
      }

      for (index_t i0 = rr.lo; i0 < rr.hi; i0 += block_q) {
        const index_t i1 = std::min(i0 + block_q, rr.hi), rows = i1 - i0;
        const index_t p0 = i0 + off, p1 = i1 + off;  // key positions of the rows
        // Resets only move forward: once a tile's first row is cut off these keys, so is the rest.
        if (gate.reset != nullptr && gate.reset[p0 * gate.stride] >= j1) break;
        const auto qi = rows_of(q + i0 * t.q_stride, rows, D, t.q_stride);
        const auto doi = rows_of(dout + i0 * t.dout_stride, rows, Dv, t.dout_stride);
        ws.lse.resize(rows);
        for (index_t r = 0; r < rows; ++r)
          ws.lse(r) = t.lse[g * t.lse_head + (i0 + r) * t.lse_stride];

        // P = exp(z - lse), z the forward's logits.
        ws.s.noalias() = qi * ws.ks.transpose();
        if (gated) {
          // coef (G_i - G_j) - lse_i in double, rounded once: G drifts far from 0 over a long
          // sequence while the differences that matter stay small.
          ws.gi.resize(static_cast<std::size_t>(rows));
          for (index_t r = 0; r < rows; ++r)
            ws.gi[r] = gate.coef * gate.cumsum[(p0 + r) * gate.stride] - double(ws.lse(r));
          for (index_t r = 0; r < rows; ++r) {
            T* row = ws.s.row(r).data();
            const double a = ws.gi[r];
            for (index_t c = 0; c < cols; ++c) row[c] += static_cast<T>(a - ws.gj[c]);
          }
        } else {
          ws.s.array().colwise() -= ws.lse;
        }
        // Masked weights are set to 0 after the exponential: Eigen's exp clamps its argument,
        // so exp(-inf) is a denormal rather than 0, and masked keys must get exactly 0.
        ws.s.array() = ws.s.array().exp();
        if (gate.reset != nullptr)
          for (index_t r = 0; r < rows; ++r)
            ws.s.row(r)
                .head(std::clamp<index_t>(gate.reset[(p0 + r) * gate.stride] - j0, 0, cols))
                .setZero();
        const bool cut_right = t.causal ? (j1 - 1 > p0) : (W > 0 && (j1 - 1) - p0 >= W);
        const bool cut_left = W > 0 && (p1 - 1) - j0 >= W;
        if (cut_right || cut_left) {
          for (index_t r = 0; r < rows; ++r) {
            const index_t i = p0 + r;
            const index_t lo = W > 0 ? i - W + 1 : j0;
            const index_t hi = t.causal ? i : (W > 0 ? i + W - 1 : j1 - 1);
            const index_t c_lo = std::clamp<index_t>(lo - j0, 0, cols);
            const index_t c_hi = std::clamp<index_t>(hi - j0 + 1, c_lo, cols);
            ws.s.row(r).head(c_lo).setZero();
            ws.s.row(r).tail(cols - c_hi).setZero();
          }
        }

        // dS = P (dP - delta), in dp.
        ws.delta = Eigen::Map<const column<T>>(delta.data() + g * n_rows + (i0 - all.lo), rows);
        ws.dp.noalias() = doi * vj.transpose();
        ws.dp.array() = ws.s.array() * (ws.dp.array().colwise() - ws.delta);

        ws.dv.noalias() += ws.s.transpose() * doi;
        ws.dk.noalias() += ws.dp.transpose() * qi;
        rows_of(t.dq_at(g, i0), rows, D, t.dq_stride).noalias() += ws.dp * ws.ks;
        if (gated) {
          ws.rowsum = ws.dp.rowwise().sum().array();
          for (index_t r = 0; r < rows; ++r) t.dG_at(g, p0 + r) += gate.coef * double(ws.rowsum(r));
          ws.colsum += ws.dp.colwise().sum().transpose().array();
        }
      }
      if (gated)
        for (index_t c = 0; c < cols; ++c) t.dG_at(g, j0 + c) -= gate.coef * double(ws.colsum(c));
    }
    rows_of(t.dk + j0 * t.dk_stride, cols, D, t.dk_stride) = t.scale * ws.dk;
    rows_of(t.dv + j0 * t.dv_stride, cols, Dv, t.dv_stride) = ws.dv;
  }
}

// Writes dq, dk, dv of every token, and dG (the gradient of the gate cumsum, laid out like g:
// [B, Tk, HQ] contiguous, one value a key token) when `cumsum` (the gate cumsum in that layout)
// is given; dG must then hold B*Tk*HQ elements. coef is the factor of G_i - G_j in the logits;
// reset as in flash_forward. Keys come from key_seq(n) (other lengths, not cache slots).
template <class Policy, class T>
void flash_backward(const attention_grad_args<T>& a, const attention_problem& p,
                    const backend::cpu& be, const double* cumsum = nullptr, double coef = 0,
                    const index_t* reset = nullptr, double* dG = nullptr) {
  constexpr index_t bq = Policy::block_q, bk = Policy::block_k;
  static_assert(bq >= 1 && bk >= 1, "attnmix: block_q and block_k must be positive");
  constexpr bool causal = Policy::mask == mask_type::causal;
  const index_t G = p.group(), W = p.window;
  const bool gated = cumsum != nullptr;

  index_t heads = 0;  // (sequence, KV head) pairs with keys
  for (index_t n = 0; n < p.num_sequences; ++n) heads += p.key_seq(n).length > 0 ? p.kv_heads : 0;
  const index_t runs_wanted = std::clamp<index_t>(
      (backward_task_target + heads - 1) / std::max<index_t>(heads, 1), 1, max_key_runs);

  // Runs of key tiles of similar cost (query rows times query heads), in key order per head.
  struct task {
    index_t seq, head, k0, k1, run, cost;
  };
  std::vector<task> tasks;
  std::vector<index_t> first_run;  // index into tasks of each head's first run
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const index_t L = p.seq(n).length, Lk = p.key_seq(n).length, off = Lk - L;
    if (Lk == 0) continue;  // then L == 0 too (the front door gives every query a key)
    const index_t tiles = (Lk + bk - 1) / bk;
    const index_t runs = std::clamp<index_t>(tiles / 2, 1, runs_wanted);
    std::vector<index_t> cost(static_cast<std::size_t>(tiles));
    index_t total = 0;
    for (index_t j = 0; j < tiles; ++j) {
      const row_range rr = rows_seeing(j * bk, std::min(Lk, (j + 1) * bk), L, off, W, causal);
      total += cost[j] = (rr.hi - rr.lo) * G;
    }
    for (index_t h = 0; h < p.kv_heads; ++h) {
      first_run.push_back(static_cast<index_t>(tasks.size()));
      index_t j = 0, sum = 0;
      for (index_t r = 0; r < runs; ++r) {
        const index_t begin = j, c0 = sum;
        // The last run takes what is left; the others stop at their share, leaving a tile to each
        // later run.
        while (j < tiles - (runs - 1 - r) &&
               (r == runs - 1 || j == begin || (sum + cost[j]) * runs <= total * (r + 1)))
          sum += cost[j++];
        tasks.push_back({n, h, begin * bk, std::min(Lk, j * bk), r, sum - c0});
      }
    }
  }
  std::vector<index_t> order(tasks.size());
  for (std::size_t t = 0; t < order.size(); ++t) order[t] = static_cast<index_t>(t);
  std::stable_sort(order.begin(), order.end(), [&](index_t x, index_t y) {
    return tasks[static_cast<std::size_t>(x)].cost > tasks[static_cast<std::size_t>(y)].cost;
  });

  // What a later run adds: dq [G, rows, D] over the rows that see its keys, and dG [G, positions]
  // over those rows' key positions and its own keys.
  struct part_range {
    row_range rows;
    index_t pos0, pos1;
  };
  const auto part_of = [&](const task& tk) {
    const index_t L = p.seq(tk.seq).length, off = p.key_seq(tk.seq).length - L;
    const row_range rr = rows_seeing(tk.k0, tk.k1, L, off, W, causal);
    const index_t pos0 = rr.hi > rr.lo ? std::min(tk.k0, rr.lo + off) : tk.k0;
    const index_t pos1 = rr.hi > rr.lo ? std::max(tk.k1, rr.hi + off) : tk.k1;
    return part_range{rr, pos0, pos1};
  };
  std::vector<std::vector<T>> dq_part(tasks.size());
  std::vector<std::vector<double>> dG_part(tasks.size());

  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<flash_backward_scratch<T>> scratch(static_cast<std::size_t>(workers));
  parallel_for(static_cast<index_t>(order.size()), workers, [&](index_t o, int worker) {
    const std::size_t id = static_cast<std::size_t>(order[static_cast<std::size_t>(o)]);
    const task& tk = tasks[id];
    const sequence s = p.seq(tk.seq), ks = p.key_seq(tk.seq);
    const index_t hq = tk.head * G;
    flash_grad_task<T> t{};
    t.q = &a.q(s.batch, s.start, hq, 0), t.q_stride = a.q.stride(1), t.q_head = a.q.stride(2);
    t.k = &a.k(ks.batch, ks.start, tk.head, 0), t.k_stride = a.k.stride(1);
    t.v = &a.v(ks.batch, ks.start, tk.head, 0), t.v_stride = a.v.stride(1);
    t.out = &a.out(s.batch, s.start, hq, 0), t.out_stride = a.out.stride(1);
    t.out_head = a.out.stride(2);
    t.dout = &a.dout(s.batch, s.start, hq, 0), t.dout_stride = a.dout.stride(1);
    t.dout_head = a.dout.stride(2);
    t.lse = &a.lse(s.batch, s.start, hq), t.lse_stride = a.lse.stride(1);
    t.lse_head = a.lse.stride(2);
    t.dk = &a.dk(ks.batch, ks.start, tk.head, 0), t.dk_stride = a.dk.stride(1);
    t.dv = &a.dv(ks.batch, ks.start, tk.head, 0), t.dv_stride = a.dv.stride(1);
    t.group = G, t.length = s.length, t.key_offset = ks.length - s.length;
    t.head_dim = p.head_dim, t.value_dim = p.value_dim;
    t.k0 = tk.k0, t.k1 = tk.k1, t.window = W, t.scale = static_cast<T>(p.scale), t.causal = causal;
    const index_t at = (ks.batch * p.key_tokens + ks.start) * p.q_heads + hq;
    if (gated) t.gate = {cumsum + at, p.q_heads, coef, reset != nullptr ? reset + at : nullptr};
    if (tk.run == 0) {
      // The first run owns the head's rows of dq and its keys' dG: it zeroes all of them.
      t.dq = &a.dq(s.batch, s.start, hq, 0), t.dq_head = a.dq.stride(2),
      t.dq_stride = a.dq.stride(1);
      if (gated) t.dG = dG + at, t.dG_head = 1, t.dG_stride = p.q_heads;
      t.row0 = 0, t.zero_lo = 0, t.zero_hi = s.length, t.pos0 = 0, t.pos1 = ks.length;
    } else {
      const part_range pr = part_of(tk);
      const index_t rows = pr.rows.hi - pr.rows.lo, span = pr.pos1 - pr.pos0;
      dq_part[id].resize(static_cast<std::size_t>(G * rows * p.head_dim));
      t.dq = dq_part[id].data(), t.dq_head = rows * p.head_dim, t.dq_stride = p.head_dim;
      if (gated) {
        dG_part[id].resize(static_cast<std::size_t>(G * span));
        t.dG = dG_part[id].data(), t.dG_head = span, t.dG_stride = 1;
      }
      t.row0 = pr.rows.lo, t.zero_lo = pr.rows.lo, t.zero_hi = pr.rows.hi;
      t.pos0 = pr.pos0, t.pos1 = pr.pos1;
    }
    flash_backward_task(t, bq, bk, scratch[static_cast<std::size_t>(worker)]);
  });

  // Later runs into the output, in key order: the same sums whatever the thread count.
  parallel_for(static_cast<index_t>(first_run.size()), workers, [&](index_t f, int) {
    for (std::size_t id = static_cast<std::size_t>(first_run[static_cast<std::size_t>(f)]) + 1;
         id < tasks.size() && tasks[id].run > 0; ++id) {
      const task& tk = tasks[id];
      const sequence s = p.seq(tk.seq), ks = p.key_seq(tk.seq);
      const part_range pr = part_of(tk);
      const index_t rows = pr.rows.hi - pr.rows.lo, span = pr.pos1 - pr.pos0;
      for (index_t g = 0; g < G; ++g) {
        const index_t hq = tk.head * G + g;
        if (rows > 0)
          rows_of(&a.dq(s.batch, s.start + pr.rows.lo, hq, 0), rows, p.head_dim, a.dq.stride(1)) +=
              rows_of(dq_part[id].data() + g * rows * p.head_dim, rows, p.head_dim, p.head_dim);
        if (gated)
          for (index_t j = 0; j < span; ++j)
            dG[(ks.batch * p.key_tokens + ks.start + pr.pos0 + j) * p.q_heads + hq] +=
                dG_part[id][static_cast<std::size_t>(g * span + j)];
      }
      std::vector<T>().swap(dq_part[id]);
    }
  });
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
