#pragma once
// Shared internals of the CPU linear-attention kinds (cpu/bla.hpp, cpu/gbla.hpp,
// cpu/linear_causal.hpp):
//  * bidirectional_forward: the two-pass reduce-then-read algorithm of spec gbla.md §3.2. Pass 1
//    reduces S = P^T V and z = P^T 1 per (sequence, KV head), one task per (sequence, token
//    range) over every head, split into as many ranges as keep the threads busy, then combines
//    the partial states; pass 2 reads o = (R S) / (R z + eps) per block of query rows with the
//    gated-norm epilogue fused. With several ranges per sequence the summation order, and so
//    the rounding, depends on the thread count.
//  * causal_forward: the chunked form (one carried state plus a masked chunk x chunk product per
//    chunk) and the recurrent form (one rank-1 update per token) of spec §4, with the key gate
//    as a prefix softmax kept stable by a running max. One task per (sequence, KV head), so a
//    single long sequence with few heads uses few threads.
// Everything is O(T D Dv) time and O(D Dv) state per head; nothing is T x T.

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
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/math/feature_map.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

template <class T>
using vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
template <class T>
using row_array = Eigen::Array<T, 1, Eigen::Dynamic>;

// dst = phi(src) element-wise, vectorised; the same function as attnmix::apply_feature_map.
template <feature_map F, class Dst, class Src>
void apply_phi(Dst&& dst, const Src& src) {
  using T = typename Src::Scalar;
  const auto x = src.array();
  if constexpr (F == feature_map::elu_plus_one) {
    // exp(min(x, 0)) + max(x, 0): the same function, but without a select, which Eigen 3.4
    // evaluates one scalar std::exp at a time.
    dst.array() = x.min(T(0)).exp() + x.max(T(0));
  } else if constexpr (F == feature_map::relu) {
    dst.array() = x.max(T(0));
  } else if constexpr (F == feature_map::squared_relu) {
    dst.array() = x.max(T(0)).square();
  } else if constexpr (F == feature_map::sigmoid) {
    dst.array() = (T(1) + (-x).exp()).inverse();
  } else {
    dst.array() = x;
  }
}

// Per-thread scratch, O(block * heads * (D + Dv) + chunk^2) elements.
template <class T>
struct linear_scratch {
  matrix<T> k, v, p, r, num, scores, weights, act, o;
  vec<T> den, carry, ell, w, u, rstd;
  vec<T> ones;  // column sums as products: z += P^T 1
  std::vector<unsigned char> valid;
};

// The validity of tokens [t0, t0 + rows) of one sequence into ws.valid; returns true when all
// are valid (ws.valid is then left unset).
template <class T>
bool load_validity(const linear_attention_args<T>& a, const sequence& s, index_t t0, index_t rows,
                   linear_scratch<T>& ws) {
  if (!a.mask.has_value()) return true;
  ws.valid.resize(static_cast<std::size_t>(rows));
  bool all = true;
  for (index_t r = 0; r < rows; ++r) {
    const bool ok = a.mask(s.batch, s.start + t0 + r) != 0;
    ws.valid[static_cast<std::size_t>(r)] = ok;
    all = all && ok;
  }
  return all;
}

// dst = act(g) element-wise (SiLU or sigmoid per Policy::activation), vectorised.
template <class Policy, class Dst, class Src>
void apply_gate_activation_block(Dst&& dst, const Src& g_block) {
  using T = typename Src::Scalar;
  const auto g = g_block.array();
  if constexpr (Policy::activation == gate_activation::silu) {
    dst.array() = g * (T(1) + (-g).exp()).inverse();
  } else {
    dst.array() = (T(1) + (-g).exp()).inverse();
  }
}

// Gated RMSNorm of the rows of `num` (rows x Dv, query head hq) in place, with `act` the
// activated output gate of the same rows. Per head: statistics over the Dv values of a row.
template <class Policy, class T, class Num, class Act>
void gated_norm_block(const linear_attention_args<T>& a, const linear_attention_problem& p,
                      index_t hq, Num& num, const Act& act, linear_scratch<T>& ws) {
  const index_t Dv = p.value_dim;
  auto x = num.array();
  if constexpr (Policy::order == norm_gate_order::gate_then_norm) x *= act.array();
  ws.rstd = (num.rowwise().squaredNorm().array() / T(Dv) + T(p.norm_eps)).rsqrt().matrix();
  num = ws.rstd.asDiagonal() * num;  // (a broadcast column would go one scalar at a time)
  if constexpr (Policy::order == norm_gate_order::norm_then_gate) x *= act.array();
  if (a.gamma.has_value()) {
    const T* gamma = a.gamma.data() + (Policy::weight == norm_weight::per_head ? hq * Dv : 0);
    x.rowwise() *= Eigen::Map<const row_array<T>>(gamma, Dv);
  }
}

