#pragma once
// Backward of the CPU linear-attention kinds (cpu/bla.hpp, cpu/gbla.hpp, cpu/linear_causal.hpp),
// spec gbla.md §3.4 and its causal counterpart.
//  * bidirectional_backward: S and z are recomputed by the reduce pass of the forward (or taken
//    from `saved`); pass A walks blocks of query rows (every query head at once, the gated norm's
//    backward fused) and reduces dS = sum_i r_i g_i^T and dz = sum_i delta_i r_i; pass B walks
//    blocks of keys and writes dk, dv and da. Both reductions are split into a fixed number of
//    parts per sequence chosen from the problem alone, so the result does not depend on the thread
//    count.
//  * causal_backward: per (sequence, KV head), a forward walk over the chunks keeps the carried
//    state every K ~ sqrt(chunks) chunks; a reverse walk, segment by segment, recomputes the
//    states of a segment from its checkpoint and carries the gradient of the state backwards (dS,
//    dz and, under the key gate, the gradient of the softmax mass). The prefix-softmax weights
//    are handled relative to the log-mass at chunk boundaries, so every factor is <= 1. Both
//    causal forms have the same gradient and take this chunked walk. A gated norm is handled
//    first: the forward recomputes o, the norm's backward turns dout into do, and the core
//    backward runs on do.
// Time O(T D Dv) per head; memory O(D Dv) per head plus O(T) scalars (and one [B,T,HQ,Dv]
// buffer for a causal gated norm); nothing is T x T.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attnmix/attention/linear_args.hpp"
#include "attnmix/core/linear_policy.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/linear.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// The forward's arguments that a backward reads, as a forward argument list (out and state_out
// left empty) so that the forward's helpers serve both.
template <class T>
linear_attention_args<T> forward_view(const linear_attention_grad_args<T>& g) {
  linear_attention_args<T> a;
  a.q = g.q;
  a.k = g.k;
  a.v = g.v;
  a.mask = g.mask;
  a.a = g.a;
  a.gate = g.gate;
  a.gamma = g.gamma;
  a.state_in = g.state_in;
  return a;
}

// grad *= phi'(x) element-wise, given x and phi(x) (unscaled).
template <feature_map F, class Grad, class X, class Phi>
void times_phi_derivative(Grad&& grad, const X& x, const Phi& phi) {
  using T = typename std::decay_t<Grad>::Scalar;
  if constexpr (F == feature_map::elu_plus_one) {
    grad.array() *= phi.array().min(T(1));  // 1 for x > 0, exp(x) = phi(x) <= 1 below
  } else if constexpr (F == feature_map::relu) {
    grad.array() *= (x.array() > T(0)).template cast<T>();
  } else if constexpr (F == feature_map::squared_relu) {
    grad.array() *= T(2) * x.array().max(T(0));
  } else if constexpr (F == feature_map::sigmoid) {
    // sigma(x) sigma(-x) from exp(-|x|): phi (1 - phi) loses 1 - phi to rounding for large x.
    const auto e = (-x.array().abs()).exp();
    grad.array() *= e * (T(1) + e).square().inverse();
    (void)phi;
  }
}

// Zeroes the rows of m whose token is not valid (ws.valid), unless every row is.
template <class M, class T>
void zero_invalid_rows(M&& m, bool all_valid, const linear_scratch<T>& ws) {
  if (all_valid) return;
  for (index_t r = 0; r < m.rows(); ++r)
    if (!ws.valid[static_cast<std::size_t>(r)]) m.row(r).setZero();
}

// Writes rows [t0, t0 + rows) of head h of a [B, T, Hx, W] gradient; pad rows get 0.
template <class T, class Src>
void store_grad_rows(const view4<T>& dst, const sequence& s, index_t h, index_t t0, const Src& src,
                     bool all_valid, const linear_scratch<T>& ws) {
  auto out = rows_of(&dst(s.batch, s.start + t0, h, 0), src.rows(), src.cols(), dst.stride(1));
  out = src;
  zero_invalid_rows(out, all_valid, ws);
}

// Backward of the gated RMSNorm over a rows x W block (W = HQ * Dv, every query head of a
// token), in groups of `width` columns (Dv per head, or W full width). o: the norm's input
// (the attention output), gate: pre-activations, dy: the gradient of the norm's output (pad rows
// zero in all three). Writes do into dy, dgate into `dgate`, and adds to dgamma_row (width W,
// one entry per column; folded to gamma's shape by the caller) when gamma_row is non-empty.
template <class Policy, class T>
void gated_norm_backward_block(const matrix<T>& o, const matrix<T>& gate, matrix<T>& dy,
                               matrix<T>& dgate, const row_array<T>& gamma_row,
                               row_array<T>& dgamma_row, index_t width, T norm_eps, matrix<T>& act,
                               matrix<T>& dact) {
  const index_t rows = o.rows(), W = o.cols();
  // act(g) and act'(g).
  {
    const auto g = gate.array();
    const auto sg = (T(1) + (-g).exp()).inverse();
    if constexpr (Policy::activation == gate_activation::silu) {
      act.array() = g * sg;
      dact.array() = sg * (T(1) + g * (T(1) - sg));
    } else {
      act.array() = sg;
      dact.array() = sg * (T(1) - sg);
    }
  }
  const bool with_gamma = gamma_row.size() > 0;
  matrix<T> x, n, dn;
  column<T> rstd, proj;
  for (index_t e0 = 0; e0 < W; e0 += width) {
    const auto ab = act.middleCols(e0, width).array();
    const auto db = dact.middleCols(e0, width).array();
    const auto ob = o.middleCols(e0, width).array();
    auto dyb = dy.middleCols(e0, width);
    auto dgb = dgate.middleCols(e0, width);
    if constexpr (Policy::order == norm_gate_order::gate_then_norm)
      x = (ob * ab).matrix();
    else
      x = ob.matrix();
    rstd = (x.rowwise().squaredNorm().array() / T(width) + norm_eps).rsqrt();
    n = rstd.matrix().asDiagonal() * x;
    // dn = dy * gamma (* act for norm_then_gate); dgamma += dy * n (* act).
    dn = dyb;
    if constexpr (Policy::order == norm_gate_order::norm_then_gate) {
      dgb = (dyb.array() * n.array() * db).matrix();  // times gamma below
      dn.array() *= ab;
    }
    if (with_gamma) {
      const auto gr = gamma_row.segment(e0, width);
      if (dgamma_row.size() > 0)
        dgamma_row.segment(e0, width) += (dn.array() * n.array()).colwise().sum();
      dn.array().rowwise() *= gr;
      if constexpr (Policy::order == norm_gate_order::norm_then_gate) dgb.array().rowwise() *= gr;
    }
    // dx = rstd * (dn - n * mean(dn * n)).
    proj = (dn.array() * n.array()).rowwise().sum() / T(width);
    dn -= proj.matrix().asDiagonal() * n;
    dn = rstd.matrix().asDiagonal() * dn;
    if constexpr (Policy::order == norm_gate_order::gate_then_norm) {
      dgb = (dn.array() * ob * db).matrix();
      dyb = (dn.array() * ab).matrix();
    } else {
      dyb = dn;
    }
  }
  (void)rows;
}

