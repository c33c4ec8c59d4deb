#pragma once
// The device memory space's pointer check for every front door: a view that claims device memory
// must really point to it (a host pointer handed to a kernel is an illegal address, not an error
// message). The front doors run it once over their argument list, after every other check.

#include <string>

#include "attnmix/core/memory_space.hpp"
#include "attnmix/core/validate.hpp"
#include "attnmix/cuda/runtime/error.cuh"

namespace attnmix {
namespace detail {

template <>
struct pointer_check<device_space> {
  static void run(const std::string& fn, const arg_list& args) {
    for (const tensor_arg& a : args)
      if (a.given && a.size() > 0 && a.space == memory_space::device)
        require(cuda::is_device_pointer(a.data), fn, a.name,
                "is marked as device memory but its pointer is not device memory");
  }
};

}  // namespace detail
}  // namespace attnmix
