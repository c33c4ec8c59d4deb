// Each mixer layer (and a test-only one written on layers::ops) against its float64 oracle (dense
// and packed batches, float and double), the MLPs, decoding against the full forward for every
// cached layer (with and without a sliding window), and caches addressed through slot mappings.

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "layers/custom_layers.hpp"
#include "layers/gated_softmax_layer.hpp"
#include "layers/layer_harness.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;

using oracle =
    std::function<std::vector<double>(const layer_ref::params&, const std::vector<double>&,
                                      const layer_ref::dims&, const layer_ref::layout&)>;

L::config small_config(index_t heads, index_t kv_heads) {
  L::config c;
  c.hidden_size = 48;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 16;  // HQ * d != D on purpose for the GQA cases
  c.w_rank = 8;
  return c;
}

// Runs the float and the double mixer over a dense and a packed batch against the oracle.
template <class Layer>
void check_mixer(const L::config& c, const oracle& ref, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt << " layer " << Layer::name);
  typename Layer::template type<float> mf(c);
  typename Layer::template type<double> md(c);
  L::randomize_parameters(mf, test_seed() ^ salt, 0.15, 0.3);
  copy_parameters(mf, md);
  const auto params = parameters_of(mf);
  const auto dm = dims_of(c);

  struct batch {
    index_t B, T;
    std::vector<std::int32_t> cu;
  };
  for (const batch& b : {batch{2, 37, {}}, batch{1, 33, {0, 1, 20, 20, 33}}, batch{1, 1, {}}}) {
    INFO("B=" << b.B << " T=" << b.T << " packed=" << !b.cu.empty());
    auto xf = random_activations<float>(r, b.B, b.T, c.hidden_size);
    host_tensor<double, 3> xd(xf.shape());
    for (index_t i = 0; i < xf.size(); ++i) xd.data()[i] = xf.data()[i];
    host_tensor<float, 3> yf(xf.shape());
    host_tensor<double, 3> yd(xf.shape());
    poison(yf);
    poison(yd);
    attnmix::view1<const std::int32_t> cu;
    if (!b.cu.empty()) cu = {b.cu.data(), {static_cast<index_t>(b.cu.size())}};
    mf.forward(xf.view(), yf.view(), cu);
    md.forward(xd.view(), yd.view(), cu);
    const auto want = ref(params, as_double(xf), dm, layer_ref::layout{b.B, b.T, to_long(b.cu)});
    CHECK(rel_error(yf.storage(), want) <= 4 * tolerance<float>());
    CHECK(rel_error(yd.storage(), want) <= 1e-11);
  }
}

// Decoding after a prefill of P tokens equals the full forward, token by token (double).
template <class Layer>
void check_decode(const L::config& c, index_t P, std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt << " layer " << Layer::name << " prefill " << P);
  typename Layer::template type<double> m(c);
  L::randomize_parameters(m, test_seed() ^ salt, 0.15, 0.3);
  const index_t N = 2, T = 19, D = c.hidden_size;
  auto x = random_activations<double>(r, N, T, D);
  host_tensor<double, 3> full(x.shape());
  m.forward(x.view(), full.view());

  auto cache = m.make_cache(N, T);
  check_prefill_then_decode(m, cache, x, full, P, [](const auto& c) { return c.length(0); });
}

using namespace custom_layers;

oracle attention_oracle(bool causal, bool fox, bool rope = false, bool norm = false,
                        bool gate = false) {
  return [=](const auto& p, const auto& x, const auto& m, const auto& l) {
    return layer_ref::attention_mixer(p, "", x, m, l, causal, fox, rope, norm, gate);
  };
}
oracle path_oracle(bool gated) {
  return [=](const auto& p, const auto& x, const auto& m, const auto& l) {
    return layer_ref::path_mixer(p, "", x, m, l, gated);
  };
}
oracle linear_oracle(bool causal) {
  return [=](const auto& p, const auto& x, const auto& m, const auto& l) {
    return layer_ref::linear_mixer(p, "", x, m, l, causal);
  };
}

