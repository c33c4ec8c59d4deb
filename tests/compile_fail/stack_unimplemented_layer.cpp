// A stack whose layer has no implementation on the chosen backend does not compile, and the
// message names the layer.
#include <attnmix/attnmix.hpp>

#ifdef ATTNMIX_SHOULD_FAIL
using backend_t = attnmix::backend::cuda;  // no GBLA on CUDA (and no CUDA header included)
#else
using backend_t = attnmix::backend::cpu;
#endif

using encoder = attnmix::basic_stack<float, attnmix::stack_policy, backend_t, attnmix::layer::sa,
                                     attnmix::layer::gbla>;

int main() {
  encoder e(attnmix::layers::config{});
  return static_cast<int>(e.num_layers);
}