// gamma as a row of HQ * Dv columns (tiled per head for norm_weight::shared); empty when absent.
template <class Policy, class T>
row_array<T> gamma_row_of(const linear_attention_args<T>& a, const linear_attention_problem& p) {
  const index_t HQ = p.q_heads, Dv = p.value_dim;
  row_array<T> row;
  if (!a.gamma.has_value()) return row;
  row.resize(HQ * Dv);
  for (index_t h = 0; h < HQ; ++h)
    for (index_t c = 0; c < Dv; ++c)
      row(h * Dv + c) = a.gamma(Policy::weight == norm_weight::per_head ? h * Dv + c : c);
  return row;
}

// Sums per-task dgamma rows (W = HQ * Dv each) in task order into dgamma.
template <class Policy, class T>
void fold_dgamma(const std::vector<row_array<T>>& parts, const linear_attention_grad_args<T>& g,
                 const linear_attention_problem& p) {
  if (!g.dgamma.has_value()) return;
  const index_t HQ = p.q_heads, Dv = p.value_dim;
  row_array<T> total = row_array<T>::Zero(HQ * Dv);
  for (const auto& r : parts)
    if (r.size() > 0) total += r;
  if constexpr (Policy::weight == norm_weight::per_head) {
    for (index_t e = 0; e < HQ * Dv; ++e) g.dgamma(e) = total(e);
  } else {
    for (index_t c = 0; c < Dv; ++c) {
      T sum = 0;
      for (index_t h = 0; h < HQ; ++h) sum += total(h * Dv + c);
      g.dgamma(c) = sum;
    }
  }
}

// ---- bidirectional (bla, gbla) ------------------------------------------------------------

// Sequences split into at most this many parts of whole blocks in each reduction.
inline constexpr index_t backward_max_parts = 32;

