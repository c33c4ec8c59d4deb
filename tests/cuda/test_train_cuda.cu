// Training on the GPU against the CPU: every backward and training op of layers::ops<cuda>
// against ops<cpu> on the same random inputs (float to 1e-5 relative, bfloat16 storage to 1e-2),
// run twice for bit-identity; the gradients of device stacks against the host stack's with the
// same weights (a stack of test-only mixers that need no attention backward now; the stacks of
// every mixer kind once their CUDA backward lands, is_backward_implemented_v); and a few AdamW
// steps of a tiny language model on the device against the CPU run, twice, and resumed from a
// host copy of the model and the optimiser.
//
// The checks run from the smallest (one op, one gradient) to the largest, so the first failure
// names what to look at.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/cuda.cuh"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using namespace attnmix_test;
using attnmix::index_t;
namespace L = attnmix::layers;
using cpu_be = attnmix::backend::cpu;
using gpu_be = attnmix::backend::cuda;
using cpu_ops = L::ops<cpu_be>;
using gpu_ops = L::ops<gpu_be>;
using bf16 = attnmix::bfloat16;

constexpr double float_tol = 1e-5, bf16_tol = 1e-2;

void sync(const char* what) {
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), what);
}

std::vector<float> randn(rng& r, index_t n, double sigma = 1.0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(sigma * r.normal());
  return v;
}
// v rounded through D (what the device sees), as float.
template <class D>
std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(static_cast<D>(v[i]));
  return o;
}
template <class D>
std::vector<D> as(const std::vector<float>& v) {
  std::vector<D> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<D>(v[i]);
  return o;
}
template <class D>
std::vector<float> back(const std::vector<D>& v) {
  std::vector<float> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(v[i]);
  return o;
}

// Relative error of got against the CPU's want, reported with the case and the gradient.
void expect_close(const std::string& what, const std::vector<float>& got,
                  const std::vector<float>& want, double tol) {
  const double err = rel_error(got, to_double(want));
  INFO(what << ": relative error " << err << " (tolerance " << tol << ")");
  CHECK(err <= tol);
}

// A layout, each row's position in it (host and device), and both backends' handles.
struct contexts {
  L::token_layout layout;
  std::vector<std::int32_t> pos;
  device_buffer<std::int32_t> dpos;
  cpu_be cbe{};
  gpu_be gbe{};
  cpu_ops::handles ch{};
  gpu_ops::handles gh{};

  explicit contexts(L::token_layout l)
      : layout(std::move(l)),
        pos(positions_of(layout)),
        dpos(pos.empty() ? std::vector<std::int32_t>{0} : pos) {}
  L::context<cpu_be> cpu() const { return {cbe, layout, pos.data(), ch}; }
  L::context<gpu_be> gpu() const { return {gbe, layout, dpos.get(), gh}; }

  static std::vector<std::int32_t> positions_of(const L::token_layout& L0) {
    std::vector<std::int32_t> p(static_cast<std::size_t>(L0.rows()));
    cpu_ops::positions(cpu_be{}, p.data(), L0);
    return p;
  }
};

// A packed batch of three sequences (lengths 5, 1, 13) and a dense one (2 x 19).
L::token_layout packed_layout() {
  return {1, 19, {0, 5, 6, 19}};
}
L::token_layout dense_layout() {
  return {2, 19, {}};
}

// ---- gemm_dx, gemm_dw -------------------------------------------------------------------------
template <class D>
void check_gemm(double tol, std::uint64_t salt) {
  rng r(salt);
  const contexts k(dense_layout());
  const index_t rows = k.layout.rows(), in = 24, out = 40, ldx = in + 3, lddy = out + 5,
                lddx = in + 7;
  const auto x = rounded<D>(randn(r, rows * ldx)), dy = rounded<D>(randn(r, rows * lddy));
  const auto w = rounded<D>(randn(r, out * in, 0.3));
  const auto dx0 = rounded<D>(randn(r, rows * lddx)), dw0 = randn(r, out * in), db0 = randn(r, out);
  for (const bool acc : {false, true}) {
    INFO("gemm_dx " << (acc ? "accumulate" : "write"));
    std::vector<float> want = dx0;
    cpu_ops::gemm_dx(k.cpu(), dy.data(), lddy, rows, w.data(), in, out, want.data(), lddx, acc);
    device_buffer<D> ddy(as<D>(dy)), dw(as<D>(w)), ddx(as<D>(dx0));
    gpu_ops::gemm_dx(k.gpu(), ddy.get(), lddy, rows, dw.get(), in, out, ddx.get(), lddx, acc);
    sync("gemm_dx");
    // Only the in columns of each row are written: compare those.
    std::vector<float> got = back(ddx.to_host()), g2, w2;
    for (index_t rr = 0; rr < rows; ++rr)
      for (index_t c = 0; c < in; ++c)
        g2.push_back(got[std::size_t(rr * lddx + c)]),
            w2.push_back(want[std::size_t(rr * lddx + c)]);
    expect_close("gemm_dx dx", g2, w2, tol);
  }
  {
    std::vector<float> want_w = dw0, want_b = db0;
    cpu_ops::gemm_dw(k.cpu(), x.data(), ldx, rows, dy.data(), lddy, in, out, want_w.data(),
                     want_b.data());
    device_buffer<D> dx(as<D>(x)), ddy(as<D>(dy));
    device_buffer<float> gw(dw0), gb(db0);
    gpu_ops::gemm_dw(k.gpu(), dx.get(), ldx, rows, ddy.get(), lddy, in, out, gw.get(), gb.get());
    sync("gemm_dw");
    expect_close("gemm_dw dW (added to)", gw.to_host(), want_w, tol);
    expect_close("gemm_dw dbias (added to)", gb.to_host(), want_b, tol);
  }
}

