// The CUDA kernel plans (include/attnmix/cuda/plan/) on this CPU: for the shapes the CUDA tests
// and benchmarks run, the kernel, tiles, grids and scratch that the launchers chose before the
// plans were pulled out of them (dd67d4e), on an H200 (sm_90, 132 SMs) and on an sm_80 device
// with 108 SMs, which takes the portable kernels. Pure host code: no CUDA header.

#include <cstdint>
#include <vector>

#include "support/catch.hpp"

#include "attnmix/cuda/plan/attention.hpp"
#include "attnmix/cuda/plan/linear.hpp"
#include "attnmix/cuda/plan/path.hpp"
#include "attnmix/cuda/plan/rows.hpp"

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

device_properties sm80() {
  device_properties d = h200();
  d.sms = 108, d.cc_major = 8, d.cc_minor = 0;
  d.smem_per_block_optin = 163 * 1024, d.smem_per_sm = 164 * 1024;
  return d;
}

launch_grid grid(unsigned x, unsigned y = 1, unsigned z = 1) {
  return {x, y, z};
}

// bench_attention_cuda: bf16, D = Dv = 64, dense, aligned.
attention_shape attention_bench(index_t B, index_t T, index_t H) {
  attention_shape s;
  s.head_dim = s.value_dim = 64;
  s.max_len = T, s.q_heads = H, s.sequences = B;
  s.sixteen_bit = true, s.aligned = true;
  return s;
}

}  // namespace

TEST_CASE("device properties name the architecture's features", "[plan]") {
  CHECK(h200().hopper());
  CHECK(h200().clusters());
  CHECK(h200().dependent_launch());
  CHECK_FALSE(sm80().hopper());
  CHECK_FALSE(sm80().clusters());
  CHECK_FALSE(sm80().dependent_launch());
}

