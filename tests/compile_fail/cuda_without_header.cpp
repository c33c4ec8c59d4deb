// The CUDA backend needs <attnmix/cuda.cuh> in an nvcc-compiled translation unit.
#include <attnmix/attnmix.hpp>

void f(const attnmix::attention_args<float>& a) {
#ifdef ATTNMIX_SHOULD_FAIL
  attnmix::attention<attnmix::kind::softmax>(a, {}, attnmix::backend::cuda{});
#else
  attnmix::attention<attnmix::kind::softmax>(a, {}, attnmix::backend::cpu{});
#endif
}