TEST_CASE("ops<cuda>::gemm_dx and gemm_dw match ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  SECTION("float") {
    check_gemm<float>(float_tol, 1);
  }
  SECTION("bfloat16 rows, float gradients") {
    check_gemm<bf16>(bf16_tol, 2);
  }
}

// ---- norm_backward ------------------------------------------------------------------------------
struct norm_case {
  const char* name;
  index_t groups_per_row, width;
  bool weight, per_group, mean, in_place, acc;
};

template <class D>
void check_norm(const norm_case& nc, double tol, std::uint64_t salt) {
  INFO("norm_backward " << nc.name);
  rng r(salt);
  const contexts k(dense_layout());
  const index_t rows = k.layout.rows(), groups = rows * nc.groups_per_row, n = groups * nc.width;
  const index_t wn = nc.per_group ? nc.groups_per_row * nc.width : nc.width;
  const auto x = rounded<D>(randn(r, n)), dy = rounded<D>(randn(r, n));
  const auto dx0 = rounded<D>(randn(r, n));
  std::vector<float> w = randn(r, wn, 0.3), dw0 = randn(r, wn);
  for (auto& v : w) v += 1.f;
  const float* wp = nc.weight ? w.data() : nullptr;
  std::vector<float> want_dx = nc.in_place ? dy : dx0, want_dw = dw0;
  cpu_ops::norm_backward(k.cpu(), x.data(), nc.in_place ? want_dx.data() : dy.data(),
                         want_dx.data(), groups, nc.width, wp, nc.per_group, nc.groups_per_row,
                         nc.mean, 1e-5, nc.weight ? want_dw.data() : nullptr, nc.acc);
  device_buffer<D> gx(as<D>(x)), gdy(as<D>(dy)), gdx(as<D>(dx0));
  device_buffer<float> gw(w), gdw(dw0);
  gpu_ops::norm_backward(k.gpu(), gx.get(), gdy.get(), nc.in_place ? gdy.get() : gdx.get(), groups,
                         nc.width, nc.weight ? gw.get() : nullptr, nc.per_group, nc.groups_per_row,
                         nc.mean, 1e-5, nc.weight ? gdw.get() : nullptr, nc.acc);
  sync("norm_backward");
  expect_close("dx", back(nc.in_place ? gdy.to_host() : gdx.to_host()), want_dx, tol);
  if (nc.weight) {
    const std::vector<float> first = gdw.to_host();
    expect_close("dw (added to)", first, want_dw, tol);
    // Again from the same start: the same bits.
    device_buffer<float> gdw2(dw0);
    device_buffer<D> gdy2(as<D>(dy)), gdx2(as<D>(dx0));
    gpu_ops::norm_backward(k.gpu(), gx.get(), gdy2.get(), nc.in_place ? gdy2.get() : gdx2.get(),
                           groups, nc.width, gw.get(), nc.per_group, nc.groups_per_row, nc.mean,
                           1e-5, gdw2.get(), nc.acc);
    sync("norm_backward (again)");
    CHECK(bitwise_equal(gdw2.to_host(), first));
  }
}

const norm_case norm_cases[] = {
    {"RMSNorm, one group a row", 1, 48, true, false, true, false, false},
    {"RMSNorm, added to dx", 1, 48, true, false, true, false, true},
    {"RMSNorm, dx in place of dy", 1, 48, true, false, true, true, false},
    {"head RMSNorm, weight shared by 3 heads", 3, 16, true, false, true, true, false},
    {"head RMSNorm, a weight per head (FoX GroupNorm)", 3, 16, true, true, true, true, false},
    {"L2 norm (PaTH's w), no weight", 3, 17, false, false, false, false, false},
    {"odd width 37", 1, 37, true, false, true, false, false},
};

TEST_CASE("ops<cuda>::norm_backward matches ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  std::uint64_t salt = 10;
  for (const auto& nc : norm_cases) check_norm<float>(nc, float_tol, ++salt);
  check_norm<bf16>(norm_cases[0], bf16_tol, ++salt);
}

// ---- short_conv_backward ----------------------------------------------------------------------
TEST_CASE("ops<cuda>::short_conv_backward matches ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  for (const bool packed : {true, false})
    for (const bool silu : {true, false})
      for (const bool acc : {false, true}) {
        INFO("short_conv_backward " << (packed ? "packed (5, 1, 13)" : "dense 2 x 19")
                                    << (silu ? ", SiLU" : ", no activation")
                                    << (acc ? ", added to dx" : ""));
        rng r(100 + 4 * packed + 2 * silu + acc);
        const contexts k(packed ? packed_layout() : dense_layout());
        const index_t rows = k.layout.rows(), C = 20, K = 4, n = rows * C;
        const auto x = randn(r, n), dy = randn(r, n), dx0 = randn(r, n);
        const auto w = randn(r, C * K, 0.5), dw0 = randn(r, C * K);
        std::vector<float> want_dx = dx0, want_dw = dw0;
        cpu_ops::short_conv_backward(k.cpu(), x.data(), dy.data(), want_dx.data(), C, w.data(), K,
                                     silu, want_dw.data(), acc);
        device_buffer<float> gx(x), gdy(dy), gdx(dx0), gw(w), gdw(dw0);
        gpu_ops::short_conv_backward(k.gpu(), gx.get(), gdy.get(), gdx.get(), C, gw.get(), K, silu,
                                     gdw.get(), acc);
        sync("short_conv_backward");
        expect_close("dx", gdx.to_host(), want_dx, float_tol);
        const std::vector<float> first = gdw.to_host();
        expect_close("dw (added to)", first, want_dw, float_tol);
        device_buffer<float> gdx2(dx0), gdw2(dw0);
        gpu_ops::short_conv_backward(k.gpu(), gx.get(), gdy.get(), gdx2.get(), C, gw.get(), K, silu,
                                     gdw2.get(), acc);
        sync("short_conv_backward (again)");
        CHECK(bitwise_equal(gdw2.to_host(), first));
      }
}

