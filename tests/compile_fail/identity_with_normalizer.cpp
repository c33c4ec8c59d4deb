// A feature map that can go negative (identity) cannot be used with the normaliser on.
#include <attnmix/attnmix.hpp>

#ifdef ATTNMIX_SHOULD_FAIL
using policy = attnmix::with_feature_map<attnmix::bla_policy, attnmix::feature_map::identity>;
#else
using policy = attnmix::with_normalize<
    attnmix::with_feature_map<attnmix::bla_policy, attnmix::feature_map::identity>, false>;
#endif

void f(const attnmix::linear_attention_args<float>& a) {
  attnmix::linear_attention<attnmix::kind::bla, policy>(a);
}
