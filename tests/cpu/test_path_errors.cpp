// Argument checks of the PaTH calls: attnmix::error naming the function and the argument, and
// outputs and caches left untouched.

#include <functional>
#include <string>

#include "cpu/test_path_harness.hpp"
#include "support/errors.hpp"

using namespace attnmix_test;
using attnmix::attention_args;
using attnmix::attention_params;
using attnmix::host_tensor;
using attnmix::view1;
using attnmix::view3;
using attnmix::view4;

namespace {

constexpr index_t B = 2, T = 20, HQ = 4, H = 2, D = 8, Dv = 6;

struct fixture {
  host_tensor<float, 4> q{{B, T, HQ, D}, 0.5f}, k{{B, T, H, D}, 0.25f}, v{{B, T, H, Dv}, 1.0f};
  host_tensor<float, 4> w{{B, T, H, D}, 0.3f}, out{{B, T, HQ, Dv}, 42.0f};
  host_tensor<float, 3> beta{{B, T, H}, 1.5f}, g{{B, T, HQ}, -0.1f}, lse{{B, T, HQ}, 42.0f};
  host_tensor<float, 4> key_cache{{B, T, H, D}, 42.0f};
  std::vector<float> spare = std::vector<float>(1 << 14, 0.0f);  // backs wrongly shaped views
  std::vector<std::int32_t> slots;

  attention_args<float> args() {
    attention_args<float> a{q.view(), k.view(), v.view(), out.view()};
    a.g = g.view(), a.w = w.view(), a.beta = beta.view(), a.lse = lse.view();
    return a;
  }
  // The first token of every row as a decoding step ([B, 1, ...] views of the same storage).
  attention_args<float> step() {
    attention_args<float> a{view4<const float>(q.data(), {B, 1, HQ, D}, q.view().strides()),
                            view4<const float>(k.data(), {B, 1, H, D}, k.view().strides()),
                            view4<const float>(v.data(), {B, 1, H, Dv}, v.view().strides()),
                            view4<float>(out.data(), {B, 1, HQ, Dv}, out.view().strides())};
    a.g = view3<const float>(g.data(), {B, 1, HQ}, g.view().strides());
    a.w = view4<const float>(w.data(), {B, 1, H, D}, w.view().strides());
    a.beta = view3<const float>(beta.data(), {B, 1, H}, beta.view().strides());
    a.lse = view3<float>(lse.data(), {B, 1, HQ}, lse.view().strides());
    return a;
  }
};

// Calls `call`, expects an attnmix::error starting "<fn>: argument '<arg>'" and containing
// `detail`, and checks that out, lse, key_cache and the cache (if any) are unchanged.
void expect_rejected(fixture& f, const attnmix::path_cache<float>* cache, const std::string& fn,
                     const std::string& arg, const std::string& detail,
                     const std::function<void()>& call) {
  const auto out = f.out.storage(), lse = f.lse.storage(), kc = f.key_cache.storage();
  std::vector<float> keys;
  std::vector<index_t> lengths;
  if (cache != nullptr) {
    keys.assign(cache->keys().data(), cache->keys().data() + cache->keys().size());
    for (index_t s = 0; s < cache->slots(); ++s) lengths.push_back(cache->length(s));
  }
  expect_error(fn, arg, detail, call);
  CHECK(bitwise_equal(f.out.storage(), out));
  CHECK(bitwise_equal(f.lse.storage(), lse));
  CHECK(bitwise_equal(f.key_cache.storage(), kc));
  if (cache != nullptr) {
    CHECK(bitwise_equal(
        std::vector<float>(cache->keys().data(), cache->keys().data() + cache->keys().size()),
        keys));
    for (index_t s = 0; s < cache->slots(); ++s) CHECK(cache->length(s) == lengths[s]);
  }
}

const std::string fwd = "attnmix::attention<path_fox>";

template <class Kind = attnmix::kind::path_fox>
void forward_rejected(
    const std::string& arg, const std::string& detail,
    const std::function<void(fixture&, attention_args<float>&, attention_params&)>& modify) {
  fixture f;
  attention_args<float> a = f.args();
  if constexpr (!attnmix::kind_traits<Kind>::uses_forget_gate) a.g = {};
  attention_params p;
  modify(f, a, p);
  expect_rejected(f, nullptr, std::string("attnmix::attention<") + Kind::name + ">", arg, detail,
                  [&] { attnmix::attention<Kind>(a, p); });
}

}  // namespace

TEST_CASE("PaTH forward: a valid fixture is accepted", "[path][cpu][errors]") {
  fixture f;
  CHECK_NOTHROW(attnmix::attention<attnmix::kind::path_fox>(f.args()));
  CHECK(std::isfinite(f.out(1, T - 1, HQ - 1, Dv - 1)));
}