TEST_CASE("softmax-family mixers match the float64 oracle", "[layers]") {
  check_mixer<attnmix::layer::sa>(small_config(4, 2), attention_oracle(false, false), 1);
  check_mixer<attnmix::layer::causal_sa>(small_config(4, 4), attention_oracle(true, false), 2);
  check_mixer<attnmix::layer::fox>(small_config(4, 2), attention_oracle(true, true), 3);
  check_mixer<rope_sa>(small_config(4, 2), attention_oracle(true, false, true, true, true), 4);
  check_mixer<gated_fox>(small_config(4, 2), attention_oracle(true, true, false, true, true), 5);
}

TEST_CASE("PaTH mixers match the float64 oracle (low-rank and full w)", "[layers]") {
  check_mixer<attnmix::layer::path>(small_config(3, 3), path_oracle(false), 11);
  check_mixer<attnmix::layer::path_fox>(small_config(4, 2), path_oracle(true), 12);
  check_mixer<attnmix::layer::path_fox>(small_config(2, 2), path_oracle(true), 13);
  check_mixer<normed_path_fox>(small_config(4, 2), path_oracle(true), 14);
}

TEST_CASE("linear-attention mixers match the float64 oracle", "[layers]") {
  check_mixer<attnmix::layer::bla>(small_config(4, 2), linear_oracle(false), 21);
  check_mixer<attnmix::layer::gbla>(small_config(4, 4), linear_oracle(false), 22);
  check_mixer<attnmix::layer::gbla>(small_config(4, 2), linear_oracle(false), 23);
  check_mixer<attnmix::layer::linear_causal>(small_config(4, 2), linear_oracle(true), 24);
  check_mixer<causal_gbla>(small_config(2, 2), linear_oracle(true), 25);
}

TEST_CASE("decoding equals the full forward for every cached layer", "[layers][decode]") {
  for (index_t P : {index_t{0}, index_t{1}, index_t{8}}) {
    check_decode<attnmix::layer::causal_sa>(small_config(4, 2), P, 31);
    check_decode<rope_sa>(small_config(4, 2), P, 32);
    check_decode<gated_fox>(small_config(4, 2), P, 33);
    check_decode<attnmix::layer::path>(small_config(3, 3), P, 34);
    check_decode<attnmix::layer::path_fox>(small_config(4, 2), P, 35);
    check_decode<normed_path_fox>(small_config(4, 2), P, 38);
    check_decode<attnmix::layer::linear_causal>(small_config(4, 2), P, 36);
    check_decode<causal_gbla>(small_config(2, 2), P, 37);
  }
}

L::config windowed(L::config c, index_t window) {
  c.window = window;
  return c;
}

TEST_CASE("sliding-window SA and FoX mixers match the float64 oracle", "[layers][window]") {
  check_mixer<attnmix::layer::sa>(windowed(small_config(4, 2), 3), attention_oracle(false, false),
                                  51);
  check_mixer<attnmix::layer::causal_sa>(windowed(small_config(4, 4), 5),
                                         attention_oracle(true, false), 52);
  check_mixer<attnmix::layer::fox>(windowed(small_config(4, 2), 1), attention_oracle(true, true),
                                   53);
  check_mixer<rope_sa>(windowed(small_config(4, 2), 7),
                       attention_oracle(true, false, true, true, true), 54);
  check_mixer<gated_fox>(windowed(small_config(4, 2), 4),
                         attention_oracle(true, true, false, true, true), 55);
}

TEST_CASE("windowed decoding equals the windowed forward", "[layers][window][decode]") {
  // T = 19 in check_decode: windows below, at and beyond the sequence length.
  for (index_t W : {index_t{1}, index_t{3}, index_t{19}, index_t{25}}) {
    for (index_t P : {index_t{0}, index_t{1}, index_t{8}}) {
      check_decode<attnmix::layer::causal_sa>(windowed(small_config(4, 2), W), P, 61);
      check_decode<rope_sa>(windowed(small_config(4, 2), W), P, 62);
      check_decode<attnmix::layer::fox>(windowed(small_config(4, 4), W), P, 63);
      check_decode<gated_fox>(windowed(small_config(4, 2), W), P, 64);
    }
  }
}

template <class Layer>
void check_layer_slots(const L::config& c, std::uint64_t salt) {
  typename Layer::template type<double> m(c);
  L::randomize_parameters(m, test_seed() ^ salt, 0.15, 0.3);
  INFO("layer " << Layer::name);
  check_slot_mapping(m, c.hidden_size, salt);
}

