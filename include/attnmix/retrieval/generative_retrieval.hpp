#pragma once
// The GBLA paper's generative-retrieval recommender: a user's history of item IDs is hashed into
// embeddings (layers::hash_embedding) and read by an encoder (any attnmix::stack; the paper's are
// bidirectional, e.g. [SA, GBLA, GBLA] x 3, beside a causal SA one); a decoder (attnmix::decoder)
// generates the semantic ID of the next item (retrieval/semantic_ids.hpp) code by code, reading
// the encoder's output:
//   memory     = encoder( items(history) )
//   tokens     = BOS, then the codes of levels 0 .. depth-2 (token 1 + level * codes + code)
//   logits(l)  = head( decoder(tokens, memory) )[l] over the columns of level l
//   p(item)    = prod_l softmax(logits(l))[code_l(item)]      (teacher forcing in training)
// Recommending encodes each history once, remembers it in the decoder's cross-attention caches,
// and runs a beam search over the codes (beam_search_items_batched) whose every level is one
// decoder call for the beams of a group of users. Parameter names: "items.*", "encoder.*",
// "codes.weight", "decoder.*", "head.weight".
//
// Histories are packed: the item IDs of every user one after the other (host memory) and their
// offsets [users + 1]. Training and recommending are written over the backend: a model on the
// GPU (its Encoder a device stack) is made from a host one by the converting constructor.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/tensor_view.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/embedding.hpp"
#include "attnmix/layers/hash_embedding.hpp"
#include "attnmix/layers/linear.hpp"
#include "attnmix/layers/ops.hpp"
#include "attnmix/retrieval/beam_search.hpp"
#include "attnmix/retrieval/semantic_ids.hpp"
#include "attnmix/stack/decoder.hpp"
#include "attnmix/stack/stack.hpp"

namespace attnmix {

// The sizes of a generative-retrieval model beside the layers::config of its encoder and decoder.
struct retrieval_config {
  int depth = 3;                // codes of a semantic ID
  int codes = 256;              // codes a level
  index_t buckets = 1 << 16;    // rows of each item-hash table
  int hashes = 2;               // hash functions (tables) an item
  index_t part = 0;             // width of a table row; 0: hidden_size / hashes
  std::uint64_t hash_seed = 0;  // the hash functions' seed
  index_t decoder_layers = 1;   // the paper's decoder has one block
};

// The users of a call: item IDs packed one history after the other, and the offsets of every
// history in them [users + 1] (host memory). Every history holds at least one item.
struct user_histories {
  view1<const std::uint64_t> items;
  view1<const std::int32_t> offsets;
};

template <class Encoder, class DecoderPolicy = decoder_policy>
class generative_retrieval {
 public:
  using scalar = typename Encoder::scalar;
  using backend_type = typename Encoder::backend_type;
  using decoder_type = decoder<scalar, DecoderPolicy, backend_type>;

 private:
  using T = scalar;
  using Backend = backend_type;
  using O = layers::ops<Backend>;
  template <class, class>
  friend class generative_retrieval;

 public:
  // Throws attnmix::error on a bad config.
  generative_retrieval(const layers::config& c, const retrieval_config& r)
      : rc_(checked(c, r)),
        items(r.buckets, r.hashes, r.part > 0 ? r.part : c.hidden_size / r.hashes, c.hidden_size,
              r.hash_seed),
        encoder(c),
        codes(1 + index_t(r.depth) * r.codes, c.hidden_size),
        dec(c, r.decoder_layers),
        head(c.hidden_size, index_t(r.depth) * r.codes) {}

  // The same model on Encoder's backend in its scalar: every weight of `other` copied (and
  // rounded) once, e.g. a host model's onto the GPU:
  //   generative_retrieval<device_stack<Enc, bfloat16>> gpu(host_model);
  template <class OtherEncoder>
  explicit generative_retrieval(const generative_retrieval<OtherEncoder, DecoderPolicy>& other)
      : rc_(other.rc_),
        items(other.items),
        encoder(other.encoder),
        codes(other.codes),
        dec(other.dec),
        head(other.head) {}

  const retrieval_config& retrieval() const { return rc_; }
  index_t hidden_size() const { return encoder.hidden_size(); }
  int depth() const { return rc_.depth; }

