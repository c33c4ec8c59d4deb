// The plan of the CUDA linear-attention backward (include/attnmix/cuda/plan/linear_backward.hpp)
// on this CPU: token ranges, causal chunks, shared memory, grids and the scratch layout, on an
// H200 (132 SMs) and on a device with only the default 48 KiB of shared memory a block.

#include "support/catch.hpp"

#include "attnmix/cuda/plan/linear_backward.hpp"

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
  d.smem_per_block_optin = 48 * 1024;
  return d;
}

linear_backward_shape bidirectional(index_t B, index_t T, index_t H, index_t D) {
  linear_backward_shape s;
  s.gated = s.normed = true;
  s.shared_gate_sum = H > 1;
  s.batch = B, s.tokens = T, s.head_dim = s.value_dim = D, s.max_len = T;
  s.sequences = B, s.kv_heads = s.q_heads = H, s.gate_heads = 1;
  return s;
}

}  // namespace

TEST_CASE("linear backward: register budget and tiles", "[plan][linear_backward]") {
  CHECK(linear_bwd_state_regs * linear_bwd_threads >=
        linear_bwd_max_dim * linear_bwd_max_dim + linear_bwd_max_dim);
  CHECK(linear_bwd_tile * 32 == linear_bwd_threads);
}

TEST_CASE("linear backward: bidirectional token ranges", "[plan][linear_backward]") {
  SECTION("the benchmark shape: B H = 128 pairs fill the GPU with 5 ranges of 1639 tokens") {
    const linear_backward_plan p = plan_linear_backward(bidirectional(8, 8192, 16, 64), h200());
    CHECK(p.parts == 5);
    CHECK(p.part_tokens == 1639);
    CHECK(p.parts * p.part_tokens >= 8192);
    CHECK(p.reduce_grid == launch_grid{5, 16, 8});
    CHECK(p.pass_grid == p.reduce_grid);
    CHECK(p.key_grid == p.pass_grid);  // the CUDA-core key pass keeps the query pass's ranges
    CHECK(p.key_part_tokens == p.part_tokens);
    CHECK(p.combine_grid == launch_grid{16, 8, 17});  // (64 * 64 + 64) / 256 slices
    CHECK(p.jac_grid == launch_grid{16, 8, 1});
    CHECK(p.stats_grid == launch_grid{1, 8, 1});
  }
  SECTION("one long sequence: at most linear_bwd_max_parts ranges") {
    const linear_backward_plan p = plan_linear_backward(bidirectional(1, 100000, 1, 64), h200());
    CHECK(p.parts == linear_bwd_max_parts);
    CHECK(p.parts * p.part_tokens >= 100000);
  }
  SECTION("short sequences: one range, at least one token") {
    CHECK(plan_linear_backward(bidirectional(1, 100, 1, 64), h200()).parts == 1);
    const linear_backward_plan p = plan_linear_backward(bidirectional(1, 0, 1, 64), h200());
    CHECK(p.parts == 1);
    CHECK(p.part_tokens == 1);
  }
  SECTION("shared memory of the passes fits the default limit at D = Dv = 128") {
    const linear_backward_plan p = plan_linear_backward(bidirectional(2, 300, 2, 128), h200());
    CHECK(p.reduce_smem == 8 * (128 + 128 + 1) * 4);
    CHECK(p.pass_a_smem == 8 * (6 * 128 + 2) * 4);
    CHECK(p.pass_b_smem == 8 * (4 * 128 + 1) * 4);
    CHECK(std::size_t(p.pass_a_smem) <= h200().smem_per_block);
  }
}

