// PaTH inference on the CPU: the prefill key cache against the recurrence's final cache, and
// decoding (token by token, and after a prefill) against the forward and the oracles.

#include <algorithm>
#include <numeric>

#include "cpu/test_path_harness.hpp"

using namespace attnmix_test;
using attnmix::gate_scaling;
using attnmix::host_tensor;
using attnmix::kind::path;
using attnmix::kind::path_fox;

namespace {

template <class Policy, class T>
void check_key_cache(const path_case& c, const path_inputs& in,
                     const attnmix_ref::path_result& ref) {
  using A = attnmix::accum_t<T>;
  path_tensors<T> t(c, in);
  host_tensor<T, 4> kc({c.B, c.T, c.H, c.D});
  poison(kc);
  attnmix::path_key_cache_args<T> a{t.k.view(), t.w.view(), t.beta.view(), kc.view()};
  attnmix::path_prefill_key_cache<Policy>(a, path_params(c), attnmix::backend::cpu{c.threads});
  INFO("chunk=" << Policy::chunk << " type=" << (sizeof(A) == 8 ? "double" : "float"));
  CHECK(rel_error(kc.storage(), ref.key_cache) <= tolerance<T>());
}

// Keys of sequence n of a case, [L, H, D] as doubles, from a [B,T,H,D] array.
std::vector<double> sequence_rows(const path_case& c, const std::vector<double>& x, index_t n,
                                  index_t width) {
  const index_t b = c.cu_seqlens.empty() ? n : 0;
  const index_t lo = c.cu_seqlens.empty() ? 0 : c.cu_seqlens[n];
  const index_t hi = c.cu_seqlens.empty() ? c.T : c.cu_seqlens[n + 1];
  return std::vector<double>(x.begin() + (b * c.T + lo) * width,
                             x.begin() + (b * c.T + hi) * width);
}

// Sequences of a packed case as (start, length).
std::vector<std::pair<index_t, index_t>> packed_sequences(const path_case& c) {
  std::vector<std::pair<index_t, index_t>> s;
  for (std::size_t n = 0; n + 1 < c.cu_seqlens.size(); ++n)
    s.push_back({c.cu_seqlens[n], c.cu_seqlens[n + 1] - c.cu_seqlens[n]});
  return s;
}

// Runs the packed case c through the decoding cache: sequence n is prefilled with its first
// prompt[n] tokens (into slot slot_of[n]) and then decoded one token per step, all sequences
// together in a shuffled row order while they have tokens left. Compares every output, the lse
// and the final cache with the oracles.
template <class Kind, class Policy, class T>
void check_decode(const path_case& c, const path_inputs& in, const std::vector<index_t>& prompt,
                  std::uint64_t salt) {
  using A = attnmix::accum_t<T>;
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  const auto seqs = packed_sequences(c);
  const index_t N = static_cast<index_t>(seqs.size()), HQ = c.HQ, H = c.H, D = c.D, Dv = c.Dv;
  const auto p = path_oracle_problem(c, oracle_gate<Kind, Policy>());
  const auto ref = attnmix_ref::path_key_recurrence(p, in.q, in.k, in.v, in.w, in.beta, in.g);
  const auto scan = attnmix_ref::path_query_scan(p, in.q, in.k, in.v, in.w, in.beta, in.g);
  REQUIRE(rel_error(ref.out, scan.out) <= 1e-12);

  index_t longest = 0;
  for (auto s : seqs) longest = std::max(longest, s.second);
  attnmix::path_cache<T> cache(N + 2, longest + 1, HQ, H, D, Dv);
  std::vector<std::int32_t> slot_of(static_cast<std::size_t>(N));  // a permutation, offset by 1
  for (index_t n = 0; n < N; ++n)
    slot_of[static_cast<std::size_t>(n)] = static_cast<std::int32_t>((n * 3 + 1) % (N + 2));
  {  // keep the slots distinct whatever N is
    std::vector<std::int32_t> sorted = slot_of;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      std::iota(slot_of.begin(), slot_of.end(), 1);
  }

  std::vector<double> out(ref.out.size(), std::nan("")), lse(ref.lse.size(), std::nan(""));
  const auto t_all = path_tensors<T>(c, in);

  // Prefill: a packed batch of the prompts.
  {
    std::vector<std::int32_t> cu = {0};
    for (index_t n = 0; n < N; ++n) cu.push_back(cu.back() + static_cast<std::int32_t>(prompt[n]));
    const index_t P = cu.back();
    path_case pc{1, P, HQ, H, D, Dv, cu};
    path_inputs pin;
    auto take = [&](const std::vector<double>& x, index_t width) {
      std::vector<double> y;
      for (index_t n = 0; n < N; ++n)
        y.insert(y.end(), x.begin() + seqs[n].first * width,
                 x.begin() + (seqs[n].first + prompt[n]) * width);
      return y;
    };
    pin.q = take(in.q, HQ * D), pin.k = take(in.k, H * D), pin.v = take(in.v, H * Dv);
    pin.w = take(in.w, H * D), pin.beta = take(in.beta, H), pin.g = take(in.g, HQ);
    path_tensors<T> t(pc, pin);
    attnmix::path_prefill<Kind, Policy>(cache, t.template args<Kind>(), {slot_of.data(), {N}},
                                        path_params(pc));
    for (index_t n = 0; n < N; ++n) {
      CHECK(cache.length(slot_of[n]) == prompt[n]);
      for (index_t i = 0; i < prompt[n]; ++i) {
        for (index_t x = 0; x < HQ * Dv; ++x)
          out[(seqs[n].first + i) * HQ * Dv + x] = t.out.storage()[(cu[n] + i) * HQ * Dv + x];
        for (index_t x = 0; x < HQ; ++x)
          lse[(seqs[n].first + i) * HQ + x] = t.lse.storage()[(cu[n] + i) * HQ + x];
      }
    }
  }

  // Decode the rest, one token per live sequence per step, rows in a shuffled order.
  rng r(salt);
  for (index_t step = 0;; ++step) {
    std::vector<index_t> rows;
    for (index_t n = 0; n < N; ++n)
      if (prompt[n] + step < seqs[n].second) rows.push_back(n);
    if (rows.empty()) break;
    for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[r.integer(0, i - 1)]);
    const index_t R = static_cast<index_t>(rows.size());
    host_tensor<T, 4> q({R, 1, HQ, D}), k({R, 1, H, D}), v({R, 1, H, Dv}), o({R, 1, HQ, Dv});
    host_tensor<A, 4> w({R, 1, H, D});
    host_tensor<A, 3> beta({R, 1, H}), g({R, 1, HQ}), l({R, 1, HQ});
    std::vector<std::int32_t> slots;
    for (index_t i = 0; i < R; ++i) {
      const index_t n = rows[i], tok = seqs[n].first + prompt[n] + step;
      slots.push_back(slot_of[n]);
      std::copy_n(t_all.q.data() + tok * HQ * D, HQ * D, q.data() + i * HQ * D);
      std::copy_n(t_all.k.data() + tok * H * D, H * D, k.data() + i * H * D);
      std::copy_n(t_all.v.data() + tok * H * Dv, H * Dv, v.data() + i * H * Dv);
      std::copy_n(t_all.w.data() + tok * H * D, H * D, w.data() + i * H * D);
      std::copy_n(t_all.beta.data() + tok * H, H, beta.data() + i * H);
      std::copy_n(t_all.g.data() + tok * HQ, HQ, g.data() + i * HQ);
    }
    poison(o);
    poison(l);
    attnmix::attention_args<T> a{q.view(), k.view(), v.view(), o.view()};
    a.w = w.view(), a.beta = beta.view(), a.lse = l.view();
    if constexpr (gated) a.g = g.view();
    attnmix::path_decode_step<Kind, Policy>(cache, a, {slots.data(), {R}}, {},
                                            attnmix::backend::cpu{c.threads});
    for (index_t i = 0; i < R; ++i) {
      const index_t n = rows[i], tok = seqs[n].first + prompt[n] + step;
      for (index_t x = 0; x < HQ * Dv; ++x) out[tok * HQ * Dv + x] = o.storage()[i * HQ * Dv + x];
      for (index_t x = 0; x < HQ; ++x) lse[tok * HQ + x] = l.storage()[i * HQ + x];
    }
  }