TEST_CASE("layer caches through a slot mapping equal each sequence alone", "[layers][slots]") {
  check_layer_slots<attnmix::layer::causal_sa>(small_config(4, 2), 71);
  check_layer_slots<attnmix::layer::causal_sa>(windowed(small_config(4, 2), 3), 72);
  check_layer_slots<gated_fox>(windowed(small_config(4, 2), 2), 73);
  check_layer_slots<attnmix::layer::path>(small_config(3, 3), 74);
  check_layer_slots<attnmix::layer::path_fox>(small_config(4, 2), 75);
  check_layer_slots<attnmix::layer::linear_causal>(small_config(4, 2), 76);
  check_layer_slots<causal_gbla>(small_config(2, 2), 77);
}

TEST_CASE("layers reject bad slot mappings and leave the cache as it was", "[layers][slots]") {
  const auto run = [](auto tag, const L::config& c, std::uint64_t salt) {
    using Layer = decltype(tag);
    typename Layer::template type<double> m(c);
    L::randomize_parameters(m, test_seed() ^ salt, 0.15, 0.3);
    INFO("layer " << Layer::name);
    check_bad_slots(m, c.hidden_size, std::string("attnmix::layers::") + m.name, salt);
  };
  run(attnmix::layer::fox{}, windowed(small_config(4, 2), 2), 81);
  run(attnmix::layer::path_fox{}, small_config(4, 2), 82);
  run(causal_gbla{}, small_config(2, 2), 83);
}

TEST_CASE("MLPs and the short convolution match plain loops", "[layers]") {
  rng r(41);
  INFO("seed " << test_seed());
  L::config c = small_config(4, 4);
  c.intermediate_size = 40;
  const index_t rows = 23;
  auto x = random_activations<double>(r, 1, rows, c.hidden_size);
  std::vector<double> y(static_cast<std::size_t>(rows * c.hidden_size));
  const auto run = [&](const auto& m, bool relu) {
    std::fill(y.begin(), y.end(), std::numeric_limits<double>::quiet_NaN());
    m.apply(x.data(), rows, y.data(), attnmix::backend::cpu{});
    const auto want = layer_ref::mlp(parameters_of(m), "", as_double(x), rows, c.hidden_size, relu);
    CHECK(rel_error(y, want) <= 1e-12);
  };
  L::mlp<double, L::mlp_kind::swiglu> s(c);
  L::mlp<double, L::mlp_kind::gelu> g(c);
  L::mlp<double, L::mlp_kind::relu> re(c);
  L::randomize_parameters(s, 1, 0.2);
  L::randomize_parameters(g, 2, 0.2);
  L::randomize_parameters(re, 3, 0.2);
  run(s, false);
  run(g, false);
  run(re, true);
  CHECK(L::mlp_width(L::config{}, L::mlp_kind::swiglu) == 768);  // fla: 256 * ceil(256*8/3/256)

  // Short conv with a rolling state: the steps continue the prefix exactly.
  for (index_t K : {index_t{3}, index_t{4}}) {
    L::short_conv<double> conv(c.hidden_size, K, true);
    L::randomize_parameters(conv, 4, 0.5);
    const L::token_layout lay{1, rows, {0, 5, 5, 6, rows}};
    std::vector<double> full(y.size());
    conv.apply(x.data(), full.data(), lay, {});
    const auto want = layer_ref::conv(as_double(x), layer_ref::layout{1, rows, {0, 5, 5, 6, rows}},
                                      c.hidden_size, parameters_of(conv).at("weight"), true);
    CHECK(rel_error(full, want) <= 1e-13);
    // Last segment: prefill 3 tokens, then step through the rest.
    const index_t D = c.hidden_size, s0 = 6, p = 3;
    auto st = conv.make_state(1);
    std::vector<double> tmp(static_cast<std::size_t>(p * D));
    conv.apply(x.data() + s0 * D, tmp.data(), L::token_layout{1, p, {}}, {}, &st);
    for (index_t t = s0 + p; t < rows; ++t) {
      std::vector<double> one(static_cast<std::size_t>(D));
      const L::ops<attnmix::backend::cpu>::handles h{};
      const L::context<attnmix::backend::cpu> one_token{{}, L::token_layout{1, 1, {}}, nullptr, h};
      conv.step(one_token, x.data() + t * D, one.data(), st);
      const std::vector<double> w(full.begin() + t * D, full.begin() + (t + 1) * D);
      CHECK(rel_error(one, w) <= 1e-13);
    }
  }
}

