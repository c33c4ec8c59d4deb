#pragma once
// PaTH and PaTH-FoX on the CPU (spec/path_fox.md §1.5-1.7 and §3).
//
// Forward, per (sequence, KV head), in chunks of C = Policy::chunk positions:
//   1. per chunk, the UT transform of its transitions: U = (I + stril(diag(beta) W W^T))^-1
//      diag(beta) W, so that the chunk product H_last ... H_first = I - W^T U; the keys carried
//      to the chunk end, K~ = K - M^T W with M = (I + ...)^-1 diag(beta) stril(W K^T); and, when
//      D <= 2C (cheaper than the rank-C form), the D x D product P = I - W^T U itself.
//   2. per (query chunk, query head): the chunk-local scores tril(Q K^T - tril(Q W^T) M) start
//      an online softmax; the queries carried through their own chunk, Q~ = Q - tril(Q W^T) U,
//      then walk the earlier key chunks right to left: score against K~, then move through that
//      chunk's product (R <- R P, or R <- R - (R W^T) U).
// O(T^2 D) time, never a T x T matrix; the per-chunk data is O(T (2D + C)) per KV head plus
// D^2 per chunk. The prefill key cache reuses step 1 and walks suffix products of the chunk
// transitions: O(T D^2). Decoding lives here too (attention/path_cache.hpp is the front door).
// Step 1 lives in cpu/detail/path_chunks.hpp, shared with the backward
// (cpu/detail/path_backward.hpp), which recomputes step 2's scans.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/attention/attention.hpp"
#include "attnmix/attention/attention_backward.hpp"
#include "attnmix/attention/path_cache.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/cpu/detail/path_backward.hpp"
#include "attnmix/cpu/detail/path_chunks.hpp"
#include "attnmix/cpu/fox.hpp"
#include "attnmix/math/householder.hpp"

namespace attnmix {

template <>
struct is_implemented<kind::path, backend::cpu> : std::true_type {};
template <>
struct is_implemented<kind::path_fox, backend::cpu> : std::true_type {};
template <>
struct is_backward_implemented<kind::path, backend::cpu> : std::true_type {};
template <>
struct is_backward_implemented<kind::path_fox, backend::cpu> : std::true_type {};

namespace detail {
namespace cpu {

// Online-softmax update of (m, l, acc) with the score tile in ws.s (every row of it has a
// finite maximum once the diagonal tile has been folded in, so no -inf - -inf arises).
template <class T, class V>
void path_softmax_update(path_scratch<T>& ws, const V& values) {
  auto S = ws.s.array();
  ws.m_new = ws.m.max(S.rowwise().maxCoeff());
  S.colwise() -= ws.m_new;
  S = S.exp();
  ws.alpha = (ws.m - ws.m_new).exp();
  ws.l = ws.alpha * ws.l + S.rowwise().sum();
  ws.acc.array().colwise() *= ws.alpha;
  ws.acc.noalias() += ws.s * values;
  ws.m = ws.m_new;
}

// Step 2 for one query chunk of one (sequence, query head). G: gate cumsum of this (sequence,
// query head) at token 0 of the sequence with stride Gs (nullptr: no gate); coef multiplies it;
// reset: the hard resets laid out like G (nullptr: none; see gate_cumsum in cpu/fox.hpp).
template <class T>
void path_query_chunk(const attention_args<T>& a, const attention_problem& p, path_chunks<T>& c,
                      index_t seq, index_t hq, index_t ci, const double* G, index_t Gs, double coef,
                      const index_t* reset, path_scratch<T>& ws) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  const sequence s = p.seq(seq);
  const index_t b = s.batch, h = hq / p.group(), C = c.chunk, D = p.head_dim, Dv = p.value_dim;
  const index_t c0 = ci * C, n = std::min(C, s.length - c0), t0 = s.start + c0;
  const T scale = static_cast<T>(p.scale);

