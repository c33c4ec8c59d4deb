#!/usr/bin/env bash
# Configures, builds and runs the whole test suite (CUDA tests too when nvcc is on PATH; they
# report Skipped without a GPU). Usage: bash scripts/test.sh [workflow preset, default: default]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/dependencies.sh
attnmix_require_packages build-essential cmake ninja-build libeigen3-dev catch2 libbenchmark-dev nlohmann-json3-dev
cmake --workflow --preset "${1:-default}"
