// The plan of the CUDA softmax-family backward (include/attnmix/cuda/plan/attention_backward.hpp)
// on this CPU: tiles, grids, shared memory and scratch for the shapes the CUDA tests and
// benchmarks run, on an H200 (sm_90, 132 SMs, 227 KiB of opt-in shared memory) and on a device
// with 99 KiB. Pure host code: no CUDA header.

#include <algorithm>
#include <utility>
#include <vector>

#include "support/catch.hpp"

#include "attnmix/cuda/plan/attention_backward.hpp"

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

device_properties small_smem() {
  device_properties d = h200();
  d.cc_major = 8, d.cc_minor = 6, d.sms = 84;
  d.smem_per_block_optin = 99 * 1024, d.smem_per_sm = 100 * 1024;
  return d;
}

attention_backward_shape shape(index_t B, index_t T, index_t HQ, index_t H, index_t D, index_t Dv) {
  attention_backward_shape s;
  s.head_dim = D, s.value_dim = Dv, s.max_len = T;
  s.q_heads = HQ, s.kv_heads = H, s.sequences = B;
  return s;
}

}  // namespace

TEST_CASE("softmax backward plans: tiles, grids and shared memory", "[plan]") {
  SECTION("bench shapes") {
    const attention_backward_plan p =
        plan_attention_backward(shape(32, 2048, 32, 32, 64, 64), h200());
    CHECK(p.variant == attention_backward_variant::simt);
    CHECK(p.chunks == 2);
    CHECK(p.tile == 32);
    CHECK(p.dkdv == launch_grid{64, 32, 32});
    CHECK(p.dq == launch_grid{64, 32, 32});
    CHECK(p.preprocess == launch_grid{256, 32, 32});
    CHECK(p.gate == launch_grid{1, 32, 1});
    CHECK(p.fits);
    const attention_backward_plan w =
        plan_attention_backward(shape(8, 4096, 16, 16, 128, 128), h200());
    CHECK(w.chunks == 4);
    CHECK(w.tile == 32);
    CHECK(w.dkdv == launch_grid{128, 16, 8});
  }
  SECTION("GQA: a dk/dv CTA a KV head, a dq CTA a query head; tails round up") {
    const attention_backward_plan p = plan_attention_backward(shape(2, 37, 4, 2, 64, 64), h200());
    CHECK(p.dkdv == launch_grid{2, 2, 2});
    CHECK(p.dq == launch_grid{2, 4, 2});
    CHECK(p.preprocess == launch_grid{5, 4, 2});
    CHECK(plan_attention_backward(shape(1, 1, 33, 1, 32, 32), h200()).gate == launch_grid{2, 1, 1});
  }
  SECTION("widest head dims take 16-row tiles") {
    const attention_backward_plan p = plan_attention_backward(shape(1, 70, 2, 1, 200, 160), h200());
    CHECK(p.chunks == 8);
    CHECK(p.tile == 16);
    CHECK(p.dkdv == launch_grid{5, 1, 1});
    CHECK(p.fits);
  }
  SECTION("shared memory against what the device lets a block opt in to") {
    CHECK(attention_backward_smem_bytes(32, 64, 64) ==
          2 * 32 * 8 + 4 * (2 * 32 * 65 + 2 * 32 * 65 + 2 * 32 * 33 + 3 * 32));
    CHECK(plan_attention_backward(shape(1, 64, 1, 1, 128, 128), small_smem()).fits);
    CHECK(plan_attention_backward(shape(1, 64, 1, 1, 256, 256), h200()).fits);
    CHECK(plan_attention_backward(shape(1, 64, 1, 1, 256, 256), small_smem()).fits);
    device_properties tiny = small_smem();
    tiny.smem_per_block_optin = 64 * 1024;
    CHECK(plan_attention_backward(shape(1, 64, 1, 1, 64, 64), tiny).fits);
    CHECK_FALSE(plan_attention_backward(shape(1, 64, 1, 1, 128, 128), tiny).fits);
  }
}