TEST_CASE("linear backward: bidirectional scratch", "[plan][linear_backward]") {
  linear_backward_shape s = bidirectional(2, 1000, 4, 64);
  s.offsets_bytes = 256;
  const linear_backward_plan p = plan_linear_backward(s, h200());
  const linear_backward_scratch& sc = p.scratch;
  const std::size_t state = std::size_t(64 * 64 + 64) * 4;
  CHECK(p.state_size == 64 * 64 + 64);
  CHECK(sc.offsets == 0);
  CHECK(sc.stats == 256);
  CHECK(sc.state == sc.stats + 256);
  CHECK(sc.partial == sc.state + padded_bytes(2 * 4 * state));
  CHECK(sc.dstate == sc.partial + padded_bytes(std::size_t(2 * p.parts * 4) * state));
  CHECK(sc.jac == sc.dstate + padded_bytes(2 * 4 * state));
  CHECK(sc.dgamma == sc.jac + 256);
  CHECK(sc.da_heads == sc.dgamma + padded_bytes(std::size_t(2 * p.parts * 4 * 64) * 4));
  CHECK(sc.bytes == sc.da_heads + padded_bytes(4 * 2 * 1000 * 4));
  for (std::size_t off :
       {sc.stats, sc.state, sc.partial, sc.dstate, sc.jac, sc.dgamma, sc.da_heads, sc.bytes})
    CHECK(off % scratch_alignment == 0);
}

