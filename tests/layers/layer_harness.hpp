#pragma once
// Shared pieces of the layer and stack tests: parameters as a name -> double map for the
// oracles, copying parameters between models, random activations.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "layers/layer_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

namespace attnmix_test {

// Prefills `model` (a layer or a stack) with the first P tokens of x (P = 0 included), then
// decodes the rest one token per step; every output must equal the forward's rows `full`
// (double), and after step t `length(cache)` must be t + 1.
template <class Model, class Cache, class Length>
void check_prefill_then_decode(const Model& model, Cache& cache,
                               const attnmix::host_tensor<double, 3>& x,
                               const attnmix::host_tensor<double, 3>& full, index_t P,
                               Length length) {
  const index_t N = x.extent(0), T = x.extent(1), D = x.extent(2);
  attnmix::host_tensor<double, 3> xp({N, P, D}), yp({N, P, D});
  std::vector<double> got, want;
  for (index_t n = 0; n < N; ++n)
    for (index_t t = 0; t < P; ++t)
      for (index_t e = 0; e < D; ++e) xp(n, t, e) = x(n, t, e), want.push_back(full(n, t, e));
  poison(yp);
  model.prefill(xp.view(), yp.view(), cache);
  for (index_t i = 0; i < yp.size(); ++i) REQUIRE(std::abs(yp.data()[i] - want[i]) <= 1e-10);
  CHECK(rel_error(yp.storage(), want) <= 1e-11);
  for (index_t t = P; t < T; ++t) {
    attnmix::host_tensor<double, 3> xs({N, 1, D}), ys({N, 1, D});
    want.clear();
    for (index_t n = 0; n < N; ++n)
      for (index_t e = 0; e < D; ++e) xs(n, 0, e) = x(n, t, e), want.push_back(full(n, t, e));
    poison(ys);
    model.decode(xs.view(), ys.view(), cache);
    INFO("token " << t);
    CHECK(rel_error(ys.storage(), want) <= 1e-11);
    CHECK(length(cache) == t + 1);
  }
}

template <class Model>
layer_ref::params parameters_of(const Model& m) {
  layer_ref::params out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out[name] = std::vector<double>(p.data.begin(), p.data.end());
  });
  return out;
}

// dst's parameters take src's values (same names and sizes).
template <class Src, class Dst>
void copy_parameters(const Src& src, Dst& dst) {
  const layer_ref::params p = parameters_of(src);
  dst.visit_parameters([&](const std::string& name, auto& q) {
    using T = typename std::decay_t<decltype(q.data)>::value_type;
    const auto& v = p.at(name);
    REQUIRE(v.size() == q.data.size());
    for (std::size_t i = 0; i < v.size(); ++i) q.data[i] = static_cast<T>(v[i]);
  });
}

inline layer_ref::dims dims_of(const attnmix::layers::config& c) {
  layer_ref::dims m{c.hidden_size, c.num_heads, c.kv_heads(), c.dim()};
  m.norm_eps = c.norm_eps;
  m.head_eps = c.head_norm_eps;
  m.rope_theta = c.rope_theta;
  m.w_rank = c.w_rank;
  m.window = c.window;
  return m;
}

// Activations exactly representable in float, so that float and double runs see one input.
template <class T>
attnmix::host_tensor<T, 3> random_activations(rng& r, index_t B, index_t Tn, index_t D) {
  attnmix::host_tensor<T, 3> x({B, Tn, D});
  for (auto& v : x.storage()) v = static_cast<T>(static_cast<float>(r.normal()));
  return x;
}

template <class T>
std::vector<double> as_double(const attnmix::host_tensor<T, 3>& x) {
  return std::vector<double>(x.storage().begin(), x.storage().end());
}

inline std::vector<long> to_long(const std::vector<std::int32_t>& cu) {
  return std::vector<long>(cu.begin(), cu.end());
}

// The message of the attnmix::error that f throws, or a marker if it throws none.
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const attnmix::error& e) {
    return e.what();
  }
  return "<no attnmix::error>";
}

}  // namespace attnmix_test

// Checks that `expr` throws attnmix::error whose message contains `text`.
#define ATTNMIX_CHECK_ERROR(expr, text)                                          \
  do {                                                                           \
    const std::string attnmix_msg_ = attnmix_test::error_message([&] { expr; }); \
    INFO(attnmix_msg_);                                                          \
    CHECK(attnmix_msg_.find(text) != std::string::npos);                         \
  } while (0)

