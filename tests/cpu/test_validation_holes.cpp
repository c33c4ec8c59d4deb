// Regression tests for the holes of issue 23 item 6 that the front doors, the CPU backend and the
// safetensors reader left open: each of these inputs once crashed, overflowed, escaped as another
// exception type or produced NaN.

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/io/safetensors.hpp"
#include "reference/path_reference.hpp"
#include "reference/softmax_reference.hpp"
#include "support/catch.hpp"
#include "support/testing.hpp"

using namespace attnmix_test;
using attnmix::attention_args;
using attnmix::attention_params;
using attnmix::host_tensor;
using attnmix::index_t;
using attnmix::view1;
using attnmix::view3;
using attnmix::view4;

namespace {

constexpr double ninf = -std::numeric_limits<double>::infinity();

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const attnmix::error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not attnmix::error: ") + e.what();
  }
  return "no exception";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A packed batch of two sequences whose offsets live inside `out` (or `lse`).
template <class Kind>
void check_offsets_inside_output(bool in_lse) {
  constexpr index_t T = 12, HQ = 2, H = 1, D = 8, Dv = 8;
  host_tensor<float, 4> q({1, T, HQ, D}, 0.5f), k({1, T, H, D}, 0.25f), v({1, T, H, Dv}, 1.0f);
  host_tensor<float, 4> w({1, T, H, D}, 0.0f);
  host_tensor<float, 3> g({1, T, HQ}, -0.1f), beta({1, T, H}, 0.5f);
  for (index_t t = 0; t < T; ++t) w(0, t, 0, 0) = 1.0f;
  std::vector<float> out_store(static_cast<std::size_t>(T * HQ * Dv), 42.0f);
  std::vector<float> lse_store(static_cast<std::size_t>(T * HQ), 42.0f);
  float* host = in_lse ? lse_store.data() : out_store.data();
  const std::int32_t offsets[3] = {0, 5, T};
  std::memcpy(host + 3, offsets, sizeof offsets);
  const std::vector<float> out_before = out_store, lse_before = lse_store;

  attention_args<float> a{q.view(), k.view(), v.view(),
                          view4<float>(out_store.data(), {1, T, HQ, Dv})};
  a.lse = view3<float>(lse_store.data(), {1, T, HQ});
  if constexpr (attnmix::kind_traits<Kind>::uses_forget_gate) a.g = g.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_householder) a.w = w.view(), a.beta = beta.view();
  attention_params p;
  p.cu_seqlens = view1<const std::int32_t>(reinterpret_cast<const std::int32_t*>(host + 3), {3});
  const std::string msg = message_of([&] { attnmix::attention<Kind>(a, p); });
  INFO(msg);
  CHECK(contains(msg, std::string("argument '") + (in_lse ? "lse" : "out") +
                          "' overlaps the memory of 'cu_seqlens'"));
  CHECK(bitwise_equal(out_store, out_before));
  CHECK(bitwise_equal(lse_store, lse_before));
}

}  // namespace

TEMPLATE_TEST_CASE("out and lse may not overlap cu_seqlens", "[holes][errors][cpu]",
                   attnmix::kind::softmax, attnmix::kind::fox, attnmix::kind::path,
                   attnmix::kind::path_fox) {
  check_offsets_inside_output<TestType>(false);
  check_offsets_inside_output<TestType>(true);
}

TEST_CASE("key_cache may not overlap cu_seqlens", "[holes][errors][cpu]") {
  constexpr index_t T = 12, H = 2, D = 8;
  host_tensor<float, 4> k({1, T, H, D}, 0.25f), w({1, T, H, D}, 0.0f);
  host_tensor<float, 3> beta({1, T, H}, 0.5f);
  for (index_t t = 0; t < T; ++t) w(0, t, 0, 0) = w(0, t, 1, 1) = 1.0f;
  std::vector<float> cache(static_cast<std::size_t>(T * H * D), 42.0f);
  const std::int32_t offsets[3] = {0, 5, T};
  std::memcpy(cache.data() + 1, offsets, sizeof offsets);
  const std::vector<float> before = cache;
  attnmix::path_key_cache_args<float> a{k.view(), w.view(), beta.view(),
                                        view4<float>(cache.data(), {1, T, H, D})};
  attention_params p;
  p.cu_seqlens =
      view1<const std::int32_t>(reinterpret_cast<const std::int32_t*>(cache.data() + 1), {3});
  const std::string msg = message_of([&] { attnmix::path_prefill_key_cache(a, p); });
  INFO(msg);
  CHECK(contains(msg, "argument 'key_cache' overlaps the memory of 'cu_seqlens'"));
  CHECK(bitwise_equal(cache, before));
}

