#pragma once
// The backward of PaTH and PaTH-FoX on the CPU (spec/path_fox.md §4), blocked like the forward
// in cpu/path.hpp and recomputing rather than storing.
//
// One task per (sequence, KV head), so that the gradients of the keys, values and transitions,
// which every later query of the group's heads adds to, are summed in a fixed order without
// races (a few long heads are split into slices of query chunks, see path_backward). Per
// (query head, query chunk):
//   1. the diagonal tile is recomputed from the saved log-sum-exp, giving dZ = p (dO V^T - delta)
//      there and the queries carried through their own chunk, R = Q~;
//   2. right to left over the earlier key chunks, as the forward walks: score against K~, form
//      dZ, add to dV and dK~, keep the chunk's scan state r and e = dZ K~, then R <- R P;
//   3. left to right, the adjoint of the running query through each chunk's transition,
//      rbar <- e + rbar P^T, which also adds r^T rbar to dP (or the rank-C terms to dW, dU);
//      what reaches the query chunk is dQ~;
//   4. back through the diagonal tile and the query's own-chunk transform to dq.
// Then per chunk, back through its UT transform (U, M, K~, P) to dk, dw and dbeta.
// Memory per task (and per slice): O(L (7D + Dv + C)) for a sequence of L tokens plus D^2 per
// chunk when the chunk products are dense; never an L x L matrix and never a copy of the
// queries per chunk.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/flash.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/cpu/detail/path_chunks.hpp"
#include "attnmix/math/householder.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// What the query chunks of one (sequence, KV head) add to the gradients of the per-chunk data,
// rows indexed by the position in the sequence: dk (direct), dK~, dv, dw and dU (direct and,
// for the rank-C transition form, through the transitions), dM ([L, C]) and, for the dense
// form, dP ([chunks * D, D]).
template <class T>
struct path_chunk_grads {
  matrix<T> dk, dkt, dv, dw, du, dm, dp;

  void reset(index_t L, index_t chunks, index_t D, index_t Dv, index_t C, bool dense) {
    dk.setZero(L, D);
    dkt.setZero(L, D);
    dv.setZero(L, Dv);
    dw.setZero(L, D);
    du.setZero(L, D);
    dm.setZero(L, C);
    if (dense) dp.setZero(chunks * D, D);
  }
};

template <class T>
struct path_backward_scratch {
  path_chunk_grads<T> grads;
  matrix<T> states, e;  // earlier chunk cj at rows [cj C, cj C + n): its scan state r, dZ K~
  matrix<T> qs, x, s, dz, r, rbar, tmp, y, dqs, dx;
  matrix<T> ww, l, rbu, rbm, lbar, xk;
  column<T> lse, delta, gi, gj, beta;
};

