// FoX has no bidirectional form: asking for one is a compile-time error.
#include <attnmix/attnmix.hpp>

void f(const attnmix::attention_args<float>& a) {
#ifdef ATTNMIX_SHOULD_FAIL
  using policy = attnmix::with_mask<attnmix::fox_policy, attnmix::mask_type::bidirectional>;
#else
  using policy = attnmix::fox_policy;
#endif
  attnmix::attention<attnmix::kind::fox, policy>(a);
}
