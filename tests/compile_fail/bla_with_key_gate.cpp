// kind::bla has no key gate or gated norm; those belong to kind::gbla.
#include <attnmix/attnmix.hpp>

#ifdef ATTNMIX_SHOULD_FAIL
using kind = attnmix::kind::bla;
#else
using kind = attnmix::kind::gbla;
#endif

void f(const attnmix::linear_attention_args<float>& a) {
  attnmix::linear_attention<kind, attnmix::gbla_policy>(a);
}