TEST_CASE("softmax backward plans: tensor cores for 16-bit inputs at dims of 32s up to 128",
          "[plan]") {
  attention_backward_shape s = shape(32, 2048, 32, 32, 64, 64);
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);  // float
  s.sixteen_bit = true;
  const attention_backward_plan p = plan_attention_backward(s, h200());
  CHECK(p.variant == attention_backward_variant::sm80_mma);
  CHECK(p.tile == 32);
  CHECK(p.dkdv == launch_grid{64, 32, 32});
  for (auto [D, Dv] : {std::pair<index_t, index_t>{128, 128}, {128, 64}, {32, 96}}) {
    s.head_dim = D, s.value_dim = Dv;
    CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma);
  }
  for (auto [D, Dv] : {std::pair<index_t, index_t>{48, 64}, {64, 40}, {256, 256}, {16, 16}}) {
    s.head_dim = D, s.value_dim = Dv;
    CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);
  }
}

TEST_CASE("softmax backward plans: v2 tensor-core kernels for aligned 16-bit D = Dv in {64, 128}",
          "[plan]") {
  attention_backward_shape s = shape(32, 2048, 32, 32, 64, 64);
  s.sixteen_bit = true, s.aligned = true;
  const attention_backward_plan p = plan_attention_backward(s, small_smem());
  CHECK(p.variant == attention_backward_variant::sm80_mma_v2);
  CHECK(p.tile == 64);
  CHECK(p.threads == 128);
  CHECK(p.dkdv == launch_grid{32, 32, 32});
  CHECK(p.dq == launch_grid{32, 32, 32});
  CHECK(p.preprocess == launch_grid{256, 32, 32});
  CHECK(p.smem_bytes == 2 * (2 * 64 * 64 + 4 * 32 * 64) + 2 * 32 * 20 + 2 * 64 * 12);
  CHECK(p.fits);
  // On Hopper the same kernels on wgmma: 64-row streamed tiles, 1024-byte aligned.
  const attention_backward_plan h = plan_attention_backward(s, h200());
  CHECK(h.variant == attention_backward_variant::sm90_wgmma);
  CHECK(h.tile == 64);
  CHECK(h.threads == 128);
  CHECK(h.dkdv == p.dkdv);
  CHECK(h.dq == p.dq);
  CHECK(h.smem_bytes == 2 * (2 * 64 * 64 + 4 * 64 * 64) + 2 * 64 * 20 + 2 * 64 * 12 + 1024);
  s.portable = true;  // the portable knob keeps to the sm_80 kernels
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma_v2);
  const attention_backward_plan w = plan_attention_backward(
      [&] {
        attention_backward_shape x = shape(8, 4096, 16, 16, 128, 128);
        x.sixteen_bit = true, x.aligned = true;
        return x;
      }(),
      small_smem());
  CHECK(w.variant == attention_backward_variant::sm80_mma_v2);
  CHECK(w.dkdv == launch_grid{64, 16, 8});
  CHECK(w.smem_bytes == 2 * (2 * 64 * 128 + 4 * 32 * 128) + 2 * 32 * 20 + 2 * 64 * 12);
  CHECK(plan_attention_backward(shape(2, 37, 4, 2, 64, 64), h200()).threads == 256);

  // GQA: a dk/dv CTA a KV head, a dq CTA a query head; tails round up.
  attention_backward_shape g = shape(2, 130, 4, 2, 64, 64);
  g.sixteen_bit = true, g.aligned = true;
  CHECK(plan_attention_backward(g, h200()).dkdv == launch_grid{3, 2, 2});
  CHECK(plan_attention_backward(g, h200()).dq == launch_grid{3, 4, 2});

  // Elsewhere the older variants.
  for (auto [D, Dv] : {std::pair<index_t, index_t>{128, 64}, {64, 128}, {32, 32}, {96, 96}}) {
    s.head_dim = D, s.value_dim = Dv;
    CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma);
  }
  s.head_dim = s.value_dim = 64;
  s.aligned = false;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma);
  s.aligned = true, s.sixteen_bit = false;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);
  s.sixteen_bit = true;
  device_properties tiny = small_smem();
  tiny.smem_per_block_optin = 64 * 1024;
  s.head_dim = s.value_dim = 128;
  CHECK(plan_attention_backward(s, tiny).variant == attention_backward_variant::sm80_mma);
  CHECK(plan_attention_backward(s, small_smem()).variant ==
        attention_backward_variant::sm80_mma_v2);
}

