// The CPU backend computes in float or double only.
#include <attnmix/attnmix.hpp>

#ifdef ATTNMIX_SHOULD_FAIL
using scalar = attnmix::bfloat16;
#else
using scalar = float;
#endif

void f(const attnmix::attention_args<scalar>& a) {
  attnmix::attention<attnmix::kind::softmax>(a);
}