TEST_CASE("softmax plans: wgmma on Hopper, mma.sync elsewhere, CUDA cores otherwise", "[plan]") {
  SECTION("H200, the causal benchmark shapes: persistent, three consumer warpgroups") {
    const index_t shapes[][2] = {{32, 2048}, {32, 4096}, {8, 8192}, {4, 16384}};
    for (const auto& bt : shapes) {
      const attention_plan p = plan_attention(attention_bench(bt[0], bt[1], 32), h200());
      CHECK(p.variant == attention_variant::sm90_wgmma);
      CHECK(p.head_dim == 64);
      CHECK(p.value_dim == 64);
      CHECK(p.consumers == 3);
      CHECK(p.rows == 192);
      CHECK(p.row_tiles == (bt[1] + 191) / 192);
      CHECK(p.items == p.row_tiles * 32 * bt[0]);
      CHECK(p.grid == grid(132));
      CHECK(p.reset_work_counter);
    }
    // T = 2048: 11 row tiles of 192.
    CHECK(plan_attention(attention_bench(32, 2048, 32), h200()).items == 11 * 32 * 32);
  }
  SECTION("wider head dims take two consumer warpgroups") {
    attention_shape s = attention_bench(8, 2048, 16);
    s.head_dim = 128;
    const attention_plan p = plan_attention(s, h200());
    CHECK(p.variant == attention_variant::sm90_wgmma);
    CHECK(p.consumers == 2);
    CHECK(p.rows == 128);
    CHECK(p.row_tiles == 16);
    CHECK(p.grid == grid(132));
  }
  SECTION("few items: a CTA an item") {
    const attention_plan p = plan_attention(attention_bench(1, 100, 2), h200());
    CHECK(p.items == 2);
    CHECK(p.grid == grid(2));
  }
  SECTION("portable (asked, or a negative scale) and sm_80: mma.sync, a CTA a 64-row tile") {
    attention_shape s = attention_bench(32, 2048, 32);
    s.portable = true;
    for (const attention_plan& p :
         {plan_attention(s, h200()), plan_attention(attention_bench(32, 2048, 32), sm80())}) {
      CHECK(p.variant == attention_variant::sm80_mma);
      CHECK(p.rows == 64);
      CHECK(p.row_tiles == 32);
      CHECK(p.items == 32 * 32 * 32);
      CHECK(p.grid == grid(32768));
      CHECK_FALSE(p.reset_work_counter);
    }
    attention_shape negative = attention_bench(2, 64, 4);
    negative.positive_scale = false;
    CHECK(plan_attention(negative, h200()).variant == attention_variant::sm80_mma);
  }
  SECTION("float, unaligned views and other head dims: a warp a row") {
    attention_shape s = attention_bench(8, 1000, 16);
    s.sixteen_bit = false;
    attention_plan p = plan_attention(s, h200());
    CHECK(p.variant == attention_variant::simt);
    CHECK(p.simt_chunks == 2);
    CHECK(p.grid == grid(250, 16, 8));
    s = attention_bench(3, 65, 4);
    s.aligned = false;
    CHECK(plan_attention(s, h200()).variant == attention_variant::simt);
    s = attention_bench(3, 65, 4);
    s.head_dim = 96;  // not a tensor-core tile
    p = plan_attention(s, h200());
    CHECK(p.variant == attention_variant::simt);
    CHECK(p.simt_chunks == 4);
    s.value_dim = 256;
    CHECK(plan_attention(s, h200()).simt_chunks == 8);
  }
  SECTION("decoding (one query a row, cached keys): the split kernel unless asked not to") {
    // 32 rows of 4096 cached keys, 16 query heads over 4 key/value heads.
    attention_shape s = attention_bench(32, 1, 16);
    s.decode = true, s.decode_keys = 4096, s.group = 4;
    const bool saved = attention_decode_splits();
    attention_decode_splits() = false;  // asked not to: the forward's kernel
    CHECK(plan_attention(s, h200()).variant == attention_variant::sm90_wgmma);
    attention_decode_splits() = true;  // the default
    attention_plan p = plan_attention(s, h200());
    CHECK(p.variant == attention_variant::decode);
    CHECK(p.split.block_keys == 256);
    CHECK(p.split.splits == 16);
    CHECK(p.split.dmax == 64);
    CHECK(p.smem == (4 * 64 + 4 * 256 + 4 * 64) * 4);
    CHECK_FALSE(p.raise_smem_limit);
    CHECK(p.split.grid == grid(16, 4, 32));
    CHECK(p.split.combine_grid == grid(16, 32));
    CHECK(p.split.ml_bytes == 32 * 16 * 16 * 2 * 4);
    CHECK(p.split.o_bytes == std::size_t(32) * 16 * 16 * 64 * 4);
    s.decode_keys = 4097;  // a key past the last block: one more
    CHECK(plan_attention(s, h200()).split.splits == 17);
    s.q_heads = s.group = 32, s.head_dim = 128;  // MQA, 32 heads at D = 128: above 48 KB
    p = plan_attention(s, h200());
    CHECK(p.split.dmax == 128);
    CHECK(p.raise_smem_limit);
    s.decode = false;  // a call that does not qualify keeps the forward's kernels
    CHECK(plan_attention(s, h200()).variant == attention_variant::sm90_wgmma);
    attention_decode_splits() = saved;
  }
  SECTION("decoding: the most keys a row sees") {
    attnmix::attention_problem p{};
    p.num_sequences = 3, p.key_tokens = 1000;
    CHECK(decode_keys(p) == 1000);  // dense keys: Tk
    const std::int32_t lengths[] = {10, 700, 333};
    p.key_lengths = lengths;
    CHECK(decode_keys(p) == 700);
    p.window = 100;
    CHECK(decode_keys(p) == 100);
    p.key_lengths = nullptr, p.window = 0;
    const std::int32_t cu_k[] = {0, 5, 905, 1000};
    p.cu_seqlens_k = cu_k;
    CHECK(decode_keys(p) == 900);
  }
}

TEST_CASE("softmax scratch: offsets, gate cumsum, part sums, work counter", "[plan]") {
  attnmix::attention_problem p{2,       1000, 8,    2,       64, 64,      0.125,  -1,
                               nullptr, 2,    1000, nullptr, 2,  nullptr, nullptr};
  const attention_scratch_layout plain(p, false, 1000);
  CHECK(plain.gate == 0);
  CHECK(plain.part_sums == 0);
  CHECK(plain.counter == 0);
  CHECK(plain.bytes == 256);
  const attention_scratch_layout gated(p, true, 1000);
  CHECK(gated.gate_parts == 4);
  CHECK(gated.reset == 2 * 1000 * 8 * 8);    // 128000, a multiple of 256
  CHECK(gated.part_sums == 128000 + 64000);  // 2 x 1000 x 8 ints
  CHECK(gated.counter == 192000 + 1024);     // 2 sequences x 4 parts x 8 heads, two doubles
  CHECK(gated.bytes == 192000 + 1024 + 256);
  CHECK(gate_cumsum_grid(p, gated.gate_parts) == grid(4, 1, 2));
  const std::int32_t cu[] = {0, 10, 1000};
  p.cu_seqlens = p.cu_seqlens_k = cu;
  CHECK(attention_scratch_layout(p, false, 990).gate == 256);  // 3 offsets, padded
}