// The same for tokens [t0, t0 + rows) of (s, hq), reading that head's gate rows.
template <class Policy, class T, class Num>
void gated_norm_rows(const linear_attention_args<T>& a, const linear_attention_problem& p,
                     const sequence& s, index_t hq, index_t t0, Num& num, linear_scratch<T>& ws) {
  const index_t rows = num.rows(), Dv = p.value_dim;
  ws.act.resize(rows, Dv);
  apply_gate_activation_block<Policy>(
      ws.act, rows_of(&a.gate(s.batch, s.start + t0, hq, 0), rows, Dv, a.gate.stride(1)));
  gated_norm_block<Policy>(a, p, hq, num, ws.act, ws);
}

// Applies the per-head epilogue to num (rows x Dv) and writes it to out rows [t0, t0 + rows) of
// (s, hq). Pad rows (ws.valid, when `all_valid` is false) are zeroed or left alone.
template <class Policy, class T, class Num>
void write_rows(const linear_attention_args<T>& a, const linear_attention_problem& p,
                const sequence& s, index_t hq, index_t t0, Num& num, bool all_valid,
                linear_scratch<T>& ws) {
  if constexpr (Policy::norm == gated_norm::per_head)
    gated_norm_rows<Policy>(a, p, s, hq, t0, num, ws);
  const index_t rows = num.rows(), Dv = p.value_dim;
  auto out = rows_of(&a.out(s.batch, s.start + t0, hq, 0), rows, Dv, a.out.stride(1));
  if (all_valid) {
    out = num;
    return;
  }
  for (index_t r = 0; r < rows; ++r) {
    if (ws.valid[static_cast<std::size_t>(r)])
      out.row(r) = num.row(r);
    else if (Policy::zero_pad_rows)
      out.row(r).setZero();
  }
}

// Writes o (rows x (HQ * Dv), every query head) to out rows [t0, t0 + rows) of s. Pad rows
// (ws.valid, when `all_valid` is false) are zeroed or left alone.
template <class Policy, class T, class Block>
void store_block(const linear_attention_args<T>& a, const sequence& s, index_t t0, const Block& o,
                 bool all_valid, const linear_scratch<T>& ws) {
  const index_t rows = o.rows(), HQ = a.out.extent(2), Dv = a.out.extent(3);
  auto row_ok = [&](index_t r) {
    return all_valid || ws.valid[static_cast<std::size_t>(r)];
  };
  if (HQ == 1 || a.out.stride(2) == Dv) {
    auto out = rows_of(&a.out(s.batch, s.start + t0, 0, 0), rows, HQ * Dv, a.out.stride(1));
    if (all_valid) {
      out = o;
      return;
    }
    for (index_t r = 0; r < rows; ++r) {
      if (row_ok(r))
        out.row(r) = o.row(r);
      else if (Policy::zero_pad_rows)
        out.row(r).setZero();
    }
    return;
  }
  for (index_t hq = 0; hq < HQ; ++hq) {
    auto out = rows_of(&a.out(s.batch, s.start + t0, hq, 0), rows, Dv, a.out.stride(1));
    for (index_t r = 0; r < rows; ++r) {
      if (row_ok(r))
        out.row(r) = o.row(r).segment(hq * Dv, Dv);
      else if (Policy::zero_pad_rows)
        out.row(r).setZero();
    }
  }
}