  const auto W = rows_of(&a.w(b, t0, h, 0), n, D, a.w.stride(1));
  const auto U = rows_of(c.u_at(b, h, t0), n, D, D);
  const auto M = rows_of(c.m_at(b, h, t0), n, n, C);
  // Gate values relative to G at the chunk start, so that what is rounded to T stays small
  // near the diagonal, where it matters.
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

  // The diagonal chunk: scores s * tril(Q K^T - tril(Q W^T) M); no transition on the diagonal.
  ws.r.noalias() = scale * rows_of(&a.q(b, t0, hq, 0), n, D, a.q.stride(1));
  ws.x.noalias() = ws.r * W.transpose();
  ws.x.template triangularView<Eigen::StrictlyUpper>().setZero();
  ws.s.noalias() = ws.r * rows_of(&a.k(b, t0, h, 0), n, D, a.k.stride(1)).transpose();
  ws.s.noalias() -= ws.x * M;
  add_gate(c0, n);
  ws.s.template triangularView<Eigen::StrictlyUpper>().setConstant(ninf);
  ws.m.setConstant(n, ninf);
  ws.l.setZero(n);
  ws.acc.setZero(n, Dv);
  path_softmax_update(ws, rows_of(&a.v(b, t0, h, 0), n, Dv, a.v.stride(1)));

  // Queries carried through their own chunk, then right to left through the earlier chunks.
  ws.r.noalias() -= ws.x * U;
  for (index_t cj = ci - 1; cj >= 0; --cj) {
    const index_t j0 = cj * C, tj = s.start + j0;  // earlier chunks are always full
    ws.s.noalias() = ws.r * rows_of(c.kt_at(b, h, tj), C, D, D).transpose();
    add_gate(j0, C);
    path_softmax_update(ws, rows_of(&a.v(b, tj, h, 0), C, Dv, a.v.stride(1)));
    if (cj == 0) break;  // chunk 0's product is never needed
    if (c.dense) {
      ws.tmp.noalias() = ws.r * rows_of(c.p_at(seq, cj, h), D, D, D);
      ws.r.swap(ws.tmp);
    } else {
      ws.tmp.noalias() = ws.r * rows_of(&a.w(b, tj, h, 0), C, D, a.w.stride(1)).transpose();
      ws.r.noalias() -= ws.tmp * rows_of(c.u_at(b, h, tj), C, D, D);
    }
  }

  rows_of(&a.out(b, t0, hq, 0), n, Dv, a.out.stride(1)) =
      (ws.acc.array().colwise() / ws.l).matrix();
  if (a.lse.has_value())
    for (index_t r = 0; r < n; ++r) a.lse(b, t0 + r, hq) = ws.m(r) + std::log(ws.l(r));
}

// The blocked forward over prepared chunks. G: gate cumsum laid out like g ([B, T, HQ],
// contiguous) or nullptr; reset: its hard resets, or nullptr.
template <class T>
void path_forward(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be,
                  path_chunks<T>& c, const double* G, double coef, const index_t* reset = nullptr) {
  require_cpu_scalar<T>();
  const index_t chunk = c.chunk;

  struct task {
    index_t seq, head, chunk;
  };
  std::vector<task> tasks;
  for (index_t n = 0; n < p.num_sequences; ++n)
    for (index_t ci = math::chunk_count(p.seq(n).length, chunk) - 1; ci >= 0; --ci)
      for (index_t hq = 0; hq < p.q_heads; ++hq) tasks.push_back({n, hq, ci});
  // Most expensive (latest) chunks first: dynamic scheduling then balances the triangle.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const task& x, const task& y) { return x.chunk > y.chunk; });

  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<path_scratch<T>> scratch(static_cast<std::size_t>(workers));
  parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t i, int worker) {
    const task& tk = tasks[static_cast<std::size_t>(i)];
    const sequence s = p.seq(tk.seq);
    const index_t at = (s.batch * p.tokens + s.start) * p.q_heads + tk.head;
    path_query_chunk(a, p, c, tk.seq, tk.head, tk.chunk, G != nullptr ? G + at : nullptr, p.q_heads,
                     coef, reset != nullptr ? reset + at : nullptr,
                     scratch[static_cast<std::size_t>(worker)]);
  });
}