TEST_CASE("layers reject bad arguments with attnmix::error", "[layers][errors]") {
  const L::config c = small_config(4, 2);
  attnmix::layer::causal_sa::type<float> m(c);
  host_tensor<float, 3> x({2, 5, 48}), y({2, 5, 48}), bad({2, 5, 47}), small({2, 4, 48});
  ATTNMIX_CHECK_ERROR(m.forward(bad.view(), y.view()), "argument 'x'");
  ATTNMIX_CHECK_ERROR(m.forward(x.view(), small.view()), "argument 'out'");
  ATTNMIX_CHECK_ERROR(m.forward(x.view(), attnmix::view3<float>(x.data(), {2, 5, 48})), "overlaps");
  auto cache = m.make_cache(2, 4);
  ATTNMIX_CHECK_ERROR(m.prefill(x.view(), y.view(), cache), "capacity 4");
  L::config broken = c;
  broken.num_kv_heads = 3;
  ATTNMIX_CHECK_ERROR((void)attnmix::layer::gbla::type<float>{broken}, "num_kv_heads");
  ATTNMIX_CHECK_ERROR((void)attnmix::layer::fox::type<float>{windowed(c, -1)}, "config.window");
}

// The test-only gated softmax mixer, in the plainest loops: per sequence and head,
// o = softmax(q k^T / sqrt(d)) v, y = o_proj(o * sigmoid(g)).
std::vector<double> gated_softmax_oracle(const layer_ref::params& p, const std::vector<double>& x,
                                         index_t D, index_t H, index_t d,
                                         const std::vector<std::pair<index_t, index_t>>& seqs) {
  const index_t W = H * d;
  const auto proj = [&](const char* name, const double* in, index_t n_in, index_t n_out) {
    const std::vector<double>& w = p.at(std::string(name) + ".weight");
    std::vector<double> out(static_cast<std::size_t>(n_out), 0.0);
    for (index_t o = 0; o < n_out; ++o)
      for (index_t i = 0; i < n_in; ++i)
        out[std::size_t(o)] += w[std::size_t(o * n_in + i)] * in[i];
    return out;
  };
  std::vector<double> y(x.size(), 0.0);
  for (const auto& [r0, len] : seqs) {
    std::vector<std::vector<double>> q, k, v, g;
    for (index_t t = 0; t < len; ++t) {
      const double* xt = x.data() + (r0 + t) * D;
      q.push_back(proj("q_proj", xt, D, W));
      k.push_back(proj("k_proj", xt, D, W));
      v.push_back(proj("v_proj", xt, D, W));
      g.push_back(proj("g_proj", xt, D, W));
    }
    for (index_t t = 0; t < len; ++t) {
      std::vector<double> o(static_cast<std::size_t>(W), 0.0);
      for (index_t h = 0; h < H; ++h) {
        std::vector<double> z(static_cast<std::size_t>(len));
        double zmax = -1e300, den = 0;
        for (index_t j = 0; j < len; ++j) {
          double dot = 0;
          for (index_t e = 0; e < d; ++e)
            dot += q[std::size_t(t)][std::size_t(h * d + e)] *
                   k[std::size_t(j)][std::size_t(h * d + e)];
          z[std::size_t(j)] = dot / std::sqrt(double(d));
          zmax = std::max(zmax, z[std::size_t(j)]);
        }
        for (index_t j = 0; j < len; ++j) den += std::exp(z[std::size_t(j)] - zmax);
        for (index_t e = 0; e < d; ++e) {
          double acc = 0;
          for (index_t j = 0; j < len; ++j)
            acc += std::exp(z[std::size_t(j)] - zmax) / den *
                   v[std::size_t(j)][std::size_t(h * d + e)];
          const double gate = g[std::size_t(t)][std::size_t(h * d + e)];
          o[std::size_t(h * d + e)] = acc / (1.0 + std::exp(-gate));
        }
      }
      const std::vector<double> yt = proj("o_proj", o.data(), W, D);
      std::copy(yt.begin(), yt.end(), y.begin() + (r0 + t) * D);
    }
  }
  return y;
}