// The full-width gated RMSNorm, after every head of `out` holds o: statistics over the HQ * Dv
// values of a token.
template <class Policy, class T>
void full_width_norm(const linear_attention_args<T>& a, const linear_attention_problem& p,
                     const backend::cpu& be) {
  const index_t HQ = p.q_heads, Dv = p.value_dim, W = HQ * Dv;
  constexpr index_t rows_per_task = 256;
  struct task {
    index_t seq, t0;
  };
  std::vector<task> tasks;
  for (index_t n = 0; n < p.num_sequences; ++n)
    for (index_t t0 = 0; t0 < p.seq(n).length; t0 += rows_per_task) tasks.push_back({n, t0});
  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<row_array<T>> scratch(static_cast<std::size_t>(workers) * 2);
  parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t ti, int worker) {
    const task tk = tasks[static_cast<std::size_t>(ti)];
    const sequence s = p.seq(tk.seq);
    row_array<T>& x = scratch[static_cast<std::size_t>(worker) * 2];
    row_array<T>& act = scratch[static_cast<std::size_t>(worker) * 2 + 1];
    x.resize(W);
    act.resize(W);
    const index_t t1 = std::min(s.length, tk.t0 + rows_per_task);
    for (index_t t = s.start + tk.t0; t < s.start + t1; ++t) {
      if (a.mask.has_value() && a.mask(s.batch, t) == 0) continue;
      for (index_t h = 0; h < HQ; ++h)
        for (index_t c = 0; c < Dv; ++c) {
          x(h * Dv + c) = a.out(s.batch, t, h, c);
          act(h * Dv + c) = apply_gate_activation<Policy::activation>(a.gate(s.batch, t, h, c));
        }
      if constexpr (Policy::order == norm_gate_order::gate_then_norm) x *= act;
      x *= T(1) / std::sqrt(x.square().sum() / T(W) + T(p.norm_eps));
      if constexpr (Policy::order == norm_gate_order::norm_then_gate) x *= act;
      for (index_t h = 0; h < HQ; ++h)
        for (index_t c = 0; c < Dv; ++c) {
          T y = x(h * Dv + c);
          if (a.gamma.has_value())
            y *= a.gamma(Policy::weight == norm_weight::per_head ? h * Dv + c : c);
          a.out(s.batch, t, h, c) = y;
        }
    }
  });
}

// Key-gate softmax statistics of one (sequence, gate head) over its valid tokens: the max M and
// 1 / sum exp(a - M), so that w_j = exp(a_j - M) * inv_sum. An empty sequence has inv_sum 0.
struct gate_stats {
  double max = -std::numeric_limits<double>::infinity();
  double inv_sum = 0;
};

template <class T>
std::vector<gate_stats> key_gate_stats(const linear_attention_args<T>& a,
                                       const linear_attention_problem& p) {
  const index_t Hg = p.gate_heads;
  std::vector<gate_stats> st(static_cast<std::size_t>(p.num_sequences * Hg));
  for (index_t n = 0; n < p.num_sequences; ++n) {
    const sequence s = p.seq(n);
    for (index_t g = 0; g < Hg; ++g) {
      gate_stats& gs = st[static_cast<std::size_t>(n * Hg + g)];
      for (index_t t = s.start; t < s.start + s.length; ++t)
        if (!a.mask.has_value() || a.mask(s.batch, t) != 0)
          gs.max = std::max(gs.max, static_cast<double>(a.a(s.batch, t, g)));
      if (gs.max == -std::numeric_limits<double>::infinity()) continue;
      double sum = 0;
      for (index_t t = s.start; t < s.start + s.length; ++t)
        if (!a.mask.has_value() || a.mask(s.batch, t) != 0)
          sum += std::exp(static_cast<double>(a.a(s.batch, t, g)) - gs.max);
      gs.inv_sum = 1.0 / sum;
    }
  }
  return st;
}

// ---- bidirectional (bla, gbla) ------------------------------------------------------------

// Tokens [t0, t0 + rows) of every head of a [B, T, Hx, W] view as one rows x (Hx * W) block:
// a map when the heads are packed (the usual layout), else a copy into `buf`. Walking all
// heads of a token block together streams through memory; one head at a time would touch a
// few cache lines of every page, which costs the CPU path about 2x.
template <class T>
const_rows<T> token_block(const view4<const T>& x, index_t b, index_t t0, index_t rows,
                          matrix<T>& buf) {
  const index_t heads = x.extent(2), W = x.extent(3);
  if (heads == 1 || x.stride(2) == W) return rows_of(&x(b, t0, 0, 0), rows, heads * W, x.stride(1));
  buf.resize(rows, heads * W);
  for (index_t r = 0; r < rows; ++r)
    for (index_t h = 0; h < heads; ++h)
      buf.row(r).segment(h * W, W) = rows_of(&x(b, t0 + r, h, 0), 1, W, W);
  return rows_of(static_cast<const T*>(buf.data()), rows, heads * W, heads * W);
}