TEST_CASE("a window near the index type's maximum means no window", "[holes][cpu]") {
  constexpr index_t B = 2, T = 37, HQ = 2, H = 1, D = 8, Dv = 4;
  rng r(23);
  host_tensor<float, 4> q({B, T, HQ, D}), k({B, T, H, D}), v({B, T, H, Dv});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  const auto run = [&](auto policy, index_t window) {
    host_tensor<float, 4> out({B, T, HQ, Dv}, 42.0f);
    attention_params p;
    p.window = window;
    attnmix::attention<attnmix::kind::softmax, decltype(policy)>(
        attention_args<float>{q.view(), k.view(), v.view(), out.view()}, p);
    return out.storage();
  };
  const index_t max = std::numeric_limits<index_t>::max();
  for (index_t window : {max, max - 1, max / 2 + 1}) {
    INFO("window " << window);
    CHECK(bitwise_equal(run(attnmix::bidirectional_softmax_policy{}, window),
                        run(attnmix::bidirectional_softmax_policy{}, 0)));
    CHECK(bitwise_equal(run(attnmix::softmax_policy{}, window), run(attnmix::softmax_policy{}, 0)));
  }
}

TEST_CASE("scale is checked finite in the computation's type", "[holes][errors][cpu]") {
  constexpr index_t T = 5, H = 1, D = 4;
  host_tensor<float, 4> q({1, T, H, D}, 0.5f), k({1, T, H, D}, 0.25f), v({1, T, H, D}, 1.0f);
  host_tensor<float, 4> out({1, T, H, D}, 42.0f);
  attention_params p;
  p.scale = 1e39;
  const std::string msg = message_of([&] {
    attnmix::attention<attnmix::kind::softmax>(
        attention_args<float>{q.view(), k.view(), v.view(), out.view()}, p);
  });
  INFO(msg);
  CHECK(contains(msg, "argument 'scale'"));
  CHECK(out(0, 0, 0, 0) == 42.0f);
  attnmix::linear_attention_params lp;
  lp.scale = 1e39;
  const std::string lmsg = message_of([&] {
    attnmix::linear_attention<attnmix::kind::bla>(
        attnmix::linear_attention_args<float>{q.view(), k.view(), v.view(), out.view()}, lp);
  });
  INFO(lmsg);
  CHECK(contains(lmsg, "argument 'scale'"));
  // Fine in double.
  host_tensor<double, 4> qd({1, T, H, D}, 0.5), kd({1, T, H, D}, 0.25), vd({1, T, H, D}, 1.0);
  host_tensor<double, 4> od({1, T, H, D}, 42.0);
  p.scale = 1e-39;
  CHECK_NOTHROW(attnmix::attention<attnmix::kind::softmax>(
      attention_args<double>{qd.view(), kd.view(), vd.view(), od.view()}, p));
}

TEST_CASE("a negative extent is reported as a negative extent", "[holes][errors][cpu]") {
  constexpr index_t T = 5, H = 1, D = 4;
  host_tensor<float, 4> q({1, T, H, D}, 0.5f), v({1, T, H, D}, 1.0f), out({1, T, H, D}, 0.0f);
  std::vector<float> spare(64, 0.0f);
  const std::string msg = message_of([&] {
    attnmix::attention<attnmix::kind::softmax>(attention_args<float>{
        q.view(), view4<const float>(spare.data(), {1, T, -1, D}), v.view(), out.view()});
  });
  INFO(msg);
  CHECK(contains(msg, "argument 'k' has a negative extent in dimension 2"));
}

