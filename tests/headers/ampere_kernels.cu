// The CUDA kernels must keep building for Ampere (sm_80), which runs the portable mma.sync paths:
// this translation unit instantiates the front doors in half and bfloat16 and is compiled for
// 80-real only. Nothing here runs.

#include <attnmix/cuda.cuh>

namespace attnmix_ampere_check {

template <class T>
void instantiate(const attnmix::attention_args<T>& a, const attnmix::linear_attention_args<T>& la,
                 attnmix::device_path_cache<float>& cache) {
  const attnmix::backend::cuda be{};
  attnmix::attention<attnmix::kind::softmax>(a, {}, be);
  attnmix::attention<attnmix::kind::fox>(a, {}, be);
  attnmix::attention<attnmix::kind::path>(a, {}, be);
  attnmix::attention<attnmix::kind::path_fox>(a, {}, be);
  attnmix::path_decode_step<attnmix::kind::path_fox>(cache, a, {}, {}, be);
  attnmix::linear_attention<attnmix::kind::bla>(la, {}, be);
  attnmix::linear_attention<attnmix::kind::gbla>(la, {}, be);
  attnmix::linear_attention<attnmix::kind::linear_causal>(la, {}, be);
}

template void instantiate<attnmix::half>(const attnmix::attention_args<attnmix::half>&,
                                         const attnmix::linear_attention_args<attnmix::half>&,
                                         attnmix::device_path_cache<float>&);
template void instantiate<attnmix::bfloat16>(
    const attnmix::attention_args<attnmix::bfloat16>&,
    const attnmix::linear_attention_args<attnmix::bfloat16>&, attnmix::device_path_cache<float>&);

}  // namespace attnmix_ampere_check
