#pragma once
// Semantic IDs saved beside a model: one safetensors file with the items' codes (I32
// "semantic_ids.codes", [items, levels + 1]) and the codebooks (F32 "semantic_ids.codebook",
// [levels, codes, dim]). Needs attnmix::io (nlohmann-json).
//
//   attnmix::save_semantic_ids(ids, "catalogue.ids.safetensors");
//   const attnmix::semantic_ids back = attnmix::load_semantic_ids("catalogue.ids.safetensors");

#include <string>

#include "attnmix/io/safetensors.hpp"
#include "attnmix/retrieval/semantic_ids.hpp"

namespace attnmix {

inline void save_semantic_ids(const semantic_ids& s, const std::string& path) {
  io::save(s, path, {{"format", "pt"}, {"attnmix", "semantic_ids"}});
}

// The IDs of a file that save_semantic_ids wrote. Throws attnmix::error naming the file for a
// file without the two tensors, with shapes that do not fit together, codes out of range or two
// items with the same codes.
inline semantic_ids load_semantic_ids(const std::string& path) {
  const std::string fn = "attnmix::load_semantic_ids";
  const io::safetensors_file file = io::safetensors_file::read(path);
  const io::tensor_info* c = file.find("semantic_ids.codes");
  const io::tensor_info* b = file.find("semantic_ids.codebook");
  detail::require(c != nullptr && b != nullptr, fn, "path",
                  "names a file without the tensors 'semantic_ids.codes' and "
                  "'semantic_ids.codebook': ",
                  path);
  const bool fit = c->shape.size() == 2 && b->shape.size() == 3 && b->shape[0] >= 1 &&
                   b->shape[1] >= 1 && b->shape[1] <= (1 << 24) && b->shape[0] <= (1 << 20) &&
                   c->shape[1] == b->shape[0] + 1 && c->shape[0] >= 1 && b->shape[2] >= 1;
  detail::require(fit, fn, "path", "names a file whose codes have shape ",
                  layers::shape_string(c->shape), " and codebooks ", layers::shape_string(b->shape),
                  " (expected [items, levels + 1] and [levels, codes, dim]): ", path);
  semantic_ids s = semantic_ids::sized(c->shape[0], b->shape[2], static_cast<int>(b->shape[0]),
                                       static_cast<int>(b->shape[1]));
  io::load(s, file);
  s.reindex();
  return s;
}

}  // namespace attnmix
