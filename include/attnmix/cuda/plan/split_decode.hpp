#pragma once
// What the split decoding steps (kernels/split_decode.cuh: the PaTH step and the softmax / FoX
// decoding kernel) plan alike: keys a block, blocks a row, the kernels' bound of D and Dv, the
// grids of the blocks and of their merge, and the partial states' scratch.

#include <algorithm>
#include <cstddef>

#include "attnmix/config.hpp"
#include "attnmix/cuda/plan/grid.hpp"
#include "attnmix/cuda/plan/scratch.hpp"

namespace attnmix {
namespace detail {
namespace cuda {

// Blocks of 256 keys, 128 threads a block and a merge (Dv <= 128).
constexpr int split_decode_block_keys = 256, split_decode_threads = 128;

struct split_decode_plan {
  int block_keys = 0, splits = 0;         // keys a block, blocks a (row, key/value head)
  int dmax = 0;                           // the kernels' compile-time bound of D and Dv (64 or 128)
  launch_grid grid, combine_grid;         // (splits, key/value heads, rows), (query heads, rows)
  std::size_t ml_bytes = 0, o_bytes = 0;  // scratch: the blocks' (max, sum) and outputs
};

// `rows` query tokens a call, the most keys one of them sees.
inline split_decode_plan plan_split_decode(index_t rows, index_t q_heads, index_t kv_heads,
                                           index_t head_dim, index_t value_dim, index_t keys) {
  split_decode_plan p;
  p.block_keys = split_decode_block_keys;
  p.splits = int(std::max<index_t>(1, (keys + p.block_keys - 1) / p.block_keys));
  p.dmax = std::max(head_dim, value_dim) <= 64 ? 64 : 128;
  p.grid = {unsigned(p.splits), unsigned(kv_heads), unsigned(rows)};
  p.combine_grid = {unsigned(q_heads), unsigned(rows)};
  p.ml_bytes = padded_bytes(static_cast<std::size_t>(rows * q_heads * p.splits * 2) * 4);
  p.o_bytes = static_cast<std::size_t>(rows * q_heads * p.splits * value_dim) * 4;
  return p;
}

}  // namespace cuda
}  // namespace detail
}  // namespace attnmix