TEST_CASE("linear backward: causal chunks", "[plan][linear_backward]") {
  linear_backward_shape s;
  s.causal = true;
  s.batch = 2, s.tokens = 1000, s.head_dim = s.value_dim = 64, s.max_len = 1000;
  s.sequences = 2, s.kv_heads = 2, s.q_heads = 4;
  s.total_slots = 2 * 16;
  SECTION("64-token chunks when the opt-in shared memory holds them") {
    const linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.chunk == 64);
    CHECK(p.max_chunks == 16);
    CHECK(p.chunk_grid == launch_grid{16, 2, 2});
    CHECK(p.scan_grid == launch_grid{33, 2, 2});  // 4160 state elements, 128 a CTA
    CHECK(std::size_t(p.causal_k_smem) <= h200().smem_per_block_optin);
    CHECK(p.scratch.inv_den - p.scratch.dstate ==
          padded_bytes(std::size_t(32 * 2) * (64 * 64 + 64) * 4));
    CHECK(p.scratch.bytes == p.scratch.delta + padded_bytes(2 * 1000 * 4 * 4));
  }
  SECTION("bfloat16 rows for 16-byte loads: the tensor-core chunk passes") {
    s.mma_inputs = true;
    const linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.mma);
    CHECK(p.mma_threads == 128);
    CHECK(p.reduce_smem == (2 * 64 * 72 + 64 * 88) * 2 + 64 * 4);
    // and the running state's 40 floats a thread
    CHECK(p.causal_q_smem == (4 * 64 * 72 + 5 * 64 * 88) * 2 + 64 * 4 + 40 * 128 * 4);
    CHECK(p.causal_k_smem == p.causal_q_smem);
    // Two sequences and two heads: walks of one chunk keep the most CTAs (64 < 2 * 132).
    CHECK(p.super == 1);
    CHECK(p.chunk_grid == launch_grid{16, 2, 2});
    CHECK_FALSE(plan_linear_backward(s, small_smem()).mma);  // 32-token chunks there
    s.head_dim = 32;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
  }
  SECTION("tensor-core walks: the longest that leaves two CTAs an SM, or the forced one") {
    s.mma_inputs = true;
    s.batch = s.sequences = 8, s.kv_heads = s.q_heads = 16, s.tokens = s.max_len = 8192;
    linear_bwd_causal_layout l = causal_layout(s, h200());
    CHECK(l.mma);
    CHECK(l.super == 8);  // 16 slots x 128 (sequence, head) pairs
    CHECK(l.slot_tokens() == 512);
    s.total_slots = 8 * 16;
    linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.super == 8);
    CHECK(p.chunk_grid == launch_grid{16, 16, 8});
    CHECK(p.scratch.inv_den - p.scratch.dstate ==
          padded_bytes(std::size_t(8 * 16 * 16) * (64 * 64 + 64) * 4));
    s.batch = s.sequences = 1, s.tokens = s.max_len = 2048;  // 32 chunks, 16 heads
    CHECK(causal_layout(s, h200()).super == 1);
    s.tokens = s.max_len = 8192;  // 128 chunks: 16 slots of 8 x 16 = 256, 32 of 4 x 16 = 512
    CHECK(causal_layout(s, h200()).super == 4);
    s.force_super = 3;
    CHECK(causal_layout(s, h200()).super == 3);
    s.total_slots = (128 + 2) / 3;
    p = plan_linear_backward(s, h200());
    CHECK(p.chunk_grid == launch_grid{43, 16, 1});
    s.mma_inputs = false;  // CUDA cores: a slot a chunk, whatever is forced
    CHECK(causal_layout(s, h200()).super == 1);
    CHECK(causal_layout(s, h200()).slot_tokens() == 64);
  }
  SECTION("under the prefix key gate with bfloat16 rows: the slot passes on tensor cores") {
    s.mma_inputs = true;
    s.gated = true, s.gate_heads = 1, s.shared_gate_sum = true;
    const linear_bwd_causal_layout l = causal_layout(s, h200());
    CHECK(l.mma);
    CHECK(l.slots(s));
    const linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.mma);
    CHECK(p.chunk == 64);
    // A slot holds its max and mass and those before it; a scan CTA 128 of its 4164 floats.
    CHECK(p.state_size == 64 * 64 + 64 + 4);
    CHECK(p.scan_grid == launch_grid{33, 2, 2});
    CHECK(p.causal_q_smem == (4 * 64 * 72 + 5 * 64 * 88) * 2 + 64 * 4 + 40 * 128 * 4 + 6 * 64 * 4);
    CHECK(p.causal_k_smem == p.causal_q_smem);
    CHECK(p.reduce_smem == (2 * 64 * 72 + 64 * 88) * 2 + 64 * 4 + 6 * 64 * 4);
    // Two CTAs a multiprocessor still fit (1 KiB reserved each).
    CHECK(2 * (std::size_t(p.causal_q_smem) + 1024) <= 228 * 1024);
    const linear_backward_scratch& sc = p.scratch;
    CHECK(sc.dstate - sc.state == padded_bytes(std::size_t(32 * 2) * (64 * 64 + 64 + 4) * 4));
    CHECK(sc.mass - sc.delta == padded_bytes(2 * 1000 * 4 * 4));
    CHECK(sc.gate_totals - sc.mass == padded_bytes(2 * 1000 * 2 * 2 * 4));
    CHECK(sc.gate_parts - sc.gate_totals == padded_bytes(2 * 2 * 4 * 4));
    CHECK(sc.da_heads - sc.gate_parts == padded_bytes(2 * 2 * 2 * 33 * 4));
    CHECK(sc.bytes == sc.da_heads + padded_bytes(2 * 2 * 1000 * 4));
    s.mma_inputs = false;  // CUDA cores: the walk a (head, sequence) below
    CHECK_FALSE(causal_layout(s, h200()).slots(s));
    CHECK(plan_linear_backward(s, h200()).chunk == 32);
  }
  SECTION("under the prefix key gate: a CTA a (head, sequence), checkpoints every ~sqrt chunks") {
    s.gated = true, s.gate_heads = 1, s.shared_gate_sum = true;
    const linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.chunk == 32);
    CHECK(p.max_chunks == 32);  // 1000 tokens
    CHECK(p.gated_K == 6);      // 6 * 6 >= 32 > 5 * 5
    CHECK(p.chunk_grid == launch_grid{2, 2, 1});
    const index_t SS = 64 * 64 + 64 + 2;
    CHECK(p.gated_task_floats == 15 * SS + 2 * (64 * 64 + 64));
    CHECK(p.gated_smem == (32 * (4 * 65 + 3 * 65) + 3 * 32 * 33 + 11 * 32) * 4);  // rows + 1
    CHECK(std::size_t(linear_bwd_gated_smem_floats(128, 128) * 4) <= h200().smem_per_block_optin);
    CHECK(p.scratch.da_heads - p.scratch.gated_states ==
          padded_bytes(std::size_t(2 * 2 * p.gated_task_floats) * 4));
    CHECK(p.scratch.bytes == p.scratch.da_heads + padded_bytes(2 * 2 * 1000 * 4));
    s.max_len = 1;
    CHECK(plan_linear_backward(s, h200()).gated_K == 1);
  }
  SECTION("shorter chunks where a block has 48 KiB") {
    CHECK(linear_bwd_causal_chunk(64, 64, small_smem()) == 32);
    CHECK(linear_bwd_causal_chunk(128, 128, small_smem()) == 16);
    CHECK(linear_bwd_causal_chunk(128, 128, h200()) == 64);
  }
}