template <class Policy, class T>
void bidirectional_forward(const linear_attention_args<T>& a, const linear_attention_problem& p,
                           const backend::cpu& be) {
  static_assert(std::is_same_v<accum_t<T>, T>, "attnmix: CPU linear attention computes in T");
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr index_t block = Policy::block;
  const index_t N = p.num_sequences, H = p.kv_heads, D = p.head_dim, Dv = p.value_dim;
  const index_t state_size = D * Dv + D;

  std::vector<gate_stats> stats;
  if constexpr (gated) stats = key_gate_stats(a, p);
  auto stats_of = [&](index_t n, index_t h) {
    return stats[static_cast<std::size_t>(n * p.gate_heads + (p.gate_heads == 1 ? 0 : h))];
  };

  // Pass 1 runs one task per (sequence, part), every head at once. Split the sequences into
  // parts only as far as needed to keep every thread busy: the workspace is one state per
  // (sequence, part, head).
  const int threads = worker_count(be, std::numeric_limits<int>::max());
  index_t max_blocks = 0;
  for (index_t n = 0; n < N; ++n)
    max_blocks = std::max(max_blocks, (p.seq(n).length + block - 1) / block);
  const index_t parts =
      N == 0 ? 1 : std::max<index_t>(1, std::min((4 * threads + N - 1) / N, max_blocks));
  std::vector<T> states(static_cast<std::size_t>(N * parts * H * state_size));
  auto slot = [&](index_t n, index_t part, index_t h) {
    return states.data() + ((n * parts + part) * H + h) * state_size;
  };

  {
    const int workers = worker_count(be, N * parts);
    std::vector<linear_scratch<T>> scratch(static_cast<std::size_t>(workers));
    parallel_for(N * parts, workers, [&](index_t task, int worker) {
      linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
      const index_t part = task % parts, n = task / parts;
      const sequence s = p.seq(n);
      const index_t blocks = (s.length + block - 1) / block;
      const index_t j_begin = std::min(s.length, (blocks * part / parts) * block);
      const index_t j_end = std::min(s.length, (blocks * (part + 1) / parts) * block);
      std::fill(slot(n, part, 0), slot(n, part, 0) + H * state_size, T(0));
      if (ws.ones.size() != block) ws.ones.setOnes(block);
      for (index_t j0 = j_begin; j0 < j_end; j0 += block) {
        const index_t rows = std::min(block, j_end - j0);
        const bool all_valid = load_validity(a, s, j0, rows, ws);
        const auto kb = token_block(a.k, s.batch, s.start + j0, rows, ws.k);
        const auto vb = token_block(a.v, s.batch, s.start + j0, rows, ws.v);
        index_t kept = rows;
        if (all_valid) {
          ws.p.resize(rows, H * D);
          apply_phi<Policy::phi>(ws.p, kb);
        } else {
          // Drop pad tokens: they must not reach S or z, and their k, v may hold anything.
          // (ws.k, ws.v may back kb, vb; gather into the scratch rows that are free.)
          ws.r.resize(rows, H * D);
          ws.num.resize(rows, H * Dv);
          kept = 0;
          for (index_t r = 0; r < rows; ++r) {
            if (!ws.valid[static_cast<std::size_t>(r)]) continue;
            ws.r.row(kept) = kb.row(r);
            ws.num.row(kept) = vb.row(r);
            ++kept;
          }
          if (kept == 0) continue;
          ws.p.resize(kept, H * D);
          apply_phi<Policy::phi>(ws.p, ws.r.topRows(kept));
        }
        for (index_t h = 0; h < H; ++h) {
          auto ph = ws.p.middleCols(h * D, D);
          if constexpr (gated) {
            // Shared gate: the weights of head 0 serve every head; compute them once.
            if (p.gate_heads != 1 || h == 0) {
              const gate_stats gs = stats_of(n, h);
              ws.w.resize(kept);
              for (index_t r = 0, i = 0; r < rows; ++r) {
                if (!all_valid && !ws.valid[static_cast<std::size_t>(r)]) continue;
                const double logit =
                    static_cast<double>(a.a(s.batch, s.start + j0 + r, p.gate_heads == 1 ? 0 : h));
                // Every key gated off (all logits -inf): weight 0, as for an all-masked sequence.
                ws.w(i++) =
                    gs.inv_sum > 0 ? static_cast<T>(std::exp(logit - gs.max) * gs.inv_sum) : T(0);
              }
            }
            ph = ws.w.asDiagonal() * ph;
          }
          T* st = slot(n, part, h);
          Eigen::Map<matrix<T>> S(st, D, Dv);
          Eigen::Map<vec<T>> z(st + D * Dv, D);
          if (all_valid)
            S.noalias() += ph.transpose() * vb.middleCols(h * Dv, Dv);
          else
            S.noalias() += ph.transpose() * ws.num.topRows(kept).middleCols(h * Dv, Dv);
          z.noalias() += ph.transpose() * ws.ones.head(kept);
        }
      }
    });
  }

  // Combine the parts into part 0 and hand out the state.
  if (parts > 1) {
    parallel_for(N * H, worker_count(be, N * H), [&](index_t nh, int) {
      const index_t n = nh / H, h = nh % H;
      Eigen::Map<vec<T>> total(slot(n, 0, h), state_size);
      for (index_t part = 1; part < parts; ++part)
        total += Eigen::Map<const vec<T>>(slot(n, part, h), state_size);
    });
  }
  const auto& so = a.state_out;
  for (index_t n = 0; n < N; ++n)
    for (index_t h = 0; h < H; ++h) {
      const T* st = slot(n, 0, h);
      if (so.S.has_value())
        for (index_t d = 0; d < D; ++d)
          for (index_t c = 0; c < Dv; ++c) so.S(n, h, d, c) = st[d * Dv + c];
      if (so.z.has_value())
        for (index_t d = 0; d < D; ++d) so.z(n, h, d) = st[D * Dv + d];
      if constexpr (gated) {
        if (so.lse.has_value()) {
          const gate_stats gs = stats_of(n, h);
          so.lse(n, h) = static_cast<T>(gs.inv_sum > 0 ? gs.max - std::log(gs.inv_sum) : gs.max);
        }
      }
    }

  // Pass 2: read, one task per (sequence, block of query rows), every query head at once.
  struct task {
    index_t seq, i0;
  };
  std::vector<task> tasks;
  for (index_t n = 0; n < N; ++n)
    for (index_t i0 = 0; i0 < p.seq(n).length; i0 += block) tasks.push_back({n, i0});
  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<linear_scratch<T>> scratch(static_cast<std::size_t>(workers));
  const T scale = static_cast<T>(p.scale), eps = static_cast<T>(p.eps);
  parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t ti, int worker) {
    linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
    const task tk = tasks[static_cast<std::size_t>(ti)];
    const sequence s = p.seq(tk.seq);
    const index_t rows = std::min(block, s.length - tk.i0);
    ws.r.resize(rows, p.q_heads * D);
    apply_phi<Policy::phi>(ws.r, token_block(a.q, s.batch, s.start + tk.i0, rows, ws.k));
    ws.r *= scale;
    const bool all_valid = load_validity(a, s, tk.i0, rows, ws);
    constexpr bool per_head_norm = Policy::norm == gated_norm::per_head;
    if constexpr (per_head_norm) {
      ws.act.resize(rows, p.q_heads * Dv);
      apply_gate_activation_block<Policy>(
          ws.act, token_block(a.gate, s.batch, s.start + tk.i0, rows, ws.k));
    }
    // Every head's output goes to one rows x (HQ * Dv) block, stored in memory order at the end.
    ws.o.resize(rows, p.q_heads * Dv);
    for (index_t hq = 0; hq < p.q_heads; ++hq) {
      const T* st = slot(tk.seq, 0, hq / p.group());
      const Eigen::Map<const matrix<T>> S(st, D, Dv);
      const Eigen::Map<const vec<T>> z(st + D * Dv, D);
      const auto rh = ws.r.middleCols(hq * D, D);
      ws.num.noalias() = rh * S;
      if constexpr (Policy::normalize) {
        ws.den.noalias() = rh * z;
        // A diagonal product: Eigen 3.4 divides by a broadcast column one scalar at a time.
        ws.den = (ws.den.array() + eps).inverse().matrix();
        ws.num = ws.den.asDiagonal() * ws.num;
      }
      if constexpr (per_head_norm)
        gated_norm_block<Policy>(a, p, hq, ws.num, ws.act.middleCols(hq * Dv, Dv), ws);
      ws.o.middleCols(hq * Dv, Dv) = ws.num;
    }
    store_block<Policy>(a, s, tk.i0, ws.o, all_valid, ws);
  });
  if constexpr (Policy::norm == gated_norm::full_width) full_width_norm<Policy>(a, p, be);
}