TEST_CASE("PaTH forward rejects bad w, beta, g, heads and window", "[path][cpu][errors]") {
  forward_rejected("w", "has shape [2, 20, 2, 7] but must be [B, T, H, D] = [2, 20, 2, 8]",
                   [](fixture& f, auto& a, auto&) {
                     a.w = view4<const float>(f.spare.data(), {B, T, H, D - 1});
                   });
  forward_rejected("w", "has shape [2, 20, 4, 8] but must be [B, T, H, D] = [2, 20, 2, 8]",
                   [](fixture& f, auto& a, auto&) {
                     a.w = view4<const float>(f.spare.data(), {B, T, HQ, D});
                   });
  forward_rejected("beta", "has shape [2, 19, 2] but must be [B, T, H] = [2, 20, 2]",
                   [](fixture& f, auto& a, auto&) {
                     a.beta = view3<const float>(f.spare.data(), {B, T - 1, H});
                   });
  forward_rejected("g", "has shape [2, 20, 2] but must be [B, T, HQ] = [2, 20, 4]",
                   [](fixture& f, auto& a, auto&) {
                     a.g = view3<const float>(f.spare.data(), {B, T, H});
                   });
  forward_rejected("k", "H = 3 heads, which does not divide the HQ = 4",
                   [](fixture& f, auto& a, auto&) {
                     a.k = view4<const float>(f.spare.data(), {B, T, 3, D});
                   });
  forward_rejected("w", "Householder directions", [](fixture&, auto& a, auto&) { a.w = {}; });
  forward_rejected("beta", "Householder strengths", [](fixture&, auto& a, auto&) { a.beta = {}; });
  forward_rejected("g", "forget gate", [](fixture&, auto& a, auto&) { a.g = {}; });
  forward_rejected<attnmix::kind::path>("g", "no forget gate",
                                        [](fixture& f, auto& a, auto&) { a.g = f.g.view(); });
  forward_rejected("window", "PaTH has no sliding window, but is 16",
                   [](fixture&, auto&, auto& p) { p.window = 16; });
  forward_rejected<attnmix::kind::path>("window", "PaTH has no sliding window",
                                        [](fixture&, auto&, auto& p) { p.window = 1; });
}

TEST_CASE("PaTH key cache rejects bad arguments", "[path][cpu][errors]") {
  const std::string fn = "attnmix::path_prefill_key_cache";
  auto run = [](fixture& f, auto modify) {
    attnmix::path_key_cache_args<float> a{f.k.view(), f.w.view(), f.beta.view(),
                                          f.key_cache.view()};
    attention_params p;
    modify(f, a, p);
    return [a, p] {
      attnmix::path_prefill_key_cache(a, p);
    };
  };
  fixture f;
  CHECK_NOTHROW(run(f, [](auto&, auto&, auto&) {})());
  fixture g;
  expect_rejected(g, nullptr, fn, "key_cache",
                  "[2, 20, 4, 8] but must be [B, T, H, D] = [2, 20, 2, 8]",
                  run(g, [](fixture& x, auto& a, auto&) {
                    a.key_cache = view4<float>(x.spare.data(), {B, T, HQ, D});
                  }));
  expect_rejected(g, nullptr, fn, "beta", "[2, 20, 1] but must be [B, T, H] = [2, 20, 2]",
                  run(g, [](fixture& x, auto& a, auto&) {
                    a.beta = view3<const float>(x.spare.data(), {B, T, 1});
                  }));
  expect_rejected(g, nullptr, fn, "w", "[2, 20, 2, 4] but must be [B, T, H, D] = [2, 20, 2, 8]",
                  run(g, [](fixture& x, auto& a, auto&) {
                    a.w = view4<const float>(x.spare.data(), {B, T, H, 4});
                  }));
  expect_rejected(g, nullptr, fn, "key_cache", "overlaps the memory of 'k'",
                  run(g, [](fixture& x, auto& a, auto&) {
                    a.key_cache = view4<float>(x.k.data(), {B, T, H, D});
                  }));
  expect_rejected(g, nullptr, fn, "cu_seqlens", "ends at 7",
                  run(g, [](fixture& x, auto& a, auto& p) {
                    x.slots = {0, 7};
                    a.k = view4<const float>(x.k.data(), {1, B * T, H, D});
                    a.w = view4<const float>(x.w.data(), {1, B * T, H, D});
                    a.beta = view3<const float>(x.beta.data(), {1, B * T, H});
                    a.key_cache = view4<float>(x.key_cache.data(), {1, B * T, H, D});
                    p.cu_seqlens = view1<const std::int32_t>(x.slots.data(), {2});
                  }));
}