TEST_CASE("softmax backward plans: a forced variant where it applies", "[plan]") {
  attention_backward_shape s = shape(1, 300, 2, 1, 64, 64);
  s.sixteen_bit = true, s.aligned = true, s.forced = true;
  s.force = attention_backward_variant::sm80_mma;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma);
  CHECK(plan_attention_backward(s, h200()).tile == 32);
  CHECK(plan_attention_backward(s, h200()).threads == 256);
  s.force = attention_backward_variant::simt;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);
  s.force = attention_backward_variant::sm80_mma_v2;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma_v2);
  s.force = attention_backward_variant::sm90_wgmma;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm90_wgmma);
  CHECK(plan_attention_backward(s, small_smem()).variant ==
        attention_backward_variant::sm80_mma_v2);          // not Hopper: the plan's own choice
  s.force = attention_backward_variant::sm90_wgmma_fused;  // dQ in the dk/dv kernel
  const attention_backward_plan f = plan_attention_backward(s, h200());
  CHECK(f.variant == attention_backward_variant::sm90_wgmma_fused);
  CHECK(f.dq_tiles == 5);  // 300 rows
  // dS^T (bf16), dQ (float) and the warps' row sums (float).
  CHECK(f.smem_bytes ==
        attention_backward_v2_smem_bytes(64, true) + 64 * 64 * 2 + 64 * 64 * 4 + 4 * 64 * 4);
  CHECK(plan_attention_backward(s, small_smem()).variant ==
        attention_backward_variant::sm80_mma_v2);
  s.force = attention_backward_variant::sm80_mma_v2;
  s.head_dim = 48;  // v2 does not apply: the plan's own choice
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);
  s.head_dim = 32, s.value_dim = 32, s.force = attention_backward_variant::sm80_mma_v2;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm80_mma);
  s.sixteen_bit = false, s.force = attention_backward_variant::sm80_mma;  // float: simt only
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::simt);
}

// The fused kernel's turns: for every 64-row tile, the key blocks whose walks include it (from
// their first row rounded down to 64, to their end row) are one run of blocks, and
// backward_first_block_at finds its first from any block of the run. Their turns
// (backward_turn) are 0, 1, ... in the order the blocks launch (causal: the last block first,
// and the last block at a tile is the one that starts there).
TEST_CASE("softmax backward, fused dQ: the key blocks at a row tile are a run", "[plan]") {
  using attnmix::detail::cuda::backward_end_row;
  using attnmix::detail::cuda::backward_first_block_at;
  using attnmix::detail::cuda::backward_first_row;
  using attnmix::detail::cuda::backward_turn;
  for (index_t length : {1, 63, 64, 65, 300, 1000})
    for (index_t W : {0, 1, 5, 64, 65, 200, 5000})
      for (bool causal : {true, false}) {
        const index_t blocks = (length + 63) / 64;
        for (index_t i0 = 0; i0 < length; i0 += 64) {
          std::vector<index_t> at;
          for (index_t j = 0; j < blocks; ++j)
            if (backward_first_row(64 * j, W, causal) / 64 * 64 <= i0 &&
                backward_end_row(std::min(64 * j + 64, length), W, length) > i0)
              at.push_back(j);
          INFO("length " << length << " W " << W << " causal " << causal << " tile " << i0);
          REQUIRE(!at.empty());  // a row sees at least one key
          CHECK(at.back() - at.front() + 1 == index_t(at.size()));
          for (index_t j : at) CHECK(backward_first_block_at(i0, j, W, length) == at.front());
          for (index_t j : at) {
            const index_t turn = backward_turn(i0, j, W, length, causal);
            // Launched in blockIdx order: causal, blockIdx = blocks - 1 - j.
            const index_t launched = causal ? blocks - 1 - j : j;
            const index_t first_launched = causal ? blocks - 1 - at.back() : at.front();
            CHECK(turn == launched - first_launched);
          }
        }
      }
}