template <class Policy, class T>
void bidirectional_backward(const linear_attention_grad_args<T>& g,
                            const linear_attention_problem& p, const backend::cpu& be) {
  static_assert(std::is_same_v<accum_t<T>, T>, "attnmix: CPU linear attention computes in T");
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  constexpr index_t block = Policy::block;
  const linear_attention_args<T> a = forward_view(g);
  const index_t N = p.num_sequences, H = p.kv_heads, HQ = p.q_heads, D = p.head_dim,
                Dv = p.value_dim, G = p.group(), Hg = p.gate_heads;
  const index_t state_size = D * Dv + D;
  const T scale = static_cast<T>(p.scale), eps = static_cast<T>(p.eps);

  index_t max_blocks = 0;
  for (index_t n = 0; n < N; ++n)
    max_blocks = std::max(max_blocks, (p.seq(n).length + block - 1) / block);
  const index_t parts = std::max<index_t>(1, std::min(backward_max_parts, max_blocks));
  auto part_range = [&](const sequence& s, index_t part, index_t& j_begin, index_t& j_end) {
    const index_t blocks = (s.length + block - 1) / block;
    j_begin = std::min(s.length, (blocks * part / parts) * block);
    j_end = std::min(s.length, (blocks * (part + 1) / parts) * block);
  };
  std::vector<T> partial(static_cast<std::size_t>(N * parts * H * state_size));
  auto slot = [&](index_t n, index_t part, index_t h) {
    return partial.data() + ((n * parts + part) * H + h) * state_size;
  };
  auto combine = [&](std::vector<T>& total) {
    total.assign(static_cast<std::size_t>(N * H * state_size), T(0));
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < H; ++h) {
        Eigen::Map<vec<T>> t(total.data() + (n * H + h) * state_size, state_size);
        for (index_t part = 0; part < parts; ++part)
          t += Eigen::Map<const vec<T>>(slot(n, part, h), state_size);
      }
  };

  // Key-gate softmax statistics: from saved.lse (w = exp(a - lse)) or recomputed.
  std::vector<gate_stats> stats;
  if constexpr (gated) {
    if (g.saved.S.has_value()) {
      stats.resize(static_cast<std::size_t>(N * Hg));
      for (index_t n = 0; n < N; ++n)
        for (index_t gh = 0; gh < Hg; ++gh) {
          const double lse = g.saved.lse(n, gh);  // shared gate: every head holds the same lse
          gate_stats& gs = stats[static_cast<std::size_t>(n * Hg + gh)];
          gs.max = lse;
          gs.inv_sum = lse == -std::numeric_limits<double>::infinity() ? 0.0 : 1.0;
        }
    } else {
      stats = key_gate_stats(a, p);
    }
  }
  // Gate weights of the valid rows of a block for gate head gh (kept rows in order), into w.
  auto gate_weights = [&](const sequence& s, index_t n, index_t gh, index_t j0, index_t rows,
                          bool all_valid, const linear_scratch<T>& ws, vec<T>& w) {
    const gate_stats gs = stats[static_cast<std::size_t>(n * Hg + gh)];
    w.resize(rows);
    for (index_t r = 0; r < rows; ++r) {
      if (!all_valid && !ws.valid[static_cast<std::size_t>(r)]) {
        w(r) = T(0);
        continue;
      }
      const double logit = static_cast<double>(a.a(s.batch, s.start + j0 + r, gh));
      w(r) = gs.inv_sum > 0 ? static_cast<T>(std::exp(logit - gs.max) * gs.inv_sum) : T(0);
    }
  };

  const int workers = worker_count(be, N * parts);
  std::vector<linear_scratch<T>> scratch(static_cast<std::size_t>(workers));

  // The state S, z per (sequence, KV head).
  std::vector<T> state;
  if (g.saved.S.has_value()) {
    state.assign(static_cast<std::size_t>(N * H * state_size), T(0));
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < H; ++h) {
        T* st = state.data() + (n * H + h) * state_size;
        for (index_t d = 0; d < D; ++d)
          for (index_t c = 0; c < Dv; ++c) st[d * Dv + c] = g.saved.S(n, h, d, c);
        if (g.saved.z.has_value())
          for (index_t d = 0; d < D; ++d) st[D * Dv + d] = g.saved.z(n, h, d);
      }
  } else {
    parallel_for(N * parts, workers, [&](index_t task, int worker) {
      linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
      const index_t part = task % parts, n = task / parts;
      const sequence s = p.seq(n);
      index_t j_begin, j_end;
      part_range(s, part, j_begin, j_end);
      std::fill(slot(n, part, 0), slot(n, part, 0) + H * state_size, T(0));
      if (ws.ones.size() != block) ws.ones.setOnes(block);
      for (index_t j0 = j_begin; j0 < j_end; j0 += block) {
        const index_t rows = std::min(block, j_end - j0);
        const bool all_valid = load_validity(a, s, j0, rows, ws);
        ws.p.resize(rows, H * D);
        apply_phi<Policy::phi>(ws.p, token_block(a.k, s.batch, s.start + j0, rows, ws.k));
        ws.v = token_block(a.v, s.batch, s.start + j0, rows, ws.scores);
        zero_invalid_rows(ws.p, all_valid, ws);
        zero_invalid_rows(ws.v, all_valid, ws);
        for (index_t h = 0; h < H; ++h) {
          auto ph = ws.p.middleCols(h * D, D);
          if constexpr (gated) {
            if (Hg != 1 || h == 0)
              gate_weights(s, n, Hg == 1 ? 0 : h, j0, rows, all_valid, ws, ws.w);
            ph = ws.w.asDiagonal() * ph;
          }
          T* st = slot(n, part, h);
          Eigen::Map<matrix<T>> S(st, D, Dv);
          Eigen::Map<vec<T>> z(st + D * Dv, D);
          S.noalias() += ph.transpose() * ws.v.middleCols(h * Dv, Dv);
          z.noalias() += ph.transpose() * ws.ones.head(rows);
        }
      }
    });
    combine(state);
  }
  auto S_of = [&](index_t n, index_t h) {
    return Eigen::Map<const matrix<T>>(state.data() + (n * H + h) * state_size, D, Dv);
  };
  auto z_of = [&](index_t n, index_t h) {
    return Eigen::Map<const vec<T>>(state.data() + (n * H + h) * state_size + D * Dv, D);
  };

  // Pass A: over query rows. do (through the norm), dq, and the partial dS, dz.
  const row_array<T> gamma_row = normed ? gamma_row_of<Policy>(a, p) : row_array<T>();
  std::vector<row_array<T>> dgamma_parts(static_cast<std::size_t>(N * parts));
  parallel_for(N * parts, workers, [&](index_t task, int worker) {
    linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
    const index_t part = task % parts, n = task / parts;
    const sequence s = p.seq(n);
    index_t i_begin, i_end;
    part_range(s, part, i_begin, i_end);
    std::fill(slot(n, part, 0), slot(n, part, 0) + H * state_size, T(0));
    row_array<T>& dgamma_row = dgamma_parts[static_cast<std::size_t>(task)];
    if (normed && gamma_row.size() > 0) dgamma_row.setZero(HQ * Dv);
    matrix<T> dgate, act, dact, x, dr;
    vec<T> inv_den, delta;
    for (index_t i0 = i_begin; i0 < i_end; i0 += block) {
      const index_t rows = std::min(block, i_end - i0);
      const bool all_valid = load_validity(a, s, i0, rows, ws);
      const auto qb = token_block(a.q, s.batch, s.start + i0, rows, ws.k);
      ws.r.resize(rows, HQ * D);
      apply_phi<Policy::phi>(ws.r, qb);
      zero_invalid_rows(ws.r, all_valid, ws);
      // ws.num: do, rows x (HQ * Dv).
      ws.num = token_block(g.dout, s.batch, s.start + i0, rows, ws.v);
      zero_invalid_rows(ws.num, all_valid, ws);
      if constexpr (normed) {
        ws.o.resize(rows, HQ * Dv);
        for (index_t hq = 0; hq < HQ; ++hq) {
          const index_t h = hq / G;
          auto oh = ws.o.middleCols(hq * Dv, Dv);
          oh.noalias() = (scale * ws.r.middleCols(hq * D, D)) * S_of(n, h);
          if constexpr (Policy::normalize) {
            ws.den.noalias() = (scale * ws.r.middleCols(hq * D, D)) * z_of(n, h);
            ws.den = (ws.den.array() + eps).inverse().matrix();
            oh = ws.den.asDiagonal() * oh;
          }
        }
        ws.act = token_block(a.gate, s.batch, s.start + i0, rows, ws.v);
        zero_invalid_rows(ws.act, all_valid, ws);
        dgate.resize(rows, HQ * Dv);
        gated_norm_backward_block<Policy>(ws.o, ws.act, ws.num, dgate, gamma_row, dgamma_row,
                                          Policy::norm == gated_norm::per_head ? Dv : HQ * Dv,
                                          static_cast<T>(p.norm_eps), act, dact);
        for (index_t hq = 0; hq < HQ; ++hq)
          store_grad_rows(g.dgate, s, hq, i0, dgate.middleCols(hq * Dv, Dv), all_valid, ws);
      }
      for (index_t hq = 0; hq < HQ; ++hq) {
        const index_t h = hq / G;
        const auto S = S_of(n, h);
        const auto z = z_of(n, h);
        const auto rh = ws.r.middleCols(hq * D, D);
        auto gh = ws.num.middleCols(hq * Dv, Dv);  // do, then g = do / den
        if constexpr (Policy::normalize) {
          inv_den.noalias() = (scale * rh) * z;
          inv_den = (inv_den.array() + eps).inverse().matrix();
          gh = inv_den.asDiagonal() * gh;
        }
        x.noalias() = gh * S.transpose();  // S g_i per row
        T* st = slot(n, part, h);
        Eigen::Map<matrix<T>> dS(st, D, Dv);
        Eigen::Map<vec<T>> dz(st + D * Dv, D);
        dS.noalias() += (scale * rh).transpose() * gh;
        if constexpr (Policy::normalize) {
          // delta_i = -(do_i . o_i) / den_i = -(r_i . S g_i) / den_i.
          delta = -(scale * (rh.array() * x.array()).rowwise().sum() * inv_den.array()).matrix();
          dz.noalias() += (scale * rh).transpose() * delta;
          x.noalias() += delta * z.transpose();
        }
        dr = scale * x;
        times_phi_derivative<Policy::phi>(dr, qb.middleCols(hq * D, D), rh);
        store_grad_rows(g.dq, s, hq, i0, dr, all_valid, ws);
      }
    }
  });
  std::vector<T> dstate;
  combine(dstate);
  if constexpr (normed) fold_dgamma<Policy>(dgamma_parts, g, p);

  // <dS, S> + <dz, z> per (sequence, KV head): the softmax Jacobian's term of da.
  std::vector<T> jac(static_cast<std::size_t>(N * H), T(0));
  if constexpr (gated) {
    for (index_t nh = 0; nh < N * H; ++nh)
      jac[static_cast<std::size_t>(nh)] =
          Eigen::Map<const vec<T>>(state.data() + nh * state_size, state_size)
              .dot(Eigen::Map<const vec<T>>(dstate.data() + nh * state_size, state_size));
  }

  // Pass B: over keys. dk, dv, da.
  parallel_for(N * parts, workers, [&](index_t task, int worker) {
    linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
    const index_t part = task % parts, n = task / parts;
    const sequence s = p.seq(n);
    index_t j_begin, j_end;
    part_range(s, part, j_begin, j_end);
    matrix<T> e, dv;
    vec<T> dw, da_shared;
    for (index_t j0 = j_begin; j0 < j_end; j0 += block) {
      const index_t rows = std::min(block, j_end - j0);
      const bool all_valid = load_validity(a, s, j0, rows, ws);
      const auto kb = token_block(a.k, s.batch, s.start + j0, rows, ws.k);
      ws.p.resize(rows, H * D);
      apply_phi<Policy::phi>(ws.p, kb);
      zero_invalid_rows(ws.p, all_valid, ws);
      ws.v = token_block(a.v, s.batch, s.start + j0, rows, ws.scores);
      zero_invalid_rows(ws.v, all_valid, ws);
      if (gated && Hg == 1) da_shared.setZero(rows);
      for (index_t h = 0; h < H; ++h) {
        const T* dst = dstate.data() + (n * H + h) * state_size;
        const Eigen::Map<const matrix<T>> dS(dst, D, Dv);
        const Eigen::Map<const vec<T>> dz(dst + D * Dv, D);
        const auto ph = ws.p.middleCols(h * D, D);
        e.noalias() = ws.v.middleCols(h * Dv, Dv) * dS.transpose();
        if constexpr (Policy::normalize) e.rowwise() += dz.transpose();
        dv.noalias() = ph * dS;
        if constexpr (gated) {
          if (Hg != 1 || h == 0) gate_weights(s, n, Hg == 1 ? 0 : h, j0, rows, all_valid, ws, ws.w);
          // da_j = w_j (phi(k_j) . e_j - <dS, S> - <dz, z>)
          dw = (ph.array() * e.array()).rowwise().sum().matrix();
          dw.array() = ws.w.array() * (dw.array() - jac[static_cast<std::size_t>(n * H + h)]);
          if (Hg == 1) {
            da_shared += dw;
          } else {
            for (index_t r = 0; r < rows; ++r)
              g.da(s.batch, s.start + j0 + r, h) =
                  all_valid || ws.valid[static_cast<std::size_t>(r)] ? dw(r) : T(0);
          }
          dv = ws.w.asDiagonal() * dv;
          e = ws.w.asDiagonal() * e;
        }
        times_phi_derivative<Policy::phi>(e, kb.middleCols(h * D, D), ph);
        store_grad_rows(g.dk, s, h, j0, e, all_valid, ws);
        store_grad_rows(g.dv, s, h, j0, dv, all_valid, ws);
      }
      if (gated && Hg == 1)
        for (index_t r = 0; r < rows; ++r)
          g.da(s.batch, s.start + j0 + r, 0) =
              all_valid || ws.valid[static_cast<std::size_t>(r)] ? da_shared(r) : T(0);
    }
  });
}