// ---- rope_backward, map_backward --------------------------------------------------------------
TEST_CASE("ops<cuda>::rope_backward matches ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  rng r(200);
  const contexts k(packed_layout());
  const index_t rows = k.layout.rows(), heads = 3, d = 16;
  std::vector<float> want = randn(r, rows * heads * d);
  device_buffer<float> g(want);
  cpu_ops::rope_backward(k.cpu(), want.data(), rows, heads, d, 10000.0);
  gpu_ops::rope_backward(k.gpu(), g.get(), rows, heads, d, 10000.0);
  sync("rope_backward");
  expect_close("rope_backward dx", g.to_host(), want, float_tol);
}

template <class Fn, class D>
void check_map(const char* name, bool binary, double tol, std::uint64_t salt) {
  for (const bool acc : {false, true}) {
    INFO("map_backward<" << name << ">" << (acc ? ", added to" : ""));
    rng r(salt);
    const contexts k(dense_layout());
    const index_t n = 333;
    const auto dy = rounded<D>(randn(r, n)), a = rounded<D>(randn(r, n, 2.0)),
               b = rounded<D>(randn(r, n, 2.0));
    const auto da0 = rounded<D>(randn(r, n)), db0 = rounded<D>(randn(r, n));
    std::vector<float> want_a = da0, want_b = db0;
    cpu_ops::map_backward<Fn>(k.cpu(), dy.data(), a.data(), binary ? b.data() : nullptr,
                              want_a.data(), binary ? want_b.data() : nullptr, n, acc);
    device_buffer<D> gdy(as<D>(dy)), ga(as<D>(a)), gb(as<D>(b)), gda(as<D>(da0)), gdb(as<D>(db0));
    gpu_ops::map_backward<Fn>(k.gpu(), static_cast<const D*>(gdy.get()),
                              static_cast<const D*>(ga.get()),
                              binary ? static_cast<const D*>(gb.get()) : nullptr, gda.get(),
                              binary ? gdb.get() : nullptr, n, acc);
    sync("map_backward");
    expect_close("da", back(gda.to_host()), want_a, tol);
    if (binary) expect_close("db", back(gdb.to_host()), want_b, tol);
  }
}

TEST_CASE("ops<cuda>::map_backward matches ops<cpu> for every function", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  namespace fn = L::fn;
  check_map<fn::silu_times, float>("silu_times", true, float_tol, 300);
  check_map<fn::times_sigmoid, float>("times_sigmoid", true, float_tol, 301);
  check_map<fn::gelu, float>("gelu", false, float_tol, 302);
  check_map<fn::relu, float>("relu", false, float_tol, 303);
  check_map<fn::log_sigmoid, float>("log_sigmoid", false, float_tol, 304);
  check_map<fn::two_sigmoid, float>("two_sigmoid", false, float_tol, 305);
  check_map<fn::plus, float>("plus", true, float_tol, 306);
  check_map<fn::silu_times, bf16>("silu_times (bfloat16)", true, bf16_tol, 307);
}

// ---- embeddings
// ----------------------------------------------------------------------------------
TEST_CASE("ops<cuda>::gather_rows and scatter_add_rows match ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  rng r(400);
  const contexts k(dense_layout());
  // More rows than a block, ids repeating (a vocabulary of 7).
  const index_t rows = 300, V = 7, width = 33;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  for (auto& id : ids) id = std::int32_t(r.integer(0, V - 1));
  const auto w = randn(r, V * width), dy = randn(r, rows * width), dw0 = randn(r, V * width);
  device_buffer<std::int32_t> gids(ids);
  {
    std::vector<float> want(static_cast<std::size_t>(rows * width));
    cpu_ops::gather_rows(k.cpu(), w.data(), ids.data(), rows, width, want.data());
    device_buffer<float> gw(w), gy(static_cast<std::size_t>(rows * width));
    gpu_ops::gather_rows(k.gpu(), static_cast<const float*>(gw.get()), gids.get(), rows, width,
                         gy.get());
    sync("gather_rows");
    expect_close("gather_rows y", gy.to_host(), want, 0.0);
  }
  std::vector<float> want = dw0;
  cpu_ops::scatter_add_rows(k.cpu(), dy.data(), ids.data(), rows, width, want.data());
  device_buffer<float> gdy(dy), gdw(dw0), gdw2(dw0);
  gpu_ops::scatter_add_rows(k.gpu(), static_cast<const float*>(gdy.get()), gids.get(), rows, width,
                            gdw.get());
  gpu_ops::scatter_add_rows(k.gpu(), static_cast<const float*>(gdy.get()), gids.get(), rows, width,
                            gdw2.get());
  sync("scatter_add_rows");
  const std::vector<float> first = gdw.to_host();
  expect_close("scatter_add_rows dW (added to)", first, want, float_tol);
  CHECK(bitwise_equal(gdw2.to_host(), first));
}