TEST_CASE("a view whose extents multiply past the index type is an attnmix::error",
          "[holes][errors][cpu]") {
  constexpr index_t T = 5, H = 1, D = 4;
  host_tensor<float, 4> q({1, T, H, D}, 0.5f), v({1, T, H, D}, 1.0f), out({1, T, H, D}, 0.0f);
  std::vector<float> spare(64, 0.0f);
  const index_t big = index_t{1} << 20;  // big^4 = 2^80 elements
  for (const auto& shape : {std::array<index_t, 4>{big, big, big, big},
                            std::array<index_t, 4>{index_t{1} << 62, 4, 1, 4}}) {
    const std::string msg = message_of([&] {
      attnmix::attention<attnmix::kind::softmax>(attention_args<float>{
          q.view(), view4<const float>(spare.data(), shape), v.view(), out.view()});
    });
    INFO(msg);
    CHECK(contains(msg, "argument 'k' has shape"));
    CHECK(contains(msg, "too many to address"));
  }
  // Strides that reach past the index type, with a small shape.
  const std::string msg = message_of([&] {
    attnmix::attention<attnmix::kind::softmax>(attention_args<float>{
        q.view(), view4<const float>(spare.data(), {1, T, H, D}, {1, index_t{1} << 62, 1, 1}),
        v.view(), out.view()});
  });
  INFO(msg);
  CHECK(contains(msg, "too many to address"));
  CHECK(out(0, 0, 0, 0) == 0.0f);
}

TEST_CASE("a path_cache too large to address is an attnmix::error", "[holes][errors][cpu]") {
  const index_t huge = index_t{1} << 62;
  for (auto sizes : {std::vector<index_t>{1, huge, 1, 1, 1, 1},
                     {4, huge / 2, 8, 8, 64, 64},
                     {huge, 4, 1, 1, 1, 1},
                     {2, 1 << 20, huge, 1, 8, 8}}) {
    const std::string msg = message_of([&] {
      attnmix::path_cache<float> c(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]);
    });
    INFO(msg);
    CHECK(msg.rfind("attnmix::path_cache: argument '", 0) == 0);
    CHECK(contains(msg, "too large"));
  }
}

// ---- hard resets: a log forget gate of -inf ----------------------------------------------------