// ---- causal (linear_causal) ---------------------------------------------------------------

// Carries cs past one chunk: P (rows x D, pad rows zero), V (rows x Dv, pad rows zero), logits
// (-inf at pads; unused without the key gate). The forward's arithmetic (causal_chunked).
template <bool Gated, class T>
void advance_state(causal_state<T>& cs, matrix<T>& P, const matrix<T>& V, const vec<T>& logits,
                   const vec<T>& ones) {
  const index_t rows = P.rows();
  if constexpr (Gated) {
    constexpr T ninf = -std::numeric_limits<T>::infinity();
    T m_last = cs.m;
    for (index_t r = 0; r < rows; ++r) m_last = std::max(m_last, logits(r));
    if (m_last == ninf) return;
    const T c = shifted_exp(cs.m, m_last);
    cs.S *= c;
    cs.z *= c;
    cs.ell *= c;
    for (index_t r = 0; r < rows; ++r) {
      const T u = shifted_exp(logits(r), m_last);
      P.row(r) *= u;
      cs.ell += u;
    }
    cs.m = m_last;
  }
  cs.S.noalias() += P.transpose() * V;
  cs.z.noalias() += P.transpose() * ones.head(rows);
}

// Scratch of one causal backward task.
template <class T>
struct causal_grad_scratch {
  matrix<T> kx, p, v, qx, phiq, r, dout, scores, wn, dov, dscore, x, dr, dphik, dv, e, dS_new;
  vec<T> logits, u, cn, beta, live, f, dn, inv, delta, kappa, da, dz_new, ones;
  std::vector<causal_state<T>> checkpoints, segment;
  std::vector<unsigned char> valid;
};