// ---- cross_entropy, adamw, sum_squares, clip, download ------------------------------------
// A device total: `start` uploaded, and read back.
struct device_total {
  device_buffer<double> d;
  explicit device_total(double start = 0.0) : d(std::vector<double>{start}) {}
  double* get() { return d.get(); }
  double read() {
    double x = 0;
    gpu_ops::download(gpu_be{}, &x, static_cast<const double*>(d.get()), 1);
    return x;
  }
};

TEST_CASE("ops<cuda>::cross_entropy matches ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  rng r(500);
  const contexts k(dense_layout());
  for (const index_t V : {index_t(50), index_t(1000)}) {
    INFO("cross_entropy V = " << V);
    const index_t rows = k.layout.rows();
    const auto logits = randn(r, rows * V, 3.0);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
    index_t count = 0;
    for (index_t i = 0; i < rows; ++i) {
      labels[std::size_t(i)] = i % 5 == 3 ? -100 : std::int32_t(r.integer(0, V - 1));
      count += labels[std::size_t(i)] != -100;
    }
    const double scale = 1.0 / double(count);
    std::vector<float> want(static_cast<std::size_t>(rows * V));
    double want_loss = 0;
    cpu_ops::cross_entropy(k.cpu(), logits.data(), V, rows, V, labels.data(), -100, want.data(), V,
                           scale, &want_loss);
    device_buffer<float> gz(logits), gd(static_cast<std::size_t>(rows * V));
    device_buffer<std::int32_t> gl(labels);
    device_total total, added(2.5);
    gpu_ops::cross_entropy(k.gpu(), static_cast<const float*>(gz.get()), V, rows, V, gl.get(), -100,
                           gd.get(), V, scale, total.get());
    const double loss = total.read();
    INFO("loss " << loss << " against " << want_loss);
    CHECK(std::abs(loss - want_loss) <= float_tol * std::abs(want_loss));
    expect_close("dlogits", gd.to_host(), want, float_tol);
    gpu_ops::cross_entropy(k.gpu(), static_cast<const float*>(gz.get()), V, rows, V, gl.get(), -100,
                           static_cast<float*>(nullptr), V, scale, added.get());
    CHECK(added.read() == 2.5 + loss);  // added to the total; the same bits without dlogits
  }
}

TEST_CASE("ops<cuda>::adamw, sum_squares and clip match ops<cpu>", "[cuda][train][ops]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  rng r(600);
  const index_t n = 5000;
  std::vector<float> p = randn(r, n), g = randn(r, n);
  std::vector<double> m(static_cast<std::size_t>(n), 0.0), v = m;
  device_buffer<float> gp(p), gg(g);
  device_buffer<double> gm(m), gv(v);
  for (index_t step = 1; step <= 3; ++step) {
    cpu_ops::adamw(cpu_be{}, p.data(), g.data(), m.data(), v.data(), n, 1e-2, 0.9, 0.999, 1e-8, 0.1,
                   step);
    gpu_ops::adamw(gpu_be{}, gp.get(), static_cast<const float*>(gg.get()), gm.get(), gv.get(), n,
                   1e-2, 0.9, 0.999, 1e-8, 0.1, step);
  }
  sync("adamw");
  expect_close("adamw weights", gp.to_host(), p, 1e-6);
  {
    const double em = rel_error(gm.to_host(), m), ev = rel_error(gv.to_host(), v);
    INFO("adamw moments: relative errors " << em << ", " << ev);
    CHECK(em <= 1e-12);
    CHECK(ev <= 1e-12);
  }
  double want = 0;
  cpu_ops::sum_squares(cpu_be{}, g.data(), n, &want);
  device_total total, twice;
  gpu_ops::sum_squares(gpu_be{}, static_cast<const float*>(gg.get()), n, total.get());
  const double got = total.read();
  INFO("sum_squares " << got << " against " << want);
  CHECK(std::abs(got - want) <= 1e-12 * want);
  for (int i = 0; i < 2; ++i)
    gpu_ops::sum_squares(gpu_be{}, static_cast<const float*>(gg.get()), n, twice.get());
  CHECK(twice.read() == got + got);  // the same bits each time, added
  // Clipping to a norm above the gradient's changes nothing; below it, scales as the CPU does
  // from the same sum of squares.
  device_total ss(got);
  const double norm = std::sqrt(got);
  gpu_ops::clip(gpu_be{}, gg.get(), n, static_cast<const double*>(ss.get()), 1.01 * norm);
  sync("clip");
  CHECK(bitwise_equal(gg.to_host(), g));
  cpu_ops::clip(cpu_be{}, g.data(), n, &got, 0.37 * norm);
  gpu_ops::clip(gpu_be{}, gg.get(), n, static_cast<const double*>(ss.get()), 0.37 * norm);
  sync("clip");
  expect_close("clip", gg.to_host(), g, 0.0);
  double clipped = 0;
  cpu_ops::sum_squares(cpu_be{}, g.data(), n, &clipped);
  CHECK(std::sqrt(clipped) == Approx(0.37 * norm).epsilon(1e-5));
}

