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
template <class Kind>
struct takes_key_lengths_backward<Kind, test_backend::serial>
    : takes_key_lengths_backward<Kind, backend::cpu> {};
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

// Each operation that takes a call's context runs the CPU one on a one-thread context; each that
// takes the backend, the CPU one on one thread.
#define ATTNMIX_SERIAL_ON_CONTEXT(op)    \
  template <class C, class... A>         \
  static auto op(const C& c, A... a) {   \
    return cpu::op(on_cpu(c).ctx, a...); \
  }
#define ATTNMIX_SERIAL_ON_BACKEND(op)                   \
  template <class... A>                                 \
  static auto op(const test_backend::serial&, A... a) { \
    return cpu::op(one_thread(), a...);                 \
  }
  ATTNMIX_SERIAL_ON_CONTEXT(gemm)
  ATTNMIX_SERIAL_ON_CONTEXT(norm)
  ATTNMIX_SERIAL_ON_CONTEXT(short_conv)
  ATTNMIX_SERIAL_ON_CONTEXT(rope)
  ATTNMIX_SERIAL_ON_CONTEXT(move_rows)
  ATTNMIX_SERIAL_ON_BACKEND(positions)
  ATTNMIX_SERIAL_ON_BACKEND(upload)
  ATTNMIX_SERIAL_ON_BACKEND(zero)
  template <class Fn, class C, class... A>
  static void map(const C& c, A... a) {
    cpu::map<Fn>(on_cpu(c).ctx, a...);
  }
  template <class V>
  static void check_memory(const std::string&, const char*, const V&) {}
  template <class Body>
  static void for_each(const test_backend::serial&, index_t n, Body&& body) {
    for (index_t i = 0; i < n; ++i) body(i);
  }

  // The backward half and the training steps.
  ATTNMIX_SERIAL_ON_CONTEXT(gemm_dx)
  ATTNMIX_SERIAL_ON_CONTEXT(gemm_dw)
  ATTNMIX_SERIAL_ON_CONTEXT(norm_backward)
  ATTNMIX_SERIAL_ON_CONTEXT(short_conv_backward)
  ATTNMIX_SERIAL_ON_CONTEXT(rope_backward)
  ATTNMIX_SERIAL_ON_CONTEXT(gather_rows)
  ATTNMIX_SERIAL_ON_CONTEXT(scatter_add_rows)
  ATTNMIX_SERIAL_ON_CONTEXT(cross_entropy)
  ATTNMIX_SERIAL_ON_BACKEND(adamw)
  ATTNMIX_SERIAL_ON_BACKEND(sum_squares)
  ATTNMIX_SERIAL_ON_BACKEND(clip)
  ATTNMIX_SERIAL_ON_BACKEND(download)
  template <class Fn, class C, class... A>
  static void map_backward(const C& c, A... a) {
    cpu::map_backward<Fn>(on_cpu(c).ctx, a...);
  }
#undef ATTNMIX_SERIAL_ON_CONTEXT
#undef ATTNMIX_SERIAL_ON_BACKEND
};
}  // namespace layers
}  // namespace attnmix
