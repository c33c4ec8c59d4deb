#!/usr/bin/env bash
# Builds the examples and runs the demo. Usage: bash scripts/demo.sh [demo arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/dependencies.sh
attnmix_require_packages build-essential cmake ninja-build libeigen3-dev
cmake --workflow --preset demo
./build/demo/examples/demo "$@"