// ---- stacks -----------------------------------------------------------------------------------
// A test-only mixer on the row ops alone (no attention, so no attention backward): a short
// convolution, a biased projection, a per-head RMSNorm, RoPE and a sigmoid gate:
//   c = conv1d(x); q = rope(norm(q_proj c)); y = o_proj(q * sigmoid(g_proj x)).
template <class T, class Backend = cpu_be>
class conv_mixer {
  using O = L::ops<Backend>;
  using space = typename Backend::memory_space;
  template <class, class>
  friend class conv_mixer;

 public:
  static constexpr bool causal = false;
  struct cache_type {};
  struct saved_type {
    L::buffer<T, space> conv, q_in, q, gate;
  };

  conv_mixer() = default;
  explicit conv_mixer(const L::config& c)
      : H_(c.num_heads),
        d_(c.dim()),
        theta_(c.rope_theta),
        conv1d(c.hidden_size, 4, true),
        q_proj(c.hidden_size, c.num_heads * c.dim(), true),
        g_proj(c.hidden_size, c.num_heads * c.dim()),
        o_proj(c.num_heads * c.dim(), c.hidden_size, true),
        norm(c.num_heads, c.dim(), true, c.head_norm_eps) {}
  template <class U, class B>
  explicit conv_mixer(const conv_mixer<U, B>& o)
      : H_(o.H_),
        d_(o.d_),
        theta_(o.theta_),
        conv1d(o.conv1d),
        q_proj(o.q_proj),
        g_proj(o.g_proj),
        o_proj(o.o_proj),
        norm(o.norm) {}

  void forward_rows(const L::context<Backend>& c, const T* x, T* y,
                    saved_type* sv = nullptr) const {
    const index_t rows = c.rows(), D = conv1d.channels(), n = rows * H_ * d_;
    typename O::scratch s(c.be, L::scratch_bytes<T>(rows * D) + L::scratch_bytes<T>(n) * 4);
    T *cv = s.template take<T>(rows * D), *qi = s.template take<T>(n), *q = s.template take<T>(n),
      *g = s.template take<T>(n), *h = s.template take<T>(n);
    if (sv != nullptr) {
      sv->conv.resize(rows * D), sv->q_in.resize(n), sv->q.resize(n), sv->gate.resize(n);
      cv = sv->conv.data(), qi = sv->q_in.data(), q = sv->q.data(), g = sv->gate.data();
    }
    conv1d.apply(c, x, cv);
    q_proj.apply(c, cv, rows, qi);
    norm.apply(c, qi, rows, q);
    O::rope(c, q, rows, H_, d_, theta_);
    g_proj.apply(c, x, rows, g);
    O::template map<L::fn::times_sigmoid>(c, h, q, g, n);
    o_proj.apply(c, h, rows, y);
  }
  void backward_rows(const L::context<Backend>& c, const T* x, const T* dy, T* dx,
                     const saved_type& sv, bool accumulate = false) {
    const index_t rows = c.rows(), D = conv1d.channels(), n = rows * H_ * d_;
    typename O::scratch s(c.be, L::scratch_bytes<T>(n) * 3 + L::scratch_bytes<T>(rows * D));
    T *h = s.template take<T>(n), *dh = s.template take<T>(n), *dg = s.template take<T>(n),
      *dc = s.template take<T>(rows * D);
    O::template map<L::fn::times_sigmoid>(c, h, sv.q.data(), sv.gate.data(), n);
    o_proj.backward(c, h, rows, dy, dh);
    O::template map_backward<L::fn::times_sigmoid>(c, dh, sv.q.data(), sv.gate.data(), dh, dg, n);
    g_proj.backward(c, x, rows, dg, dx, accumulate);
    O::rope_backward(c, dh, rows, H_, d_, theta_);
    norm.backward(c, sv.q_in.data(), rows, dh, dh);
    q_proj.backward(c, sv.conv.data(), rows, dh, dc);
    conv1d.backward(c, x, dc, dx, true);
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.conv1d.visit_parameters(f, prefix + "conv1d.");
    s.q_proj.visit_parameters(f, prefix + "q_proj.");
    s.g_proj.visit_parameters(f, prefix + "g_proj.");
    s.o_proj.visit_parameters(f, prefix + "o_proj.");
    s.norm.visit_parameters(f, prefix + "q_norm.");
  }

  index_t H_ = 0, d_ = 0;
  double theta_ = 10000.0;

 public:
  L::short_conv<T, Backend> conv1d;
  L::linear<T, Backend> q_proj, g_proj, o_proj;
  L::head_rms_norm<T, Backend> norm;
};
using conv_layer = attnmix::layer::custom<attnmix::kind::softmax, conv_mixer>;

L::config stack_config(index_t kv_heads = 0) {
  L::config c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = 96;
  c.w_rank = 8;
  return c;
}

// A parameter's gradient on the host (zeros where none was made yet).
template <class T>
std::vector<float> grad_of(const L::parameter<T, attnmix::host_space>& p) {
  if (p.grad.empty()) return std::vector<float>(static_cast<std::size_t>(p.numel()), 0.f);
  return std::vector<float>(p.grad.begin(), p.grad.end());
}
template <class T>
std::vector<float> grad_of(const L::parameter<T, attnmix::device_space>& p) {
  const auto g = p.grad_values();
  return std::vector<float>(g.begin(), g.end());
}