namespace attnmix_test {

// Tokens held by `slot` of a layer cache, or of a stack cache (the first layer's).
template <class Cache>
index_t slot_length(const Cache& c, index_t slot) {
  return c.length(slot);
}
template <class... C>
index_t slot_length(const std::tuple<C...>& c, index_t slot) {
  return std::get<0>(c).length(slot);
}
template <class Cache>
std::vector<index_t> slot_lengths(const Cache& c, index_t slots) {
  std::vector<index_t> out;
  for (index_t s = 0; s < slots; ++s) out.push_back(slot_length(c, s));
  return out;
}

// Rows [t0, t1) of sequence b of x [B, T, D] as a [1, t1 - t0, D] tensor.
template <class T>
attnmix::host_tensor<T, 3> token_rows(const attnmix::host_tensor<T, 3>& x, index_t b, index_t t0,
                                      index_t t1) {
  const index_t D = x.extent(2);
  attnmix::host_tensor<T, 3> out({1, t1 - t0, D});
  for (index_t t = t0; t < t1; ++t)
    for (index_t e = 0; e < D; ++e) out(0, t - t0, e) = x(b, t, e);
  return out;
}

// Prefill and decoding through arbitrary cache slots (Model: a causal layer or stack in
// double). Each sequence alone (identity mapping, a cache of its own; itself checked against
// the full forward) is the reference for a run that prefills into slots out of order, leaves
// slots unused, and decodes permuted and sparse subsets of the sequences.
template <class Model>
void check_slot_mapping(const Model& m, index_t D, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt);
  // Sequences 0-2 are prefilled together, sequence 3 alone before them.
  const std::vector<index_t> prompt{4, 1, 6, 3}, total{9, 7, 10, 6};
  const std::vector<std::int32_t> slot_of{3, 0, 4, 1};  // slot 2 stays empty
  const index_t S = 5, cap = 12, Nseq = 4;
  std::vector<attnmix::host_tensor<double, 3>> x, ref;
  for (index_t n = 0; n < Nseq; ++n) {
    const auto u = static_cast<std::size_t>(n);
    x.push_back(random_activations<double>(r, 1, total[u], D));
    attnmix::host_tensor<double, 3> full(x[u].shape()), alone(x[u].shape());
    m.forward(x[u].view(), full.view());
    auto cache = m.make_cache(1, cap);
    const auto xp = token_rows(x[u], 0, 0, prompt[u]);
    attnmix::host_tensor<double, 3> yp(xp.shape());
    m.prefill(xp.view(), yp.view(), cache);
    std::copy(yp.storage().begin(), yp.storage().end(), alone.data());
    for (index_t t = prompt[u]; t < total[u]; ++t) {
      const auto xs = token_rows(x[u], 0, t, t + 1);
      attnmix::host_tensor<double, 3> ys(xs.shape());
      m.decode(xs.view(), ys.view(), cache);
      std::copy(ys.storage().begin(), ys.storage().end(), alone.data() + t * D);
    }
    INFO("sequence " << n << " alone");
    CHECK(rel_error(alone.storage(), as_double(full)) <= 1e-11);
    ref.push_back(alone);
  }
  const auto ref_rows = [&](index_t n, index_t t0, index_t t1) {
    const auto& a = ref[static_cast<std::size_t>(n)].storage();
    return std::vector<double>(a.begin() + t0 * D, a.begin() + t1 * D);
  };

  auto cache = m.make_cache(S, cap);
  {  // Sequence 3 into slot 1.
    const auto xp = token_rows(x[3], 0, 0, prompt[3]);
    attnmix::host_tensor<double, 3> yp(xp.shape());
    poison(yp);
    m.prefill(xp.view(), yp.view(), cache, std::vector<std::int32_t>{slot_of[3]});
    CHECK(rel_error(yp.storage(), ref_rows(3, 0, prompt[3])) <= 1e-11);
  }
  {  // Sequences 0-2, packed, into slots 3, 0, 4; slot 1 keeps sequence 3.
    std::vector<std::int32_t> cu{0};
    for (index_t n = 0; n < 3; ++n)
      cu.push_back(cu.back() + static_cast<std::int32_t>(prompt[static_cast<std::size_t>(n)]));
    attnmix::host_tensor<double, 3> xp({1, cu.back(), D}), yp({1, cu.back(), D});
    std::vector<double> want;
    for (index_t n = 0; n < 3; ++n) {
      const auto u = static_cast<std::size_t>(n);
      for (index_t t = 0; t < prompt[u]; ++t)
        for (index_t e = 0; e < D; ++e) xp(0, cu[u] + t, e) = x[u](0, t, e);
      const auto w = ref_rows(n, 0, prompt[u]);
      want.insert(want.end(), w.begin(), w.end());
    }
    poison(yp);
    const std::vector<std::int32_t> slots(slot_of.begin(), slot_of.begin() + 3);
    m.prefill(xp.view(), yp.view(), cache, slots, {cu.data(), {static_cast<index_t>(cu.size())}});
    CHECK(rel_error(yp.storage(), want) <= 1e-11);
  }
  CHECK(slot_lengths(cache, S) == std::vector<index_t>{1, 3, 0, 4, 6});