TEST_CASE("linear backward: the tensor-core passes", "[plan][linear_backward]") {
  linear_backward_shape s = bidirectional(8, 2048, 16, 64);
  CHECK_FALSE(plan_linear_backward(s, h200()).mma);  // float, or rows off the vectors
  s.mma_inputs = true;
  SECTION("D = Dv = 64: four warps, tiles of 64 tokens") {
    const linear_backward_plan p = plan_linear_backward(s, h200());
    CHECK(p.mma);
    CHECK(p.mma_threads == 128);
    // Several waves of CTAs: 16 a multiprocessor over 128 (sequence, head) pairs, ranges of at
    // least 256 tokens.
    CHECK(p.parts == 8);
    s.tokens = s.max_len = 32768;
    CHECK(plan_linear_backward(s, h200()).parts == 17);
    s.tokens = s.max_len = 2048;
    using L = linear_bwd_mma_layout<64, 64>;
    CHECK(p.pass_a_smem == L::query_smem);
    // S | z, R, q and [g | delta] tiles; dgamma terms, z, row flags and the head's gamma. Three
    // CTAs a multiprocessor.
    CHECK(p.pass_a_smem ==
          2 * (2 * 64 * 88 + 3 * 64 * 72 + 2 * 64 * 88) + 4 * (4 * 64 + 64 + 64 + 64));
    CHECK(3 * (p.pass_a_smem + 1024) <= 228 * 1024);
    // The key pass: dS in two parts, dz and three constants, two stages of k and v and 16 result
    // rows for each of 8 warps; two CTAs
    // a multiprocessor, about four waves of them: 2 * 132 * 4 over 128 pairs.
    CHECK(p.key_threads == 256);
    CHECK(p.pass_b_smem == 2 * (2 * 64 * 72 + 2 * 8 * 16 * (72 + 72) + 8 * 16 * 72) + 4 * (64 + 4));
    CHECK(2 * (p.pass_b_smem + 1024) <= 228 * 1024);
    CHECK(p.key_grid.x == 8);
    CHECK(p.key_part_tokens == 256);
    CHECK(p.key_grid.y == 16);
    CHECK(p.key_grid.z == 8);
    // Enough (sequence, head) pairs for four waves: one range a pair. One long head: at most
    // linear_bwd_max_parts ranges.
    linear_backward_shape many = bidirectional(64, 2048, 32, 64),
                          one = bidirectional(1, 1 << 20, 1, 64);
    many.mma_inputs = one.mma_inputs = true;
    CHECK(plan_linear_backward(many, h200()).key_grid.x == 1);
    CHECK(plan_linear_backward(many, h200()).key_part_tokens == 2048);
    CHECK(plan_linear_backward(one, h200()).key_grid.x == 64);
    CHECK(plan_linear_backward(one, h200()).key_part_tokens == (1 << 20) / 64);
    CHECK(p.reduce_smem == 2 * (2 * 64 * 72 + 64 * 88) + 8 * 64);
  }
  SECTION("over the default 48 KiB: not without the opt-in; half keeps v in two parts") {
    CHECK_FALSE(plan_linear_backward(s, small_smem()).mma);
    s.half_inputs = true;
    const linear_backward_plan p = plan_linear_backward(s, h200());
    // The key pass splits half's v in registers: the same shared memory.
    CHECK(p.pass_b_smem == linear_bwd_mma_layout<64, 64>::key_smem);
    CHECK(p.reduce_smem > linear_bwd_mma_layout<64, 64>::reduce_smem(false));
  }
  SECTION("other dims, causal half calls and the forced CUDA cores keep the CUDA-core kernels") {
    s.value_dim = 32;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
    s.value_dim = s.head_dim = 128;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
    s.value_dim = 64, s.head_dim = 32;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
    s.head_dim = 64, s.force_simt = true;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
    s.force_simt = false, s.causal = true, s.gated = false;
    CHECK(plan_linear_backward(s, h200()).mma);  // bfloat16: sm80_linear_backward_causal.cuh
    s.half_inputs = true;
    CHECK_FALSE(plan_linear_backward(s, h200()).mma);
  }
}