// The core backward (no gated norm) of one (sequence, KV head); dout is the gradient of the
// attention output o. da_out: where da of this head's rows goes (rows of the sequence).
template <class Policy, class T>
void causal_backward_task(const linear_attention_grad_args<T>& g, const linear_attention_args<T>& a,
                          const view4<const T>& dout, const linear_attention_problem& p, index_t n,
                          index_t h, T* da_out, causal_grad_scratch<T>& ws) {
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normalize = Policy::normalize;
  constexpr index_t C = Policy::chunk;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const index_t D = p.head_dim, Dv = p.value_dim, G = p.group();
  const index_t gh = p.gate_heads == 1 ? 0 : h;
  const T scale = static_cast<T>(p.scale), eps = static_cast<T>(p.eps);
  const sequence s = p.seq(n);
  const index_t chunks = (s.length + C - 1) / C;
  const index_t K =
      std::max<index_t>(1, static_cast<index_t>(std::ceil(std::sqrt(static_cast<double>(chunks)))));
  if (ws.ones.size() < C) ws.ones.setOnes(C);

  bool all_valid = true;
  auto is_valid = [&](index_t r) {
    return all_valid || ws.valid[static_cast<std::size_t>(r)];
  };
  // Loads chunk c: validity, kx (k rows), p = phi(k), v, logits; pad rows of p, v zero.
  auto load_keys = [&](index_t c0, index_t rows) {
    const index_t t0 = s.start + c0;
    all_valid = true;
    if (a.mask.has_value()) {
      ws.valid.resize(static_cast<std::size_t>(rows));
      for (index_t r = 0; r < rows; ++r) {
        ws.valid[static_cast<std::size_t>(r)] = a.mask(s.batch, t0 + r) != 0;
        all_valid = all_valid && ws.valid[static_cast<std::size_t>(r)];
      }
    }
    ws.kx = rows_of(&a.k(s.batch, t0, h, 0), rows, D, a.k.stride(1));
    ws.p.resize(rows, D);
    apply_phi<Policy::phi>(ws.p, ws.kx);
    ws.v = rows_of(&a.v(s.batch, t0, h, 0), rows, Dv, a.v.stride(1));
    if constexpr (gated) {
      ws.logits.resize(rows);
      for (index_t r = 0; r < rows; ++r)
        ws.logits(r) = is_valid(r) ? static_cast<T>(a.a(s.batch, t0 + r, gh)) : ninf;
    }
    if (!all_valid)
      for (index_t r = 0; r < rows; ++r)
        if (!is_valid(r)) ws.p.row(r).setZero(), ws.v.row(r).setZero();
  };

  // Forward walk: checkpoints at the start of every K-th chunk.
  causal_state<T> cs;
  load_state<Policy>(a, p, n, h, cs);
  const index_t segments = (chunks + K - 1) / K;
  ws.checkpoints.resize(static_cast<std::size_t>(std::max<index_t>(segments, 1)));
  for (index_t c = 0; c < chunks; ++c) {
    if (c % K == 0) ws.checkpoints[static_cast<std::size_t>(c / K)] = cs;
    const index_t rows = std::min(C, s.length - c * C);
    load_keys(c * C, rows);
    advance_state<gated>(cs, ws.p, ws.v, ws.logits, ws.ones);
  }

  // Gradient of the final state: dS, dz (and under the gate kappa, the gradient of the
  // log-mass), relative to the final mass.
  matrix<T> dS = matrix<T>::Zero(D, Dv);
  vec<T> dz = vec<T>::Zero(D);
  T kappa_acc = 0;
  const auto& dso = g.dstate_out;
  if (dso.S.has_value())
    for (index_t d = 0; d < D; ++d)
      for (index_t c = 0; c < Dv; ++c) dS(d, c) = dso.S(n, h, d, c);
  if (dso.z.has_value())
    for (index_t d = 0; d < D; ++d) dz(d) = dso.z(n, h, d);
  if constexpr (gated) {
    if (cs.ell > T(0)) {
      const T inv = T(1) / cs.ell;
      kappa_acc = -(dS.cwiseProduct(cs.S).sum() + dz.dot(cs.z)) * inv;
      if (dso.lse.has_value()) kappa_acc += static_cast<T>(dso.lse(n, h));
    }
  }

  // Reverse walk.
  for (index_t seg = segments - 1; seg >= 0; --seg) {
    const index_t c_first = seg * K, c_last = std::min(chunks, c_first + K);
    ws.segment.resize(static_cast<std::size_t>(K + 1));
    ws.segment[0] = ws.checkpoints[static_cast<std::size_t>(seg)];
    for (index_t c = c_first; c < c_last; ++c) {
      causal_state<T>& next = ws.segment[static_cast<std::size_t>(c - c_first + 1)];
      next = ws.segment[static_cast<std::size_t>(c - c_first)];
      const index_t rows = std::min(C, s.length - c * C);
      load_keys(c * C, rows);
      advance_state<gated>(next, ws.p, ws.v, ws.logits, ws.ones);
    }
    for (index_t c = c_last - 1; c >= c_first; --c) {
      const causal_state<T>& cs0 = ws.segment[static_cast<std::size_t>(c - c_first)];
      const causal_state<T>& cs1 = ws.segment[static_cast<std::size_t>(c - c_first + 1)];
      const index_t c0 = c * C, rows = std::min(C, s.length - c0), t0 = s.start + c0;
      load_keys(c0, rows);

      // Normalised weights: wn(i, j) = w_ij of key j in row i's prefix softmax, cn_i the weight
      // of the carried (unnormalised) state, beta_i = L_start / L_i, f_j = exp(a_j) / L_end,
      // rho = L_start / L_end.
      T rho = 1;
      if constexpr (gated) {
        ws.u.resize(rows);
        T m_run = cs0.m;
        for (index_t r = 0; r < rows; ++r) ws.u(r) = m_run = std::max(m_run, ws.logits(r));
        ws.wn.setZero(rows, rows);
        ws.cn.resize(rows);
        ws.beta.resize(rows);
        ws.live.resize(rows);
        for (index_t i = 0; i < rows; ++i) {
          const T carry = shifted_exp(cs0.m, ws.u(i));
          T ell = carry * cs0.ell;
          for (index_t j = 0; j <= i; ++j)
            ell += (ws.wn(i, j) = shifted_exp(ws.logits(j), ws.u(i)));
          const T inv = ell > T(0) ? T(1) / ell : T(0);
          ws.live(i) = ell > T(0) ? T(1) : T(0);
          ws.wn.row(i) *= inv;
          ws.cn(i) = carry * inv;
          ws.beta(i) = ws.cn(i) * cs0.ell;
        }
        ws.f.resize(rows);
        const T inv_end = cs1.ell > T(0) ? T(1) / cs1.ell : T(0);
        for (index_t j = 0; j < rows; ++j) ws.f(j) = shifted_exp(ws.logits(j), cs1.m) * inv_end;
        rho = shifted_exp(cs0.m, cs1.m) * cs0.ell * inv_end;
      }

      // Through the state after this chunk (the rows after it): e_j = dS v_j + dz.
      ws.e.noalias() = ws.v * dS.transpose();
      ws.e.rowwise() += dz.transpose();
      ws.dv.noalias() = ws.p * dS;
      if constexpr (gated) {
        ws.da = ((ws.p.array() * ws.e.array()).rowwise().sum() + kappa_acc).matrix();
        ws.da.array() *= ws.f.array();
        ws.dphik = ws.f.asDiagonal() * ws.e;
        ws.dv = ws.f.asDiagonal() * ws.dv;
      } else {
        ws.dphik = ws.e;
      }
      ws.dS_new = rho * dS;
      ws.dz_new = rho * dz;
      T kappa_new = rho * kappa_acc;

      for (index_t hq = h * G; hq < (h + 1) * G; ++hq) {
        ws.qx = rows_of(&a.q(s.batch, t0, hq, 0), rows, D, a.q.stride(1));
        ws.phiq.resize(rows, D);
        apply_phi<Policy::phi>(ws.phiq, ws.qx);
        ws.dout = rows_of(&dout(s.batch, t0, hq, 0), rows, Dv, dout.stride(1));
        if (!all_valid)
          for (index_t r = 0; r < rows; ++r)
            if (!is_valid(r)) ws.phiq.row(r).setZero(), ws.dout.row(r).setZero();
        ws.r = scale * ws.phiq;
        // scores = R P^T masked to j <= i (and weighted): A.
        ws.scores.noalias() = ws.r * ws.p.transpose();
        ws.dov.noalias() = ws.dout * ws.v.transpose();
        ws.x.noalias() = ws.dout * cs0.S.transpose();  // S_c do_i per row
        if constexpr (gated) {
          ws.dscore = ws.scores.cwiseProduct(ws.wn);  // A
        } else {
          ws.dscore = ws.scores;
          ws.dscore.template triangularView<Eigen::StrictlyUpper>().setZero();
        }
        // do . num_i = cn_i r_i . (S_c do_i) + sum_j A_ij do_i . v_j
        vec<T>& don = ws.delta;
        don = (ws.r.array() * ws.x.array()).rowwise().sum().matrix();
        if constexpr (gated) don.array() *= ws.cn.array();
        don.array() += (ws.dscore.array() * ws.dov.array()).rowwise().sum();
        // dn: the denominator of row i (1 without the normaliser).
        if constexpr (normalize) {
          ws.dn.noalias() = ws.r * cs0.z;
          if constexpr (gated) ws.dn.array() *= ws.cn.array();
          ws.dn.array() += ws.dscore.rowwise().sum().array() + eps;
          ws.inv = ws.dn.array().inverse().matrix();
          // A row that has seen no key with a finite logit is 0 and passes no gradient.
          if constexpr (gated) ws.inv.array() *= ws.live.array();
        }
        // g_i = do_i / dn_i, delta_i = -(do_i . o_i) / dn_i, kappa_i: the gradient of row i's
        // log-mass (eps delta_i with the normaliser, -(do_i . o_i) without).
        if constexpr (normalize) {
          ws.delta = -(don.array() * ws.inv.array().square()).matrix();
          if constexpr (gated) ws.kappa = eps * ws.delta;
          ws.dout = ws.inv.asDiagonal() * ws.dout;  // now g
          ws.x = ws.inv.asDiagonal() * ws.x;
          ws.dov = ws.inv.asDiagonal() * ws.dov;
        } else if constexpr (gated) {
          ws.kappa = -don;
        }
        // Inter: dr_i = cn_i (S_c g_i + delta_i z_c); intra: dscore = wn (g_i . v_j + delta_i).
        ws.dr = ws.x;
        if constexpr (normalize) ws.dr.noalias() += ws.delta * cs0.z.transpose();
        if constexpr (gated) ws.dr = ws.cn.asDiagonal() * ws.dr;
        // Keep A for dv before dscore overwrites it.
        ws.dv.noalias() += ws.dscore.transpose() * ws.dout;
        if constexpr (normalize) ws.dov.colwise() += ws.delta;
        if constexpr (gated) {
          ws.dov.array() *= ws.wn.array();
        } else {
          ws.dov.template triangularView<Eigen::StrictlyUpper>().setZero();
        }
        ws.dscore.swap(ws.dov);  // dscore
        ws.dr.noalias() += ws.dscore * ws.p;
        ws.dphik.noalias() += ws.dscore.transpose() * ws.r;
        if constexpr (gated) {
          ws.da.array() += (ws.scores.array() * ws.dscore.array()).colwise().sum().transpose();
          ws.da.noalias() += ws.wn.transpose() * ws.kappa;
          kappa_new += ws.beta.dot(ws.kappa);
          ws.dout = ws.beta.asDiagonal() * ws.dout;
          if constexpr (normalize) ws.delta.array() *= ws.beta.array();
        }
        ws.dS_new.noalias() += ws.r.transpose() * ws.dout;
        if constexpr (normalize) ws.dz_new.noalias() += ws.r.transpose() * ws.delta;
        // dq = scale * dr * phi'(q)
        ws.dr *= scale;
        times_phi_derivative<Policy::phi>(ws.dr, ws.qx, ws.phiq);
        auto dq = rows_of(&g.dq(s.batch, t0, hq, 0), rows, D, g.dq.stride(1));
        dq = ws.dr;
        if (!all_valid)
          for (index_t r = 0; r < rows; ++r)
            if (!is_valid(r)) dq.row(r).setZero();
      }
      times_phi_derivative<Policy::phi>(ws.dphik, ws.kx, ws.p);
      auto dk = rows_of(&g.dk(s.batch, t0, h, 0), rows, D, g.dk.stride(1));
      auto dv = rows_of(&g.dv(s.batch, t0, h, 0), rows, Dv, g.dv.stride(1));
      dk = ws.dphik;
      dv = ws.dv;
      for (index_t r = 0; r < rows; ++r) {
        const bool ok = is_valid(r);
        if (!ok) dk.row(r).setZero(), dv.row(r).setZero();
        if constexpr (gated) da_out[c0 + r] = ok ? ws.da(r) : T(0);
      }
      dS.swap(ws.dS_new);
      dz.swap(ws.dz_new);
      kappa_acc = kappa_new;
    }
  }

  // The initial state: dS, dz are relative to its own mass; d lse = <S0, dS> + <z0, dz> + kappa.
  const auto& dsi = g.dstate_in;
  const auto& si = g.state_in;
  if (dsi.S.has_value())
    for (index_t d = 0; d < D; ++d)
      for (index_t c = 0; c < Dv; ++c) dsi.S(n, h, d, c) = dS(d, c);
  if (dsi.z.has_value())
    for (index_t d = 0; d < D; ++d) dsi.z(n, h, d) = dz(d);
  if constexpr (gated) {
    if (dsi.lse.has_value()) {
      T dl = 0;
      if (si.lse(n, h) != ninf) {
        dl = kappa_acc;
        for (index_t d = 0; d < D; ++d) {
          for (index_t c = 0; c < Dv; ++c) dl += si.S(n, h, d, c) * dS(d, c);
          if (si.z.has_value()) dl += si.z(n, h, d) * dz(d);
        }
      }
      dsi.lse(n, h) = dl;
    }
  }
}

