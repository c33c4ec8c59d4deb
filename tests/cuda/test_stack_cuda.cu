// attnmix::device_stack (the host stack type on backend::cuda) against the host stack in double
// with the same weights: the hybrid encoder, causal stacks of every mixer kind and policy switch,
// a test-only custom layer, dense, padded and varlen batches, in float and bfloat16; and its
// argument checks.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attnmix/cuda.cuh"
#include "layers/custom_layers.hpp"
#include "layers/gated_softmax_layer.hpp"
#include "support/cuda_testing.cuh"
#include "support/testing.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
using attnmix::index_t;
namespace L = attnmix::layers;
namespace layer = attnmix::layer;
using attnmix::repeat;

using namespace custom_layers;
// Bidirectional SA with every switch on, qkv biases too.
struct biased_rope_sa_policy : L::sa_layer_policy {
  static constexpr bool rope = true;
  static constexpr bool qk_norm = true;
  static constexpr bool output_gate = true;
  static constexpr bool qkv_bias = true;
  static constexpr const char* name = "biased_rope_sa";
};
template <class T, class Backend = attnmix::backend::cpu>
using biased_rope_sa_layer = L::attention_layer<T, biased_rope_sa_policy, Backend>;
using biased_rope_sa = layer::custom<attnmix::kind::softmax, biased_rope_sa_layer>;

L::config make_config(index_t heads, index_t kv_heads, index_t window = 0) {
  L::config c;
  c.hidden_size = 128;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = 192;
  c.w_rank = 16;
  c.window = window;
  return c;
}

// Copies every parameter of `from` into `to` (same layer list, other scalar).
template <class From, class To>
void copy_parameters(const From& from, To& to) {
  std::map<std::string, std::vector<double>> values;
  from.visit_parameters([&](const std::string& name, const auto& p) {
    values[name].assign(p.data.begin(), p.data.end());
  });
  to.visit_parameters([&](const std::string& name, auto& p) {
    using S = typename std::decay_t<decltype(p.data)>::value_type;
    const auto& v = values.at(name);
    REQUIRE(v.size() == p.data.size());
    for (std::size_t i = 0; i < v.size(); ++i) p.data[i] = static_cast<S>(v[i]);
  });
}

// Batch inputs of one check: x and, optionally, a mask or packed offsets.
struct batch {
  index_t B = 2, T = 37;
  std::vector<index_t> lengths;  // mask: valid tokens per row (left-padded when odd rows)
  std::vector<std::int32_t> cu;  // varlen offsets (then B = 1)
};

template <class D, class Policy, class... Layers>
void check_stack(const L::config& c, const batch& in, std::uint64_t salt, double tol) {
  using host_f = attnmix::basic_stack<float, Policy, attnmix::backend::cpu, Layers...>;
  using host_d = attnmix::basic_stack<double, Policy, attnmix::backend::cpu, Layers...>;
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt);
  host_f sf(c);
  L::randomize_parameters(sf, test_seed() ^ salt, 0.15, 0.3);
  // The device keeps projections in D: weights that D represents exactly leave the activations'
  // rounding as the only difference to the reference.
  sf.visit_parameters([](const std::string&, auto& p) {
    for (auto& v : p.data) v = static_cast<float>(static_cast<D>(static_cast<float>(v)));
  });
  host_d sd(c);
  copy_parameters(sf, sd);

  const index_t D_model = c.hidden_size, n = in.B * in.T * D_model;
  // x as D rounds it: the reference sees the rounded values.
  std::vector<D> xd(static_cast<std::size_t>(n));
  host_tensor<double, 3> x({in.B, in.T, D_model}), want({in.B, in.T, D_model});
  for (index_t i = 0; i < n; ++i) {
    xd[std::size_t(i)] = static_cast<D>(static_cast<float>(r.normal()));
    x.storage()[std::size_t(i)] = static_cast<double>(static_cast<float>(xd[std::size_t(i)]));
  }
  host_tensor<std::uint8_t, 2> mask({in.B, in.T});
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
  sd.forward(x.view(), want.view(), si);

  const attnmix::device_stack<host_f, D> gpu(sf);
  device_buffer<D> dx(xd), dy(static_cast<std::size_t>(n));
  const attnmix::view3<const D> vx(dx.get(), {in.B, in.T, D_model}, attnmix::memory_space::device);
  const attnmix::view3<D> vy(dy.get(), {in.B, in.T, D_model}, attnmix::memory_space::device);
  gpu.forward(vx, vy, si);
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "device_stack forward");
  const std::vector<D> got = dy.to_host();
  std::vector<double> gotd(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) gotd[i] = static_cast<float>(got[i]);
  const double err = rel_error(gotd, want.storage());
  INFO("relative error " << err);
  CHECK(err <= tol);
  if (!in.lengths.empty()) {  // pad rows are zeros, exactly
    bool zeros = true;
    for (index_t b = 0; b < in.B; ++b)
      for (index_t t = 0; t < in.T; ++t)
        if (mask(b, t) == 0)
          for (index_t k = 0; k < D_model; ++k)
            zeros = zeros && gotd[std::size_t((b * in.T + t) * D_model + k)] == 0.0;
    CHECK(zeros);
  }
}