TEST_CASE("softmax backward scratch: offsets, delta, gate sums, G and resets", "[plan]") {
  attnmix::attention_problem p{};
  p.batch = 2, p.tokens = 100, p.q_heads = 4, p.kv_heads = 2, p.head_dim = p.value_dim = 64;
  p.num_sequences = 2;
  const attention_backward_scratch_layout plain(p, false);
  CHECK(plain.delta == 0);
  CHECK(plain.colsum == 3328);  // 800 floats, padded to 256 bytes
  CHECK(plain.bytes == plain.colsum + scratch_alignment);
  const attention_backward_scratch_layout gated(p, true);
  CHECK(gated.rowsum == gated.colsum + 3328);
  CHECK(gated.gate == gated.rowsum + 3328);
  CHECK(gated.reset == gated.gate + 6400);  // 800 doubles
  CHECK(gated.bytes == gated.reset + 3328 + scratch_alignment);
  // Fused: the float dQ sums (800 rows of D = 64) and the turns (2 sequences x 4 heads x 2 tiles).
  const attention_backward_scratch_layout fused(p, true, 2);
  CHECK(fused.dq_acc == gated.reset + 3328);
  CHECK(fused.dq_acc_bytes == 800 * 64 * 4);
  CHECK(fused.dq_turn == fused.dq_acc + 800 * 64 * 4);
  CHECK(fused.dq_turn_bytes == 2 * 4 * 2 * 4);
  CHECK(fused.bytes == fused.dq_turn + 256 + scratch_alignment);
  const std::int32_t offsets[] = {0, 50, 200};
  attnmix::attention_problem packed = p;
  packed.batch = 1, packed.tokens = 200, packed.cu_seqlens = offsets;
  CHECK(attention_backward_scratch_layout(packed, true).delta == 256);
}

TEST_CASE("softmax backward with keys of other lengths: CUDA cores, key tiles of the keys",
          "[plan]") {
  attention_backward_shape s = shape(2, 37, 4, 2, 64, 64);
  s.sixteen_bit = s.aligned = true;
  CHECK(plan_attention_backward(s, h200()).variant == attention_backward_variant::sm90_wgmma);
  s.keys_differ = true, s.max_key_len = 300;
  s.forced = true, s.force = attention_backward_variant::sm80_mma;
  const attention_backward_plan p = plan_attention_backward(s, h200());
  CHECK(p.variant == attention_backward_variant::simt);
  CHECK(p.dkdv == launch_grid{10, 2, 2});  // 300 keys in tiles of 32
  CHECK(p.dq == launch_grid{2, 4, 2});     // 37 queries
  // The keys' own offsets are copied after the queries'.
  const std::int32_t cu[] = {0, 10, 37}, cu_k[] = {0, 100, 300};
  attnmix::attention_problem q{};
  q.batch = 1, q.tokens = 37, q.q_heads = 4, q.kv_heads = 2, q.head_dim = q.value_dim = 64;
  q.num_sequences = 2, q.cu_seqlens = cu, q.cu_seqlens_k = cu_k, q.key_tokens = 300;
  q.key_batch = 1;
  const attention_backward_scratch_layout l(q, false);
  CHECK(l.keys == 256);
  CHECK(l.delta == 512);
  q.cu_seqlens_k = cu;  // the same offsets: one copy
  CHECK(attention_backward_scratch_layout(q, false).delta == 256);
}
