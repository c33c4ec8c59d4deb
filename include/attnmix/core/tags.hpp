#pragma once
// Backend and kind tags. Backends are objects because they carry runtime state (a thread
// count, a CUDA stream); kinds are empty types that only select code.
//
// A backend tag is any struct with a `name` and a `memory_space` (host_space or device_space):
// is_backend_v detects them, so a new backend is its tag plus its specialisations.

#include "attnmix/core/memory_space.hpp"

namespace attnmix {

namespace backend {

// Eigen on the host. threads = 0 uses std::thread::hardware_concurrency().
struct cpu {
  using memory_space = host_space;
  int threads = 0;
  static constexpr const char* name = "cpu";
};

// CUDA on the current device. `stream` is a cudaStream_t (nullptr: the legacy default stream),
// kept as void* so that host-only translation units can name the tag.
struct cuda {
  using memory_space = device_space;
  void* stream = nullptr;
  // true: only kernels that every supported GPU runs (mma.sync, not Hopper's wgmma), to compare
  // them or test them on a Hopper GPU.
  bool portable = false;
  static constexpr const char* name = "cuda";
};

}  // namespace backend

namespace kind {

struct softmax {  // softmax attention (SA)
  static constexpr const char* name = "softmax";
};
struct fox {  // Forgetting Transformer attention: SA plus a cumulative log forget gate bias
  static constexpr const char* name = "fox";
};
struct path {  // PaTH: SA whose scores pass through accumulated Householder transforms
  static constexpr const char* name = "path";
};
struct path_fox {  // PaTH plus the FoX forget gate
  static constexpr const char* name = "path_fox";
};
struct bla {  // bidirectional linear attention
  static constexpr const char* name = "bla";
};
struct gbla {  // gated BLA: key gate and gated RMSNorm on top of BLA
  static constexpr const char* name = "gbla";
};
struct linear_causal {  // causal linear attention with a recurrent state
  static constexpr const char* name = "linear_causal";
};

}  // namespace kind
}  // namespace attnmix
