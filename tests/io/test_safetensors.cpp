// safetensors: save -> load round trips bit-exactly, every bad-file case gives an attnmix::error
// naming the file and the tensor (and leaves the model unchanged), and the fuzz corpus's
// regressions parse or are rejected cleanly.

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "attnmix/io/safetensors.hpp"
#include "layers/layer_harness.hpp"
#include "support/errors.hpp"

namespace {

using namespace attnmix_test;
using attnmix::host_tensor;
namespace L = attnmix::layers;
namespace io = attnmix::io;
namespace layer = attnmix::layer;
using model = attnmix::stack<float, layer::sa, layer::gbla, layer::path_fox>;

L::config io_config() {
  L::config c;
  c.hidden_size = 16;
  c.num_heads = 2;
  c.intermediate_size = 24;
  c.w_rank = 4;
  return c;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("attnmix_test_" + std::to_string(test_seed()) + "_" + name + ".safetensors"))
      .string();
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::vector<unsigned char>& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

template <class M>
std::vector<float> flat(const M& m) {
  std::vector<float> out;
  m.visit_parameters([&](const std::string&, const auto& p) {
    out.insert(out.end(), p.data.begin(), p.data.end());
  });
  return out;
}

TEST_CASE("save then load is bit-exact (float and double), outputs too", "[io]") {
  INFO("seed " << test_seed());
  const L::config c = io_config();
  model a(c), b(c);
  L::randomize_parameters(a, test_seed(), 0.3, 0.3);
  L::randomize_parameters(b, test_seed() + 1, 0.3, 0.3);
  const std::string path = temp_path("round_trip");
  io::save(a, path);
  io::load(b, path);
  CHECK(bitwise_equal(flat(a), flat(b)));
  rng r(1);
  auto x = random_activations<float>(r, 2, 9, c.hidden_size);
  host_tensor<float, 3> ya(x.shape()), yb(x.shape());
  a.forward(x.view(), ya.view());
  b.forward(x.view(), yb.view());
  CHECK(bitwise_equal(ya.storage(), yb.storage()));

  attnmix::stack<double, layer::fox, layer::gbla> d1(c), d2(c);
  L::randomize_parameters(d1, test_seed(), 0.3, 0.3);
  io::save(d1, path);
  io::load(d2, path);
  std::vector<double> p1, p2;
  d1.visit_parameters([&](const std::string&, const auto& p) {
    p1.insert(p1.end(), p.data.begin(), p.data.end());
  });
  d2.visit_parameters([&](const std::string&, const auto& p) {
    p2.insert(p2.end(), p.data.begin(), p.data.end());
  });
  CHECK(bitwise_equal(p1, p2));
  // F32 widens into double parameters; F64 does not narrow into float ones.
  attnmix::stack<float, layer::fox, layer::gbla> f(c);
  ATTNMIX_CHECK_ERROR(io::load(f, path), "has dtype F64");
  io::save(f, path);
  io::load(d2, path);
  std::remove(path.c_str());
}

TEST_CASE("F16 and BF16 tensors load into float parameters", "[io]") {
  L::linear<float> lin(2, 3);
  std::vector<std::uint16_t> h(6), bf(6);
  for (int i = 0; i < 6; ++i) {
    h[static_cast<std::size_t>(i)] = attnmix::half(0.25f * float(i)).bits;
    bf[static_cast<std::size_t>(i)] = attnmix::bfloat16(-0.5f * float(i)).bits;
  }
  for (int which = 0; which < 2; ++which) {
    const auto bytes = io::serialize({{"weight",
                                       which ? io::dtype::bf16 : io::dtype::f16,
                                       {3, 2},
                                       which ? bf.data() : h.data(),
                                       12}});
    io::load(lin, io::safetensors_file::parse(bytes, "mem"));
    for (int i = 0; i < 6; ++i)
      CHECK(lin.weight.data[static_cast<std::size_t>(i)] == (which ? -0.5f : 0.25f) * float(i));
  }
}

// Every rejection names the file (and the tensor where there is one), and leaves the model as
// it was.
void expect_bad(model& m, const std::vector<unsigned char>& bytes, const std::string& text,
                const std::string& tensor = "") {
  const std::string path = temp_path("bad");
  write_bytes(path, bytes);
  const auto before = flat(m);
  const std::string msg = error_message([&] { io::load(m, path); });
  INFO(msg);
  CHECK(msg.find(text) != std::string::npos);
  CHECK(msg.find("file '" + path + "'") != std::string::npos);
  if (!tensor.empty()) CHECK(msg.find("'" + tensor + "'") != std::string::npos);
  CHECK(bitwise_equal(flat(m), before));
  std::remove(path.c_str());
}

// The model's tensors as a list the tests can edit before serialising.
std::vector<io::tensor_bytes> tensors_of(const model& m) {
  std::vector<io::tensor_bytes> out;
  m.visit_parameters([&](const std::string& name, const auto& p) {
    out.push_back({name, io::dtype::f32, p.shape, p.data.data(), p.data.size() * 4});
  });
  return out;
}

std::vector<unsigned char> with_header(const std::string& json, std::size_t data_bytes = 0) {
  std::vector<unsigned char> b(8 + json.size() + data_bytes, 0);
  const std::uint64_t n = json.size();
  for (int i = 0; i < 8; ++i)
    b[static_cast<std::size_t>(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::copy(json.begin(), json.end(), b.begin() + 8);
  return b;
}

TEST_CASE("bad files give attnmix::error naming file and tensor", "[io][errors]") {
  INFO("seed " << test_seed());
  const L::config c = io_config();
  model m(c);
  L::randomize_parameters(m, test_seed(), 0.3, 0.3);
  const auto good = tensors_of(m);
  const std::string q = "layers.0.attn.q_proj.weight";

  SECTION("missing tensor") {
    auto t = good;
    t.erase(t.begin() + 1);
    expect_bad(m, io::serialize(t), "has no tensor", good[1].name);
  }
  SECTION("extra tensor") {
    auto t = good;
    float extra[2] = {1, 2};
    t.push_back({"layers.0.attn.unexpected", io::dtype::f32, {2}, extra, 8});
    expect_bad(m, io::serialize(t), "that the model does not have", "layers.0.attn.unexpected");
  }
  SECTION("wrong shape") {
    auto t = good;
    for (auto& e : t)
      if (e.name == q) e.shape = {e.shape[0] * e.shape[1] / 2, 2};
    expect_bad(m, io::serialize(t), "but the model expects", q);
  }
  SECTION("wrong dtype") {
    auto t = good;
    for (auto& e : t)
      if (e.name == q) e.type = io::dtype::i32;
    expect_bad(m, io::serialize(t), "has dtype I32", q);
  }
  SECTION("truncated anywhere") {
    const auto bytes = io::serialize(good);
    for (std::size_t cut : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{40},
                            bytes.size() / 2, bytes.size() - 1}) {
      INFO("cut at " << cut);
      expect_bad(m,
                 std::vector<unsigned char>(bytes.begin(), bytes.begin() + static_cast<long>(cut)),
                 "is truncated");
    }
  }
  SECTION("corrupt headers") {
    expect_bad(m, with_header("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], "), "not valid JSON");
    expect_bad(m, with_header("[1, 2, 3]"), "not a JSON object");
    expect_bad(
        m,
        with_header("{\"w\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4),
        "unknown dtype 'F33'", "w");
    expect_bad(
        m,
        with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4),
        "not a non-negative integer", "w");
    expect_bad(
        m,
        with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 8),
        "need 8", "w");
    expect_bad(
        m,
        with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 0]}}", 8),
        "end before they begin", "w");
    expect_bad(
        m,
        with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                    " \"v\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                    12),
        "overlap");
    expect_bad(m,
               with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296],"
                           " \"data_offsets\": [0, 0]}}"),
               "larger than the file's data", "w");
    expect_bad(m, with_header("{\"__metadata__\": {\"k\": 1}}"), "is not a string");
    auto huge = with_header("{}");
    huge[7] = 0x7f;
    expect_bad(m, huge, "exceeds the 100 MB limit");
  }
  SECTION("unreadable file") {
    const std::string msg =
        error_message([&] { io::load(m, "/nonexistent/dir/model.safetensors"); });
    CHECK(msg.find("cannot be opened") != std::string::npos);
    CHECK(msg.find("/nonexistent/dir/model.safetensors") != std::string::npos);
  }
}

