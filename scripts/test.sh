#!/usr/bin/env bash
# Configures, builds and runs the whole test suite (CUDA tests too when nvcc is on PATH; they
# report Skipped without a GPU), then a bounded libFuzzer run of the safetensors parser (about a
# minute; preset fuzz, clang). Usage: bash scripts/test.sh [workflow preset, default: default]
# (a preset other than default skips the fuzz run; ATTNMIX_FUZZ=0 skips it too). Without a GPU
# the default preset compiles the CUDA targets to PTX only (ATTNMIX_CUDA_PTX_ONLY): they are
# built to prove they compile, and their tests report Skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/dependencies.sh
attnmix_require_packages build-essential cmake ninja-build libeigen3-dev catch2 libbenchmark-dev \
  nlohmann-json3-dev clang libclang-rt-dev
if [ "${1:-default}" = default ]; then
  ptx_only=ON
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then ptx_only=OFF; fi
  cmake --preset default -DATTNMIX_CUDA_PTX_ONLY=$ptx_only >/dev/null
fi
cmake --workflow --preset "${1:-default}"
if [ "${1:-default}" = default ] && [ "${ATTNMIX_FUZZ:-1}" != 0 ]; then
  cmake --workflow --preset fuzz
fi
