// The plan of the CUDA PaTH backward (include/attnmix/cuda/plan/path_backward.hpp) on this CPU:
// slices, grids, shared memory against the device's limit, and the scratch layout (aligned,
// disjoint parts, the zeroed range, the size the benchmark reports), the choice of the tiled or
// tensor-core kernels and its override. Pure host code.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "support/catch.hpp"

#include "attnmix/cuda/plan/path_backward.hpp"

namespace {

using namespace attnmix::detail::cuda;
using attnmix::index_t;

device_properties h200() {
  device_properties d;
  d.sms = 132, d.cc_major = 9, d.cc_minor = 0;
  d.smem_per_block = 48 * 1024, d.smem_per_block_optin = 227 * 1024;
  d.smem_per_sm = 228 * 1024, d.registers_per_sm = 65536;
  d.max_grid_y = d.max_grid_z = 65535;
  return d;
}

path_shape shape(index_t B, index_t T, index_t HQ, index_t H, index_t D, index_t Dv) {
  path_shape s;
  s.batch = B, s.tokens = T, s.max_len = T, s.sequences = B;
  s.q_heads = HQ, s.kv_heads = H, s.head_dim = D, s.value_dim = Dv;
  return s;
}

}  // namespace

TEST_CASE("PaTH backward plan: slices cover the SMs twice, at most 8, at least 4 chunks each",
          "[plan][path][backward]") {
  // Many heads: one slice.
  CHECK(plan_path_backward(shape(32, 2048, 32, 32, 64, 64), false, h200()).slices == 1);
  // B H = 128 on 132 SMs: 3 slices for 264 CTAs.
  CHECK(plan_path_backward(shape(4, 16384, 32, 32, 64, 64), false, h200()).slices == 3);
  // Few heads: capped at 8.
  CHECK(plan_path_backward(shape(1, 131072, 8, 8, 64, 64), true, h200()).slices == 8);
  // Short sequences: no slice shorter than 4 chunks.
  CHECK(plan_path_backward(shape(1, 200, 2, 1, 64, 64), false, h200()).slices == 1);
  CHECK(plan_path_backward(shape(1, 1100, 2, 1, 64, 64), false, h200()).slices == 4);
  CHECK(plan_path_backward(shape(1, 0, 2, 1, 64, 64), false, h200()).slices == 1);
}

TEST_CASE("PaTH backward plan: grids and shared memory", "[plan][path][backward]") {
  const path_backward_plan p = plan_path_backward(shape(2, 1100, 4, 2, 64, 64), true, h200());
  CHECK(p.query_grid.x == unsigned(p.slices));
  CHECK(p.query_grid.y == 2u);
  CHECK(p.query_grid.z == 2u);
  CHECK(p.chunk_grid.x == 18u);  // ceil(1100 / 64)
  CHECK(p.gate_grid.x == 1u);
  CHECK(p.gate_grid.y == 2u);
  CHECK(p.fits);
  CHECK(p.query_smem == 4 * (4 * 64 * 65 + 5 * 64 * 65 + 4 * 64));
  // The tiled chunk kernel: dK~ / Lbar, dW, dU, dM, WW, XK and beta (two CTAs an SM).
  CHECK(p.chunk_smem == 4 * (6 * 64 * 65 + 64));
  CHECK(2 * (p.chunk_smem + 1024) <= 228 * 1024);
  // D = 128 fits an H200's 227 KB but not an sm_80 device's 163 KB.
  CHECK(plan_path_backward(shape(1, 100, 1, 1, 128, 128), false, h200()).fits);
  device_properties small = h200();
  small.smem_per_block_optin = 163 * 1024;
  CHECK_FALSE(plan_path_backward(shape(1, 100, 1, 1, 128, 128), false, small).fits);
  CHECK(plan_path_backward(shape(1, 100, 1, 1, 64, 64), false, small).fits);
  // The forward's float chunk preparation.
  CHECK(p.forward.variant == path_variant::simt);
  CHECK(p.forward.prepare_dim == 64);
}