// Every parameter's gradient, by name, on the host.
template <class Model>
std::vector<std::pair<std::string, std::vector<float>>> grads_of(Model& m) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  m.visit_parameters(
      [&](const std::string& name, const auto& p) { out.emplace_back(name, grad_of(p)); });
  return out;
}

struct stack_batch {
  const char* name;
  index_t B, T;
  std::vector<index_t> lengths;  // mask: valid tokens per row (left-padded on odd rows)
  std::vector<std::int32_t> cu;  // packed offsets (B = 1)
};

// Every gradient of `m` (zeros where none was made yet), by name, in double.
template <class Model>
std::vector<std::pair<std::string, std::vector<double>>> double_grads_of(Model& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out.emplace_back(name, p.grad.empty() ? std::vector<double>(std::size_t(p.numel()), 0.0)
                                          : std::vector<double>(p.grad.begin(), p.grad.end()));
  });
  return out;
}

// The norm of the terms a bias gradient sums over rows (db = sum_r dy_r), estimated from its
// projection's weight gradient dW = sum_r dy_r x_r^T: the projections read RMS-normed rows, so a
// column of dW sums the same dy_r with signs that do not line up, and ||dW|| / sqrt(in) is about
// sqrt(sum_r |dy_r|^2). 0 for every other parameter.
double bias_terms(const std::vector<std::pair<std::string, std::vector<double>>>& grads,
                  std::size_t i) {
  const std::string& name = grads[i].first;
  const std::string suffix = ".bias";
  if (name.size() <= suffix.size() || name.compare(name.size() - 5, 5, suffix) != 0) return 0;
  const std::string weight = name.substr(0, name.size() - 5) + ".weight";
  for (const auto& [n, g] : grads) {
    if (n != weight) continue;
    double ss = 0;
    for (double v : g) ss += v * v;
    return std::sqrt(ss / (double(g.size()) / double(grads[i].second.size())));
  }
  return 0;
}

// The device stack's out, dx and every parameter gradient, float, against the same stack in
// float64 on the host (the same weights): each within float_tol of it, or, where the float host
// stack itself is further off, within 4x the float host stack's own error. A bias gradient sums
// every row's term and can cancel to a small fraction of them, while each term carries its own
// float error (a row's dbeta, say, is held to float_tol of its size by the primitive's tests):
// independent errors of n terms add up to float_tol times the root sum of squares of the terms,
// so a bias's error is taken relative to max(||ref||, that norm).
// Then the device backward again from zero gradients: the same bits.
template <class Policy, class... Layers>
void check_stack_grads(const L::config& c, const stack_batch& in, std::uint64_t salt) {
  using host_t = attnmix::basic_stack<float, Policy, cpu_be, Layers...>;
  using exact_t = attnmix::basic_stack<double, Policy, cpu_be, Layers...>;
  INFO("stack " << in.name << ", seed " << test_seed() << " salt " << salt);
  rng r(salt);
  host_t hs(c);
  L::randomize_parameters(hs, test_seed() ^ salt, 0.15, 0.3);
  exact_t es(c);
  L::transfer_parameters(hs, es);
  const index_t D = c.hidden_size, n = in.B * in.T * D;
  const auto x = randn(r, n), dout = randn(r, n);
  attnmix::host_tensor<std::uint8_t, 2> mask({in.B, in.T});
  attnmix::stack_inputs si;
  if (!in.lengths.empty()) {
    mask.fill(0);
    for (index_t b = 0; b < in.B; ++b) {
      const index_t len = in.lengths[std::size_t(b)], first = b % 2 ? in.T - len : 0;
      for (index_t t = first; t < first + len; ++t) mask(b, t) = 1;
    }
    si.mask = mask.view();
  }
  if (!in.cu.empty()) si.cu_seqlens = {in.cu.data(), {index_t(in.cu.size())}};
  const std::array<index_t, 3> shape{in.B, in.T, D};

  // The float64 stack (the reference) and the float host stack (the float error of this case).
  std::vector<std::vector<double>> want(2, std::vector<double>(x.size()));
  {
    const auto xd = to_double(x), doutd = to_double(dout);
    typename exact_t::saved_type esv;
    es.forward(attnmix::view3<const double>(xd.data(), shape),
               attnmix::view3<double>(want[0].data(), shape), esv, si);
    es.backward(attnmix::view3<const double>(doutd.data(), shape),
                attnmix::view3<double>(want[1].data(), shape), esv);
  }
  const auto want_g = double_grads_of(es);
  std::vector<std::vector<float>> host(2, std::vector<float>(x.size()));
  typename host_t::saved_type hsv;
  hs.forward(attnmix::view3<const float>(x.data(), shape),
             attnmix::view3<float>(host[0].data(), shape), hsv, si);
  hs.backward(attnmix::view3<const float>(dout.data(), shape),
              attnmix::view3<float>(host[1].data(), shape), hsv);
  for (const auto& [name, g] : grads_of(hs)) host.push_back(g);
  REQUIRE(host.size() == want_g.size() + 2);
  for (const auto& [name, g] : want_g) want.push_back(g);

  attnmix::device_stack<host_t, float> gs(hs);
  device_buffer<float> gx(x), gdout(dout), gout(x.size()), gdx(x.size());
  const auto dev = attnmix::memory_space::device;
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    typename attnmix::device_stack<host_t, float>::saved_type sv;
    gs.visit_parameters([](const std::string&, auto& p) { p.zero_grad(); });
    gs.forward(attnmix::view3<const float>(gx.get(), shape, dev),
               attnmix::view3<float>(gout.get(), shape, dev), sv, si);
    gs.backward(attnmix::view3<const float>(gdout.get(), shape, dev),
                attnmix::view3<float>(gdx.get(), shape, dev), sv);
    sync("device stack backward");
    const auto got_g = grads_of(gs);
    std::vector<std::vector<float>> all{gout.to_host(), gdx.to_host()};
    for (const auto& [name, g] : got_g) all.push_back(g);
    if (run == 0) {
      REQUIRE(got_g.size() == want_g.size());
      for (std::size_t i = 0; i < all.size(); ++i) {
        const std::string what = i == 0   ? std::string("out (training forward)")
                                 : i == 1 ? std::string("dx")
                                          : "d " + want_g[i - 2].first;
        if (i >= 2) REQUIRE(got_g[i - 2].first == want_g[i - 2].first);
        // rel_error, a bias's floored at the norm of its terms (0 elsewhere: no floor).
        const double terms = i >= 2 ? bias_terms(want_g, i - 2) : 0.0;
        const double err = floored_error(all[i], want[i], terms),
                     host_err = floored_error(host[i], want[i], terms);
        INFO(what << ": relative error " << err << " against float64, the float host stack's "
                  << host_err << (terms > 0 ? " (floored at the norm of the bias's terms)" : ""));
        CHECK(err <= std::max(float_tol, 4 * host_err));
      }
      first = all;
    } else {
      bool same = true;
      for (std::size_t i = 0; i < all.size(); ++i) same = same && bitwise_equal(all[i], first[i]);
      INFO("a second forward and backward from zero gradients gives the same bits");
      CHECK(same);
    }
  }
}