namespace {

// A hard reset at token r of a sequence is, by the definition G_i - G_j = sum_{j<t<=i} g_t, the
// same as cutting the sequence at r: queries before r are unaffected, queries from r on see only
// keys j >= r. The oracles compute the cut sequences.
template <class Kind, class Policy, class T>
void check_hard_reset() {
  constexpr index_t L = 70, HQ = 2, H = 1, D = 8, Dv = 8;
  const index_t resets[] = {0, 17, 64, 69};
  rng r(91);
  host_tensor<T, 4> q({1, L, HQ, D}), k({1, L, H, D}), v({1, L, H, Dv}), w({1, L, H, D});
  host_tensor<T, 3> g({1, L, HQ}), beta({1, L, H});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(w);
  r.fill_uniform(g, -0.3, -0.01), r.fill_uniform(beta, 0.1, 1.9);
  for (index_t t = 0; t < L; ++t) {
    double n2 = 0;
    for (index_t d = 0; d < D; ++d) n2 += double(w(0, t, 0, d)) * double(w(0, t, 0, d));
    for (index_t d = 0; d < D; ++d) w(0, t, 0, d) = static_cast<T>(w(0, t, 0, d) / std::sqrt(n2));
  }
  std::vector<long> cut{0};
  for (index_t s : resets) {
    for (index_t hq = 0; hq < HQ; ++hq) g(0, s, hq) = static_cast<T>(ninf);
    if (s > 0) cut.push_back(s);
  }
  cut.push_back(L);

  host_tensor<T, 4> out({1, L, HQ, Dv});
  host_tensor<T, 3> lse({1, L, HQ});
  poison(out), poison(lse);
  attention_args<T> a{q.view(), k.view(), v.view(), out.view()};
  a.g = g.view();
  a.lse = lse.view();
  if constexpr (attnmix::kind_traits<Kind>::uses_householder) a.w = w.view(), a.beta = beta.view();
  attnmix::attention<Kind, Policy>(a);

  std::vector<double> gd = to_double(g.storage());
  for (auto& x : gd)
    if (std::isinf(x)) x = 0;  // the oracles see the cut sequences; the reset's own g is unused
  constexpr bool before = Policy::gate == attnmix::gate_scaling::before_scale;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> ref_out, ref_lse;
  if constexpr (attnmix::kind_traits<Kind>::uses_householder) {
    attnmix_ref::path_problem p{1, L, HQ, H, D, Dv, scale, cut};
    p.gate = before ? attnmix_ref::path_problem::gate_before_scale
                    : attnmix_ref::path_problem::gate_after_scale;
    const auto ref = attnmix_ref::path_query_scan(p, to_double(q.storage()), to_double(k.storage()),
                                                  to_double(v.storage()), to_double(w.storage()),
                                                  to_double(beta.storage()), gd);
    ref_out = ref.out, ref_lse = ref.lse;
  } else {
    attnmix_ref::softmax_problem p{1, L, HQ, H, D, Dv, scale, true, 0, cut};
    p.gate = before ? attnmix_ref::softmax_problem::gate_before_scale
                    : attnmix_ref::softmax_problem::gate_after_scale;
    const auto ref = attnmix_ref::softmax_attention(
        p, to_double(q.storage()), to_double(k.storage()), to_double(v.storage()), gd);
    ref_out = ref.out, ref_lse = ref.lse;
  }
  CHECK(rel_error(out.storage(), ref_out) <= tolerance<T>());
  CHECK(lse_error(lse.storage(), ref_lse) <= tolerance<T>());
}

}  // namespace

TEMPLATE_TEST_CASE("FoX: a log gate of -inf is a hard reset", "[holes][fox][cpu]", float, double) {
  using attnmix::gate_scaling;
  check_hard_reset<attnmix::kind::fox, attnmix::fox_policy, TestType>();
  check_hard_reset<attnmix::kind::fox,
                   attnmix::with_gate_scaling<attnmix::fox_policy, gate_scaling::before_scale>,
                   TestType>();
}

TEMPLATE_TEST_CASE("PaTH-FoX: a log gate of -inf is a hard reset", "[holes][path][cpu]", float,
                   double) {
  check_hard_reset<attnmix::kind::path_fox, attnmix::path_fox_policy, TestType>();
}

TEST_CASE("PaTH-FoX decoding through a hard reset matches the forward", "[holes][path][cpu]") {
  constexpr index_t L = 20, P = 6, HQ = 2, H = 1, D = 8, Dv = 8;
  rng r(92);
  host_tensor<double, 4> q({1, L, HQ, D}), k({1, L, H, D}), v({1, L, H, Dv}), w({1, L, H, D});
  host_tensor<double, 3> g({1, L, HQ}), beta({1, L, H});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(w);
  r.fill_uniform(g, -0.3, -0.01), r.fill_uniform(beta, 0.1, 1.9);
  for (index_t t = 0; t < L; ++t) {
    double n2 = 0;
    for (index_t d = 0; d < D; ++d) n2 += w(0, t, 0, d) * w(0, t, 0, d);
    for (index_t d = 0; d < D; ++d) w(0, t, 0, d) /= std::sqrt(n2);
  }
  for (index_t s : {index_t{3}, index_t{11}, index_t{12}})  // one in the prompt, two while decoding
    for (index_t hq = 0; hq < HQ; ++hq) g(0, s, hq) = ninf;

  host_tensor<double, 4> full({1, L, HQ, Dv});
  attention_args<double> fa{q.view(), k.view(), v.view(), full.view()};
  fa.g = g.view(), fa.w = w.view(), fa.beta = beta.view();
  attnmix::attention<attnmix::kind::path_fox>(fa);

  // Tokens [t0, t0 + n) of a [1, L, ...] tensor.
  const auto rows = [](const auto& t, index_t t0, index_t n) {
    const auto view = t.view();
    auto shape = view.shape();
    shape[1] = n;
    return decltype(view)(view.data() + t0 * view.stride(1), shape, view.strides());
  };
  attnmix::path_cache<double> cache(1, L, HQ, H, D, Dv);
  host_tensor<double, 4> out({1, L, HQ, Dv});
  poison(out);
  attention_args<double> pa{rows(q, 0, P), rows(k, 0, P), rows(v, 0, P),
                            view4<double>(out.data(), {1, P, HQ, Dv}, out.view().strides())};
  pa.g = rows(g, 0, P), pa.w = rows(w, 0, P), pa.beta = rows(beta, 0, P);
  attnmix::path_prefill<attnmix::kind::path_fox>(cache, pa);
  for (index_t t = P; t < L; ++t) {
    attention_args<double> sa{rows(q, t, 1), rows(k, t, 1), rows(v, t, 1),
                              view4<double>(out.data() + t * HQ * Dv, {1, 1, HQ, Dv})};
    sa.g = rows(g, t, 1), sa.w = rows(w, t, 1), sa.beta = rows(beta, t, 1);
    attnmix::path_decode_step<attnmix::kind::path_fox>(cache, sa);
  }
  CHECK(rel_error(out.storage(), to_double(full.storage())) <= 1e-12);
}