TEST_CASE("softmax scratch with keys of their own layout", "[plan]") {
  // Three sequences of 4 queries reading slots of a cache of 5 rows of 600 keys (k [5, 600]).
  const std::int32_t slots[] = {4, 0, 4}, lengths[] = {10, 600, 33};
  attnmix::attention_problem p{3,       4, 8,   2,       64, 64,      0.125,  0,
                               nullptr, 3, 600, nullptr, 5,  nullptr, nullptr};
  p.key_slots = slots;
  const attention_scratch_layout slotted(p, true, 4);
  CHECK(slotted.cu_k == 0);
  CHECK(slotted.lengths == 256);  // 3 slots, padded
  CHECK(slotted.gate == 256);
  CHECK(slotted.gate_parts == 3);  // 600 keys a row
  CHECK(slotted.reset == 256 + 5 * 600 * 8 * 8);
  CHECK(slotted.part_sums == slotted.reset + 5 * 600 * 8 * 4);
  CHECK(slotted.counter == slotted.part_sums + 2048);  // 5 rows x 3 parts x 8 heads, padded
  CHECK(gate_cumsum_grid(p, slotted.gate_parts) == grid(3, 1, 5));
  p.key_lengths = lengths;
  CHECK(attention_scratch_layout(p, true, 4).gate == 512);
  // Packed queries and keys with offsets of their own: a scan a sequence of keys, the longest
  // of 900.
  const std::int32_t cu[] = {0, 2, 2, 12}, cu_k[] = {0, 900, 905, 1205};
  attnmix::attention_problem q{1,  12, 8,    2,    64, 64,      0.125,  0,
                               cu, 3,  1205, cu_k, 1,  nullptr, nullptr};
  const attention_scratch_layout packed(q, true, 10);
  CHECK(packed.cu_k == 256);
  CHECK(packed.slots == 512);
  CHECK(packed.gate == 512);
  CHECK(packed.gate_parts == 4);
  CHECK(packed.counter == packed.part_sums + 3 * 4 * 8 * 16);
  CHECK(gate_cumsum_grid(q, packed.gate_parts) == grid(4, 1, 3));
}