// Steps 1-4 for one query chunk of one (sequence, query head); adds to g and writes dq.
// G, coef, reset as in path_query_chunk; dG: d loss / d G at token 0 of the sequence, token
// stride dGs (nullptr: no gate).
template <class T>
void path_query_chunk_backward(const attention_grad_args<T>& a, const attention_problem& p,
                               path_chunks<T>& c, index_t seq, index_t hq, index_t ci,
                               const double* G, index_t Gs, double coef, const index_t* reset,
                               double* dG, index_t dGs, path_chunk_grads<T>& g,
                               path_backward_scratch<T>& ws) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const sequence s = p.seq(seq);
  const index_t b = s.batch, h = hq / p.group(), C = c.chunk, D = p.head_dim, Dv = p.value_dim;
  const index_t c0 = ci * C, n = std::min(C, s.length - c0), t0 = s.start + c0;
  const T scale = static_cast<T>(p.scale);

  const auto W = rows_of(&a.w(b, t0, h, 0), n, D, a.w.stride(1));
  const auto U = rows_of(c.u_at(b, h, t0), n, D, D);
  const auto M = rows_of(c.m_at(b, h, t0), n, n, C);
  const auto dO = rows_of(&a.dout(b, t0, hq, 0), n, Dv, a.dout.stride(1));
  const auto O = rows_of(&a.out(b, t0, hq, 0), n, Dv, a.out.stride(1));
  ws.delta = (dO.array() * O.array()).rowwise().sum();
  ws.lse.resize(n);
  for (index_t r = 0; r < n; ++r) ws.lse(r) = static_cast<T>(a.lse(b, t0 + r, hq));

  // The gate bias exactly as the forward adds it (relative to G at the chunk start).
  const double g_ref = G != nullptr ? G[c0 * Gs] : 0.0;
  if (G != nullptr) {
    ws.gi.resize(n);
    for (index_t r = 0; r < n; ++r) ws.gi(r) = static_cast<T>(coef * (G[(c0 + r) * Gs] - g_ref));
  }
  const auto add_gate = [&](index_t j0, index_t cols) {
    if (G == nullptr) return;
    ws.gj.resize(cols);
    for (index_t j = 0; j < cols; ++j) ws.gj(j) = static_cast<T>(coef * (G[(j0 + j) * Gs] - g_ref));
    ws.s.array().colwise() += ws.gi;
    ws.s.array().rowwise() -= ws.gj.transpose();
    cut_at_resets(ws.s, gate_bias{G, Gs, coef, reset}, c0, j0);
  };
  // Logits in ws.s become p = exp(z - lse); ws.dz = p (dO V^T - delta). Adds p^T dO to dv and
  // coef * (row sums - column sums) of dZ to dG. Keys cut by the mask or a reset have p = 0.
  const auto backprop_softmax = [&](index_t j0, index_t cols, const const_rows<T>& V) {
    ws.s.array().colwise() -= ws.lse;
    ws.s = ws.s.array().exp().matrix();
    ws.dz.noalias() = dO * V.transpose();
    ws.dz.array().colwise() -= ws.delta;
    ws.dz.array() *= ws.s.array();
    g.dv.middleRows(j0, cols).noalias() += ws.s.transpose() * dO;
    if (dG == nullptr) return;
    for (index_t r = 0; r < n; ++r)
      dG[(c0 + r) * dGs] += coef * static_cast<double>(ws.dz.row(r).sum());
    for (index_t j = 0; j < cols; ++j)
      dG[(j0 + j) * dGs] -= coef * static_cast<double>(ws.dz.col(j).sum());
  };

  // Step 1: the diagonal tile, z = s tril(Q K^T - tril(Q W^T) M) (+ gate).
  const auto K = rows_of(&a.k(b, t0, h, 0), n, D, a.k.stride(1));
  ws.qs.noalias() = scale * rows_of(&a.q(b, t0, hq, 0), n, D, a.q.stride(1));
  ws.x.noalias() = ws.qs * W.transpose();
  ws.x.template triangularView<Eigen::StrictlyUpper>().setZero();
  ws.s.noalias() = ws.qs * K.transpose();
  ws.s.noalias() -= ws.x * M;
  add_gate(c0, n);
  ws.s.template triangularView<Eigen::StrictlyUpper>().setConstant(ninf);
  backprop_softmax(c0, n, rows_of(&a.v(b, t0, h, 0), n, Dv, a.v.stride(1)));
  g.dk.middleRows(c0, n).noalias() += ws.dz.transpose() * ws.qs;
  g.dm.block(c0, 0, n, n).noalias() -= ws.x.transpose() * ws.dz;
  ws.dqs.noalias() = ws.dz * K;
  ws.dx.setZero(n, n);
  ws.dx.noalias() -= ws.dz * M.transpose();

  if (ci > 0) {
    // Step 2: the forward's walk, keeping each chunk's scan state and dZ K~.
    if (ws.states.rows() < ci * C) ws.states.resize(ci * C, D), ws.e.resize(ci * C, D);
    ws.r = ws.qs;
    ws.r.noalias() -= ws.x * U;
    for (index_t cj = ci - 1; cj >= 0; --cj) {
      const index_t j0 = cj * C, tj = s.start + j0;  // earlier chunks are always full
      const auto Kt = rows_of(c.kt_at(b, h, tj), C, D, D);
      ws.states.middleRows(j0, n) = ws.r;
      ws.s.noalias() = ws.r * Kt.transpose();
      add_gate(j0, C);
      backprop_softmax(j0, C, rows_of(&a.v(b, tj, h, 0), C, Dv, a.v.stride(1)));
      g.dkt.middleRows(j0, C).noalias() += ws.dz.transpose() * ws.r;
      ws.e.middleRows(j0, n).noalias() = ws.dz * Kt;
      if (cj == 0) break;  // chunk 0's product is never applied
      if (c.dense) {
        ws.tmp.noalias() = ws.r * rows_of(c.p_at(seq, cj, h), D, D, D);
        ws.r.swap(ws.tmp);
      } else {
        ws.tmp.noalias() = ws.r * rows_of(&a.w(b, tj, h, 0), C, D, a.w.stride(1)).transpose();
        ws.r.noalias() -= ws.tmp * rows_of(c.u_at(b, h, tj), C, D, D);
      }
    }
    // Step 3: r^(cj-1) = r^(cj) P_cj, so rbar^(cj) = e_cj + rbar^(cj-1) P_cj^T and
    // dP_cj += r^(cj)^T rbar^(cj-1).
    ws.rbar = ws.e.topRows(n);
    for (index_t cj = 1; cj < ci; ++cj) {
      const index_t j0 = cj * C, tj = s.start + j0;
      const auto R = ws.states.middleRows(j0, n);
      if (c.dense) {
        g.dp.middleRows(cj * D, D).noalias() += R.transpose() * ws.rbar;
        ws.tmp.noalias() = ws.rbar * rows_of(c.p_at(seq, cj, h), D, D, D).transpose();
        ws.tmp += ws.e.middleRows(j0, n);
        ws.rbar.swap(ws.tmp);
      } else {  // P = I - W^T U: dU -= (r W^T)^T rbar, dW -= (rbar U^T)^T r
        const auto Wj = rows_of(&a.w(b, tj, h, 0), C, D, a.w.stride(1));
        const auto Uj = rows_of(c.u_at(b, h, tj), C, D, D);
        ws.y.noalias() = R * Wj.transpose();
        ws.tmp.noalias() = ws.rbar * Uj.transpose();
        g.du.middleRows(j0, C).noalias() -= ws.y.transpose() * ws.rbar;
        g.dw.middleRows(j0, C).noalias() -= ws.tmp.transpose() * R;
        ws.rbar.noalias() -= ws.tmp * Wj;
        ws.rbar += ws.e.middleRows(j0, n);
      }
    }
    // Q~ = Qs - tril(Qs W^T) U.
    ws.dqs += ws.rbar;
    ws.dx.noalias() -= ws.rbar * U.transpose();
    g.du.middleRows(c0, n).noalias() -= ws.x.transpose() * ws.rbar;
  }

  // Step 4: X = tril(Qs W^T).
  ws.dx.template triangularView<Eigen::StrictlyUpper>().setZero();
  ws.dqs.noalias() += ws.dx * W;
  g.dw.middleRows(c0, n).noalias() += ws.dx.transpose() * ws.qs;
  rows_of(&a.dq(b, t0, hq, 0), n, D, a.dq.stride(1)) = scale * ws.dqs;
}