TEST_CASE("GBLA: key-gate logits of -inf give the all-masked result", "[holes][gbla][cpu]") {
  constexpr index_t B = 2, T = 9, HQ = 2, H = 1, D = 4, Dv = 4;
  rng r(93);
  host_tensor<float, 4> q({B, T, HQ, D}), k({B, T, H, D}), v({B, T, H, Dv}), gate({B, T, HQ, Dv});
  host_tensor<float, 3> a({B, T, 1});
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v), r.fill_normal(gate), r.fill_normal(a);
  for (index_t t = 0; t < T; ++t)
    a(1, t, 0) = static_cast<float>(ninf);  // row 1: every key gated off
  host_tensor<float, 4> out({B, T, HQ, Dv});
  poison(out);
  attnmix::linear_attention_args<float> la{q.view(), k.view(), v.view(), out.view()};
  la.a = a.view(), la.gate = gate.view();
  attnmix::linear_attention<attnmix::kind::gbla>(la);
  // Row 0 is unaffected: the same call with row 1 masked instead.
  host_tensor<std::uint8_t, 2> mask({B, T}, 1);
  for (index_t t = 0; t < T; ++t) mask(1, t) = 0;
  host_tensor<float, 3> a0 = a;
  for (index_t t = 0; t < T; ++t) a0(1, t, 0) = 0.0f;
  host_tensor<float, 4> masked({B, T, HQ, Dv});
  poison(masked);
  la.out = masked.view(), la.a = a0.view(), la.mask = mask.view();
  attnmix::linear_attention<attnmix::kind::gbla>(la);
  CHECK(rel_error(out.storage(), to_double(masked.storage())) <= 1e-6);
  for (index_t t = 0; t < T; ++t)
    for (index_t hq = 0; hq < HQ; ++hq)
      for (index_t e = 0; e < Dv; ++e) CHECK(out(1, t, hq, e) == 0.0f);
}