// ---- causal (linear_causal) ---------------------------------------------------------------

// The carried state of one (sequence, KV head). With the key gate, S, z and ell are scaled by
// exp(-m) for the running max m of the logits seen so far: S = sum_j exp(a_j - m) phi(k_j) v_j^T,
// ell = sum_j exp(a_j - m). Without it, m = 0 and ell = 1 throughout.
template <class T>
struct causal_state {
  matrix<T> S;
  vec<T> z;
  T ell = 1;
  T m = 0;
};

template <class Policy, class T>
void load_state(const linear_attention_args<T>& a, const linear_attention_problem& p, index_t n,
                index_t h, causal_state<T>& cs) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const index_t D = p.head_dim, Dv = p.value_dim;
  const auto& si = a.state_in;
  cs.S.setZero(D, Dv);
  cs.z.setZero(D);
  cs.ell = gated ? T(0) : T(1);
  cs.m = gated ? -std::numeric_limits<T>::infinity() : T(0);
  if (!si.S.has_value()) return;
  for (index_t d = 0; d < D; ++d)
    for (index_t c = 0; c < Dv; ++c) cs.S(d, c) = si.S(n, h, d, c);
  if (si.z.has_value())
    for (index_t d = 0; d < D; ++d) cs.z(d) = si.z(n, h, d);
  if constexpr (gated) {
    // The stored state is normalised: S = sum_j w_j p_j v_j^T with sum_j w_j = 1, and lse the
    // log of the softmax mass; as a carried state that is ell = 1 at m = lse.
    cs.m = si.lse(n, h);
    cs.ell = cs.m == -std::numeric_limits<T>::infinity() ? T(0) : T(1);
  }
}