TEST_CASE("PaTH plans: the forward and a decoding step", "[plan]") {
  // bench_path_cuda: bf16, D = Dv = 64, H = HQ = 32.
  path_shape s;
  s.batch = 32, s.tokens = 2048, s.head_dim = s.value_dim = 64, s.max_len = 2048;
  s.q_heads = s.kv_heads = 32, s.sequences = 32;
  s.sixteen_bit = s.aligned = s.q_vectors = true;
  const std::size_t part = std::size_t(32) * 32 * 2048 * 64 * 2;  // rows x D halves
  SECTION("H200: the wgmma forward over pairs of chunks, with the dense transitions") {
    const path_plan p = plan_path(s, h200());
    CHECK(p.variant == path_variant::sm90_wgmma);
    CHECK(p.prepare_dim == 64);
    CHECK(p.prepare_grid == grid(32, 32, 32));
    CHECK(p.pairs == 16);
    CHECK(p.items == 16 * 32 * 32);
    CHECK(p.grid == grid(132));
    CHECK(p.reset_work_counter);
    CHECK(p.chunks.half_w);
    CHECK(p.chunks.dense);
    CHECK(p.chunks.u == part);
    CHECK(p.chunks.e == 4 * part);
    CHECK(p.chunks.bytes == 5 * part);
  }
  SECTION("portable, sm_80, or q rows without 16-byte alignment: mma.sync a chunk a CTA") {
    path_shape portable = s, unaligned_q = s;
    portable.portable = true;
    unaligned_q.q_vectors = false;
    for (const path_plan& p :
         {plan_path(portable, h200()), plan_path(s, sm80()), plan_path(unaligned_q, h200())}) {
      CHECK(p.variant == path_variant::sm80_mma);
      CHECK(p.head_dim == 64);
      CHECK(p.value_dim == 64);
      CHECK(p.grid == grid(32, 32, 32));
      CHECK(p.chunks.half_w);
      CHECK_FALSE(p.chunks.dense);
      CHECK(p.chunks.bytes == 4 * part);
    }
    path_shape wide = s;
    wide.head_dim = 128;
    const path_plan p = plan_path(wide, h200());  // Hopper's kernel is D = Dv = 64 only
    CHECK(p.variant == path_variant::sm80_mma);
    CHECK(p.prepare_dim == 128);
  }
  SECTION("float: CUDA cores, the chunk data in float") {
    path_shape f = s;
    f.sixteen_bit = false;
    f.tokens = f.max_len = 1000;
    const path_plan p = plan_path(f, h200());
    CHECK(p.variant == path_variant::simt);
    CHECK(p.prepare_dim == 64);
    CHECK(p.simt_dim == 64);
    CHECK(p.grid == grid(16, 32, 32));
    CHECK_FALSE(p.chunks.half_w);
    const std::size_t rows = std::size_t(32) * 32 * 1000;
    CHECK(p.chunks.bytes == 2 * rows * 64 * 4 + rows * 64 * 4);
    f.value_dim = 96;
    CHECK(plan_path(f, h200()).simt_dim == 128);
  }
  SECTION("decoding: splits of 256 keys, the default shared-memory limit") {
    // bench_path_cuda's decode: N = 32 sequences of L = 8192 cached tokens, H = HQ = 32.
    path_decode_shape d;
    d.longest = 8193, d.batch = 32, d.q_heads = d.kv_heads = 32, d.head_dim = d.value_dim = 64;
    d.row_bytes = 32 * 8;
    path_decode_plan p = plan_path_decode(d, h200());
    CHECK(p.split.block_keys == 256);
    CHECK(p.split.splits == 33);
    CHECK(p.split.dmax == 64);
    CHECK(p.smem == (2 * 64 + 256 + 4 * 64) * 4);
    CHECK_FALSE(p.raise_smem_limit);
    CHECK(p.flush_smem == (64 * 64 + 128) * 4);
    CHECK_FALSE(p.raise_flush_smem_limit);
    CHECK(p.split.grid == grid(33, 32, 32));
    CHECK(p.split.combine_grid == grid(32, 32));
    CHECK(p.transition_grid == grid(32, 32));
    CHECK(p.split.ml_bytes == 32 * 32 * 33 * 2 * 4);
    CHECK(p.split.o_bytes == 32 * 32 * 33 * 64 * 4);
    CHECK(p.qm_bytes == 32 * 32 * 64 * 4);
    CHECK(p.bytes == p.split.ml_bytes + p.split.o_bytes + p.qm_bytes + 256);
    d.kv_heads = 8;  // a group of 4 query heads a KV head at D = 128: 14 KB
    d.head_dim = 128;
    p = plan_path_decode(d, h200());
    CHECK(p.split.dmax == 128);
    CHECK(p.smem == (2 * 4 * 128 + 4 * 256 + 4 * 128) * 4);
    CHECK_FALSE(p.raise_smem_limit);
    CHECK(p.flush_smem == (128 * 128 + 128) * 4);  // 66 KB: above the default limit
    CHECK(p.raise_flush_smem_limit);
    d.kv_heads = 1;  // a group of 32: 66 KB, above the default limit
    CHECK(plan_path_decode(d, h200()).raise_smem_limit);
  }
}

