#!/usr/bin/env bash
# Builds the examples and runs hybrid_encoder: the [SA, GBLA, GBLA] x 3 encoder beside an SA-only
# one, at a length where the hybrid's linear-attention layers beat softmax (about 2x, some 20 s
# on 2 cores once built).
# Usage: bash scripts/demo.sh [T B D heads threads]  (default 8192 2 256 4)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/dependencies.sh
attnmix_require_packages build-essential cmake ninja-build libeigen3-dev nlohmann-json3-dev
cmake --workflow --preset demo
./build/demo/examples/hybrid_encoder "$@"
