#!/bin/sh
# Runs the CUDA PaTH backward kernels (include/attnmix/cuda/kernels/path_backward_simt.cuh) on
# the CPU, one thread per CTA, against the CPU backward: a check of their algebra and indexing
# that needs no GPU. Each element loop runs forwards and then backwards; the two outputs must be
# identical (an element of a pass that read another's result would differ). Not a race checker
# across passes: that is what the __syncthreads between passes are for.
#   scripts/path_backward_emulation/run.sh   (from the repository root; about 2 minutes)
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${TMPDIR:-/tmp}/attnmix_path_backward_emulation
mkdir -p "$work"
cp "$here/prelude.hpp" "$here/emu.cpp" "$work/"
python3 - "$root" "$work" <<'PY'
import re, sys
root, work = sys.argv[1], sys.argv[2]
s = open(root + '/include/attnmix/cuda/kernels/path_backward_simt.cuh').read()
s = re.sub(r'#include "attnmix/cuda/arch/types.cuh"\n#include "attnmix/cuda/kernels/attention_params.cuh"\n'
           r'#include "attnmix/cuda/kernels/path_simt.cuh"\n#include "attnmix/cuda/kernels/shapes.hpp"',
           '#include "prelude.hpp"', s)
assert 'prelude' in s
s = re.sub(r'__global__\s+void\s+__launch_bounds__\(\d+\)\s*', 'void ', s)
s = s.replace('extern __shared__ float smem[];', 'float* smem = emu_smem_buf.data();')
s = s.replace('__device__ ', '').replace('__forceinline__', 'inline')
s = s.replace('isinf(', 'std::isinf(').replace('expf(', 'std::exp(')
old = """  const int total = rows * cols;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) f(idx / cols, idx % cols);"""
assert old in s
s = s.replace(old, """  const int total = rows * cols;
  if (emu_reverse) {
    for (int idx = total - 1; idx >= 0; --idx) f(idx / cols, idx % cols);
    return;
  }
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) f(idx / cols, idx % cols);""")
open(work + '/kernels.hpp', 'w').write(s)
PY
g++ -std=c++17 -O2 -I"$work" -I"$root/tests" -I"$root/include" -isystem /usr/include/eigen3 \
  "$work/emu.cpp" -o "$work/emu"
seed=${ATTNMIX_TEST_SEED:-5}
ATTNMIX_TEST_SEED=$seed "$work/emu" > "$work/forward.txt"
ATTNMIX_TEST_SEED=$seed EMU_REVERSE=1 "$work/emu" > "$work/reverse.txt"
cat "$work/forward.txt"
cmp -s "$work/forward.txt" "$work/reverse.txt" && echo "element order: identical" || { echo "element order: DIFFERS"; exit 1; }