// The prefill key cache from prepared chunks. out(n, h) returns {pointer to token 0 of
// sequence n in KV head h, token stride} of where kappa goes.
template <class T, class Out>
void path_key_cache(const view4<const T>& w, const attention_problem& p, const backend::cpu& be,
                    path_chunks<T>& c, Out out) {
  require_cpu_scalar<T>();
  const index_t D = p.head_dim, tasks = p.num_sequences * p.kv_heads, chunk = c.chunk;
  const int workers = worker_count(be, tasks);
  struct suffix_scratch {
    matrix<T> s, tmp, proj;
  };
  std::vector<suffix_scratch> scratch(static_cast<std::size_t>(workers));
  parallel_for(tasks, workers, [&](index_t i, int worker) {
    suffix_scratch& ws = scratch[static_cast<std::size_t>(worker)];
    const index_t n = i / p.kv_heads, h = i % p.kv_heads;
    const sequence s = p.seq(n);
    if (s.length == 0) return;  // nothing to write; out(n, h) might point past the end
    const auto [dst, dst_stride] = out(n, h);
    const index_t chunks = math::chunk_count(s.length, chunk);
    // S = P_last ... P_{ci+1}, the transitions after chunk ci; kappa = S k~, i.e. rows K~ S^T.
    ws.s.setIdentity(D, D);
    for (index_t ci = chunks - 1; ci >= 0; --ci) {
      const index_t t0 = s.start + ci * chunk, rows = std::min(chunk, s.length - ci * chunk);
      const auto Kt = rows_of(c.kt_at(s.batch, h, t0), rows, D, D);
      auto dst_rows = rows_of(dst + ci * chunk * dst_stride, rows, D, dst_stride);
      if (ci == chunks - 1)
        dst_rows = Kt;
      else
        dst_rows.noalias() = Kt * ws.s.transpose();
      if (ci == 0) break;
      if (c.dense) {
        ws.tmp.noalias() = ws.s * rows_of(c.p_at(n, ci, h), D, D, D);
        ws.s.swap(ws.tmp);
      } else {
        ws.proj.noalias() = ws.s * rows_of(&w(s.batch, t0, h, 0), rows, D, w.stride(1)).transpose();
        ws.s.noalias() -= ws.proj * rows_of(c.u_at(s.batch, h, t0), rows, D, D);
      }
    }
  });
}

// One decoding step of one (row, KV head): carry the slot's keys through the new transition,
// append the token, attend with the group's queries.
template <class T>
void path_decode_head(const attention_args<T>& a, const attention_problem& p, T* keys, T* values,
                      double* gates, index_t length, index_t row, index_t h, bool gated,
                      double coef, matrix<T>& z) {
  const index_t D = p.head_dim, Dv = p.value_dim, H = p.kv_heads, HQ = p.q_heads;
  const index_t G = p.group(), hq0 = h * G;
  T* kh = keys + h * D;     // token j at kh + j * H * D
  T* vh = values + h * Dv;  // token j at vh + j * H * Dv
  const T* w = &a.w(row, 0, h, 0);
  const T beta = a.beta(row, 0, h);
  for (index_t j = 0; j < length; ++j) math::apply_householder(kh + j * H * D, w, beta, D);
  for (index_t d = 0; d < D; ++d) kh[length * H * D + d] = a.k(row, 0, h, d);
  for (index_t e = 0; e < Dv; ++e) vh[length * H * Dv + e] = a.v(row, 0, h, e);
  for (index_t g = 0; g < G; ++g) {
    const index_t hq = hq0 + g;
    const double x = gated ? static_cast<double>(a.g(row, 0, hq)) : 0.0;
    if (x == -std::numeric_limits<double>::infinity()) {
      // A hard reset: the cached keys get weight 0 from now on (G_t - (+inf) = -inf), and the
      // cumsum restarts at this token.
      for (index_t j = 0; j < length; ++j)
        gates[j * HQ + hq] = std::numeric_limits<double>::infinity();
      gates[length * HQ + hq] = 0.0;
    } else {
      const double prev = length > 0 ? gates[(length - 1) * HQ + hq] : 0.0;
      gates[length * HQ + hq] = prev + x;
    }
  }

  const index_t L = length + 1;
  const auto K = rows_of(static_cast<const T*>(kh), L, D, H * D);
  const auto Q = rows_of(&a.q(row, 0, hq0, 0), G, D, a.q.stride(2));
  z.noalias() = static_cast<T>(p.scale) * (Q * K.transpose());  // G x L
  if (gated)
    for (index_t g = 0; g < G; ++g) {
      const double Gt = gates[length * HQ + hq0 + g];
      for (index_t j = 0; j < L; ++j)
        z(g, j) += static_cast<T>(coef * (Gt - gates[j * HQ + hq0 + g]));
    }
  const auto V = rows_of(static_cast<const T*>(vh), L, Dv, H * Dv);
  for (index_t g = 0; g < G; ++g) {
    const T m = z.row(g).maxCoeff();
    z.row(g).array() = (z.row(g).array() - m).exp();
    const T l = z.row(g).sum();
    rows_of(&a.out(row, 0, hq0 + g, 0), 1, Dv, Dv) = (z.row(g) * V) / l;
    if (a.lse.has_value()) a.lse(row, 0, hq0 + g) = m + std::log(l);
  }
}

}  // namespace cpu