// Chunk ci of one (sequence, KV head): from the summed gradients of K~, M, U (and P) back
// through K~ = K - M^T W, P = I - W^T U and the UT transform [U, M] = (I + L)^-1 diag(beta)
// [W, stril(W K^T)], L = stril(diag(beta) W W^T); writes dk, dv, dw and dbeta.
template <class T>
void path_chunk_backward(const attention_grad_args<T>& a, const attention_problem& p,
                         path_chunks<T>& c, index_t seq, index_t h, index_t ci,
                         path_chunk_grads<T>& g, path_backward_scratch<T>& ws) {
  const sequence s = p.seq(seq);
  const index_t b = s.batch, C = c.chunk, D = p.head_dim, Dv = p.value_dim;
  const index_t c0 = ci * C, n = std::min(C, s.length - c0), t0 = s.start + c0;
  const auto W = rows_of(&a.w(b, t0, h, 0), n, D, a.w.stride(1));
  const auto K = rows_of(&a.k(b, t0, h, 0), n, D, a.k.stride(1));
  const auto U = rows_of(c.u_at(b, h, t0), n, D, D);
  const auto M = rows_of(c.m_at(b, h, t0), n, n, C);
  auto dK = g.dk.middleRows(c0, n);
  auto dKt = g.dkt.middleRows(c0, n);
  auto dW = g.dw.middleRows(c0, n);
  auto dU = g.du.middleRows(c0, n);
  auto dM = g.dm.block(c0, 0, n, n);

  if (c.dense && ci > 0) {  // chunk 0's product is never applied: its dP is 0
    const auto dP = g.dp.middleRows(ci * D, D);
    dU.noalias() -= W * dP;
    dW.noalias() -= U * dP.transpose();
  }
  dK += dKt;
  dM.noalias() -= W * dKt.transpose();
  dW.noalias() -= M * dKt;
  dM.template triangularView<Eigen::Upper>().setZero();  // M is strictly lower

  ws.beta.resize(n);
  for (index_t r = 0; r < n; ++r) ws.beta(r) = a.beta(b, t0 + r, h);
  ws.ww.noalias() = W * W.transpose();
  ws.l = ws.ww;
  ws.l.array().colwise() *= ws.beta;
  // [U, M] = (I + L)^-1 R: R^bar = (I + L)^-T [dU, dM], L^bar = -stril(R^bar [U, M]^T).
  const auto lower_t = ws.l.template triangularView<Eigen::UnitLower>().transpose();
  ws.rbu = dU;
  lower_t.solveInPlace(ws.rbu);
  ws.rbm = dM;
  lower_t.solveInPlace(ws.rbm);
  ws.lbar.noalias() = ws.rbu * U.transpose();
  ws.lbar.noalias() += ws.rbm * M.transpose();
  ws.lbar.template triangularView<Eigen::Upper>().setZero();
  ws.xk.noalias() = W * K.transpose();
  ws.xk.template triangularView<Eigen::Upper>().setZero();

  // R = diag(beta) [W, stril(W K^T)] and L = stril(diag(beta) W W^T).
  for (index_t r = 0; r < n; ++r)
    a.dbeta(b, t0 + r, h) = (ws.rbu.row(r).array() * W.row(r).array()).sum() +
                            (ws.rbm.row(r).array() * ws.xk.row(r).array()).sum() -
                            (ws.lbar.row(r).array() * ws.ww.row(r).array()).sum();
  ws.rbu.array().colwise() *= ws.beta;
  dW += ws.rbu;
  ws.lbar.array().colwise() *= -ws.beta;  // d (w_a . w_b), a > b
  dW.noalias() += ws.lbar * W;
  dW.noalias() += ws.lbar.transpose() * W;
  ws.rbm.array().colwise() *= ws.beta;  // d (w_a . k_b), a > b
  ws.rbm.template triangularView<Eigen::Upper>().setZero();
  dW.noalias() += ws.rbm * K;
  dK.noalias() += ws.rbm.transpose() * W;

  rows_of(&a.dk(b, t0, h, 0), n, D, a.dk.stride(1)) = dK;
  rows_of(&a.dw(b, t0, h, 0), n, D, a.dw.stride(1)) = dW;
  rows_of(&a.dv(b, t0, h, 0), n, Dv, a.dv.stride(1)) = g.dv.middleRows(c0, n);
}