// Float: DESIGN.md's float tolerance, through every block. bfloat16: the activations are rounded
// to 8 significant bits after every step of every block (about ten roundings a block, each up to
// 2^-9 relative, amplified by the norms); with the tests' large random weights the error of a
// 5-6 block stack measured 2-4e-2, hence 6e-2.
constexpr double float_tol = 1e-5, bf16_tol = 6e-2;

template <class D>
void run_all(double tol) {
  using attnmix::stack_policy;
  const batch dense{2, 37, {}, {}};
  const batch masked{4, 29, {29, 1, 0, 17}, {}};
  const batch packed{1, 80, {}, {0, 33, 33, 64, 80}};
  const L::config mha = make_config(2, 2), gqa = make_config(4, 2);
  SECTION("hybrid [SA, GBLA, GBLA] encoder") {
    check_stack<D, stack_policy, repeat<2, layer::sa, layer::gbla, layer::gbla>>(mha, dense, 1,
                                                                                 tol);
    check_stack<D, stack_policy, layer::sa, layer::gbla, layer::bla>(gqa, masked, 2, tol);
    check_stack<D, stack_policy, layer::sa, layer::gbla>(mha, packed, 3, tol);
  }
  SECTION("causal mixers, MHA (low-rank w) and GQA (full w)") {
    check_stack<D, stack_policy, layer::path_fox, layer::fox, layer::causal_sa, layer::path,
                layer::linear_causal>(mha, dense, 4, tol);
    check_stack<D, stack_policy, layer::path, layer::path_fox, layer::fox, layer::linear_causal>(
        gqa, packed, 5, tol);
  }
  SECTION("every mixer switch: RoPE, qk-norm, biases, output gates, causal GBLA") {
    check_stack<D, stack_policy, biased_rope_sa, gated_fox, normed_path_fox, causal_gbla>(
        gqa, packed, 6, tol);
    check_stack<D, stack_policy, rope_sa, gated_fox, biased_rope_sa>(mha, masked, 7, tol);
  }
  SECTION("a test-only layer written on layers::ops, with no CUDA code of its own") {
    check_stack<D, stack_policy, attnmix_test::gated_softmax, layer::gbla,
                attnmix_test::gated_softmax>(mha, masked, 10, tol);
    check_stack<D, stack_policy, layer::fox, attnmix_test::gated_softmax>(gqa, packed, 11, tol);
  }
  SECTION("GELU and ReLU MLPs, sliding windows") {
    check_stack<D, attnmix::with_mlp<L::mlp_kind::gelu>, layer::sa, layer::fox>(
        make_config(2, 2, 5), dense, 8, tol);
    check_stack<D, attnmix::with_mlp<L::mlp_kind::relu>, layer::causal_sa, layer::gbla>(
        make_config(4, 2, 9), masked, 9, tol);
  }
}

}  // namespace

TEST_CASE("device_stack in float matches the host stack in double", "[stack][float]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  run_all<float>(float_tol);
}

TEST_CASE("device_stack in bfloat16 matches the host stack in double", "[stack][bf16]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  run_all<attnmix::bfloat16>(bf16_tol);
}

// One mixer alone on the GPU: the same template with backend::cuda, made from the host layer.
template <class HostF, class HostD, class Device>
void check_layer(const L::config& c, const std::vector<std::int32_t>& cu, index_t B, index_t T,
                 std::uint64_t salt) {
  rng r(salt);
  INFO("seed " << test_seed() << " salt " << salt << " layer " << HostF::name);
  HostF hf(c);
  L::randomize_parameters(hf, test_seed() ^ salt, 0.15, 0.3);
  HostD hd(c);
  copy_parameters(hf, hd);
  const Device gpu(hf);
  const index_t n = B * T * c.hidden_size;
  std::vector<float> xf(static_cast<std::size_t>(n));
  host_tensor<double, 3> x({B, T, c.hidden_size}), want({B, T, c.hidden_size});
  for (index_t i = 0; i < n; ++i)
    x.storage()[std::size_t(i)] = xf[std::size_t(i)] = static_cast<float>(r.normal());
  attnmix::view1<const std::int32_t> cv;
  if (!cu.empty()) cv = {cu.data(), {index_t(cu.size())}};
  hd.forward(x.view(), want.view(), cv);
  device_buffer<float> dx(xf), dy(static_cast<std::size_t>(n));
  const auto dev = attnmix::memory_space::device;
  gpu.forward(attnmix::view3<const float>(dx.get(), {B, T, c.hidden_size}, dev),
              attnmix::view3<float>(dy.get(), {B, T, c.hidden_size}, dev), cv);
  attnmix::detail::cuda::check(cudaDeviceSynchronize(), "layer forward");
  const std::vector<float> got = dy.to_host();
  const double err = rel_error(std::vector<double>(got.begin(), got.end()), want.storage());
  INFO("relative error " << err);
  CHECK(err <= float_tol);
}