template <class Policy>
struct attention_impl<kind::path, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    auto c = cpu::path_prepare<T>(a.k, a.w, a.beta, p, Policy::chunk, be);
    cpu::path_forward(a, p, be, c, nullptr, 0.0);
  }
};

template <class Policy>
struct attention_impl<kind::path_fox, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p, const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    const cpu::gate_prefix G = cpu::gate_cumsum(a.g, p);
    auto c = cpu::path_prepare<T>(a.k, a.w, a.beta, p, Policy::chunk, be);
    cpu::path_forward(a, p, be, c, G.cumsum(), gate_coefficient<Policy>(p), G.resets());
  }
};

// The backward (cpu/detail/path_backward.hpp): recomputes the forward's chunk data and query
// scans; a.out and a.lse must be those of attention<kind>(...) under the same Policy.
template <class Policy>
struct attention_backward_impl<kind::path, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    cpu::path_backward(a, p, be, Policy::chunk, nullptr, 0.0, nullptr, nullptr);
  }
};

template <class Policy>
struct attention_backward_impl<kind::path_fox, backend::cpu, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    const cpu::gate_prefix G = cpu::gate_cumsum(a.g, p);
    std::vector<double> dG(G.G.size(), 0.0);
    cpu::path_backward(a, p, be, Policy::chunk, G.cumsum(), gate_coefficient<Policy>(p), G.resets(),
                       dG.data());
    cpu::gate_cumsum_backward(dG, a.g, a.dg, p);
  }
};

template <>
struct path_cache_impl<backend::cpu> {
  template <class Policy, class T>
  static void key_cache(const path_key_cache_args<T>& a, const attention_problem& p,
                        const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    const auto& out = a.key_cache;
    auto c = cpu::path_prepare<T>(a.k, a.w, a.beta, p, Policy::chunk, be);
    cpu::path_key_cache(a.w, p, be, c, [&](index_t n, index_t h) {
      const sequence s = p.seq(n);
      return std::pair<T*, index_t>(&out(s.batch, s.start, h, 0), out.stride(1));
    });
  }