const stack_batch stack_batches[] = {
    {"dense 2 x 23", 2, 23, {}, {}},
    {"masked 3 x 17 (lengths 17, 9, 4)", 3, 17, {17, 9, 4}, {}},
    {"packed (7, 1, 30)", 1, 38, {}, {0, 7, 8, 38}},
};

TEST_CASE("device stack gradients match the host stack's: MLPs, norms and a row-op mixer",
          "[cuda][train][stack]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  std::uint64_t salt = 700;
  for (const auto& b : stack_batches) {
    check_stack_grads<attnmix::stack_policy, conv_layer, conv_layer>(stack_config(), b, ++salt);
    check_stack_grads<attnmix::with_mlp<L::mlp_kind::gelu>, conv_layer>(stack_config(), b, ++salt);
    check_stack_grads<attnmix::with_mlp<L::mlp_kind::relu>, conv_layer>(stack_config(), b, ++salt);
  }
}

// Stacks of one mixer kind after a row-op mixer, once the kind's CUDA backward exists: two heads
// of D = 64 (the attention kernels' usual head size), or two query heads on one KV head (gqa).
template <class Layer>
void check_mixer_stack(bool gqa, std::uint64_t salt) {
  using kind = typename Layer::kind;
  if constexpr (attnmix::is_backward_implemented_v<kind, gpu_be>) {
    L::config c = stack_config(gqa ? 1 : 0);
    c.num_heads = 2;
    c.head_dim = 64;
    INFO(kind::name << (gqa ? ", GQA 2 / 1 heads" : ", 2 heads") << ", D = 64");
    for (const auto& b : stack_batches)
      check_stack_grads<attnmix::stack_policy, conv_layer, Layer, Layer>(c, b, ++salt);
  } else {
    WARN("ATTNMIX_SKIP: the CUDA backward of " << kind::name << " is not implemented yet");
  }
}

namespace layer = attnmix::layer;
TEST_CASE("device stack gradients: SA", "[cuda][train][stack][sa]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::sa>(true, 800);
  check_mixer_stack<layer::causal_sa>(false, 810);
}
TEST_CASE("device stack gradients: FoX", "[cuda][train][stack][fox]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::fox>(true, 820);
}
TEST_CASE("device stack gradients: PaTH", "[cuda][train][stack][path]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::path>(false, 830);
}
TEST_CASE("device stack gradients: PaTH-FoX", "[cuda][train][stack][path_fox]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::path_fox>(false, 840);
}
TEST_CASE("device stack gradients: BLA", "[cuda][train][stack][bla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::bla>(false, 850);
}
TEST_CASE("device stack gradients: GBLA", "[cuda][train][stack][gbla]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::gbla>(true, 860);
}
TEST_CASE("device stack gradients: causal linear attention",
          "[cuda][train][stack][linear_causal]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  check_mixer_stack<layer::linear_causal>(false, 870);
}

// ---- a tiny language model --------------------------------------------------------------------
using host_lm = attnmix::train::language_model<attnmix::stack<float, conv_layer, conv_layer>>;
using gpu_lm = attnmix::train::language_model<
    attnmix::device_stack<attnmix::stack<float, conv_layer, conv_layer>, float>>;

struct lm_data {
  index_t B = 2, T = 21, V = 37;
  std::vector<std::int32_t> tokens, labels;
  attnmix::tensor_view<const std::int32_t, 2> tok() const { return {tokens.data(), {B, T}}; }
  attnmix::tensor_view<const std::int32_t, 2> lab() const { return {labels.data(), {B, T}}; }
};