  CHECK(rel_error(out, ref.out) <= tolerance<T>());
  CHECK(rel_error(lse, ref.lse) <= tolerance<T>());
  // The decoding equals the library's own forward too.
  const path_outputs fwd = run_path_forward<Kind, Policy, T>(c, in);
  CHECK(rel_error(out, fwd.out) <= tolerance<T>());
  // The final cache is the recurrence's.
  for (index_t n = 0; n < N; ++n) {
    const index_t L = seqs[n].second, slot = slot_of[n];
    CHECK(cache.length(slot) == L);
    const auto keys = cache.keys(), values = cache.values();
    std::vector<double> kc, vc;
    for (index_t j = 0; j < L; ++j)
      for (index_t h = 0; h < H; ++h) {
        for (index_t d = 0; d < D; ++d) kc.push_back(keys(slot, j, h, d));
        for (index_t e = 0; e < Dv; ++e) vc.push_back(values(slot, j, h, e));
      }
    CHECK(rel_error(kc, sequence_rows(c, ref.key_cache, n, H * D)) <= tolerance<T>());
    CHECK(rel_error(vc, sequence_rows(c, in.v, n, H * Dv)) == 0.0);
  }
}

// Packed sequences of different lengths, including 0 and 1, off the chunk sizes.
std::vector<path_case> decode_cases() {
  return {
      {1, 150, 4, 2, 32, 16, {0, 5, 5, 6, 76, 150}, beta_range::near_two},
      {1, 90, 2, 2, 16, 24, {0, 1, 90}, beta_range::exactly_two, 1},
      {1, 40, 3, 1, 8, 8, {0, 40}, beta_range::uniform, 3},
  };
}

}  // namespace