// A model that checks the values it loads: every value of "w" must be >= 0.
struct checked_model {
  L::parameter<double> w{{3}}, b{{2}};
  template <class F>
  void visit_parameters(F&& f) {
    f("w", w), f("b", b);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    f("w", w), f("b", b);
  }
  template <class Values, class Reject>
  void check_loaded(Values&& values, Reject&& reject) const {
    const std::vector<double> v = values("w");
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!(v[i] >= 0)) reject("tensor 'w' holds a negative value at [" + std::to_string(i) + "]");
  }
};

TEST_CASE("a model's own check of the loaded values runs before anything is written", "[io]") {
  checked_model m;
  m.w.data = {1, 2, 3};
  m.b.data = {4, 5};
  const std::vector<double> w_bad{1, -2, 3}, w_good{7, 8, 9}, b_new{6, 7};
  const auto file = [&](const std::vector<double>& w) {
    return io::safetensors_file::parse(
        io::serialize({{"w", io::dtype::f64, {3}, w.data(), 24},
                       {"b", io::dtype::f64, {2}, b_new.data(), 16}}),
        "mem");
  };
  const std::string msg = error_message([&] { io::load(m, file(w_bad)); });
  INFO(msg);
  CHECK(msg == "attnmix::io::load: file 'mem' tensor 'w' holds a negative value at [1]");
  CHECK(m.w.data == std::vector<double>{1, 2, 3});
  CHECK(m.b.data == std::vector<double>{4, 5});
  io::load(m, file(w_good));
  CHECK(m.w.data == w_good);
  CHECK(m.b.data == b_new);
}