TEST_CASE("PaTH backward plan: the scratch layout", "[plan][path][backward]") {
  for (bool gated : {false, true}) {
    const path_shape s = shape(2, 1100, 4, 2, 40, 24);
    const path_backward_plan p = plan_path_backward(s, gated, h200());
    const path_backward_layout& l = p.layout;
    const auto rows = std::size_t(2 * 2 * 1100), S = std::size_t(p.slices);
    CHECK(l.slice_d >= rows * 40 * 4);
    CHECK(l.slice_dv >= rows * 24 * 4);
    std::vector<std::pair<std::size_t, std::size_t>> parts = {
        {0, p.forward.chunks.bytes}, {l.dkt, S * l.slice_d},    {l.dw, S * l.slice_d},
        {l.du, S * l.slice_d},       {l.dv, S * l.slice_dv},    {l.dk, rows * 40 * 4},
        {l.dm, rows * 64 * 4},       {l.states, S * l.slice_d}, {l.e, S * l.slice_d}};
    if (gated) {
      const std::size_t g = 2 * 1100 * 4;
      CHECK(l.slice_gate >= g * 8);
      parts.push_back({l.dgate, S * l.slice_gate});
      parts.push_back({l.gate, g * 8});
      parts.push_back({l.reset, g * 4});
    }
    std::sort(parts.begin(), parts.end());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      CHECK(parts[i].first % 256 == 0);
      if (i + 1 < parts.size()) CHECK(parts[i].first + parts[i].second <= parts[i + 1].first);
    }
    CHECK(parts.back().first + parts.back().second <= p.scratch_bytes);
    // The sums that start at 0 form one range: dK~, dW, dU, dv, dk, dM (and dG).
    CHECK(l.zeroed == l.dkt);
    CHECK(l.zeroed + l.zeroed_bytes ==
          (gated ? l.dgate + S * l.slice_gate : l.dm + padded_bytes(rows * 64 * 4)));
  }
}

TEST_CASE("PaTH backward plan: extra memory is O(B T H D)", "[plan][path][backward]") {
  // bench_path_cuda's report: per slice 5 [rows, D] parts and one [rows, Dv], plus dk, dM and the
  // chunk data once.
  const path_backward_plan p = plan_path_backward(shape(4, 16384, 32, 32, 64, 64), true, h200());
  const double rows = 4.0 * 32 * 16384;
  const double floats = rows * (3 * (5 * 64 + 64) + 64 + 64 + 64 + 64 + 64);
  CHECK(double(p.scratch_bytes) >= 4 * floats);
  CHECK(double(p.scratch_bytes) <= 4 * floats * 1.01 + 4.0 * rows * 8);
}

TEST_CASE("PaTH backward plan: the query kernel, tiled for float inputs and every head dim",
          "[plan][path][backward]") {
  const path_shape s = shape(2, 1100, 4, 2, 64, 64);
  const path_backward_plan a = plan_path_backward(s, true, h200());
  CHECK(a.query_kernel == path_backward_kernel::tiled);
  CHECK(plan_path_backward(s, true, h200(), path_backward_kernel::tiled).query_kernel ==
        path_backward_kernel::tiled);
  // Every shape, odd head dims included.
  CHECK(plan_path_backward(shape(1, 100, 2, 2, 40, 24), false, h200(), path_backward_kernel::tiled)
            .query_kernel == path_backward_kernel::tiled);
  CHECK(plan_path_backward(shape(1, 100, 1, 1, 17, 9), false, h200(), path_backward_kernel::tiled)
            .query_kernel == path_backward_kernel::tiled);
  CHECK(a.query_smem == path_backward_query_smem(64));
  CHECK(a.chunk_smem == path_backward_chunk_tiled_smem(64));
  // Forcing the tensor-core kernel where it does not apply (float) changes nothing.
  const path_backward_plan f = plan_path_backward(s, true, h200(), path_backward_kernel::mma);
  CHECK(f.query_kernel == path_backward_kernel::tiled);
  CHECK(f.slices == a.slices);
  CHECK(f.query_smem == a.query_smem);
  CHECK(f.chunk_smem == a.chunk_smem);
  CHECK(f.scratch_bytes == a.scratch_bytes);
  CHECK(f.query_grid.x == a.query_grid.x);
  // The launcher's override starts automatic.
  CHECK(path_backward_kernel_override() == path_backward_kernel::automatic);
}