// The query chunks of one (sequence, KV head) are split into `slices` contiguous ranges of
// about equal work. With one slice the task is done by one worker, which sums into its own
// scratch and finishes the chunks at once. A few long heads (fewer than slice_target tasks)
// are split further, each slice summing into its own buffers, which are then added in slice
// order: the same bits for every thread count, at the cost of one set of sums per slice.
inline constexpr index_t path_backward_slice_target = 8;
inline constexpr index_t path_backward_max_slices = 4;

// The blocked backward. G: the forward's gate cumsum laid out like g ([B, T, HQ], contiguous)
// or nullptr; reset: its hard resets or nullptr; dG: laid out like G, receives d loss / d G
// (nullptr when G is).
template <class T>
void path_backward(const attention_grad_args<T>& a, const attention_problem& p,
                   const backend::cpu& be, index_t chunk, const double* G, double coef,
                   const index_t* reset, double* dG) {
  require_cpu_scalar<T>();
  path_chunks<T> c = path_prepare<T>(a.k, a.w, a.beta, p, chunk, be);
  const index_t D = p.head_dim, Dv = p.value_dim, HQ = p.q_heads, group = p.group();

  struct task {
    index_t seq, head, chunks, first, slices;  // first: its first unit
  };
  struct unit {
    index_t task, lo, hi;  // query chunks [lo, hi)
  };
  std::vector<task> tasks;
  for (index_t n = 0; n < p.num_sequences; ++n)
    if (p.seq(n).length > 0)
      for (index_t h = 0; h < p.kv_heads; ++h)
        tasks.push_back({n, h, math::chunk_count(p.seq(n).length, chunk), 0, 1});
  const auto count = static_cast<index_t>(tasks.size());
  std::vector<unit> units;
  for (index_t i = 0; i < count; ++i) {
    task& tk = tasks[static_cast<std::size_t>(i)];
    if (count < path_backward_slice_target)
      tk.slices = std::clamp<index_t>(
          std::min((path_backward_slice_target + count - 1) / count, path_backward_max_slices), 1,
          std::max<index_t>(1, tk.chunks / 4));
    tk.first = static_cast<index_t>(units.size());
    // Query chunk ci costs ci + 1 tiles: cut where the running sum crosses k / slices.
    const double total = 0.5 * double(tk.chunks) * double(tk.chunks + 1);
    index_t lo = 0;
    for (index_t k = 1; k <= tk.slices; ++k) {
      index_t hi = lo;
      while (hi < tk.chunks && (k == tk.slices || 0.5 * double(hi) * double(hi + 1) <
                                                      total * double(k) / double(tk.slices)))
        ++hi;
      if (hi > lo) units.push_back({i, lo, hi});
      lo = hi;
    }
    tk.slices = static_cast<index_t>(units.size()) - tk.first;
  }
  const auto work = [&](const unit& u) {
    return (u.hi * (u.hi + 1) - u.lo * (u.lo + 1)) *
           p.seq(tasks[static_cast<std::size_t>(u.task)].seq).length;
  };
  std::vector<index_t> order(units.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<index_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](index_t x, index_t y) {
    return work(units[static_cast<std::size_t>(x)]) > work(units[static_cast<std::size_t>(y)]);
  });

  // The sums of a sliced task's units ([group, rows] gate sums beside them).
  std::vector<path_chunk_grads<T>> sums(units.size());
  std::vector<std::vector<double>> gate_sums(units.size());
  const int workers = worker_count(be, static_cast<index_t>(units.size()));
  std::vector<path_backward_scratch<T>> scratch(static_cast<std::size_t>(workers));
  parallel_for(static_cast<index_t>(units.size()), workers, [&](index_t i, int worker) {
    const index_t ui = order[static_cast<std::size_t>(i)];
    const unit& u = units[static_cast<std::size_t>(ui)];
    const task& tk = tasks[static_cast<std::size_t>(u.task)];
    path_backward_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
    const sequence s = p.seq(tk.seq);
    const bool alone = tk.slices == 1;
    const index_t rows = std::min(u.hi * chunk, s.length);
    path_chunk_grads<T>& g = alone ? ws.grads : sums[static_cast<std::size_t>(ui)];
    g.reset(rows, u.hi, D, Dv, chunk, c.dense);
    std::vector<double>& gs = gate_sums[static_cast<std::size_t>(ui)];
    if (!alone && dG != nullptr) gs.assign(static_cast<std::size_t>(group * rows), 0.0);
    for (index_t hq = tk.head * group; hq < (tk.head + 1) * group; ++hq) {
      const index_t at = (s.batch * p.tokens + s.start) * HQ + hq;
      double* dg = dG == nullptr ? nullptr : alone ? dG + at : gs.data() + (hq % group) * rows;
      for (index_t ci = u.lo; ci < u.hi; ++ci)
        path_query_chunk_backward(a, p, c, tk.seq, hq, ci, G != nullptr ? G + at : nullptr, HQ,
                                  coef, reset != nullptr ? reset + at : nullptr, dg, alone ? HQ : 1,
                                  g, ws);
    }
    if (alone)
      for (index_t ci = 0; ci < tk.chunks; ++ci)
        path_chunk_backward(a, p, c, tk.seq, tk.head, ci, g, ws);
  });

  // Sliced tasks: per chunk, add the slices' sums in slice order into the last slice's (which
  // covers every chunk), then finish the chunk.
  struct part {
    index_t task, chunk;
  };
  std::vector<part> parts;
  for (index_t i = 0; i < count; ++i)
    if (tasks[static_cast<std::size_t>(i)].slices > 1)
      for (index_t ci = 0; ci < tasks[static_cast<std::size_t>(i)].chunks; ++ci)
        parts.push_back({i, ci});
  const int part_workers = worker_count(be, static_cast<index_t>(parts.size()));
  if (part_workers > workers) scratch.resize(static_cast<std::size_t>(part_workers));
  parallel_for(static_cast<index_t>(parts.size()), part_workers, [&](index_t i, int worker) {
    const part& pt = parts[static_cast<std::size_t>(i)];
    const task& tk = tasks[static_cast<std::size_t>(pt.task)];
    const sequence s = p.seq(tk.seq);
    const index_t last = tk.first + tk.slices - 1, c0 = pt.chunk * chunk;
    const index_t n = std::min(chunk, s.length - c0);
    path_chunk_grads<T>& g = sums[static_cast<std::size_t>(last)];
    for (index_t k = tk.first; k < last; ++k) {
      if (units[static_cast<std::size_t>(k)].hi <= pt.chunk) continue;
      const path_chunk_grads<T>& o = sums[static_cast<std::size_t>(k)];
      g.dk.middleRows(c0, n) += o.dk.middleRows(c0, n);
      g.dkt.middleRows(c0, n) += o.dkt.middleRows(c0, n);
      g.dv.middleRows(c0, n) += o.dv.middleRows(c0, n);
      g.dw.middleRows(c0, n) += o.dw.middleRows(c0, n);
      g.du.middleRows(c0, n) += o.du.middleRows(c0, n);
      g.dm.middleRows(c0, n) += o.dm.middleRows(c0, n);
      if (c.dense) g.dp.middleRows(pt.chunk * D, D) += o.dp.middleRows(pt.chunk * D, D);
    }
    path_chunk_backward(a, p, c, tk.seq, tk.head, pt.chunk, g,
                        scratch[static_cast<std::size_t>(worker)]);
    if (dG == nullptr) return;
    for (index_t hq = tk.head * group; hq < (tk.head + 1) * group; ++hq)
      for (index_t t = c0; t < c0 + n; ++t) {
        double sum = 0;
        for (index_t k = tk.first; k <= last; ++k) {
          const index_t rows = std::min(units[static_cast<std::size_t>(k)].hi * chunk, s.length);
          if (t < rows)
            sum += gate_sums[static_cast<std::size_t>(k)]
                            [static_cast<std::size_t>((hq % group) * rows + t)];
        }
        dG[(s.batch * p.tokens + s.start + t) * HQ + hq] = sum;
      }
  });
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