  template <class Kind, class Policy, class T>
  static void prefill(path_cache<T>& cache, const attention_args<T>& a, const attention_problem& p,
                      const std::vector<index_t>& slots, const backend::cpu& be) {
    static_assert(Policy::chunk >= 1, "attnmix: Policy::chunk must be positive");
    cpu::require_cpu_scalar<T>();
    // The forward and the key cache share the per-chunk UT data.
    auto c = cpu::path_prepare<T>(a.k, a.w, a.beta, p, Policy::chunk, be);
    cpu::gate_prefix G;
    if constexpr (kind_traits<Kind>::uses_forget_gate) {
      G = cpu::gate_cumsum(a.g, p);
      cpu::path_forward(a, p, be, c, G.cumsum(), gate_coefficient<Policy>(p), G.resets());
    } else {
      cpu::path_forward(a, p, be, c, nullptr, 0.0);
    }
    const index_t cap = cache.capacity(), H = p.kv_heads, HQ = p.q_heads, D = p.head_dim,
                  Dv = p.value_dim;
    T* keys = path_cache_access::keys(cache);
    T* values = path_cache_access::values(cache);
    double* gates = path_cache_access::gates(cache);
    const auto slot_of = [&](index_t n) {
      return slots[static_cast<std::size_t>(n)];
    };
    cpu::path_key_cache(a.w, p, be, c, [&](index_t n, index_t h) {
      return std::pair<T*, index_t>(keys + (slot_of(n) * cap * H + h) * D, H * D);
    });
    for (index_t n = 0; n < p.num_sequences; ++n) {
      const sequence s = p.seq(n);
      const index_t slot = slot_of(n);
      for (index_t t = 0; t < s.length; ++t) {
        for (index_t h = 0; h < H; ++h)
          for (index_t e = 0; e < Dv; ++e)
            values[((slot * cap + t) * H + h) * Dv + e] = a.v(s.batch, s.start + t, h, e);
      }
      // The cumsum as the forward has it; keys before the last hard reset get +inf, so that
      // every later query gives them G_t - (+inf) = -inf.
      for (index_t hq = 0; hq < HQ; ++hq) {
        const auto at = [&](index_t t) {
          return static_cast<std::size_t>((s.batch * p.tokens + s.start + t) * HQ + hq);
        };
        const index_t cut = G.resets() != nullptr && s.length > 0 ? G.reset[at(s.length - 1)] : 0;
        for (index_t t = 0; t < s.length; ++t)
          gates[(slot * cap + t) * HQ + hq] = !kind_traits<Kind>::uses_forget_gate ? 0.0
                                              : t < cut ? std::numeric_limits<double>::infinity()
                                                        : G.G[at(t)];
      }
      path_cache_access::set_length(cache, slot, s.length);
    }
  }

  template <class Kind, class Policy, class T>
  static void decode(path_cache<T>& cache, const attention_args<T>& a, const attention_problem& p,
                     const std::vector<index_t>& slots, const backend::cpu& be) {
    cpu::require_cpu_scalar<T>();
    constexpr bool gated = kind_traits<Kind>::uses_forget_gate;
    const double coef = gated ? gate_coefficient<Policy>(p) : 0.0;
    const index_t cap = cache.capacity(), H = p.kv_heads, HQ = p.q_heads, D = p.head_dim,
                  Dv = p.value_dim, tasks = p.batch * H;
    std::vector<index_t> lengths(static_cast<std::size_t>(p.batch));
    for (index_t n = 0; n < p.batch; ++n)
      lengths[static_cast<std::size_t>(n)] = cache.length(slots[static_cast<std::size_t>(n)]);
    T* keys = path_cache_access::keys(cache);
    T* values = path_cache_access::values(cache);
    double* gates = path_cache_access::gates(cache);
    const int workers = cpu::worker_count(be, tasks);
    std::vector<cpu::matrix<T>> scratch(static_cast<std::size_t>(workers));
    cpu::parallel_for(tasks, workers, [&](index_t i, int worker) {
      const index_t n = i / H, h = i % H, slot = slots[static_cast<std::size_t>(n)];
      cpu::path_decode_head(a, p, keys + slot * cap * H * D, values + slot * cap * H * Dv,
                            gates + slot * cap * HQ, lengths[static_cast<std::size_t>(n)], n, h,
                            gated, coef, scratch[static_cast<std::size_t>(worker)]);
    });
    for (index_t n = 0; n < p.batch; ++n)
      path_cache_access::set_length(cache, slots[static_cast<std::size_t>(n)],
                                    lengths[static_cast<std::size_t>(n)] + 1);
  }
};

}  // namespace detail
}  // namespace attnmix