template <class Policy, class T>
void store_state(const linear_attention_args<T>& a, const linear_attention_problem& p, index_t n,
                 index_t h, const causal_state<T>& cs) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const index_t D = p.head_dim, Dv = p.value_dim;
  const auto& so = a.state_out;
  const T inv = gated && cs.ell > T(0) ? T(1) / cs.ell : T(1);
  if (so.S.has_value())
    for (index_t d = 0; d < D; ++d)
      for (index_t c = 0; c < Dv; ++c) so.S(n, h, d, c) = cs.S(d, c) * inv;
  if (so.z.has_value())
    for (index_t d = 0; d < D; ++d) so.z(n, h, d) = cs.z(d) * inv;
  if constexpr (gated) {
    if (so.lse.has_value()) so.lse(n, h) = cs.ell > T(0) ? cs.m + std::log(cs.ell) : cs.m;
  }
}

// exp(x - m) that treats m = -inf (nothing seen yet) as weight 0 instead of NaN.
template <class T>
T shifted_exp(T x, T m) {
  return x == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(x - m);
}

// 1 / x, and 0 where x is 0: under the key gate a row that has seen no key with a finite logit
// has a zero softmax mass (ell = 0) and a zero numerator; its output is 0, as for a masked row.
template <class V>
auto inverse_or_zero(const V& x) {
  using T = typename V::Scalar;
  return (x.array() == T(0)).select(T(0), x.array().inverse()).matrix().eval();
}