// The deferred-transition schedule of a device PaTH cache (shapes.hpp; kernels/path_decode.cuh),
// simulated on the host for prompts of every length up to three flush periods and the steps after:
// every key a step scores is where the step kernel looks for it and carried through exactly the
// transitions before it (kept: M s_j with M the product since s_j's last update; recent: in the
// ring, current), the new key takes a ring entry no key still in the ring needs, and a flush
// leaves every key kept, carried through its step.
TEST_CASE("the PaTH decoding cache's flush schedule keeps every key once", "[plan][path][decode]") {
  const index_t R = path_decode_flush, ring_size = path_decode_recent;
  for (index_t prompt = 0; prompt <= 3 * R + 1; ++prompt) {
    INFO("prompt of " << prompt << " tokens");
    // through[j]: the last token whose transition key j's kept value includes (-1: not kept).
    std::vector<index_t> through(static_cast<std::size_t>(prompt + 4 * R), -1);
    std::vector<index_t> ring(static_cast<std::size_t>(ring_size), -1);
    index_t m_from = prompt;  // M = H_(L-1) ... H_(m_from): the prefill leaves M = I
    for (index_t j = 0; j < prompt; ++j) through[std::size_t(j)] = prompt - 1;
    for (index_t j = path_decode_flushed(prompt); j < prompt; ++j)
      ring[std::size_t(j % ring_size)] = j;
    for (index_t L = prompt; L < prompt + 3 * R + 2; ++L) {
      // The transition kernel: M <- H_L M, or H_L alone.
      if (path_decode_fresh_transitions(L)) m_from = L;
      // The step kernel.
      const index_t F = path_decode_flushed(L);
      REQUIRE(F <= L);
      REQUIRE(L - F <= R);
      for (index_t j = 0; j < F; ++j) REQUIRE(through[std::size_t(j)] == m_from - 1);
      for (index_t j = F; j < L; ++j) REQUIRE(ring[std::size_t(j % ring_size)] == j);
      const index_t taken = ring[std::size_t(L % ring_size)];
      REQUIRE((taken < F || taken >= L));  // no key the step or its flush still reads
      ring[std::size_t(L % ring_size)] = L;
      // The flush kernel: every key before L kept, through H_L.
      if (path_decode_flushes(L)) {
        REQUIRE(F == L - R);
        for (index_t j = 0; j < L; ++j) {
          if (j >= F) REQUIRE(ring[std::size_t(j % ring_size)] == j);
          through[std::size_t(j)] = L;
        }
        CHECK(path_decode_flushed(L + 1) == L);
        CHECK(path_decode_fresh_transitions(L + 1));
      }
    }
  }
}

namespace {

// bench_linear_cuda: bf16, D = Dv = 64, H = HQ = 16, dense and aligned.
linear_shape linear_bench(bool causal, index_t B, index_t T) {
  linear_shape s;
  s.causal = causal;
  s.sixteen_bit = true;
  s.head_dim = s.value_dim = 64;
  s.max_len = T, s.sequences = B, s.kv_heads = s.q_heads = 16;
  s.kv_vectors = s.q_vectors = s.out_pairs = s.out_vectors = s.gate_vectors = true;
  s.causal_ctas_per_sm = 2;  // the chunked kernel's 98 KB of shared memory: two CTAs an SM
  return s;
}

}  // namespace