TEST_CASE("a test-only mixer written on layers::ops matches its float64 oracle",
          "[layers][custom]") {
  rng r(91);
  INFO("seed " << test_seed());
  const L::config c = small_config(3, 3);
  attnmix_test::gated_softmax_mixer<double> md(c);
  attnmix_test::gated_softmax_mixer<float> mf(c);
  L::randomize_parameters(md, test_seed() ^ 91, 0.15, 0.3);
  copy_parameters(md, mf);
  const auto params = parameters_of(md);
  const index_t D = c.hidden_size;
  // A dense batch of two sequences, then a packed one with an empty and a length-1 sequence.
  for (const std::vector<std::int32_t>& cu :
       {std::vector<std::int32_t>{}, std::vector<std::int32_t>{0, 7, 7, 8, 21}}) {
    const index_t B = cu.empty() ? 2 : 1, T = cu.empty() ? 11 : 21;
    auto xd = random_activations<double>(r, B, T, D);
    host_tensor<float, 3> xf(xd.shape());
    for (index_t i = 0; i < xd.size(); ++i) xf.data()[i] = static_cast<float>(xd.data()[i]);
    host_tensor<double, 3> yd(xd.shape());
    host_tensor<float, 3> yf(xd.shape());
    poison(yd);
    poison(yf);
    std::vector<std::pair<index_t, index_t>> seqs;
    attnmix::view1<const std::int32_t> cv;
    if (cu.empty()) {
      for (index_t b = 0; b < B; ++b) seqs.push_back({b * T, T});
    } else {
      cv = {cu.data(), {index_t(cu.size())}};
      for (std::size_t n = 0; n + 1 < cu.size(); ++n) seqs.push_back({cu[n], cu[n + 1] - cu[n]});
    }
    md.forward(xd.view(), yd.view(), cv);
    mf.forward(xf.view(), yf.view(), cv);
    INFO("packed " << !cu.empty());
    CHECK(rel_error(yd.storage(),
                    gated_softmax_oracle(params, as_double(xd), D, 3, c.dim(), seqs)) <= 1e-12);
    CHECK(rel_error(yf.storage(), gated_softmax_oracle(params, as_double(xf), D, 3, c.dim(),
                                                       seqs)) <= 4 * tolerance<float>());
  }
}

TEST_CASE("layers reject a cache made for another layout, and absurd cache sizes",
          "[layers][errors]") {
  L::config a = small_config(4, 1), b = small_config(4, 4);
  attnmix::layer::fox::type<double> fa(a), fb(b);
  attnmix::layer::path::type<double> pa(a), pb(b);
  attnmix::layer::linear_causal::type<double> la(a), lb(b);
  host_tensor<double, 3> x({2, 3, 48}), y({2, 3, 48}), x1({2, 1, 48}), y1({2, 1, 48});
  auto fc = fb.make_cache(2, 4);
  ATTNMIX_CHECK_ERROR(fa.prefill(x.view(), y.view(), fc), "was made for kv_heads = 4");
  ATTNMIX_CHECK_ERROR(fa.decode(x1.view(), y1.view(), fc), "the layer has kv_heads = 1");
  auto pc = pb.make_cache(2, 4);
  ATTNMIX_CHECK_ERROR(pa.prefill(x.view(), y.view(), pc), "kv_heads = 4");
  ATTNMIX_CHECK_ERROR(pa.decode(x1.view(), y1.view(), pc), "kv_heads = 4");
  auto lc = lb.make_cache(2, 4);
  ATTNMIX_CHECK_ERROR(la.prefill(x.view(), y.view(), lc), "kv_heads = 4");
  CHECK(fc.length(0) == 0);
  CHECK(pc.length(0) == 0);
  CHECK(lc.length(0) == 0);

  ATTNMIX_CHECK_ERROR((void)fa.make_cache(-1, 4), "argument 'sequences' must be >= 0");
  ATTNMIX_CHECK_ERROR((void)fa.make_cache(2, -1), "argument 'capacity' must be >= 0");
  ATTNMIX_CHECK_ERROR((void)fa.make_cache(2, index_t{1} << 62), "argument 'capacity'");
  ATTNMIX_CHECK_ERROR((void)pa.make_cache(-1, 4), "argument 'sequences'");
  ATTNMIX_CHECK_ERROR((void)pa.make_cache(2, index_t{1} << 62), "argument 'capacity'");
  ATTNMIX_CHECK_ERROR((void)la.make_cache(index_t{1} << 60, 1), "argument 'capacity'");
}

}  // namespace