TEST_CASE("PaTH backward plan: the tensor-core query kernel for 16-bit inputs at D = Dv = 64",
          "[plan][path][backward]") {
  path_shape s = shape(2, 1100, 4, 2, 64, 64);
  s.sixteen_bit = true;
  const path_backward_plan m = plan_path_backward(s, true, h200());
  CHECK(m.query_kernel == path_backward_kernel::mma);
  CHECK(m.query_smem == std::size_t(path_bwd_mma_layout::smem));
  CHECK(m.query_smem <= 227 * 1024);
  CHECK(m.fits);
  // The same grids as the tiled kernels.
  const path_backward_plan t = plan_path_backward(s, true, h200(), path_backward_kernel::tiled);
  CHECK(t.query_kernel == path_backward_kernel::tiled);
  CHECK(m.chunk_smem == std::size_t(path_bwd_mma_layout::chunk_smem));
  CHECK(m.chunk_smem <= 227 * 1024);
  CHECK(t.query_grid.x == m.query_grid.x);
  CHECK(t.layout.trans == 0);
  CHECK(t.layout.dtrans == 0);
  CHECK(t.layout.khat == 0);
  CHECK(t.layout.dpis == 0);
  const path_backward_layout& l = m.layout;
  const auto S = std::size_t(m.slices);
  // Slices cut at super-chunks: one copy of dK~, dW, dU (and dP), where the tiled kernels keep one
  // a slice; dPi in rows / 8 + 64 rows.
  CHECK(l.own_copies == 1);
  CHECK(t.layout.own_copies == int(S));
  CHECK(l.slice_pi == padded_bytes((2 * 2 * 1100 / 8 + 64) * 64 * 4));
  CHECK(m.scratch_bytes + 3 * (S - 1) * l.slice_d ==
        t.scratch_bytes + (S + 3) * l.slice_d + (S + 1) * l.slice_pi);
  CHECK(l.dw - l.dkt == l.slice_d);
  // Zeroed: dP, dK^ (a slice), dPi (a slice); once, after the zeroed range: N, K^, I - Pi.
  std::vector<std::pair<std::size_t, std::size_t>> parts = {
      {l.dtrans, l.slice_d}, {l.dkhat, S * l.slice_d}, {l.dpis, S * l.slice_pi},
      {l.trans, l.slice_d},  {l.khat, l.slice_d},      {l.pis, l.slice_pi}};
  for (std::size_t i = 0; i < parts.size(); ++i) {
    CHECK(parts[i].first % 256 == 0);
    CHECK(parts[i].first + parts[i].second <= m.scratch_bytes);
    if (i < 3) CHECK(parts[i].first >= l.zeroed);
    if (i < 3) CHECK(parts[i].first + parts[i].second <= l.zeroed + l.zeroed_bytes);
    if (i >= 3) CHECK(parts[i].first >= l.zeroed + l.zeroed_bytes);
    for (std::size_t k = 0; k < i; ++k)
      CHECK((parts[k].first + parts[k].second <= parts[i].first ||
             parts[i].first + parts[i].second <= parts[k].first));
  }
  // Super-chunks of eight chunks: 1100 tokens are 18 chunks, 3 super-chunks.
  CHECK(path_bwd_mma_layout::super == 8);
  CHECK(m.super_grid.x == 3u);
  CHECK(m.super_grid.y == 2u);
  CHECK(m.super_grid.z == 2u);
  // Elsewhere the tiled ones, forced or not: float, D = 128, D != Dv, a device before sm_80 or
  // with too little shared memory.
  const auto pick = [](path_shape x, const device_properties& d) {
    return plan_path_backward(x, false, d, path_backward_kernel::mma).query_kernel;
  };
  path_shape f = s;
  f.sixteen_bit = false;
  CHECK(pick(f, h200()) == path_backward_kernel::tiled);
  path_shape wide = shape(1, 100, 1, 1, 128, 128);
  wide.sixteen_bit = true;
  CHECK(pick(wide, h200()) == path_backward_kernel::tiled);
  path_shape odd = shape(1, 100, 1, 1, 64, 32);
  odd.sixteen_bit = true;
  CHECK(pick(odd, h200()) == path_backward_kernel::tiled);
  device_properties old = h200();
  old.cc_major = 7;
  CHECK(pick(s, old) == path_backward_kernel::tiled);
  device_properties small = h200();
  small.smem_per_block_optin = 163 * 1024;
  CHECK(pick(s, small) == path_backward_kernel::tiled);
}