TEST_CASE("bidirectional linear-attention plans", "[plan]") {
  SECTION("H200, the GBLA benchmark shapes: one clustered kernel, two CTAs a head") {
    const index_t lengths[] = {2048, 8192, 32768};
    for (index_t T : lengths) {
      const linear_plan p = plan_linear(linear_bench(false, 8, T), h200());
      CHECK(p.read == linear_read_variant::sm90_cluster);
      CHECK(p.reduce == linear_reduce_variant::none);
      CHECK_FALSE(p.combine);
      CHECK(p.cluster == 2);
      CHECK(p.cluster_tokens == T / 2);
      CHECK(p.read_grid == grid(2, 16, 8));
      CHECK(p.read_smem == 55552);
      CHECK(p.scratch.bytes == 0);
    }
  }
  SECTION("sm_80, the same shapes: fused reduce (two blocks a head), the fast read") {
    const index_t lengths[] = {2048, 8192, 32768};
    const index_t per_cta[] = {32, 144, 512};
    for (int i = 0; i < 3; ++i) {
      const index_t T = lengths[i];
      const linear_plan p = plan_linear(linear_bench(false, 8, T), sm80());
      CHECK(p.reduce == linear_reduce_variant::sm80_fast);
      CHECK(p.partials == 2);
      CHECK(p.block_tokens == T / 2);
      CHECK(p.fused);
      CHECK(p.reduce_smem == 55296);
      CHECK(p.reduce_grid == grid(16, 2, 8));
      CHECK_FALSE(p.combine);
      CHECK(p.read == linear_read_variant::sm80_fast);
      CHECK(p.read_per_cta == per_cta[i]);
      CHECK(p.read_grid == grid(16, 4, 8));
      CHECK(p.scratch.partial_bytes == 4261888);
      CHECK(p.scratch.state_bytes == 2129920);
      CHECK(p.scratch.staged_bytes == 1458176);
      CHECK(p.scratch.done_bytes == 512);
      CHECK(p.scratch.bytes == 7850496);
      CHECK(p.scratch.done == 7850496 - 512);
    }
  }
  SECTION("H200, a group of more than 64 query heads a KV head: no cluster") {
    linear_shape s = linear_bench(false, 1, 2048);
    s.kv_heads = 1, s.q_heads = 65;
    CHECK(plan_linear(s, h200()).read == linear_read_variant::sm80_fast);
  }
  SECTION("H200, D = Dv = 128: the wide tensor-core reduce and read") {
    linear_shape s = linear_bench(false, 8, 2048);
    s.head_dim = s.value_dim = 128;
    const linear_plan p = plan_linear(s, h200());
    CHECK(p.reduce == linear_reduce_variant::sm80_mma_wide);
    CHECK(p.partials == 8);
    CHECK(p.block_tokens == 256);
    CHECK(p.fused);
    CHECK(p.reduce_grid == grid(16, 8, 8));
    CHECK(p.read == linear_read_variant::sm80_mma_wide);
    CHECK(p.read_per_cta == 5);
    CHECK(p.read_grid == grid(16, 7, 8));
    CHECK(p.scratch.bytes == 76096000);
  }
  SECTION("float: CUDA cores, reduce -> combine -> read") {
    linear_shape s = linear_bench(false, 8, 2048);
    s.sixteen_bit = false;
    const linear_plan p = plan_linear(s, h200());
    CHECK(p.reduce == linear_reduce_variant::simt);
    CHECK(p.reduce_blocks == 1);
    CHECK(p.partials == 5);
    CHECK(p.block_tokens == 416);
    CHECK(p.reduce_grid == grid(5, 16, 8));
    CHECK_FALSE(p.fused);
    CHECK(p.combine);
    CHECK(p.combine_grid == grid(16, 8, 5));
    CHECK(p.read == linear_read_variant::simt);
    CHECK(p.read_chunks == 2);
    CHECK(p.read_grid == grid(32, 16, 8));
    CHECK(p.scratch.bytes == 12784640);
  }
  SECTION("H200, shapes of test_linear_cuda") {
    // {B = 2, T = 2000, HQ = 4, H = 2, D = Dv = 64}: a cluster of 8 CTAs a head.
    linear_shape s = linear_bench(false, 2, 2000);
    s.q_heads = 4, s.kv_heads = 2;
    linear_plan p = plan_linear(s, h200());
    CHECK(p.read == linear_read_variant::sm90_cluster);
    CHECK(p.cluster == 8);
    CHECK(p.cluster_tokens == 256);
    CHECK(p.read_grid == grid(8, 2, 2));
    CHECK(p.read_smem == 55808);
    // {1, 200, 2, 1, 16, 128}: the wide tensor-core kernels, fused.
    s = linear_bench(false, 1, 200);
    s.q_heads = 2, s.kv_heads = 1, s.head_dim = 16, s.value_dim = 128;
    p = plan_linear(s, h200());
    CHECK(p.reduce == linear_reduce_variant::sm80_mma_wide);
    CHECK(p.partials == 4);
    CHECK(p.block_tokens == 64);
    CHECK(p.fused);
    CHECK(p.read == linear_read_variant::sm80_mma_wide);
    CHECK(p.read_per_cta == 1);
    CHECK(p.read_grid == grid(2, 4, 1));
    CHECK(p.scratch.bytes == 41732);
    // {2, 100, 2, 2, 48, 48}: dims the tensor-core reduce does not tile.
    s = linear_bench(false, 2, 100);
    s.q_heads = s.kv_heads = 2, s.head_dim = s.value_dim = 48;
    p = plan_linear(s, h200());
    CHECK(p.reduce == linear_reduce_variant::simt);
    CHECK(p.reduce_blocks == 1);
    CHECK(p.partials == 2);
    CHECK(p.block_tokens == 64);
    CHECK(p.combine);
    CHECK(p.combine_grid == grid(2, 2, 3));
    CHECK(p.read == linear_read_variant::simt);
    CHECK(p.read_chunks == 2);
    CHECK(p.read_grid == grid(2, 2, 2));
    CHECK(p.scratch.bytes == 113152);
  }
  SECTION("no tokens: the states only (reduce, combine), no read") {
    linear_shape s = linear_bench(false, 2, 0);
    s.sixteen_bit = false;
    const linear_plan p = plan_linear(s, h200());
    CHECK(p.reduce == linear_reduce_variant::simt);
    CHECK(p.read == linear_read_variant::none);
  }
}