  // The mean cross-entropy of the next items' codes (codes [users, depth], host, each in
  // [0, codes)) given the histories; with `backward`, adds every parameter's gradient to its
  // .grad. Throws attnmix::error on bad arguments, before anything is computed.
  double loss(const user_histories& h, const tensor_view<const std::int32_t, 2>& next,
              bool backward = true, const Backend& be = Backend{}) {
    static_assert(layers::has_training_ops_v<Backend>,
                  "attnmix::generative_retrieval::loss: layers::ops<Backend> lacks a training "
                  "operation (the list is in attnmix/layers/ops.hpp)");
    using attnmix::detail::require;
    const std::string fn = "attnmix::generative_retrieval::loss";
    const index_t users = check_histories(fn, h);
    attnmix::detail::check_given(fn, "codes", next);
    attnmix::detail::check_space(fn, "codes", next, memory_space::host, "code validation");
    require(next.extent(0) == users && next.extent(1) == rc_.depth, fn, "codes", "has shape ",
            attnmix::detail::shape_of(next), " but must be [users, depth] = [", users, ", ",
            rc_.depth, "]");
    for (index_t u = 0; u < users; ++u)
      for (int l = 0; l < rc_.depth; ++l)
        require(next(u, l) >= 0 && next(u, l) < rc_.codes, fn, "codes", "[", u, ", ", l, "] is ",
                next(u, l), ", not a code in [0, ", rc_.codes, ")");

    const index_t D = hidden_size(), depth = rc_.depth, C = rc_.codes;
    const index_t rows = users * depth, hist = h.items.extent(0), V = depth * C;
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows)), labels(tokens.size());
    std::vector<std::int32_t> dec_cu(static_cast<std::size_t>(users + 1));
    for (index_t u = 0; u < users; ++u) {
      dec_cu[std::size_t(u)] = std::int32_t(u * depth);
      for (index_t l = 0; l < depth; ++l) {
        tokens[std::size_t(u * depth + l)] = l == 0 ? 0 : token(l - 1, next(u, l - 1));
        labels[std::size_t(l * users + u)] = next(u, l);  // by level: one call a level below
      }
    }
    dec_cu[std::size_t(users)] = std::int32_t(rows);
    const std::vector<std::int32_t> buckets = bucket_rows(h);
    using layers::scratch_bytes;
    typename O::scratch s(be, scratch_bytes<std::int32_t>(hist * rc_.hashes) +
                                  scratch_bytes<std::int32_t>(rows) * 2 +
                                  scratch_bytes<T>(hist * D) * 3 + scratch_bytes<T>(rows * D) * 3 +
                                  scratch_bytes<T>(rows * V) * 2 + scratch_bytes<double>(1));
    std::int32_t* dbuckets = s.template take<std::int32_t>(hist * rc_.hashes);
    std::int32_t *dtokens = s.template take<std::int32_t>(rows),
                 *dlabels = s.template take<std::int32_t>(rows);
    T *x = s.template take<T>(hist * D), *memory = s.template take<T>(hist * D),
      *dmemory = s.template take<T>(hist * D);
    T *y = s.template take<T>(rows * D), *z = s.template take<T>(rows * D),
      *dz = s.template take<T>(rows * D);
    T *logits = s.template take<T>(rows * V), *dlogits = s.template take<T>(rows * V);
    double* total = s.template take<double>(1);
    O::upload(be, dbuckets, buckets.data(), index_t(buckets.size()));
    O::upload(be, dtokens, tokens.data(), rows);
    O::upload(be, dlabels, labels.data(), rows);

