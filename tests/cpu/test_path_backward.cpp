// PaTH and PaTH-FoX backward on the CPU: the float64 gradient oracle against central finite
// differences of the forward oracle, then the blocked backward against the gradient oracle for
// several chunk sizes (dense and rank-C chunk products), both gate conventions, GQA, varlen,
// D != Dv and the beta ranges of the spec; the exact zeros at sequence starts, hard resets,
// strided views and determinism.

#include <array>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "cpu/test_path_harness.hpp"
#include "reference/finite_difference.hpp"
#include "reference/path_backward_reference.hpp"

using namespace attnmix_test;
using attnmix::gate_scaling;
using attnmix::kind::path;
using attnmix::kind::path_fox;
using gate_mode = attnmix_ref::path_problem::gate_mode;

namespace {

using after_policy =
    attnmix::with_gate_scaling<attnmix::path_fox_policy, gate_scaling::after_scale>;

struct gradients {
  std::vector<double> dq, dk, dv, dw, dbeta, dg;
};

std::vector<double> random_dout(const path_case& c, std::uint64_t salt) {
  rng r(salt);
  std::vector<double> d(static_cast<std::size_t>(c.B * c.T * c.HQ * c.Dv));
  for (auto& x : d) x = to_float_grid(r.normal());
  return d;
}

// The library forward (for out and lse), then the backward into NaN-poisoned gradients.
template <class Kind, class Policy, class T>
gradients run_path_backward(const path_case& c, const path_inputs& in,
                            const std::vector<double>& dout) {
  using A = attnmix::accum_t<T>;
  path_tensors<T> t(c, in);
  const attnmix::backend::cpu be{c.threads};
  attnmix::attention<Kind, Policy>(t.template args<Kind>(), path_params(c), be);
  attnmix::host_tensor<T, 4> dO({c.B, c.T, c.HQ, c.Dv}), dq({c.B, c.T, c.HQ, c.D}),
      dk({c.B, c.T, c.H, c.D}), dv({c.B, c.T, c.H, c.Dv});
  attnmix::host_tensor<A, 4> dw({c.B, c.T, c.H, c.D});
  attnmix::host_tensor<A, 3> dbeta({c.B, c.T, c.H}), dg({c.B, c.T, c.HQ});
  dO.storage() = cast_to<T>(dout);
  poison(dq), poison(dk), poison(dv), poison(dw), poison(dbeta), poison(dg);
  attnmix::attention_grad_args<T> a;
  a.q = t.q.view(), a.k = t.k.view(), a.v = t.v.view();
  a.w = t.w.view(), a.beta = t.beta.view();
  a.out = t.out.view(), a.lse = t.lse.view(), a.dout = dO.view();
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view(), a.dw = dw.view(), a.dbeta = dbeta.view();
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  if constexpr (gated) a.g = t.g.view(), a.dg = dg.view();
  attnmix::attention_backward<Kind, Policy>(a, path_params(c), be);
  return {to_double(dq.storage()),    to_double(dk.storage()),
          to_double(dv.storage()),    to_double(dw.storage()),
          to_double(dbeta.storage()), gated ? to_double(dg.storage()) : std::vector<double>{}};
}

attnmix_ref::path_gradients oracle_gradients(const path_case& c, const path_inputs& in,
                                             const std::vector<double>& dout, gate_mode gate) {
  return attnmix_ref::path_query_scan_backward(path_oracle_problem(c, gate), in.q, in.k, in.v, in.w,
                                               in.beta, in.g, dout);
}

// The oracle against finite differences: relative, except that a gradient much smaller than
// the loss (dw and dbeta with beta near 0) is compared at the differences' absolute accuracy,
// eps |loss| / h per element, about 1e-10 here.
double fd_error(const std::vector<double>& oracle, const std::vector<double>& fd) {
  double diff = 0;
  for (std::size_t i = 0; i < fd.size(); ++i) diff += (oracle[i] - fd[i]) * (oracle[i] - fd[i]);
  return std::sqrt(diff) / std::max(std::sqrt(attnmix_ref::dot(fd, fd)), 1.0);
}

// The first token of every sequence: its transition never enters a logit.
std::vector<index_t> sequence_starts(const path_case& c) {
  std::vector<index_t> rows;
  if (c.cu_seqlens.empty()) {
    for (index_t b = 0; b < c.B; ++b)
      if (c.T > 0) rows.push_back(b * c.T);
  } else {
    for (std::size_t n = 0; n + 1 < c.cu_seqlens.size(); ++n)
      if (c.cu_seqlens[n + 1] > c.cu_seqlens[n]) rows.push_back(c.cu_seqlens[n]);
  }
  return rows;
}

bool zero_at_starts(const path_case& c, const gradients& g) {
  bool ok = true;
  for (index_t row : sequence_starts(c))
    for (index_t h = 0; h < c.H; ++h) {
      ok = ok && g.dbeta[static_cast<std::size_t>(row * c.H + h)] == 0.0;
      for (index_t d = 0; d < c.D; ++d)
        ok = ok && g.dw[static_cast<std::size_t>((row * c.H + h) * c.D + d)] == 0.0;
    }
  return ok;
}

// The largest error per gradient (dq, dk, dv, dw, dbeta, dg) and type, reported by each sweep.
std::array<std::array<double, 6>, 2> worst{};

std::string describe_worst() {
  std::ostringstream os;
  const char* names[] = {"dq", "dk", "dv", "dw", "dbeta", "dg"};
  for (int t = 0; t < 2; ++t) {
    os << (t == 0 ? "double:" : " float:");
    for (int i = 0; i < 6; ++i) os << " " << names[i] << " " << worst[t][i];
  }
  return os.str();
}

template <class T>
void check_gradients(const gradients& got, const attnmix_ref::path_gradients& ref, bool gated) {
  const double tol = sizeof(T) == 8 ? 1e-10 : 1e-5;
  const double e[] = {rel_error(got.dq, ref.dq),       rel_error(got.dk, ref.dk),
                      rel_error(got.dv, ref.dv),       rel_error(got.dw, ref.dw),
                      rel_error(got.dbeta, ref.dbeta), gated ? rel_error(got.dg, ref.dg) : 0.0};
  INFO("errors dq " << e[0] << " dk " << e[1] << " dv " << e[2] << " dw " << e[3] << " dbeta "
                    << e[4] << " dg " << e[5]);
  for (int i = 0; i < 6; ++i) {
    CHECK(e[i] <= tol);
    auto& w = worst[sizeof(T) == 8 ? 0 : 1][static_cast<std::size_t>(i)];
    w = std::max(w, e[i]);
  }
}

template <class Kind, class Policy, class T>
void check_case(const path_case& c, const path_inputs& in, const std::vector<double>& dout,
                const attnmix_ref::path_gradients& ref) {
  constexpr bool gated = attnmix::kind_traits<Kind>::uses_forget_gate;
  INFO("chunk=" << Policy::chunk << " type=" << (sizeof(T) == 8 ? "double" : "float"));
  const gradients g = run_path_backward<Kind, Policy, T>(c, in, dout);
  check_gradients<T>(g, ref, gated);
  CHECK(zero_at_starts(c, g));
}

// Chunks of 8 and 16 make D > 2C here and there: the rank-C form of the chunk products.
template <class Kind, class Policy>
void check_chunks(const path_case& c, const path_inputs& in, const std::vector<double>& dout,
                  gate_mode gate) {
  const auto ref = oracle_gradients(c, in, dout, gate);
  check_case<Kind, with_chunk<Policy, 8>, double>(c, in, dout, ref);
  check_case<Kind, with_chunk<Policy, 16>, double>(c, in, dout, ref);
  check_case<Kind, with_chunk<Policy, 64>, double>(c, in, dout, ref);
  check_case<Kind, with_chunk<Policy, 16>, float>(c, in, dout, ref);
}

std::vector<path_case> backward_cases() {
  return {
      {1, 1, 1, 1, 8, 8},
      {2, 13, 4, 2, 16, 8, {}, beta_range::near_two},
      {1, 63, 4, 2, 32, 16},
      {1, 65, 2, 2, 64, 48, {}, beta_range::uniform, 1},
      {1, 130, 3, 3, 16, 24, {}, beta_range::near_zero},
      {1, 140, 4, 1, 32, 16, {}, beta_range::near_two},
      {1, 100, 2, 2, 16, 8, {}, beta_range::exactly_two},
      {1, 150, 4, 2, 16, 16, {0, 0, 1, 64, 64, 97, 150}},
      {1, 90, 2, 1, 16, 16, {0, 40, 41, 90}, beta_range::near_two, 3},
      {3, 40, 2, 2, 8, 8, {}, beta_range::uniform, 3},
      {1, 0, 2, 1, 8, 8, {0, 0}},
  };
}

// A dense tensor inside a padded buffer: [B, T, heads, dim] in rows of dim + pad, or
// [B, T, heads] (dim == 0) with one spare per token.
struct padded {
  static constexpr index_t pad = 3;
  static constexpr double fill = -7.0;
  index_t B, T, heads, dim;  // dim == 0: rank 3
  std::vector<double> data;
  padded(index_t B_, index_t T_, index_t h, index_t d, const std::vector<double>& x, double init)
      : B(B_), T(T_), heads(h), dim(d) {
    data.assign(
        static_cast<std::size_t>(dim > 0 ? B * T * heads * (dim + pad) : B * T * (heads + 1)),
        fill);
    for (std::size_t i = 0; i < dense_size(); ++i) data[at(i)] = x.empty() ? init : x[i];
  }
  std::size_t dense_size() const {
    return static_cast<std::size_t>(B * T * heads * std::max<index_t>(dim, 1));
  }
  std::size_t at(std::size_t n) const {
    const auto i = static_cast<index_t>(n);
    return static_cast<std::size_t>(dim > 0 ? (i / dim) * (dim + pad) + i % dim
                                            : (i / heads) * (heads + 1) + i % heads);
  }
  template <class E>
  attnmix::view4<E> v4() {
    return attnmix::view4<E>(data.data(), {B, T, heads, dim},
                             {T * heads * (dim + pad), heads * (dim + pad), dim + pad, 1});
  }
  template <class E>
  attnmix::view3<E> v3() {
    return attnmix::view3<E>(data.data(), {B, T, heads}, {T * (heads + 1), heads + 1, 1});
  }
  std::vector<double> dense() const {
    std::vector<double> y(dense_size());
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = data[at(i)];
    return y;
  }
  bool padding_kept() const {
    std::vector<bool> used(data.size(), false);
    for (std::size_t i = 0; i < dense_size(); ++i) used[at(i)] = true;
    for (std::size_t i = 0; i < data.size(); ++i)
      if (!used[i] && data[i] != fill) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("the PaTH gradient oracle matches finite differences", "[path][cpu][oracle]") {
  const std::vector<path_case> cases = {
      {1, 1, 1, 1, 4, 4},
      {2, 9, 4, 2, 4, 3, {}, beta_range::near_two},
      {1, 12, 2, 1, 5, 3, {0, 0, 1, 6, 12}},
      {1, 10, 3, 3, 3, 5, {}, beta_range::near_zero},
  };
  std::uint64_t salt = 10;
  worst = {};
  for (const path_case& c : cases)
    for (gate_mode gate :
         {gate_mode::no_gate, gate_mode::gate_before_scale, gate_mode::gate_after_scale}) {
      INFO("seed " << test_seed() << " " << c.describe() << " gate mode " << int(gate));
      path_inputs in = make_path_inputs(c, ++salt);
      const std::vector<double> dout = random_dout(c, ++salt);
      const auto p = path_oracle_problem(c, gate);
      const auto ref =
          attnmix_ref::path_query_scan_backward(p, in.q, in.k, in.v, in.w, in.beta, in.g, dout);
      // The loss sum(dout * out) as a function of one input at a time.
      const auto fd = [&](std::vector<double>& x) {
        return attnmix_ref::finite_difference(
            [&](const std::vector<double>& y) {
              const std::vector<double> saved = x;
              x = y;
              const double loss = attnmix_ref::dot(
                  dout, attnmix_ref::path_query_scan(p, in.q, in.k, in.v, in.w, in.beta, in.g).out);
              x = saved;
              return loss;
            },
            x);
      };
      const double e[] = {fd_error(ref.dq, fd(in.q)),
                          fd_error(ref.dk, fd(in.k)),
                          fd_error(ref.dv, fd(in.v)),
                          fd_error(ref.dw, fd(in.w)),
                          fd_error(ref.dbeta, fd(in.beta)),
                          gate != gate_mode::no_gate ? fd_error(ref.dg, fd(in.g)) : 0.0};
      INFO("errors dq " << e[0] << " dk " << e[1] << " dv " << e[2] << " dw " << e[3] << " dbeta "
                        << e[4] << " dg " << e[5]);
      for (int i = 0; i < 6; ++i) {
        CHECK(e[i] <= 1e-8);
        worst[0][static_cast<std::size_t>(i)] =
            std::max(worst[0][static_cast<std::size_t>(i)], e[i]);
      }
      gradients g{ref.dq, ref.dk, ref.dv, ref.dw, ref.dbeta, ref.dg};
      CHECK(zero_at_starts(c, g));
    }
  WARN("worst errors against finite differences " << describe_worst());
}

TEST_CASE("PaTH backward matches the gradient oracle", "[path][cpu]") {
  std::uint64_t salt = 1000;
  worst = {};
  for (const path_case& c : backward_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    check_chunks<path, attnmix::path_policy>(c, in, random_dout(c, ++salt), gate_mode::no_gate);
  }
  WARN("worst relative errors " << describe_worst());
}

TEST_CASE("PaTH-FoX backward matches the gradient oracle, gate before the scale",
          "[path_fox][cpu]") {
  std::uint64_t salt = 2000;
  worst = {};
  for (const path_case& c : backward_cases()) {
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    check_chunks<path_fox, attnmix::path_fox_policy>(c, in, random_dout(c, ++salt),
                                                     gate_mode::gate_before_scale);
  }
  WARN("worst relative errors " << describe_worst());
}

TEST_CASE("PaTH-FoX backward matches the gradient oracle, gate after the scale",
          "[path_fox][cpu]") {
  std::uint64_t salt = 3000;
  worst = {};
  for (path_case c : backward_cases()) {
    c.gate_lo = std::log(0.5);  // strong forgetting: the convention makes a visible difference
    INFO("seed " << test_seed() << " " << c.describe());
    const path_inputs in = make_path_inputs(c, ++salt);
    check_chunks<path_fox, after_policy>(c, in, random_dout(c, ++salt),
                                         gate_mode::gate_after_scale);
  }
  WARN("worst relative errors " << describe_worst());
}

TEMPLATE_TEST_CASE("PaTH-FoX backward through hard resets (a log gate of -inf)", "[path_fox][cpu]",
                   float, double) {
  // A reset at r is the same as cutting the sequence there (see test_validation_holes.cpp): the
  // oracle runs the cut sequences, with the reset's own (unused) gate set to 0.
  using T = TestType;
  const path_case c{1, 70, 2, 1, 8, 8, {}, beta_range::near_two};
  INFO("seed " << test_seed() << " " << c.describe());
  path_inputs in = make_path_inputs(c, 51);
  const std::vector<double> dout = random_dout(c, 52);
  const index_t resets[] = {0, 17, 64, 69};
  path_case cut = c;
  cut.cu_seqlens = {0};
  for (index_t r : resets) {
    for (index_t hq = 0; hq < c.HQ; ++hq) in.g[static_cast<std::size_t>(r * c.HQ + hq)] = 0.0;
    if (r > 0) cut.cu_seqlens.push_back(static_cast<std::int32_t>(r));
  }
  cut.cu_seqlens.push_back(static_cast<std::int32_t>(c.T));
  const auto check = [&](gate_mode mode, auto policy) {
    using P = decltype(policy);
    const auto ref = oracle_gradients(cut, in, dout, mode);
    path_inputs reset_in = in;
    for (index_t r : resets)
      for (index_t hq = 0; hq < c.HQ; ++hq)
        reset_in.g[static_cast<std::size_t>(r * c.HQ + hq)] =
            -std::numeric_limits<double>::infinity();
    const gradients g = run_path_backward<path_fox, P, T>(c, reset_in, dout);
    INFO("chunk " << P::chunk << " gate mode " << int(mode));
    check_gradients<T>(g, ref, true);
    for (index_t r : resets)
      for (index_t hq = 0; hq < c.HQ; ++hq)
        CHECK(g.dg[static_cast<std::size_t>(r * c.HQ + hq)] == 0.0);
    CHECK(zero_at_starts(c, g));
  };
  check(gate_mode::gate_before_scale, with_chunk<attnmix::path_fox_policy, 16>{});
  check(gate_mode::gate_before_scale, attnmix::path_fox_policy{});
  check(gate_mode::gate_after_scale, with_chunk<after_policy, 16>{});
}

TEST_CASE("PaTH-FoX backward keeps float accuracy over a long sequence", "[path_fox][cpu]") {
  // ~30 chunk products in a row with eigenvalues near -1 on the way back.
  path_case c{1, 2000, 1, 1, 32, 32, {}, beta_range::near_two};
  c.gate_lo = -0.2, c.gate_hi = 0.0;
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 61);
  const std::vector<double> dout = random_dout(c, 62);
  const auto ref = oracle_gradients(c, in, dout, gate_mode::gate_before_scale);
  check_gradients<float>(run_path_backward<path_fox, attnmix::path_fox_policy, float>(c, in, dout),
                         ref, true);
}

TEST_CASE("PaTH-FoX backward gives the same bits for every thread count", "[path_fox][cpu]") {
  // Few (sequence, KV head) tasks: the long sequence's query chunks are split into slices.
  path_case c{1, 600, 4, 2, 32, 16, {0, 5, 6, 600}};
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 71);
  const std::vector<double> dout = random_dout(c, 72);
  c.threads = 1;
  const gradients one = run_path_backward<path_fox, attnmix::path_fox_policy, float>(c, in, dout);
  for (int threads : {1, 2, 3, 0}) {
    c.threads = threads;
    const gradients g = run_path_backward<path_fox, attnmix::path_fox_policy, float>(c, in, dout);
    INFO("threads " << threads);
    CHECK(bitwise_equal(g.dq, one.dq));
    CHECK(bitwise_equal(g.dk, one.dk));
    CHECK(bitwise_equal(g.dv, one.dv));
    CHECK(bitwise_equal(g.dw, one.dw));
    CHECK(bitwise_equal(g.dbeta, one.dbeta));
    CHECK(bitwise_equal(g.dg, one.dg));
  }
}

TEST_CASE("PaTH-FoX backward reads and writes strided views", "[path_fox][cpu]") {
  // Every tensor inside a padded buffer: rows and heads further apart than dense; the padding
  // must survive.
  const path_case c{2, 70, 4, 2, 16, 8};
  INFO("seed " << test_seed() << " " << c.describe());
  const path_inputs in = make_path_inputs(c, 81);
  const std::vector<double> dout = random_dout(c, 82);
  using attnmix::view3;
  using attnmix::view4;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  padded q(c.B, c.T, c.HQ, c.D, in.q, 0), k(c.B, c.T, c.H, c.D, in.k, 0),
      v(c.B, c.T, c.H, c.Dv, in.v, 0), w(c.B, c.T, c.H, c.D, in.w, 0),
      beta(c.B, c.T, c.H, 0, in.beta, 0), g(c.B, c.T, c.HQ, 0, in.g, 0),
      out(c.B, c.T, c.HQ, c.Dv, {}, nan), lse(c.B, c.T, c.HQ, 0, {}, nan),
      dO(c.B, c.T, c.HQ, c.Dv, dout, 0), dq(c.B, c.T, c.HQ, c.D, {}, nan),
      dk(c.B, c.T, c.H, c.D, {}, nan), dv(c.B, c.T, c.H, c.Dv, {}, nan),
      dw(c.B, c.T, c.H, c.D, {}, nan), dbeta(c.B, c.T, c.H, 0, {}, nan),
      dg(c.B, c.T, c.HQ, 0, {}, nan);
  using P = with_chunk<attnmix::path_fox_policy, 16>;
  attnmix::attention_args<double> f{q.v4<const double>(), k.v4<const double>(),
                                    v.v4<const double>(), out.v4<double>()};
  f.g = g.v3<const double>(), f.w = w.v4<const double>(), f.beta = beta.v3<const double>();
  f.lse = lse.v3<double>();
  attnmix::attention<path_fox, P>(f);
  attnmix::attention_grad_args<double> a;
  a.q = q.v4<const double>(), a.k = k.v4<const double>(), a.v = v.v4<const double>();
  a.g = g.v3<const double>(), a.w = w.v4<const double>(), a.beta = beta.v3<const double>();
  a.out = out.v4<const double>(), a.lse = lse.v3<const double>(), a.dout = dO.v4<const double>();
  a.dq = dq.v4<double>(), a.dk = dk.v4<double>(), a.dv = dv.v4<double>();
  a.dg = dg.v3<double>(), a.dw = dw.v4<double>(), a.dbeta = dbeta.v3<double>();
  attnmix::attention_backward<path_fox, P>(a);

  const auto ref = oracle_gradients(c, in, dout, gate_mode::gate_before_scale);
  check_gradients<double>(
      {dq.dense(), dk.dense(), dv.dense(), dw.dense(), dbeta.dense(), dg.dense()}, ref, true);
  for (const padded* t : {&dq, &dk, &dv, &dw, &dbeta, &dg}) CHECK(t->padding_kept());
}
