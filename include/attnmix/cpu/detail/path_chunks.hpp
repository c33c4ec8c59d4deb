#pragma once
// The per-chunk data of PaTH on the CPU, shared by the forward, the prefill key cache and the
// backward (spec/path_fox.md §1.5): per chunk of C positions, the UT transform of its
// transitions U = (I + stril(diag(beta) W W^T))^-1 diag(beta) W, so that the chunk product
// H_last ... H_first = I - W^T U; the keys carried to the chunk end, K~ = K - M^T W with
// M = (I + ...)^-1 diag(beta) stril(W K^T); and, when D <= 2C, the D x D product P = I - W^T U.

#include <algorithm>
#include <vector>

#include "attnmix/attention/args.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/cpu/detail/eigen.hpp"
#include "attnmix/cpu/detail/parallel.hpp"
#include "attnmix/math/householder.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

// Per-chunk data of every (sequence, KV head). Buffers are head-major, [B, H, T, .] with T the
// (packed) token position, so that a chunk's rows are contiguous.
template <class T>
struct path_chunks {
  index_t chunk = 0, heads = 0, tokens = 0, dim = 0;
  bool dense = false;          // chunk products kept as D x D matrices
  std::vector<index_t> first;  // first[n]: global index of sequence n's first chunk
  std::vector<T> u, kt, m, p;  // U, K~ ([B,H,T,D]); M ([B,H,T,C]); P ([chunks,H,D,D])

  index_t row(index_t b, index_t h, index_t t) const { return (b * heads + h) * tokens + t; }
  T* u_at(index_t b, index_t h, index_t t) { return u.data() + row(b, h, t) * dim; }
  T* kt_at(index_t b, index_t h, index_t t) { return kt.data() + row(b, h, t) * dim; }
  T* m_at(index_t b, index_t h, index_t t) { return m.data() + row(b, h, t) * chunk; }
  T* p_at(index_t n, index_t c, index_t h) {
    return p.data() + ((first[static_cast<std::size_t>(n)] + c) * heads + h) * dim * dim;
  }
};

template <class T>
struct path_scratch {
  matrix<T> a, x, s, r, tmp, acc;
  column<T> beta, m, l, m_new, alpha, gi, gj;
};

// Step 1 for one chunk of n rows. w, k: first row of the chunk in one KV head; beta: its first
// strength. Writes U and K~ (n x D, contiguous), M (n x n, row stride C) and, if p != nullptr,
// P = I - W^T U (D x D).
template <class T>
void path_prepare_chunk(const T* w, index_t w_stride, const T* beta, index_t beta_stride,
                        const T* k, index_t k_stride, index_t n, index_t D, index_t C, T* u_out,
                        T* kt_out, T* m_out, T* p_out, path_scratch<T>& ws) {
  const auto W = rows_of(w, n, D, w_stride);
  const auto K = rows_of(k, n, D, k_stride);
  ws.beta.resize(n);
  for (index_t a = 0; a < n; ++a) ws.beta(a) = beta[a * beta_stride];

  // I + stril(diag(beta) W W^T): only the strict lower part is stored; the unit diagonal is
  // implied by the UnitLower view. Forward substitution with it applies (I + L)^-1.
  ws.a.noalias() = W * W.transpose();
  ws.a.array().colwise() *= ws.beta;
  const auto lower = ws.a.template triangularView<Eigen::UnitLower>();

  auto U = rows_of(u_out, n, D, D);
  U.noalias() = ws.beta.matrix().asDiagonal() * W;
  lower.solveInPlace(U);

  ws.x.noalias() = W * K.transpose();  // (a, b) = w_a . k_b, kept for a > b
  ws.x.template triangularView<Eigen::Upper>().setZero();
  ws.x.array().colwise() *= ws.beta;
  lower.solveInPlace(ws.x);  // M
  rows_of(m_out, n, n, C) = ws.x;

  auto Kt = rows_of(kt_out, n, D, D);
  Kt = K;
  Kt.noalias() -= ws.x.transpose() * W;

  if (p_out != nullptr) {
    auto P = rows_of(p_out, D, D, D);
    P.setIdentity();
    P.noalias() -= W.transpose() * U;
  }
}

// Step 1 over every chunk of every (sequence, KV head), in parallel.
template <class T>
path_chunks<T> path_prepare(const view4<const T>& k, const view4<const T>& w,
                            const view3<const T>& beta, const attention_problem& p, index_t chunk,
                            const backend::cpu& be) {
  path_chunks<T> c;
  c.chunk = chunk;
  c.heads = p.kv_heads;
  c.tokens = p.tokens;
  c.dim = p.head_dim;
  c.dense = p.head_dim <= 2 * chunk;  // 2 C D^2 flops per query row block beats 4 C^2 D
  c.first.resize(static_cast<std::size_t>(p.num_sequences + 1), 0);
  for (index_t n = 0; n < p.num_sequences; ++n)
    c.first[static_cast<std::size_t>(n + 1)] =
        c.first[static_cast<std::size_t>(n)] + math::chunk_count(p.seq(n).length, chunk);
  const index_t chunks = c.first.back();
  const auto rows = static_cast<std::size_t>(p.batch * p.kv_heads * p.tokens);
  c.u.resize(rows * static_cast<std::size_t>(p.head_dim));
  c.kt.resize(rows * static_cast<std::size_t>(p.head_dim));
  c.m.resize(rows * static_cast<std::size_t>(chunk));
  if (c.dense) c.p.resize(static_cast<std::size_t>(chunks * p.kv_heads * p.head_dim * p.head_dim));

  struct task {
    index_t seq, chunk, head;
  };
  std::vector<task> tasks;
  tasks.reserve(static_cast<std::size_t>(chunks * p.kv_heads));
  for (index_t n = 0; n < p.num_sequences; ++n)
    for (index_t ci = 0; ci < math::chunk_count(p.seq(n).length, chunk); ++ci)
      for (index_t h = 0; h < p.kv_heads; ++h) tasks.push_back({n, ci, h});

  const int workers = worker_count(be, static_cast<index_t>(tasks.size()));
  std::vector<path_scratch<T>> scratch(static_cast<std::size_t>(workers));
  parallel_for(static_cast<index_t>(tasks.size()), workers, [&](index_t i, int worker) {
    const task& tk = tasks[static_cast<std::size_t>(i)];
    const sequence s = p.seq(tk.seq);
    const index_t t0 = s.start + tk.chunk * chunk, n = std::min(chunk, s.length - tk.chunk * chunk);
    path_prepare_chunk(&w(s.batch, t0, tk.head, 0), w.stride(1), &beta(s.batch, t0, tk.head),
                       beta.stride(1), &k(s.batch, t0, tk.head, 0), k.stride(1), n, p.head_dim,
                       chunk, c.u_at(s.batch, tk.head, t0), c.kt_at(s.batch, tk.head, t0),
                       c.m_at(s.batch, tk.head, t0),
                       c.dense ? c.p_at(tk.seq, tk.chunk, tk.head) : nullptr,
                       scratch[static_cast<std::size_t>(worker)]);
  });
  return c;
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