TEST_CASE("values() reads only the bytes of a tensor of its file", "[io][errors]") {
  const float x[4] = {1, 2, 3, 4};
  const auto f =
      io::safetensors_file::parse(io::serialize({{"x", io::dtype::f32, {4}, x, 16}}), "mem");
  io::tensor_info t = f.tensors()[0];
  CHECK(f.values<float>(t) == std::vector<float>{1, 2, 3, 4});
  const std::string fn = "attnmix::io::safetensors_file::values";
  t.end = 1u << 30;
  ATTNMIX_CHECK_ERROR(f.values<float>(t),
                      fn + ": file 'mem' tensor 'x' has data bytes [0, 1073741824)");
  t.begin = 8, t.end = 4;
  ATTNMIX_CHECK_ERROR(f.values<float>(t), fn + ": file 'mem' tensor 'x' has data bytes [8, 4)");
  t.begin = 0, t.end = 12;  // inside the file, but not the 16 bytes its shape needs
  ATTNMIX_CHECK_ERROR(f.values<float>(t), "need 16");
}

TEST_CASE("serialize and save reject tensors that would make a corrupt file", "[io][errors]") {
  const float x[4] = {1, 2, 3, 4};
  const std::string fn = "attnmix::io::serialize";
  using tb = io::tensor_bytes;
  expect_error(fn, "tensors", "tensor 'x' of 12 bytes but shape [4] of F32 needs 16", [&] {
    io::serialize({tb{"x", io::dtype::f32, {4}, x, 12}});
  });
  expect_error(fn, "tensors", "tensor 'x' of 16 bytes but a null pointer", [&] {
    io::serialize({tb{"x", io::dtype::f32, {4}, nullptr, 16}});
  });
  expect_error(fn, "tensors", "tensor 'x' with a negative extent", [&] {
    io::serialize({tb{"x", io::dtype::f32, {-4}, x, 0}});
  });
  expect_error(fn, "tensors", "'x' twice", [&] {
    io::serialize({tb{"x", io::dtype::f32, {4}, x, 16}, tb{"x", io::dtype::f32, {2}, x, 8}});
  });
  expect_error(fn, "tensors", "'__metadata__'", [&] {
    io::serialize({tb{"__metadata__", io::dtype::f32, {4}, x, 16}});
  });
  CHECK(io::serialize({tb{"e", io::dtype::f32, {0, 3}, nullptr, 0}}).size() > 8);

  // save checks the model's parameters before it opens the file: the old file stays.
  const std::string path = temp_path("save_rejected");
  write_bytes(path, {1, 2, 3});
  checked_model m;
  m.w.data.resize(2);  // shape [3]
  expect_error("attnmix::io::save", "model", "'w' of shape [3] but 2 values",
               [&] { io::save(m, path); });
  CHECK(read_bytes(path) == std::vector<unsigned char>{1, 2, 3});
  std::remove(path.c_str());
}

TEST_CASE("fuzz corpus regressions parse or are rejected cleanly", "[io][fuzz]") {
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(ATTNMIX_IO_CORPUS)) {
    if (!entry.is_regular_file()) continue;
    ++files;
    INFO(entry.path().string());
    try {
      const auto f =
          io::safetensors_file::parse(read_bytes(entry.path().string()), entry.path().string());
      for (const auto& t : f.tensors())
        if (t.type == io::dtype::f32 || t.type == io::dtype::f16 || t.type == io::dtype::bf16)
          CHECK(f.values<float>(t).size() * io::element_size(t.type) == t.end - t.begin);
    } catch (const attnmix::error& e) {
      CHECK(std::string(e.what()).find(entry.path().string()) != std::string::npos);
    }
  }
  CHECK(files > 0);
}

}  // namespace