TEST_CASE("a single mixer runs on the GPU through the same forward", "[layers][float]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using cuda = attnmix::backend::cuda;
  const L::config gqa = make_config(4, 2), mha = make_config(2, 2);
  const std::vector<std::int32_t> cu{0, 9, 9, 10, 40};
  using pf = L::path_fox_layer_policy;
  check_layer<L::path_layer<float, pf>, L::path_layer<double, pf>, L::path_layer<float, pf, cuda>>(
      gqa, {}, 2, 23, 21);
  check_layer<L::path_layer<float, pf>, L::path_layer<double, pf>, L::path_layer<float, pf, cuda>>(
      mha, cu, 1, 40, 22);
  check_layer<attnmix_test::gated_softmax_mixer<float>, attnmix_test::gated_softmax_mixer<double>,
              attnmix_test::gated_softmax_mixer<float, cuda>>(mha, cu, 1, 40, 23);
  using gp = causal_gbla_policy;
  check_layer<L::linear_layer<float, gp>, L::linear_layer<double, gp>,
              L::linear_layer<float, gp, cuda>>(gqa, {}, 2, 23, 24);
}

TEST_CASE("device_stack reports each block and rejects bad arguments", "[stack][errors]") {
  ATTNMIX_REQUIRE_CUDA_DEVICE();
  using host = attnmix::stack<float, layer::sa, layer::gbla, layer::gbla>;
  const L::config c = make_config(2, 2);
  host s(c);
  L::randomize_parameters(s, 5);
  const attnmix::device_stack<host, attnmix::bfloat16> gpu(s);
  const index_t B = 2, T = 8, D = c.hidden_size;
  device_buffer<attnmix::bfloat16> dx(std::size_t(B * T * D)), dy(std::size_t(B * T * D));
  std::vector<attnmix::bfloat16> hx(std::size_t(B * T * D), attnmix::bfloat16(0.5f));
  const auto dev = attnmix::memory_space::device;
  using cview = attnmix::view3<const attnmix::bfloat16>;
  using view = attnmix::view3<attnmix::bfloat16>;
  const cview x(dx.get(), {B, T, D}, dev);
  const view y(dy.get(), {B, T, D}, dev);

  std::vector<std::string> seen;
  attnmix::stack_inputs in;
  in.on_layer = [&](index_t i, const char* name, double seconds) {
    CHECK(seconds >= 0);
    seen.push_back(std::to_string(i) + name);
  };
  gpu.forward(x, y, in);
  CHECK(seen == std::vector<std::string>{"0sa", "1gbla", "2gbla"});

  // The message of the attnmix::error f throws, "" when it throws none.
  const auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const attnmix::error& e) {
      return e.what();
    }
    return "";
  };
  const auto has = [](const std::string& m, const char* part) {
    INFO(m);
    return m.find(part) != std::string::npos;
  };
  // Host memory marked as host, and host memory marked as device.
  std::string m = message([&] { gpu.forward(cview(hx.data(), {B, T, D}), y); });
  CHECK(has(m, "attnmix::stack::forward"));
  CHECK(has(m, "'x' is in host memory"));
  m = message([&] { gpu.forward(cview(hx.data(), {B, T, D}, dev), y); });
  CHECK(has(m, "'x' is marked as device memory"));
  m = message([&] { gpu.forward(x, view(dy.get(), {B, T - 1, D}, dev)); });
  CHECK(has(m, "'out'"));
  m = message([&] {
    gpu.forward(cview(dx.get(), {B, T, D / 2}, dev), view(dy.get(), {B, T, D / 2}, dev));
  });
  CHECK(has(m, "hidden_size = 128"));
  m = message([&] { gpu.forward(x, view(dx.get(), {B, T, D}, dev)); });
  CHECK(has(m, "overlaps"));
  host_tensor<std::uint8_t, 2> bad_mask({B, T + 1});
  bad_mask.fill(1);
  attnmix::stack_inputs bad;
  bad.mask = bad_mask.view();
  m = message([&] { gpu.forward(x, y, bad); });
  CHECK(has(m, "'mask'"));
  const std::vector<std::int32_t> cu{0, 3, 2 * T};
  bad = {};
  bad.cu_seqlens = {cu.data(), {3}};
  m = message([&] { gpu.forward(x, y, bad); });
  CHECK(has(m, "B = 1"));
}