// Chunked form for one (sequence, KV head), all query heads of its group.
template <class Policy, class T>
void causal_chunked(const linear_attention_args<T>& a, const linear_attention_problem& p, index_t n,
                    index_t h, causal_state<T>& cs, linear_scratch<T>& ws) {
  constexpr bool gated = Policy::gate != key_gate::off;
  constexpr index_t C = Policy::chunk;
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const index_t D = p.head_dim, Dv = p.value_dim, G = p.group();
  const index_t g = p.gate_heads == 1 ? 0 : h;
  const T scale = static_cast<T>(p.scale), eps = static_cast<T>(p.eps);
  const sequence s = p.seq(n);
  if (ws.ones.size() < C) ws.ones.setOnes(C);
  for (index_t c0 = 0; c0 < s.length; c0 += C) {
    const index_t rows = std::min(C, s.length - c0);
    const index_t t0 = s.start + c0;
    const bool all_valid = load_validity(a, s, c0, rows, ws);
    auto is_valid = [&](index_t r) {
      return all_valid || ws.valid[static_cast<std::size_t>(r)];
    };

    // Key features with pad rows zeroed, and values with pad rows zeroed (pad v may hold NaN).
    ws.p.resize(rows, D);
    apply_phi<Policy::phi>(ws.p, rows_of(&a.k(s.batch, t0, h, 0), rows, D, a.k.stride(1)));
    const auto vmap = rows_of(&a.v(s.batch, t0, h, 0), rows, Dv, a.v.stride(1));
    if (!all_valid) {
      ws.v = vmap;
      for (index_t r = 0; r < rows; ++r)
        if (!is_valid(r)) ws.p.row(r).setZero(), ws.v.row(r).setZero();
    }

    // Intra-chunk weights W_ij (j <= i): exp(a_j - m_i) with m_i the running max at row i,
    // the carry factor exp(m - m_i) of the state, and the softmax mass ell_i at row i.
    T m_last = cs.m;
    if constexpr (gated) {
      ws.w.resize(rows);  // logits, -inf at pads
      ws.u.resize(rows);  // running max m_i
      for (index_t r = 0; r < rows; ++r) {
        ws.w(r) = is_valid(r) ? static_cast<T>(a.a(s.batch, t0 + r, g)) : ninf;
        m_last = std::max(m_last, ws.w(r));
        ws.u(r) = m_last;
      }
      ws.weights.setZero(rows, rows);
      ws.carry.resize(rows);
      ws.ell.resize(rows);
      for (index_t i = 0; i < rows; ++i) {
        ws.carry(i) = shifted_exp(cs.m, ws.u(i));
        T ell = ws.carry(i) * cs.ell;
        for (index_t j = 0; j <= i; ++j) {
          const T wij = shifted_exp(ws.w(j), ws.u(i));
          ws.weights(i, j) = wij;
          ell += wij;
        }
        ws.ell(i) = ell;
      }
    }

    for (index_t hq = h * G; hq < (h + 1) * G; ++hq) {
      ws.r.resize(rows, D);
      apply_phi<Policy::phi>(ws.r, rows_of(&a.q(s.batch, t0, hq, 0), rows, D, a.q.stride(1)));
      ws.r *= scale;
      ws.scores.noalias() = ws.r * ws.p.transpose();
      if constexpr (gated)
        ws.scores.array() *= ws.weights.array();
      else
        ws.scores.template triangularView<Eigen::StrictlyUpper>().setZero();
      ws.num.noalias() = ws.r * cs.S;
      if constexpr (gated) ws.num = ws.carry.asDiagonal() * ws.num;
      if (all_valid)
        ws.num.noalias() += ws.scores * vmap;
      else
        ws.num.noalias() += ws.scores * ws.v;
      if constexpr (Policy::normalize) {
        ws.den.noalias() = ws.r * cs.z;
        if constexpr (gated) {
          ws.den.array() = ws.den.array() * ws.carry.array() + eps * ws.ell.array();
        } else {
          ws.den.array() += eps;
        }
        ws.den += ws.scores.rowwise().sum();
        ws.den = inverse_or_zero(ws.den);
        ws.num = ws.den.asDiagonal() * ws.num;
      } else if constexpr (gated) {
        ws.den = inverse_or_zero(ws.ell);
        ws.num = ws.den.asDiagonal() * ws.num;
      }
      write_rows<Policy>(a, p, s, hq, c0, ws.num, all_valid, ws);
    }

    // Carry the state past this chunk.
    if constexpr (gated) {
      if (m_last == ninf) continue;  // nothing valid so far
      const T c = shifted_exp(cs.m, m_last);
      for (index_t r = 0; r < rows; ++r) ws.p.row(r) *= shifted_exp(ws.w(r), m_last);
      cs.S *= c;
      cs.z *= c;
      cs.ell *= c;
      for (index_t r = 0; r < rows; ++r) cs.ell += shifted_exp(ws.w(r), m_last);
      cs.m = m_last;
    }
    if (all_valid)
      cs.S.noalias() += ws.p.transpose() * vmap;
    else
      cs.S.noalias() += ws.p.transpose() * ws.v;
    cs.z.noalias() += ws.p.transpose() * ws.ones.head(rows);
  }
}

