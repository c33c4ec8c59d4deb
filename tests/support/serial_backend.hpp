#pragma once
// A third backend, defined in the tests only: a serial CPU backend. Adding it takes its tag and
// the specialisations below, each forwarding to the CPU backend on one thread: the front doors'
// implementations (attention_impl, linear_attention_impl, their backwards, path_cache_impl,
// is_implemented, is_backward_implemented, takes_key_lengths) and the layers' operations
// (layers::ops, the forward half and the training half). Nothing else of attnmix knows it; the
// front doors, their checks, the host caches, the layers, the stacks, the language model and
// AdamW run on it unchanged. tests/core/test_third_backend.cpp and tests/stack/test_stack.cpp
// check that its results are the cpu backend's, bit for bit.

#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"

namespace test_backend {
struct serial {
  using memory_space = attnmix::host_space;
  static constexpr const char* name = "serial";
};
}  // namespace test_backend

namespace attnmix {
template <class Kind>
struct is_implemented<Kind, test_backend::serial> : is_implemented<Kind, backend::cpu> {};
template <class Kind>
struct takes_key_lengths<Kind, test_backend::serial> : takes_key_lengths<Kind, backend::cpu> {};
namespace detail {
template <class Kind, class Policy>
struct attention_impl<Kind, test_backend::serial, Policy> {
  template <class T>
  static void run(const attention_args<T>& a, const attention_problem& p,
                  const test_backend::serial&) {
    attention_impl<Kind, backend::cpu, Policy>::run(a, p, backend::cpu{1});
  }
};
template <class Kind, class Policy>
struct linear_attention_impl<Kind, test_backend::serial, Policy> {
  template <class T>
  static void run(const linear_attention_args<T>& a, const linear_attention_problem& p,
                  const test_backend::serial&) {
    linear_attention_impl<Kind, backend::cpu, Policy>::run(a, p, backend::cpu{1});
  }
};
template <>
struct path_cache_impl<test_backend::serial> {
  using cpu = path_cache_impl<backend::cpu>;
  template <class Policy, class T>
  static void key_cache(const path_key_cache_args<T>& a, const attention_problem& p,
                        const test_backend::serial&) {
    cpu::template key_cache<Policy>(a, p, backend::cpu{1});
  }
  template <class Kind, class Policy, class T>
  static void prefill(path_cache<T>& c, const attention_args<T>& a, const attention_problem& p,
                      const std::vector<index_t>& slots, const test_backend::serial&) {
    cpu::template prefill<Kind, Policy>(c, a, p, slots, backend::cpu{1});
  }
  template <class Kind, class Policy, class T>
  static void decode(path_cache<T>& c, const attention_args<T>& a, const attention_problem& p,
                     const std::vector<index_t>& slots, const test_backend::serial&) {
    cpu::template decode<Kind, Policy>(c, a, p, slots, backend::cpu{1});
  }
};
}  // namespace detail

template <class Kind>
struct is_backward_implemented<Kind, test_backend::serial>
    : is_backward_implemented<Kind, backend::cpu> {};
namespace detail {
template <class Kind, class Policy>
struct attention_backward_impl<Kind, test_backend::serial, Policy> {
  template <class T>
  static void run(const attention_grad_args<T>& a, const attention_problem& p,
                  const test_backend::serial&) {
    attention_backward_impl<Kind, backend::cpu, Policy>::run(a, p, backend::cpu{1});
  }
};
template <class Kind, class Policy>
struct linear_attention_backward_impl<Kind, test_backend::serial, Policy> {
  template <class T>
  static void run(const linear_attention_grad_args<T>& a, const linear_attention_problem& p,
                  const test_backend::serial&) {
    linear_attention_backward_impl<Kind, backend::cpu, Policy>::run(a, p, backend::cpu{1});
  }
};
}  // namespace detail

namespace layers {
template <>
struct ops<test_backend::serial> {
  using cpu = ops<backend::cpu>;
  struct handles {};
  template <class T>
  static constexpr bool computes = cpu::computes<T>;
  static const backend::cpu& one_thread() {
    static const backend::cpu be{1};
    return be;
  }
  struct on_cpu {  // a serial call's context as a one-thread CPU one
    explicit on_cpu(const context<test_backend::serial>& c)
        : ctx{one_thread(), c.layout, c.positions, h} {}
    cpu::handles h;
    context<backend::cpu> ctx;
  };
  struct scratch : cpu::scratch {
    scratch(const test_backend::serial&, std::size_t bytes) : cpu::scratch(one_thread(), bytes) {}
  };
  struct timer : cpu::timer {
    timer(const test_backend::serial&, bool on) : cpu::timer(one_thread(), on) {}
  };

  template <class C, class... A>
  static void gemm(const C& c, A... a) {
    cpu::gemm(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void norm(const C& c, A... a) {
    cpu::norm(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void short_conv(const C& c, A... a) {
    cpu::short_conv(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void rope(const C& c, A... a) {
    cpu::rope(on_cpu(c).ctx, a...);
  }
  template <class Fn, class C, class... A>
  static void map(const C& c, A... a) {
    cpu::map<Fn>(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void move_rows(const C& c, A... a) {
    cpu::move_rows(on_cpu(c).ctx, a...);
  }
  template <class... A>
  static void positions(const test_backend::serial&, A&&... a) {
    cpu::positions(one_thread(), a...);
  }
  template <class S>
  static void upload(const test_backend::serial&, S* dst, const S* src, index_t n) {
    cpu::upload(one_thread(), dst, src, n);
  }
  template <class S>
  static void zero(const test_backend::serial&, S* p, index_t n) {
    cpu::zero(one_thread(), p, n);
  }
  template <class V>
  static void check_memory(const std::string&, const char*, const V&) {}
  template <class Body>
  static void for_each(const test_backend::serial&, index_t n, Body&& body) {
    for (index_t i = 0; i < n; ++i) body(i);
  }

  // The backward half and the training steps.
  template <class C, class... A>
  static void gemm_dx(const C& c, A... a) {
    cpu::gemm_dx(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void gemm_dw(const C& c, A... a) {
    cpu::gemm_dw(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void norm_backward(const C& c, A... a) {
    cpu::norm_backward(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void short_conv_backward(const C& c, A... a) {
    cpu::short_conv_backward(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void rope_backward(const C& c, A... a) {
    cpu::rope_backward(on_cpu(c).ctx, a...);
  }
  template <class Fn, class C, class... A>
  static void map_backward(const C& c, A... a) {
    cpu::map_backward<Fn>(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void gather_rows(const C& c, A... a) {
    cpu::gather_rows(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static void scatter_add_rows(const C& c, A... a) {
    cpu::scatter_add_rows(on_cpu(c).ctx, a...);
  }
  template <class C, class... A>
  static double cross_entropy(const C& c, A... a) {
    return cpu::cross_entropy(on_cpu(c).ctx, a...);
  }
  template <class... A>
  static void adamw(const test_backend::serial&, A... a) {
    cpu::adamw(one_thread(), a...);
  }
  template <class G>
  static double sum_squares(const test_backend::serial&, const G* g, index_t n) {
    return cpu::sum_squares(one_thread(), g, n);
  }
  template <class G>
  static void scale(const test_backend::serial&, G* g, index_t n, double factor) {
    cpu::scale(one_thread(), g, n, factor);
  }
};
}  // namespace layers
}  // namespace attnmix
