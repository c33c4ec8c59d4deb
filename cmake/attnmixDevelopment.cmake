# Settings for attnmix's own tests, benchmarks and examples; never exported.
find_program(ATTNMIX_CCACHE ccache)
if(ATTNMIX_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${ATTNMIX_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${ATTNMIX_CCACHE})
endif()

add_library(attnmix_dev INTERFACE)
target_link_libraries(attnmix_dev INTERFACE attnmix::attnmix)
target_compile_options(attnmix_dev INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>
  # GCC 12 reports false positives inside Eigen's AVX-512 intrinsics.
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-maybe-uninitialized>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
if(ATTNMIX_NATIVE_ARCH)
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=native ATTNMIX_HAS_MARCH_NATIVE)
  if(ATTNMIX_HAS_MARCH_NATIVE)
    target_compile_options(attnmix_dev INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
endif()
