# Eigen >= 3.4 is required. Eigen 3.4's version file rejects version ranges and Eigen 5
# rejects a plain "3.4" request, so ask twice.
find_package(Eigen3 3.4 QUIET NO_MODULE)
if(NOT Eigen3_FOUND)
  find_package(Eigen3 5 QUIET NO_MODULE)
endif()
if(NOT Eigen3_FOUND)
  message(FATAL_ERROR "attnmix needs Eigen >= 3.4 (Eigen3Config.cmake not found).\n"
    "  Debian/Ubuntu: sudo apt-get install libeigen3-dev\n"
    "  Or pass -DEigen3_DIR=<prefix>/share/eigen3/cmake")
endif()

# nlohmann-json: only attnmix/io (safetensors) needs it, so it is optional; the attnmix::io
# target exists when it is found (Debian: nlohmann-json3-dev).
find_package(nlohmann_json 3 QUIET)

# CUDA backend. The library itself needs no CUDA language; nvcc is enabled only for the
# project's own CUDA tests and benchmarks, so a parent project never gets CUDA switched on.
set(ATTNMIX_HAS_CUDA OFF)
if(NOT ATTNMIX_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(ATTNMIX_HAS_CUDA ON)
  elseif(ATTNMIX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ATTNMIX_CUDA=ON but the CUDA Toolkit was not found. Put nvcc on PATH or "
      "pass -DCUDAToolkit_ROOT=/usr/local/cuda.")
  endif()
endif()

set(ATTNMIX_HAS_CUDA_COMPILER OFF)
if(ATTNMIX_HAS_CUDA AND (ATTNMIX_BUILD_TESTS OR ATTNMIX_BUILD_BENCHMARKS OR ATTNMIX_BUILD_EXAMPLES))
  include(CheckLanguage)
  check_language(CUDA)  # caches NOTFOUND: delete CMakeCache.txt after installing nvcc
  if(CMAKE_CUDA_COMPILER)
    if(ATTNMIX_CUDA_PTX_ONLY)
      # Built to prove they compile, never run here: PTX (code=compute_90a, JIT-compiled on
      # load), and their host code unoptimised.
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES 90a-virtual)
      endif()
      set(CMAKE_CUDA_FLAGS_RELEASE "-O0 -DNDEBUG")
    elseif(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a-real)  # exactly -gencode=arch=compute_90a,code=sm_90a
    endif()
    enable_language(CUDA)
    set(ATTNMIX_HAS_CUDA_COMPILER ON)
  elseif(ATTNMIX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ATTNMIX_CUDA=ON but no CUDA compiler was found. Put nvcc on PATH, set "
      "CUDACXX, or pass -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc (and delete CMakeCache.txt).")
  endif()
endif()
message(STATUS "attnmix: CUDA backend ${ATTNMIX_HAS_CUDA}, CUDA tests ${ATTNMIX_HAS_CUDA_COMPILER}"
               " (architectures: ${CMAKE_CUDA_ARCHITECTURES})")