TEST_CASE("gated causal linear attention: key-gate logits of -inf weigh nothing",
          "[holes][linear_causal][cpu]") {
  constexpr index_t T = 70, HQ = 1, H = 1, D = 4, Dv = 4;
  using base = attnmix::with_key_gate<attnmix::linear_causal_policy, attnmix::key_gate::shared>;
  using recurrent = attnmix::with_causal_form<base, attnmix::causal_form::recurrent>;
  rng r(94);
  host_tensor<double, 4> q({1, T, HQ, D}), k({1, T, H, D}), v({1, T, H, Dv});
  host_tensor<double, 3> a({1, T, 1}, ninf);
  r.fill_normal(q), r.fill_normal(k), r.fill_normal(v);
  const auto run = [&](auto policy, const host_tensor<double, 3>& logits) {
    host_tensor<double, 4> out({1, T, HQ, Dv});
    host_tensor<double, 4> S({1, H, D, Dv});
    host_tensor<double, 3> z({1, H, D});
    host_tensor<double, 2> lse({1, H});
    poison(out), poison(S), poison(z), poison(lse);
    attnmix::linear_attention_args<double> la{q.view(), k.view(), v.view(), out.view()};
    la.a = logits.view();
    la.state_out = {S.view(), z.view(), lse.view()};
    attnmix::linear_attention<attnmix::kind::linear_causal, decltype(policy)>(la);
    return std::vector<std::vector<double>>{out.storage(), S.storage(), z.storage(), lse.storage()};
  };
  for (const auto& res : {run(base{}, a), run(recurrent{}, a)}) {  // every key gated off
    for (double x : res[0]) CHECK(x == 0.0);
    for (double x : res[1]) CHECK(x == 0.0);
    for (double x : res[2]) CHECK(x == 0.0);
    CHECK(res[3][0] == ninf);
  }
  // The first 40 keys gated off: the rows before 40 are 0, the rest see only keys >= 40.
  r.fill_normal(a);
  for (index_t t = 0; t < 40; ++t) a(0, t, 0) = ninf;
  host_tensor<double, 3> tail = a;
  for (const auto& res : {run(base{}, a), run(recurrent{}, a)}) {
    for (index_t i = 0; i < 40 * Dv; ++i) CHECK(res[0][static_cast<std::size_t>(i)] == 0.0);
    for (double x : res[0]) CHECK(std::isfinite(x));
    for (double x : res[1]) CHECK(std::isfinite(x));
    CHECK(std::isfinite(res[3][0]));
  }
}

// ---- safetensors ---------------------------------------------------------------------------

namespace {

std::vector<unsigned char> safetensors_bytes(const std::string& header, std::size_t data_bytes) {
  std::vector<unsigned char> b(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i)
    b[static_cast<std::size_t>(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

}  // namespace

TEST_CASE("safetensors: overlaps are found past neighbours and empty tensors", "[holes][io]") {
  using attnmix::io::safetensors_file;
  // 'b' is empty and sorts between 'a' and 'c', which overlap.
  const std::string h1 = R"({"a":{"dtype":"F32","shape":[25],"data_offsets":[0,100]},)"
                         R"("b":{"dtype":"F32","shape":[0],"data_offsets":[10,10]},)"
                         R"("c":{"dtype":"F32","shape":[2],"data_offsets":[50,58]}})";
  const std::string m1 =
      message_of([&] { safetensors_file::parse(safetensors_bytes(h1, 100), "x"); });
  INFO(m1);
  CHECK(contains(m1, "overlap"));
  CHECK(contains(m1, "'a'"));
  // An empty tensor placed inside another one's bytes.
  const std::string h2 = R"({"a":{"dtype":"F32","shape":[25],"data_offsets":[0,100]},)"
                         R"("b":{"dtype":"F32","shape":[0],"data_offsets":[40,40]}})";
  const std::string m2 =
      message_of([&] { safetensors_file::parse(safetensors_bytes(h2, 100), "x"); });
  INFO(m2);
  CHECK(contains(m2, "overlap"));
  // Empty tensors at the edges of others are fine.
  const std::string h3 = R"({"a":{"dtype":"F32","shape":[25],"data_offsets":[0,100]},)"
                         R"("b":{"dtype":"F32","shape":[0],"data_offsets":[100,100]},)"
                         R"("c":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})";
  CHECK_NOTHROW(safetensors_file::parse(safetensors_bytes(h3, 100), "x"));
}

TEST_CASE("safetensors: reading a directory is an attnmix::error", "[holes][io]") {
  const std::string msg =
      message_of([] { attnmix::io::safetensors_file::read(ATTNMIX_IO_CORPUS); });
  INFO(msg);
  CHECK(msg.rfind("attnmix::io::safetensors_file::read: file '", 0) == 0);
}