TEST_CASE("causal linear-attention plans", "[plan]") {
  SECTION("H200, B = 8: two segments a sequence, the tensor-core reduce of the first") {
    const index_t lengths[] = {2048, 8192, 32768};
    for (index_t T : lengths) {
      const linear_plan p = plan_linear(linear_bench(true, 8, T), h200());
      CHECK(p.segments == 2);
      CHECK(p.segment_tokens == T / 2);
      CHECK(p.partials == 1);
      CHECK(p.reduce == linear_reduce_variant::sm80_mma);
      CHECK(p.reduce_grid == grid(16, 1, 8));
      CHECK(p.prefix);
      CHECK(p.prefix_grid == grid(16, 8));
      CHECK(p.causal == linear_causal_variant::simt);
      CHECK(p.causal_chunks == 2);
      CHECK(p.causal_grid == grid(2, 16, 8));
      CHECK(p.causal_smem == 100608);
      CHECK(p.scratch.bytes == 6392832);
      CHECK(p.read == linear_read_variant::none);
    }
  }
  SECTION("H200, one sequence of 32768 tokens: sixteen segments") {
    const linear_plan p = plan_linear(linear_bench(true, 1, 32768), h200());
    CHECK(p.segments == 16);
    CHECK(p.segment_tokens == 2048);
    CHECK(p.partials == 15);
    CHECK(p.causal_grid == grid(16, 16, 1));
    CHECK(p.scratch.bytes == 8257536);
  }
  SECTION("many sequences: one segment, no reduce") {
    const linear_plan p = plan_linear(linear_bench(true, 64, 512), h200());
    CHECK(p.segments == 1);
    CHECK_FALSE(p.prefix);
    CHECK(p.reduce == linear_reduce_variant::none);
    CHECK(p.causal_grid == grid(1, 16, 64));
    CHECK(p.partials == 0);
    CHECK(p.scratch.bytes == 0);
  }
  SECTION("bfloat16 at D = Dv = 64 scans on tensor cores; other calls on CUDA cores") {
    linear_shape s = linear_bench(true, 8, 2048);
    s.bf16 = true;
    s.causal_ctas_per_sm = 3;  // 70 KB of shared memory and 168 registers a thread
    const linear_plan p = plan_linear(s, h200());
    CHECK(p.causal == linear_causal_variant::sm80_mma);
    CHECK(p.causal_smem == causal_mma_smem_bytes);
    CHECK(p.segments == 3);  // 396 CTA slots over 128 (sequence, head) pairs
    CHECK(p.segment_tokens == 704);
    CHECK(p.causal_grid == grid(3, 16, 8));
    CHECK(p.reduce == linear_reduce_variant::sm80_mma);
    const auto variant = [](linear_shape x) {
      return plan_linear(x, h200()).causal;
    };
    linear_shape other = s;
    other.bf16 = false;  // half
    CHECK(variant(other) == linear_causal_variant::simt);
    other = s, other.q_vectors = false;
    CHECK(variant(other) == linear_causal_variant::simt);
    other = s, other.value_dim = 32;
    CHECK(variant(other) == linear_causal_variant::simt);
    other = s, other.head_dim = other.value_dim = 128;
    CHECK(variant(other) == linear_causal_variant::simt);
  }
  SECTION("sm_80 has fewer SMs: the split follows the device") {
    const linear_plan p = plan_linear(linear_bench(true, 1, 32768), sm80());
    CHECK(p.segments == 13);  // 216 CTA slots over 16 heads
    CHECK(p.segment_tokens == 2560);
    CHECK(p.partials == 12);
    CHECK(p.scratch.bytes == 6659328);
  }
}

TEST_CASE("row kernels: a block per 256 values, at most 32 blocks an SM", "[plan]") {
  CHECK(rows_grid(0, 256, h200()) == 1);
  CHECK(rows_grid(1000, 256, h200()) == 4);
  CHECK(rows_grid(1000000, 256, h200()) == 3907);
  CHECK(rows_grid(100000000, 256, h200()) == 132 * 32);
  CHECK(rows_grid(100000000, 256, sm80()) == 108 * 32);
}
