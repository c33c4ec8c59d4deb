#!/usr/bin/env bash
# Builds and runs the whole test suite, in two builds: the model, training and io tier and every
# bad-input test under AddressSanitizer and UndefinedBehaviorSanitizer (preset asan), then all
# the other tests in Release (preset default: the kernels' numerics, plans, headers, the consumer
# project, and the CUDA tests when nvcc is on PATH, which report Skipped without a GPU); then a
# bounded libFuzzer run of the safetensors parser (about a minute; preset fuzz, clang).
# Usage: bash scripts/test.sh [workflow preset]: with a preset, only that preset's workflow
# (every test it builds). ATTNMIX_FUZZ=0 skips the fuzz run. Without a GPU the default preset
# compiles the CUDA targets to PTX only (ATTNMIX_CUDA_PTX_ONLY): they are built to prove they
# compile, and their tests report Skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/dependencies.sh
attnmix_require_packages build-essential cmake ninja-build libeigen3-dev catch2 libbenchmark-dev \
  nlohmann-json3-dev clang libclang-rt-dev
if [ $# -gt 0 ]; then
  exec cmake --workflow --preset "$1"
fi
cmake --workflow --preset asan
ptx_only=ON
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then ptx_only=OFF; fi
# -O2 rather than Release's -O3: these tests compile a quarter faster and run as fast.
cmake --preset default -DATTNMIX_CUDA_PTX_ONLY=$ptx_only -DATTNMIX_TESTS=rest \
  -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" >/dev/null
cmake --build --preset default
ctest --preset default
if [ "${ATTNMIX_FUZZ:-1}" != 0 ]; then
  cmake --workflow --preset fuzz
fi