TEST_CASE("PaTH decoding rejects another head layout, bad slots and full slots",
          "[path][cpu][errors]") {
  using attnmix::kind::path_fox;
  const std::string fn = "attnmix::path_decode_step<path_fox>";
  fixture f;
  attnmix::path_cache<float> cache(3, 4, HQ, H, D, Dv);
  // Two valid steps first, so that the cache holds something to protect.
  CHECK_NOTHROW(attnmix::path_decode_step<path_fox>(cache, f.step()));
  CHECK_NOTHROW(attnmix::path_decode_step<path_fox>(cache, f.step()));
  REQUIRE(cache.length(0) == 2);
  REQUIRE(cache.length(2) == 0);

  auto step = [&](attnmix::path_cache<float>& c, const attention_args<float>& a,
                  view1<const std::int32_t> slots = {}, attention_params p = {}) {
    return [&c, a, slots, p] {
      attnmix::path_decode_step<path_fox>(c, a, slots, p);
    };
  };
  attnmix::path_cache<float> other_heads(3, 4, 2 * HQ, H, D, Dv), other_kv(3, 4, HQ, 2 * H, D, Dv);
  attnmix::path_cache<float> other_dv(3, 4, HQ, H, D, Dv + 1);
  expect_rejected(f, &other_heads, fn, "cache",
                  "holds HQ = 8 query and H = 2 key/value heads but 'q' has HQ = 4",
                  step(other_heads, f.step()));
  expect_rejected(f, &other_kv, fn, "cache",
                  "H = 4 key/value heads but 'q' has HQ = 4 and 'k' has H = 2",
                  step(other_kv, f.step()));
  expect_rejected(f, &other_dv, fn, "cache", "holds values of Dv = 7 but 'v' has Dv = 6",
                  step(other_dv, f.step()));

  attention_args<float> bad = f.step();
  bad.g = view3<const float>(f.spare.data(), {B, 1, H});
  expect_rejected(f, &cache, fn, "g", "[2, 1, 2] but must be [B, T, HQ] = [2, 1, 4]",
                  step(cache, bad));
  bad = f.step();
  bad.w = view4<const float>(f.spare.data(), {B, 1, H, D + 1});
  expect_rejected(f, &cache, fn, "w", "but must be [B, T, H, D] = [2, 1, 2, 8]", step(cache, bad));
  expect_rejected(f, &cache, fn, "q", "one new token per sequence", step(cache, f.args()));

  f.slots = {2, 2};
  expect_rejected(f, &cache, fn, "slots", "names slot 2 twice",
                  step(cache, f.step(), {f.slots.data(), {2}}));
  f.slots = {0, 3};
  expect_rejected(f, &cache, fn, "slots", "entry 1 is 3 but the cache has slots [0, 3)",
                  step(cache, f.step(), {f.slots.data(), {2}}));
  expect_rejected(f, &cache, fn, "slots", "has 1 entries but there are 2 sequences",
                  step(cache, f.step(), {f.slots.data(), {1}}));
  attention_params windowed;
  windowed.window = 3;
  expect_rejected(f, &cache, fn, "window", "PaTH has no sliding window",
                  step(cache, f.step(), {}, windowed));

  // Fill slots 0 and 1 to capacity (4), then one more step must be refused.
  CHECK_NOTHROW(attnmix::path_decode_step<path_fox>(cache, f.step()));
  CHECK_NOTHROW(attnmix::path_decode_step<path_fox>(cache, f.step()));
  REQUIRE(cache.length(1) == 4);
  expect_rejected(f, &cache, fn, "cache", "slot 0 is full: it holds 4 tokens",
                  step(cache, f.step()));
  f.slots = {2, 1};
  expect_rejected(f, &cache, fn, "cache", "slot 1 is full",
                  step(cache, f.step(), {f.slots.data(), {2}}));
  attnmix::path_cache<float> one_slot(1, 4, HQ, H, D, Dv);
  expect_rejected(f, &one_slot, fn, "slots", "there are 2 sequences and the cache has 1 slots",
                  step(one_slot, f.step()));
}

TEST_CASE("PaTH prefill rejects a cache that is too small or of another layout",
          "[path][cpu][errors]") {
  using attnmix::kind::path_fox;
  const std::string fn = "attnmix::path_prefill<path_fox>";
  fixture f;
  attnmix::path_cache<float> small(2, T - 1, HQ, H, D, Dv), other(2, T, HQ, H, D + 1, Dv);
  attnmix::path_cache<float> ok(2, T, HQ, H, D, Dv);
  expect_rejected(f, &small, fn, "cache", "has capacity 19 but sequence 0 has 20 tokens",
                  [&] { attnmix::path_prefill<path_fox>(small, f.args()); });
  expect_rejected(f, &other, fn, "cache", "holds keys of D = 9 but 'k' has D = 8",
                  [&] { attnmix::path_prefill<path_fox>(other, f.args()); });
  CHECK_NOTHROW(attnmix::path_prefill<path_fox>(ok, f.args()));
  CHECK(ok.length(1) == T);
}

TEST_CASE("path_cache rejects bad sizes", "[path][cpu][errors]") {
  CHECK_THROWS_AS(attnmix::path_cache<float>(2, 8, 3, 2, 8, 8), attnmix::error);
  CHECK_THROWS_AS(attnmix::path_cache<double>(0, 8, 2, 2, 8, 8), attnmix::error);
  attnmix::path_cache<float> c(2, 8, 4, 2, 8, 8);
  CHECK_THROWS_AS(c.length(2), attnmix::error);
  try {
    attnmix::path_cache<float>(2, 8, 3, 2, 8, 8);
  } catch (const attnmix::error& e) {
    CHECK(std::string(e.what()).rfind("attnmix::path_cache: argument 'q_heads'", 0) == 0);
  }
}