// Recurrent form for one (sequence, KV head): S += p v^T per token, then every query head of
// the group reads it.
template <class Policy, class T>
void causal_recurrent(const linear_attention_args<T>& a, const linear_attention_problem& p,
                      index_t n, index_t h, causal_state<T>& cs, linear_scratch<T>& ws) {
  constexpr bool gated = Policy::gate != key_gate::off;
  const index_t D = p.head_dim, Dv = p.value_dim, G = p.group();
  const index_t g = p.gate_heads == 1 ? 0 : h;
  const T scale = static_cast<T>(p.scale), eps = static_cast<T>(p.eps);
  const sequence s = p.seq(n);
  ws.p.resize(1, D);
  ws.r.resize(1, D);
  for (index_t i = 0; i < s.length; ++i) {
    const index_t t = s.start + i;
    const bool valid = load_validity(a, s, i, 1, ws);
    if (valid) {
      apply_phi<Policy::phi>(ws.p, rows_of(&a.k(s.batch, t, h, 0), 1, D, D));
      if constexpr (gated) {
        const T logit = static_cast<T>(a.a(s.batch, t, g));
        if (logit > cs.m) {  // rescale to the new running max
          const T c = shifted_exp(cs.m, logit);
          cs.S *= c;
          cs.z *= c;
          cs.ell *= c;
          cs.m = logit;
        }
        const T u = shifted_exp(logit, cs.m);
        cs.ell += u;
        ws.p *= u;
      }
      cs.S.noalias() += ws.p.transpose() * rows_of(&a.v(s.batch, t, h, 0), 1, Dv, Dv);
      cs.z.noalias() += ws.p.row(0).transpose();
    }
    for (index_t hq = h * G; hq < (h + 1) * G; ++hq) {
      if (valid) {
        apply_phi<Policy::phi>(ws.r, rows_of(&a.q(s.batch, t, hq, 0), 1, D, D));
        ws.r *= scale;
        ws.num.noalias() = ws.r * cs.S;
        if (gated && cs.ell == T(0)) {  // no key with a finite logit yet: 0, as if masked
          ws.num.setZero(1, Dv);
        } else if constexpr (Policy::normalize) {
          const T den = (ws.r * cs.z)(0, 0) + eps * cs.ell;
          ws.num /= den;
        } else if constexpr (gated) {
          ws.num /= cs.ell;
        }
      } else {
        ws.num.setZero(1, Dv);
      }
      write_rows<Policy>(a, p, s, hq, i, ws.num, valid, ws);
    }
  }
}

template <class Policy, class T>
void causal_forward(const linear_attention_args<T>& a, const linear_attention_problem& p,
                    const backend::cpu& be) {
  static_assert(std::is_same_v<accum_t<T>, T>, "attnmix: CPU linear attention computes in T");
  const index_t tasks = p.num_sequences * p.kv_heads;
  const int workers = worker_count(be, tasks);
  std::vector<linear_scratch<T>> scratch(static_cast<std::size_t>(workers));
  std::vector<causal_state<T>> states(static_cast<std::size_t>(workers));
  parallel_for(tasks, workers, [&](index_t task, int worker) {
    const index_t n = task / p.kv_heads, h = task % p.kv_heads;
    causal_state<T>& cs = states[static_cast<std::size_t>(worker)];
    linear_scratch<T>& ws = scratch[static_cast<std::size_t>(worker)];
    load_state<Policy>(a, p, n, h, cs);
    if constexpr (Policy::form == causal_form::chunked)
      causal_chunked<Policy>(a, p, n, h, cs, ws);
    else
      causal_recurrent<Policy>(a, p, n, h, cs, ws);
    store_state<Policy>(a, p, n, h, cs);
  });
  if constexpr (Policy::norm == gated_norm::full_width) full_width_norm<Policy>(a, p, be);
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