    const layers::token_layout LH{1, hist, offsets_of(h)}, LD{1, rows, dec_cu};
    const layers::context<Backend> ch{be, LH, nullptr, handles_}, cd{be, LD, nullptr, handles_};
    const view3<T> xv(x, {1, hist, D}, space_of_v<Backend>),
        mv(memory, {1, hist, D}, space_of_v<Backend>), yv(y, {1, rows, D}, space_of_v<Backend>),
        zv(z, {1, rows, D}, space_of_v<Backend>);
    const view1<const std::int32_t> enc_cu(LH.cu_seqlens.data(), {users + 1}),
        dcu(dec_cu.data(), {users + 1});
    items.apply(ch, dbuckets, hist, x);
    typename Encoder::saved_type enc_saved;
    typename decoder_type::saved_type dec_saved;
    stack_inputs ein;
    ein.cu_seqlens = enc_cu;
    if (backward)
      encoder.forward(xv, mv, enc_saved, ein, be);
    else
      encoder.forward(xv, mv, ein, be);
    codes.apply(cd, dtokens, rows, y);
    const decoder_inputs din{dcu, enc_cu};
    if (backward)
      dec.forward(yv, mv, zv, dec_saved, din, be);
    else
      dec.forward(yv, mv, zv, din, be);
    head.apply(cd, z, rows, logits);
    // Level l's rows are rows u * depth + l: logits from column l * C, every depth-th row.
    if (backward) O::zero(be, dlogits, rows * V);
    O::zero(be, total, 1);
    for (index_t l = 0; l < depth; ++l)
      O::cross_entropy(cd, logits + l * V + l * C, depth * V, users, C, dlabels + l * users, -1,
                       backward ? dlogits + l * V + l * C : nullptr, depth * V, 1.0 / double(rows),
                       total);
    if (backward) {
      head.backward(cd, z, rows, dlogits, dz);
      dec.backward(mv, view3<const T>(dz, {1, rows, D}, space_of_v<Backend>), yv,
                   view3<T>(dmemory, {1, hist, D}, space_of_v<Backend>), dec_saved, be);
      codes.backward(cd, dtokens, rows, y);  // y holds d(code embeddings) now
      encoder.backward(view3<const T>(dmemory, {1, hist, D}, space_of_v<Backend>), xv, enc_saved,
                       be);
      items.backward(ch, dbuckets, hist, x);  // x holds d(item embeddings) now
    }
    double sum = 0;
    O::download(be, &sum, total, 1);
    return sum / double(rows);
  }

  // The encoder's output for the histories: memory [1, sum T, D] (packed as the histories), in the
  // backend's memory. Throws attnmix::error on bad arguments.
  void encode(const user_histories& h, const view3<T>& memory,
              const Backend& be = Backend{}) const {
    const std::string fn = "attnmix::generative_retrieval::encode";
    const index_t users = check_histories(fn, h), hist = h.items.extent(0), D = hidden_size();
    layers::detail::check_activation(fn, "memory", memory, D, space_of_v<Backend>, Backend::name);
    attnmix::detail::require(memory.extent(0) == 1 && memory.extent(1) == hist, fn, "memory",
                             "has shape ", attnmix::detail::shape_of(memory),
                             " but must be [1, items, D] = [1, ", hist, ", ", D, "]");
    O::check_memory(fn, "memory", memory);
    const std::vector<std::int32_t> buckets = bucket_rows(h);
    using layers::scratch_bytes;
    typename O::scratch s(
        be, scratch_bytes<std::int32_t>(hist * rc_.hashes) + scratch_bytes<T>(hist * D));
    std::int32_t* dbuckets = s.template take<std::int32_t>(hist * rc_.hashes);
    T* x = s.template take<T>(hist * D);
    O::upload(be, dbuckets, buckets.data(), index_t(buckets.size()));
    const layers::token_layout LH{1, hist, offsets_of(h)};
    items.apply(layers::context<Backend>{be, LH, nullptr, handles_}, dbuckets, hist, x);
    stack_inputs ein;
    ein.cu_seqlens = view1<const std::int32_t>(LH.cu_seqlens.data(), {users + 1});
    encoder.forward(view3<const T>(x, {1, hist, D}, space_of_v<Backend>), memory, ein, be);
  }

  // Users whose beams one decoder call scores (recommend's scratch grows with it).
  static constexpr index_t recommend_group = 32;

  // The top_k items of the catalogue `ids` (whose depth and codes are the model's) for each user,
  // best first, by a beam search of `width` beams over their semantic IDs: each history encoded
  // once, each level one decoder call for the beams of up to recommend_group users. Throws
  // attnmix::error on bad arguments (a width or top_k out of range, a catalogue of other codes).
  std::vector<beam_result> recommend(const user_histories& h, const semantic_ids& ids, int width,
                                     int top_k, const Backend& be = Backend{}) const {
    using attnmix::detail::require;
    const std::string fn = "attnmix::generative_retrieval::recommend";
    const index_t users = check_histories(fn, h);
    require(ids.depth() == rc_.depth && ids.codes == rc_.codes, fn, "ids", "has IDs of ",
            ids.depth(), " codes in [0, ", ids.codes, ") but the model's are ", rc_.depth,
            " codes in [0, ", rc_.codes, ")");
    require(width >= 1 && width <= ids.items, fn, "width", "is ", width, " but must be in [1, ",
            ids.items, "] (the catalogue's items)");
    require(top_k >= 1 && top_k <= width, fn, "top_k", "is ", top_k,
            " but must be in [1, width = ", width, "]");
    const index_t hist = h.items.extent(0), D = hidden_size(), C = rc_.codes;
    const index_t V = index_t(rc_.depth) * C;
    index_t longest = 0;
    for (index_t u = 0; u < users; ++u)
      longest = std::max<index_t>(longest, h.offsets(u + 1) - h.offsets(u));
    // In the backend's memory: the encoder's output, then per scoring call (the beams of up to
    // `group` users, at most `width` beams of depth tokens each) the tokens, their embeddings,
    // the decoder's output, the beams' last rows and their logits. The logits of the level scored
    // come back to the host.
    const index_t group = std::min<index_t>(users, recommend_group);
    using layers::scratch_bytes;
    const index_t max_beams = group * index_t(width), max_rows = max_beams * index_t(rc_.depth);
    typename O::scratch s(
        be, scratch_bytes<T>(hist * D) + scratch_bytes<std::int32_t>(max_rows) +
                scratch_bytes<T>(max_rows * D) * 2 + scratch_bytes<std::int64_t>(max_beams) +
                scratch_bytes<T>(max_beams * D) + scratch_bytes<T>(max_beams * V));
    T* memory = s.template take<T>(hist * D);
    std::int32_t* dtokens = s.template take<std::int32_t>(max_rows);
    T *x = s.template take<T>(max_rows * D), *z = s.template take<T>(max_rows * D);
    std::int64_t* dlast_rows = s.template take<std::int64_t>(max_beams);
    T* last = s.template take<T>(max_beams * D);
    T* logits = s.template take<T>(max_beams * V);
    const auto in_backend = [&](T* p, index_t rows) {
      return view3<T>(p, {1, rows, D}, space_of_v<Backend>);
    };
    encode(h, in_backend(memory, hist), be);
    auto cache = dec.make_memory_cache(users, longest);
    dec.remember(view3<const T>(memory, {1, hist, D}, space_of_v<Backend>), cache,
                 view1<const std::int32_t>(h.offsets.data(), {users + 1}), be);

    std::vector<beam_result> out;
    out.reserve(static_cast<std::size_t>(users));
    std::vector<std::int32_t> tokens, slots;
    std::vector<std::int64_t> last_rows;
    std::vector<T> level_logits;
    for (index_t u0 = 0; u0 < users; u0 += group) {
      // Each level one decoder call for the beams of users u0 .. u0 + group - 1, each beam
      // reading its user's remembered memory.
      const auto scorer = [&](const std::vector<std::vector<std::int32_t>>& prefixes,
                              const std::vector<index_t>& owner, std::vector<double>& logp) {
        const index_t beams = index_t(prefixes.size()), level = index_t(prefixes[0].size());
        const index_t len = level + 1, rows = beams * len;
        tokens.assign(static_cast<std::size_t>(rows), 0);
        last_rows.resize(static_cast<std::size_t>(beams));
        slots.resize(static_cast<std::size_t>(beams));
        for (index_t b = 0; b < beams; ++b) {
          for (index_t l = 0; l < level; ++l)
            tokens[std::size_t(b * len + l + 1)] =
                token(l, prefixes[std::size_t(b)][std::size_t(l)]);
          last_rows[std::size_t(b)] = b * len + level;
          slots[std::size_t(b)] = std::int32_t(u0 + owner[std::size_t(b)]);
        }
        O::upload(be, dtokens, tokens.data(), rows);
        O::upload(be, dlast_rows, last_rows.data(), beams);
        const layers::token_layout LB{beams, len, {}};
        const layers::context<Backend> c{be, LB, nullptr, handles_};
        codes.apply(c, dtokens, rows, x);
        dec.forward(view3<const T>(x, {beams, len, D}, space_of_v<Backend>),
                    view3<T>(z, {beams, len, D}, space_of_v<Backend>), cache, slots, be);
        // The last row of each beam predicts the next level, from that level's columns.
        O::move_rows(c, z, last, dlast_rows, static_cast<const std::int64_t*>(nullptr), beams, D);
        head.apply(c, last, beams, logits);
        level_logits.resize(static_cast<std::size_t>(beams * V));
        O::download(be, level_logits.data(), logits, beams * V);
        for (index_t b = 0; b < beams; ++b)
          log_softmax_row(level_logits.data() + b * V + level * C, C, logp.data() + b * C);
      };
      for (beam_result& r :
           beam_search_items_batched(ids, std::min(group, users - u0), width, top_k, scorer))
        out.push_back(std::move(r));
    }
    return out;
  }

  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") {
    visit(*this, f, prefix);
  }
  template <class F>
  void visit_parameters(F&& f, const std::string& prefix = "") const {
    visit(*this, f, prefix);
  }

 private:
  retrieval_config rc_;
  typename O::handles handles_{};

 public:
  layers::hash_embedding<T, Backend> items;
  Encoder encoder;
  layers::embedding<T, Backend> codes;
  decoder_type dec;
  layers::linear<T, Backend> head;

 private:
  template <class Self, class F>
  static void visit(Self& s, F& f, const std::string& prefix) {
    s.items.visit_parameters(f, prefix + "items.");
    s.encoder.visit_parameters(f, prefix + "encoder.");
    s.codes.visit_parameters(f, prefix + "codes.");
    s.dec.visit_parameters(f, prefix + "decoder.");
    s.head.visit_parameters(f, prefix + "head.");
  }

  // The decoder's input token of code `code` of level `level` (0 is BOS).
  std::int32_t token(index_t level, std::int32_t code) const {
    return std::int32_t(1 + level * rc_.codes + code);
  }

  static retrieval_config checked(const layers::config& c, const retrieval_config& r) {
    using attnmix::detail::require;
    const std::string fn = "attnmix::generative_retrieval";
    layers::validate_config(fn, c);
    require(r.depth >= 1, fn, "retrieval.depth", "must be >= 1 but is ", r.depth);
    require(r.codes >= 1, fn, "retrieval.codes", "must be >= 1 but is ", r.codes);
    require(r.hashes >= 1, fn, "retrieval.hashes", "must be >= 1 but is ", r.hashes);
    require(r.part >= 0, fn, "retrieval.part", "must be >= 0 (0: hidden_size / hashes) but is ",
            r.part);
    require(r.part > 0 || c.hidden_size >= r.hashes, fn, "retrieval.part", "is 0 but hidden_size ",
            c.hidden_size, " / hashes ", r.hashes, " is 0");
    require(index_t(r.depth) * r.codes < INT32_MAX, fn, "retrieval.codes", "is ", r.codes,
            " and depth ", r.depth, ": the decoder's tokens would not fit an int32");
    return r;
  }

  // Checks a call's histories and returns the number of users.
  index_t check_histories(const std::string& fn, const user_histories& h) const {
    using attnmix::detail::require;
    attnmix::detail::check_given(fn, "offsets", h.offsets);
    attnmix::detail::check_space(fn, "offsets", h.offsets, memory_space::host, "history offsets");
    require(h.offsets.extent(0) >= 2, fn, "offsets", "holds ", h.offsets.extent(0),
            " offsets; a call needs at least one user (2 offsets)");
    if (h.items.extent(0) > 0) {
      attnmix::detail::check_given(fn, "items", h.items);
      attnmix::detail::check_space(fn, "items", h.items, memory_space::host, "item hashing");
    }
    attnmix::detail::check_offsets(fn, "offsets", h.offsets, h.items.extent(0));
    const index_t users = h.offsets.extent(0) - 1;
    for (index_t u = 0; u < users; ++u)
      require(h.offsets(u + 1) > h.offsets(u), fn, "offsets", "give user ", u,
              " an empty history; every user needs at least one item");
    return users;
  }
  std::vector<std::int32_t> offsets_of(const user_histories& h) const {
    std::vector<std::int32_t> cu(static_cast<std::size_t>(h.offsets.extent(0)));
    for (index_t i = 0; i < h.offsets.extent(0); ++i) cu[std::size_t(i)] = h.offsets(i);
    return cu;
  }
  std::vector<std::int32_t> bucket_rows(const user_histories& h) const {
    const index_t n = h.items.extent(0);
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) ids[std::size_t(i)] = h.items(i);
    std::vector<std::int32_t> rows(static_cast<std::size_t>(n * rc_.hashes));
    items.bucket_rows(ids.data(), n, rows.data());
    return rows;
  }
  static void log_softmax_row(const T* z, index_t n, double* out) {
    const auto at = [&](index_t i) {
      return double(accum_t<T>(z[i]));
    };  // 16-bit: via float
    double m = -std::numeric_limits<double>::infinity();
    for (index_t i = 0; i < n; ++i) m = std::max(m, at(i));
    double s = 0;
    for (index_t i = 0; i < n; ++i) s += std::exp(at(i) - m);
    const double lse = m + std::log(s);
    for (index_t i = 0; i < n; ++i) out[i] = at(i) - lse;
  }
};

}  // namespace attnmix