lm_data make_lm_data(std::uint64_t salt) {
  rng r(salt);
  lm_data d;
  for (index_t b = 0; b < d.B; ++b)
    for (index_t t = 0; t < d.T; ++t) d.tokens.push_back(std::int32_t(r.integer(0, d.V - 1)));
  for (index_t b = 0; b < d.B; ++b)
    for (index_t t = 0; t < d.T; ++t)  // next-token labels; the last of each row ignored
      d.labels.push_back(t + 1 < d.T ? d.tokens[std::size_t(b * d.T + t + 1)]
                                     : attnmix::train::ignore_label);
  return d;
}

// `steps` AdamW steps (with clipping) of `model` on `data`; the loss before each step.
template <class Model, class Opt, class Backend>
std::vector<double> train_steps(Model& model, Opt& opt, const lm_data& data, int steps,
                                const Backend& be) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Opt::zero_grad(model);
    losses.push_back(model.loss(data.tok(), data.lab(), true, be));
    opt.step(model, 3e-3, be);
  }
  return losses;
}

TEST_CASE("language_model trains on the device as on the CPU", "[cuda][train][lm]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  L::config c = stack_config();
  c.hidden_size = 32;
  c.num_heads = 2;
  c.intermediate_size = 48;
  const lm_data data = make_lm_data(900);
  host_lm hm(c, data.V);
  L::randomize_parameters(hm, test_seed() ^ 900, 0.1, 0.2);
  attnmix::train::adamw_config oc;
  oc.clip_norm = 1.0;

  // The first step's gradients, parameter by parameter.
  {
    host_lm h1(c, data.V);
    L::transfer_parameters(hm, h1);
    gpu_lm g1(h1);
    attnmix::train::adamw<cpu_be>::zero_grad(h1);
    attnmix::train::adamw<gpu_be>::zero_grad(g1);
    const double lh = h1.loss(data.tok(), data.lab(), true);
    const double lg = g1.loss(data.tok(), data.lab(), true, gpu_be{});
    INFO("loss " << lg << " against " << lh);
    CHECK(std::abs(lg - lh) <= float_tol * std::abs(lh));
    const auto gh = grads_of(h1), gg = grads_of(g1);
    REQUIRE(gh.size() == gg.size());
    for (std::size_t i = 0; i < gh.size(); ++i)
      expect_close("language model d " + gh[i].first, gg[i].second, gh[i].second, float_tol);
  }

  constexpr int steps = 6;
  host_lm hcopy(c, data.V);
  L::transfer_parameters(hm, hcopy);
  attnmix::train::adamw<cpu_be> ho(oc);
  const std::vector<double> want = train_steps(hcopy, ho, data, steps, cpu_be{});
  INFO("CPU losses " << want.front() << " ... " << want.back());

  std::vector<double> got[2];
  std::vector<float> weights[2];
  for (int run = 0; run < 2; ++run) {
    gpu_lm gm(hm);
    attnmix::train::adamw<gpu_be> go(oc);
    got[run] = train_steps(gm, go, data, steps, gpu_be{});
    std::vector<double> all;
    gm.visit_parameters([&](const std::string&, const auto& p) {
      std::vector<double> v;
      p.get_values(v);
      all.insert(all.end(), v.begin(), v.end());
    });
    weights[run].assign(all.begin(), all.end());
  }
  for (int s = 0; s < steps; ++s) {
    INFO("step " << s << ": device loss " << got[0][std::size_t(s)] << ", CPU "
                 << want[std::size_t(s)]);
    // Float rounding grows through the steps (AdamW divides by sqrt(v)): 1e-4 relative.
    CHECK(std::abs(got[0][std::size_t(s)] - want[std::size_t(s)]) <=
          1e-4 * std::abs(want[std::size_t(s)]));
  }
  CHECK(want.back() < want.front());
  INFO("a second device run gives the same losses and weights, bit for bit");
  CHECK(got[0] == got[1]);
  CHECK(bitwise_equal(weights[0], weights[1]));
}

TEST_CASE("a device language model and its optimiser resume from host copies bit for bit",
          "[cuda][train][lm][checkpoint]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  INFO("seed " << test_seed());
  L::config c = stack_config();
  c.hidden_size = 32;
  c.num_heads = 2;
  c.intermediate_size = 48;
  const lm_data data = make_lm_data(950);
  host_lm hm(c, data.V);
  L::randomize_parameters(hm, test_seed() ^ 950, 0.1, 0.2);

  // Straight through: 5 steps.
  gpu_lm straight(hm);
  attnmix::train::adamw<gpu_be> so;
  const std::vector<double> want = train_steps(straight, so, data, 5, gpu_be{});

  // 3 steps, then the model and the optimiser's state to host copies (what io::save writes),
  // a fresh device model and optimiser from them, 2 more steps.
  gpu_lm first(hm);
  attnmix::train::adamw<gpu_be> fo;
  std::vector<double> got = train_steps(first, fo, data, 3, gpu_be{});
  host_lm saved(c, data.V);
  L::transfer_parameters(first, saved);
  attnmix::train::adamw<cpu_be> saved_opt;
  saved_opt.init(saved);
  L::transfer_parameters(fo, saved_opt);
  CHECK(saved_opt.steps() == 3);

  gpu_lm resumed(saved);
  attnmix::train::adamw<gpu_be> ro;
  ro.init(resumed);
  L::transfer_parameters(saved_opt, ro);
  const std::vector<double> more = train_steps(resumed, ro, data, 2, gpu_be{});
  got.insert(got.end(), more.begin(), more.end());
  INFO("losses straight " << want.back() << ", resumed " << got.back());
  CHECK(got == want);
}

}  // namespace