// A policy with the gated norm off: the core that a causal gated norm wraps.
template <class Policy>
struct without_gated_norm : Policy {
  static constexpr gated_norm norm = gated_norm::off;
};

template <class Policy, class T>
void causal_backward(const linear_attention_grad_args<T>& g, const linear_attention_problem& p,
                     const backend::cpu& be) {
  static_assert(std::is_same_v<accum_t<T>, T>, "attnmix: CPU linear attention computes in T");
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr bool normed = Policy::norm != gated_norm::off;
  using core = without_gated_norm<Policy>;
  const linear_attention_args<T> a = forward_view(g);
  const index_t N = p.num_sequences, H = p.kv_heads, HQ = p.q_heads, Dv = p.value_dim, B = p.batch,
                Tn = p.tokens;

  // Through the gated norm: recompute o, then do = the norm's backward of dout.
  std::vector<T> do_buf;
  view4<const T> dout = g.dout;
  if constexpr (normed) {
    do_buf.resize(static_cast<std::size_t>(B * Tn * HQ * Dv));
    const view4<T> o_view(do_buf.data(), {B, Tn, HQ, Dv});
    linear_attention_args<T> fa = a;
    fa.out = o_view;
    fa.gate = {};
    fa.gamma = {};
    causal_forward<core>(fa, p, be);
    const index_t W = HQ * Dv;
    constexpr index_t rows_per_task = 256;
    struct task {
      index_t seq, t0;
    };
    std::vector<task> tasks;
    for (index_t n = 0; n < N; ++n)
      for (index_t t0 = 0; t0 < p.seq(n).length; t0 += rows_per_task) tasks.push_back({n, t0});
    const row_array<T> gamma_row = gamma_row_of<Policy>(a, p);
    std::vector<row_array<T>> dgamma_parts(tasks.size());
    const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
    std::vector<linear_scratch<T>> scratch(static_cast<std::size_t>(workers));
    parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t ti, int worker) {
      linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
      const task tk = tasks[static_cast<std::size_t>(ti)];
      const sequence s = p.seq(tk.seq);
      const index_t rows = std::min(rows_per_task, s.length - tk.t0);
      const bool all_valid = load_validity(a, s, tk.t0, rows, ws);
      auto ob = rows_of(&o_view(s.batch, s.start + tk.t0, 0, 0), rows, W, W);
      ws.o = ob;
      ws.act = token_block(a.gate, s.batch, s.start + tk.t0, rows, ws.k);
      ws.num = token_block(g.dout, s.batch, s.start + tk.t0, rows, ws.v);
      zero_invalid_rows(ws.o, all_valid, ws);
      zero_invalid_rows(ws.act, all_valid, ws);
      zero_invalid_rows(ws.num, all_valid, ws);
      row_array<T>& dgamma_row = dgamma_parts[static_cast<std::size_t>(ti)];
      if (gamma_row.size() > 0) dgamma_row.setZero(W);
      matrix<T> dgate, act, dact;
      dgate.resize(rows, W);
      gated_norm_backward_block<Policy>(ws.o, ws.act, ws.num, dgate, gamma_row, dgamma_row,
                                        Policy::norm == gated_norm::per_head ? Dv : W,
                                        static_cast<T>(p.norm_eps), act, dact);
      for (index_t hq = 0; hq < HQ; ++hq)
        store_grad_rows(g.dgate, s, hq, tk.t0, dgate.middleCols(hq * Dv, Dv), all_valid, ws);
      ob = ws.num;  // do, pad rows 0
    });
    fold_dgamma<Policy>(dgamma_parts, g, p);
    dout = view4<const T>(do_buf.data(), {B, Tn, HQ, Dv});
  }

  // da of a shared gate sums over the KV heads: one row per head, summed in head order.
  const bool shared_sum = gated && p.gate_heads == 1 && H > 1;
  std::vector<T> da_heads(shared_sum ? static_cast<std::size_t>(H * Tn * std::max<index_t>(B, 1))
                                     : 0);
  const index_t tasks = N * H;
  const int workers = worker_count(be, tasks);
  std::vector<causal_grad_scratch<T>> scratch(static_cast<std::size_t>(workers));
  std::vector<std::vector<T>> da_rows(static_cast<std::size_t>(workers));
  parallel_for(tasks, workers, [&](index_t task, int worker) {
    const index_t n = task / H, h = task % H;
    const sequence s = p.seq(n);
    T* da_out = nullptr;
    std::vector<T>& rows_buf = da_rows[static_cast<std::size_t>(worker)];
    if constexpr (gated) {
      if (shared_sum) {
        da_out = da_heads.data() + (h * B + s.batch) * Tn + s.start;
      } else {
        rows_buf.resize(static_cast<std::size_t>(std::max<index_t>(s.length, 1)));
        da_out = rows_buf.data();
      }
    }
    causal_backward_task<core>(g, a, dout, p, n, h, da_out,
                               scratch[static_cast<std::size_t>(worker)]);
    if constexpr (gated) {
      if (!shared_sum) {
        const index_t gh = p.gate_heads == 1 ? 0 : h;
        for (index_t t = 0; t < s.length; ++t) g.da(s.batch, s.start + t, gh) = da_out[t];
      }
    }
  });
  if constexpr (gated) {
    if (shared_sum) {
      for (index_t n = 0; n < N; ++n) {
        const sequence s = p.seq(n);
        for (index_t t = s.start; t < s.start + s.length; ++t) {
          T sum = 0;
          for (index_t h = 0; h < H; ++h)
            sum += da_heads[static_cast<std::size_t>((h * B + s.batch) * Tn + t)];
          g.da(s.batch, t, 0) = sum;
        }
      }
    }
  }
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