TEST_CASE("the prefill key cache equals the recurrence's final cache", "[path][cpu][cache]") {
  const std::vector<path_case> cases = {
      {1, 1, 1, 1, 8, 8},
      {2, 100, 2, 2, 64, 8, {}, beta_range::near_two},  // D = 64 > 2C for C = 16: rank-C path
      {1, 300, 4, 2, 32, 8, {0, 0, 1, 64, 65, 200, 300}, beta_range::exactly_two},
      {3, 130, 2, 1, 16, 8, {}, beta_range::near_zero, 3},
  };
  std::uint64_t salt = 4000;
  for (const path_case& c : cases) {
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    const auto ref =
        attnmix_ref::path_key_recurrence(path_oracle_problem(c, attnmix_ref::path_problem::no_gate),
                                         in.q, in.k, in.v, in.w, in.beta);
    check_key_cache<with_chunk<attnmix::path_policy, 16>, double>(c, in, ref);
    check_key_cache<with_chunk<attnmix::path_policy, 64>, double>(c, in, ref);
    check_key_cache<with_chunk<attnmix::path_policy, 128>, double>(c, in, ref);
    check_key_cache<with_chunk<attnmix::path_policy, 16>, float>(c, in, ref);
    check_key_cache<with_chunk<attnmix::path_policy, 64>, float>(c, in, ref);
  }
}

TEMPLATE_TEST_CASE("decoding token by token equals the forward", "[path][cpu][decode]", float,
                   double) {
  using T = TestType;
  using after = attnmix::with_gate_scaling<attnmix::path_fox_policy, gate_scaling::after_scale>;
  std::uint64_t salt = 5000;
  for (const path_case& c : decode_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    const std::vector<index_t> none(c.cu_seqlens.size() - 1, 0);
    {
      INFO("path");
      check_decode<path, attnmix::path_policy, T>(c, in, none, salt);
    }
    {
      INFO("path_fox, gate before the scale");
      check_decode<path_fox, with_chunk<attnmix::path_fox_policy, 16>, T>(c, in, none, salt);
    }
    {
      INFO("path_fox, gate after the scale");
      check_decode<path_fox, after, T>(c, in, none, salt);
    }
  }
}

TEMPLATE_TEST_CASE("prefill then decoding equals the forward", "[path][cpu][decode]", float,
                   double) {
  using T = TestType;
  std::uint64_t salt = 6000;
  for (const path_case& c : decode_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    const auto seqs = packed_sequences(c);
    std::vector<index_t> last(seqs.size()), half(seqs.size());
    for (std::size_t n = 0; n < seqs.size(); ++n) {
      last[n] = std::max<index_t>(0, seqs[n].second - 1);  // prefill T-1, decode the last token
      half[n] = seqs[n].second / 2;
    }
    {
      INFO("prefill all but the last token");
      check_decode<path_fox, attnmix::path_fox_policy, T>(c, in, last, salt);
      check_decode<path, with_chunk<attnmix::path_policy, 32>, T>(c, in, last, salt);
    }
    {
      INFO("prefill half");
      check_decode<path_fox, attnmix::path_fox_policy, T>(c, in, half, salt);
    }
  }
}