  // Decoding: round k takes the unfinished sequences in a rotated order and leaves one out
  // (except every fifth round).
  std::vector<index_t> pos(prompt);
  const std::vector<index_t> base{2, 0, 3, 1};
  for (int round = 0; round < 40; ++round) {
    std::vector<index_t> ids;
    for (int i = 0; i < 4; ++i) {
      const index_t n = base[static_cast<std::size_t>((i + round) % 4)];
      if (pos[static_cast<std::size_t>(n)] < total[static_cast<std::size_t>(n)] &&
          (round % 5 == 4 || n != round % 5))
        ids.push_back(n);
    }
    if (ids.empty()) continue;
    const auto N = static_cast<index_t>(ids.size());
    attnmix::host_tensor<double, 3> xs({N, 1, D}), ys({N, 1, D});
    std::vector<std::int32_t> slots;
    std::vector<double> want;
    for (index_t i = 0; i < N; ++i) {
      const index_t n = ids[static_cast<std::size_t>(i)], t = pos[static_cast<std::size_t>(n)];
      slots.push_back(slot_of[static_cast<std::size_t>(n)]);
      for (index_t e = 0; e < D; ++e) xs(i, 0, e) = x[static_cast<std::size_t>(n)](0, t, e);
      const auto w = ref_rows(n, t, t + 1);
      want.insert(want.end(), w.begin(), w.end());
      ++pos[static_cast<std::size_t>(n)];
    }
    poison(ys);
    m.decode(xs.view(), ys.view(), cache, slots);
    INFO("round " << round << " rows " << N);
    CHECK(rel_error(ys.storage(), want) <= 1e-11);
  }
  CHECK(pos == total);
  CHECK(slot_lengths(cache, S) == std::vector<index_t>{7, 6, 0, 9, 10});
}

// Bad slot mappings throw attnmix::error naming `fn` and the argument, and write neither the
// output nor the cache: decoding afterwards gives what it gives on a cache never handed a bad
// call.
template <class Model>
void check_bad_slots(const Model& m, index_t D, const std::string& fn, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt);
  const index_t S = 3, cap = 3;
  const auto xp = random_activations<double>(r, 2, 2, D);
  const auto xf = random_activations<double>(r, 1, 3, D);  // fills slot 1
  const auto xs = random_activations<double>(r, 2, 1, D);
  const std::vector<std::int32_t> good{2, 0};
  const auto prepare = [&](auto& cache) {
    attnmix::host_tensor<double, 3> yp(xp.shape()), yf(xf.shape());
    m.prefill(xp.view(), yp.view(), cache, good);
    m.prefill(xf.view(), yf.view(), cache, std::vector<std::int32_t>{1});
  };
  auto clean = m.make_cache(S, cap);
  prepare(clean);
  attnmix::host_tensor<double, 3> want(xs.shape());
  m.decode(xs.view(), want.view(), clean, good);

  auto cache = m.make_cache(S, cap);
  prepare(cache);
  const std::vector<index_t> lengths{2, 3, 2};
  REQUIRE(slot_lengths(cache, S) == lengths);
  const auto untouched = [&](const attnmix::host_tensor<double, 3>& y) {
    CHECK(std::all_of(y.storage().begin(), y.storage().end(),
                      [](double v) { return std::isnan(v); }));
    CHECK(slot_lengths(cache, S) == lengths);
  };
  using slots = std::vector<std::int32_t>;
  const std::string pf = fn + "::prefill: argument 'slots'", df = fn + "::decode: argument 'slots'";
  // (No structured bindings: the lambdas below capture them, which C++17 does not allow.)
  for (const auto& entry :
       std::vector<std::pair<slots, std::string>>{{{1, 1}, "names slot 1 twice"},
                                                  {{0, 3}, "entry 1 is 3"},
                                                  {{-1, 0}, "entry 0 is -1"},
                                                  {{0}, "has 1 entries but there are 2"},
                                                  {{0, 1, 2}, "has 3 entries but there are 2"}}) {
    const slots& bad = entry.first;
    const std::string& text = entry.second;
    INFO("slots " << ::Catch::Detail::stringify(bad));
    attnmix::host_tensor<double, 3> y(xp.shape());
    poison(y);
    ATTNMIX_CHECK_ERROR(m.prefill(xp.view(), y.view(), cache, bad), pf);
    ATTNMIX_CHECK_ERROR(m.prefill(xp.view(), y.view(), cache, bad), text);
    untouched(y);
    attnmix::host_tensor<double, 3> ys(xs.shape());
    poison(ys);
    ATTNMIX_CHECK_ERROR(m.decode(xs.view(), ys.view(), cache, bad), df);
    ATTNMIX_CHECK_ERROR(m.decode(xs.view(), ys.view(), cache, bad), text);
    untouched(ys);
  }
  {  // Slot 1 is full; slot 0 before it must not advance either.
    attnmix::host_tensor<double, 3> ys(xs.shape());
    poison(ys);
    ATTNMIX_CHECK_ERROR(m.decode(xs.view(), ys.view(), cache, slots{0, 1}),
                        fn + "::decode: argument 'cache' slot 1 is full");
    untouched(ys);
  }
  attnmix::host_tensor<double, 3> got(xs.shape());
  poison(got);
  m.decode(xs.view(), got.view(), cache, good);
  CHECK(rel_error(got.storage(), as_double(want)) <= 1e-14);
  CHECK(slot_lengths(cache, S) == std::vector<index_t>{3, 3, 3});
}

}  // namespace attnmix_test
