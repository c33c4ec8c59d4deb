#pragma once
// Weights in and out: the safetensors format (an 8-byte little-endian header length N, N bytes
// of JSON {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "value"}}, then the data). The JSON header is parsed with
// nlohmann-json (Debian: nlohmann-json3-dev), which is why this header is not in the
// attnmix.hpp umbrella.
//
//   attnmix::io::save(model, "model.safetensors");   // every parameter, in its own dtype
//   attnmix::io::load(model, "model.safetensors");   // strict: names, shapes and dtypes
//
// Every defect of a file (truncated, corrupt header, unknown dtype, offsets out of range or
// overlapping) and every mismatch with the model (a missing, extra or wrongly shaped tensor,
// a dtype that does not convert losslessly) throws attnmix::error naming the file and the
// tensor. A failed load leaves the model unchanged.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "attnmix/core/error.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/layers/common.hpp"

namespace attnmix {
namespace io {

// Element types of the format. Only the floating types load into parameters.
enum class dtype {
  f64,
  f32,
  f16,
  bf16,
  i64,
  i32,
  i16,
  i8,
  u64,
  u32,
  u16,
  u8,
  boolean,
  f8_e4m3,
  f8_e5m2
};

inline const char* to_string(dtype t) {
  switch (t) {
    case dtype::f64:
      return "F64";
    case dtype::f32:
      return "F32";
    case dtype::f16:
      return "F16";
    case dtype::bf16:
      return "BF16";
    case dtype::i64:
      return "I64";
    case dtype::i32:
      return "I32";
    case dtype::i16:
      return "I16";
    case dtype::i8:
      return "I8";
    case dtype::u64:
      return "U64";
    case dtype::u32:
      return "U32";
    case dtype::u16:
      return "U16";
    case dtype::u8:
      return "U8";
    case dtype::boolean:
      return "BOOL";
    case dtype::f8_e4m3:
      return "F8_E4M3";
    case dtype::f8_e5m2:
      return "F8_E5M2";
  }
  return "?";
}

inline std::size_t element_size(dtype t) {
  switch (t) {
    case dtype::f64:
    case dtype::i64:
    case dtype::u64:
      return 8;
    case dtype::f32:
    case dtype::i32:
    case dtype::u32:
      return 4;
    case dtype::f16:
    case dtype::bf16:
    case dtype::i16:
    case dtype::u16:
      return 2;
    default:
      return 1;
  }
}

// The dtype a parameter of element type T is saved as.
template <class T>
constexpr dtype dtype_of() {
  static_assert(
      std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t>,
      "attnmix::io: parameters are float, double or int32 (codes)");
  return std::is_same_v<T, float>    ? dtype::f32
         : std::is_same_v<T, double> ? dtype::f64
                                     : dtype::i32;
}

// One tensor entry of a file.
struct tensor_info {
  std::string name;
  dtype type = dtype::f32;
  std::vector<index_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte range within the data section
};

namespace detail {

[[noreturn]] inline void fail(const std::string& fn, const std::string& file,
                              const std::string& what) {
  throw error(fn + ": file '" + file + "' " + what);
}

inline bool parse_dtype(const std::string& s, dtype& out) {
  static const std::pair<const char*, dtype> names[] = {
      {"F64", dtype::f64},      {"F32", dtype::f32},         {"F16", dtype::f16},
      {"BF16", dtype::bf16},    {"I64", dtype::i64},         {"I32", dtype::i32},
      {"I16", dtype::i16},      {"I8", dtype::i8},           {"U64", dtype::u64},
      {"U32", dtype::u32},      {"U16", dtype::u16},         {"U8", dtype::u8},
      {"BOOL", dtype::boolean}, {"F8_E4M3", dtype::f8_e4m3}, {"F8_E5M2", dtype::f8_e5m2}};
  for (const auto& [n, t] : names)
    if (s == n) {
      out = t;
      return true;
    }
  return false;
}

// The safetensors reference implementation refuses headers above 100 MB; so do we, before
// allocating anything that large.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

}  // namespace detail

// A parsed safetensors file held in memory.
class safetensors_file {
 public:
  // Parses `bytes` (the whole file); `source` names it in error messages.
  // Throws attnmix::error on any defect; never reads outside `bytes`.
  static safetensors_file parse(std::vector<unsigned char> bytes, const std::string& source) {
    const std::string fn = "attnmix::io::safetensors_file::parse";
    safetensors_file f;
    f.source_ = source;
    f.bytes_ = std::move(bytes);
    const auto& b = f.bytes_;
    if (b.size() < 8)
      detail::fail(fn, source,
                   "is truncated: " + std::to_string(b.size()) +
                       " bytes, fewer than the 8-byte header length");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | b[static_cast<std::size_t>(i)];
    if (n > detail::max_header_bytes)
      detail::fail(
          fn, source,
          "is corrupt: its header length " + std::to_string(n) + " exceeds the 100 MB limit");
    if (n > b.size() - 8)
      detail::fail(fn, source,
                   "is truncated: the header needs " + std::to_string(n) + " bytes but only " +
                       std::to_string(b.size() - 8) + " follow");
    f.data_offset_ = 8 + static_cast<std::size_t>(n);
    const std::uint64_t data_size = b.size() - f.data_offset_;

    const auto* first = reinterpret_cast<const char*>(b.data() + 8);
    nlohmann::json header =
        nlohmann::json::parse(first, first + n, nullptr, /*allow_exceptions=*/false);
    if (header.is_discarded()) detail::fail(fn, source, "is corrupt: its header is not valid JSON");
    if (!header.is_object())
      detail::fail(fn, source, "is corrupt: its header is not a JSON object");

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& e = it.value();
      if (name == "__metadata__") {
        if (!e.is_object()) detail::fail(fn, source, "is corrupt: '__metadata__' is not an object");
        for (auto m = e.begin(); m != e.end(); ++m) {
          if (!m.value().is_string())
            detail::fail(fn, source,
                         "is corrupt: metadata entry '" + m.key() + "' is not a string");
          f.metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const auto bad = [&](const std::string& what) {
        detail::fail(fn, source, "is corrupt: tensor '" + name + "' " + what);
      };
      if (!e.is_object()) bad("is not a JSON object");
      tensor_info t;
      t.name = name;
      const auto dt = e.find("dtype");
      if (dt == e.end() || !dt->is_string()) bad("has no string 'dtype'");
      if (!detail::parse_dtype(dt->get<std::string>(), t.type))
        bad("has an unknown dtype '" + dt->get<std::string>() + "'");
      const auto sh = e.find("shape");
      if (sh == e.end() || !sh->is_array()) bad("has no array 'shape'");
      if (sh->size() > 8) bad("has rank " + std::to_string(sh->size()) + ", more than 8");
      std::uint64_t numel = 1;
      for (const auto& d : *sh) {
        if (!d.is_number_unsigned()) bad("has a shape entry that is not a non-negative integer");
        const std::uint64_t v = d.get<std::uint64_t>();
        if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
            (v != 0 && numel > data_size / v))
          bad("has a shape larger than the file's data");
        numel *= v;
        t.shape.push_back(static_cast<index_t>(v));
      }
      const auto off = e.find("data_offsets");
      if (off == e.end() || !off->is_array() || off->size() != 2 ||
          !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
        bad("has no 'data_offsets' pair of non-negative integers");
      t.begin = (*off)[0].get<std::uint64_t>();
      t.end = (*off)[1].get<std::uint64_t>();
      if (t.begin > t.end) bad("has data_offsets that end before they begin");
      if (t.end > data_size)
        detail::fail(fn, source,
                     "is truncated: tensor '" + name + "' ends at data byte " +
                         std::to_string(t.end) + " but the data section has " +
                         std::to_string(data_size) + " bytes");
      if (numel * detail_size(t.type) != t.end - t.begin)
        bad("has " + std::to_string(t.end - t.begin) + " bytes of data but its shape " +
            layers::shape_string(t.shape) + " and dtype " + to_string(t.type) + " need " +
            std::to_string(numel * detail_size(t.type)));
      f.tensors_.push_back(std::move(t));
    }
    // Tensors must not share bytes: sorted by where they begin, each begins at or after the
    // furthest end so far. An empty tensor may sit at an edge but not inside another's bytes.
    std::vector<const tensor_info*> order;
    for (const auto& t : f.tensors_) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const tensor_info* a, const tensor_info* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    const tensor_info* furthest = nullptr;  // the tensor that ends last among those before
    for (const tensor_info* t : order) {
      if (furthest != nullptr && t->begin < furthest->end)
        detail::fail(fn, source,
                     "is corrupt: tensors '" + furthest->name + "' and '" + t->name +
                         "' overlap (data bytes [" + std::to_string(furthest->begin) + ", " +
                         std::to_string(furthest->end) + ") and [" + std::to_string(t->begin) +
                         ", " + std::to_string(t->end) + "))");
      if (furthest == nullptr || t->end > furthest->end) furthest = t;
    }
    return f;
  }

  // Reads and parses a file. Throws attnmix::error if it cannot be read or is malformed.
  static safetensors_file read(const std::string& path) {
    const char* fn = "attnmix::io::safetensors_file::read";
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) detail::fail(fn, path, "is a directory");
    std::ifstream in(path, std::ios::binary);
    if (!in) detail::fail(fn, path, "cannot be opened for reading");
    std::vector<unsigned char> bytes;
    try {  // the stream library reports some read errors (EISDIR, EIO) by throwing
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } catch (const std::ios_base::failure& e) {
      detail::fail(fn, path, std::string("could not be read: ") + e.what());
    }
    if (in.bad()) detail::fail(fn, path, "could not be read");
    return parse(std::move(bytes), path);
  }

  const std::string& source() const { return source_; }
  const std::vector<tensor_info>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const tensor_info* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

  // The values of `t` as T. Dtypes that convert exactly are accepted: F32, F16 and BF16 into
  // float; those, F64 and I32 into double; I32 into int32. Anything else throws attnmix::error, as
  // does a
  // tensor_info (made or edited by the caller) whose byte range is not its shape's and dtype's
  // within this file's data.
  template <class T>
  std::vector<T> values(const tensor_info& t) const {
    const std::string fn = "attnmix::io::safetensors_file::values";
    check_convertible<T>(fn, t);
    check_range(fn, t);
    std::vector<T> out(static_cast<std::size_t>((t.end - t.begin) / detail_size(t.type)));
    const unsigned char* p = bytes_.data() + data_offset_ + t.begin;
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = element<T>(p, i, t.type);
    return out;
  }

  template <class T>
  void check_convertible(const std::string& fn, const tensor_info& t) const {
    const bool floating = t.type == dtype::f32 || t.type == dtype::f16 || t.type == dtype::bf16;
    const bool ok = std::is_same_v<T, std::int32_t>
                        ? t.type == dtype::i32
                        : floating || (std::is_same_v<T, double> &&
                                       (t.type == dtype::f64 || t.type == dtype::i32));
    if (!ok)
      detail::fail(fn, source_,
                   "tensor '" + t.name + "' has dtype " + to_string(t.type) +
                       " but the model's parameter is " + to_string(dtype_of<T>()) +
                       " (F16 and BF16 also load; nothing that would lose precision)");
  }

 private:
  static std::size_t detail_size(dtype t) { return element_size(t); }

  // t's byte range lies in the data section and holds exactly its shape's elements.
  void check_range(const std::string& fn, const tensor_info& t) const {
    const std::uint64_t data_size = bytes_.size() - data_offset_;
    const auto range = [&] {
      return "tensor '" + t.name + "' has data bytes [" + std::to_string(t.begin) + ", " +
             std::to_string(t.end) + ")";
    };
    if (t.begin > t.end || t.end > data_size)
      detail::fail(fn, source_,
                   range() + ", outside the " + std::to_string(data_size) + " bytes of data");
    std::uint64_t numel = 1;
    for (const index_t e : t.shape) {
      const auto u = static_cast<std::uint64_t>(e);
      if (e < 0 || (u != 0 && numel > data_size / u))
        detail::fail(fn, source_,
                     range() + " but a shape " + layers::shape_string(t.shape) +
                         " larger than the file's data");
      numel *= u;
    }
    if (numel * detail_size(t.type) != t.end - t.begin)
      detail::fail(fn, source_,
                   range() + " but its shape " + layers::shape_string(t.shape) + " and dtype " +
                       to_string(t.type) + " need " + std::to_string(numel * detail_size(t.type)));
  }

  template <class T>
  static T element(const unsigned char* p, std::size_t i, dtype t) {
    switch (t) {
      case dtype::f64: {
        double v;
        std::memcpy(&v, p + 8 * i, 8);
        return static_cast<T>(v);
      }
      case dtype::f32: {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return static_cast<T>(v);
      }
      case dtype::i32: {
        std::int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        return static_cast<T>(v);
      }
      case dtype::f16:
      case dtype::bf16: {
        std::uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);
        return static_cast<T>(t == dtype::f16 ? attnmix::detail::half_bits_to_float(bits)
                                              : attnmix::detail::bfloat16_bits_to_float(bits));
      }
      default:
        return T(0);
    }
  }

  std::string source_;
  std::vector<unsigned char> bytes_;
  std::size_t data_offset_ = 0;
  std::vector<tensor_info> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: raw little-endian bytes of `type`.
struct tensor_bytes {
  std::string name;
  dtype type = dtype::f32;
  std::vector<index_t> shape;
  const void* data = nullptr;
  std::size_t bytes = 0;
};

namespace detail {

// Every entry makes a well-formed tensor: extents >= 0, exactly the bytes its shape and dtype
// need (behind a pointer when there are any), a name of its own that is not "__metadata__".
// Throws attnmix::error("<fn>: argument '<arg>' ...").
inline void check_tensors(const std::string& fn, const char* arg,
                          const std::vector<tensor_bytes>& tensors) {
  using attnmix::detail::fail;
  std::map<std::string, bool> seen;
  for (const auto& t : tensors) {
    const std::string what = "has tensor '" + t.name + "'";
    if (t.name == "__metadata__") fail(fn, arg, what, ", a name the format keeps for the metadata");
    if (!seen.emplace(t.name, true).second) fail(fn, arg, what, " twice");
    std::uint64_t bytes = element_size(t.type);
    for (const index_t e : t.shape) {
      if (e < 0)
        fail(fn, arg, what, " with a negative extent in its shape ", layers::shape_string(t.shape));
      if (e != 0 && bytes > std::numeric_limits<std::uint64_t>::max() / std::uint64_t(e))
        fail(fn, arg, what, " of shape ", layers::shape_string(t.shape), ", too large");
      bytes *= std::uint64_t(e);
    }
    if (bytes != t.bytes)
      fail(fn, arg, what, " of ", t.bytes, " bytes but shape ", layers::shape_string(t.shape),
           " of ", to_string(t.type), " needs ", bytes);
    if (t.bytes > 0 && t.data == nullptr)
      fail(fn, arg, what, " of ", t.bytes, " bytes but a null pointer");
  }
}

}  // namespace detail

// Serialises tensors (in the given order) and metadata into safetensors bytes. Throws
// attnmix::error for an entry that would not make a well-formed file (see check_tensors).
inline std::vector<unsigned char> serialize(
    const std::vector<tensor_bytes>& tensors,
    const std::map<std::string, std::string>& metadata = {}) {
  detail::check_tensors("attnmix::io::serialize", "tensors", tensors);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    nlohmann::ordered_json e;
    e["dtype"] = to_string(t.type);
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + t.bytes};
    header[t.name] = e;
    offset += t.bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // keep the data 8-byte aligned
  std::vector<unsigned char> out(8 + h.size() + offset);
  std::uint64_t n = h.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::memcpy(out.data() + 8, h.data(), h.size());
  std::size_t pos = 8 + h.size();
  for (const auto& t : tensors) {
    if (t.bytes) std::memcpy(out.data() + pos, t.data, t.bytes);
    pos += t.bytes;
  }
  return out;
}

inline void write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) detail::fail("attnmix::io::save", path, "cannot be opened for writing");
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) detail::fail("attnmix::io::save", path, "could not be written completely");
}

// Saves every parameter of `model` (anything with visit_parameters) under its name, in its own
// dtype (F32 for float, F64 for double). Throws attnmix::error, before the file is opened, for
// a parameter whose values do not fill its shape or a name used twice; and if the file cannot
// be written.
template <class Model>
void save(const Model& model, const std::string& path,
          const std::map<std::string, std::string>& metadata = {{"format", "pt"}}) {
  const std::string fn = "attnmix::io::save";
  std::vector<tensor_bytes> list;
  model.visit_parameters([&](const std::string& name, const auto& p) {
    using T = typename std::decay_t<decltype(p.data)>::value_type;
    index_t n = 1;
    for (const index_t e : p.shape)
      attnmix::detail::require(e >= 0 && attnmix::detail::checked_mul(n, e, n), fn, "model",
                               "has parameter '", name, "' of shape ",
                               layers::shape_string(p.shape), ", which no tensor can have");
    attnmix::detail::require(p.data.size() == static_cast<std::size_t>(n), fn, "model",
                             "has parameter '", name, "' of shape ", layers::shape_string(p.shape),
                             " but ", p.data.size(), " values");
    list.push_back({name, dtype_of<T>(), p.shape, p.data.data(), p.data.size() * sizeof(T)});
  });
  detail::check_tensors(fn, "model", list);
  write_file(path, serialize(list, metadata));
}

namespace detail {
template <class Model, class = void>
struct has_check_loaded : std::false_type {};
template <class Model>
struct has_check_loaded<Model, std::void_t<decltype(std::declval<const Model&>().check_loaded(
                                   std::declval<std::vector<double> (&)(const std::string&)>(),
                                   std::declval<void (&)(const std::string&)>()))>>
    : std::true_type {};
}  // namespace detail

// Loads every parameter of `model` from a parsed file. Strict: each parameter must be present
// with its exact shape and a dtype that converts losslessly, and the file must hold no other
// tensor. A model may also check the values themselves (an optimiser's step count, say): if it
// has check_loaded(values, reject), it is called once the names, shapes and dtypes have passed;
// values(name) gives a tensor's values as doubles and reject(what) throws attnmix::error naming
// the file. Throws attnmix::error naming the tensor and the file; the model is unchanged then.
template <class Model>
void load(Model& model, const safetensors_file& file) {
  const std::string fn = "attnmix::io::load";
  std::map<std::string, bool> used;
  // Pass 1: check everything.
  model.visit_parameters([&](const std::string& name, auto& p) {
    using T = typename std::decay_t<decltype(p.data)>::value_type;
    const tensor_info* t = file.find(name);
    if (t == nullptr)
      detail::fail(fn, file.source(),
                   "has no tensor '" + name + "' (shape " + layers::shape_string(p.shape) +
                       "), which the model needs");
    if (t->shape != p.shape)
      detail::fail(fn, file.source(),
                   "tensor '" + name + "' has shape " + layers::shape_string(t->shape) +
                       " but the model expects " + layers::shape_string(p.shape));
    file.check_convertible<T>(fn, *t);
    used[name] = true;
  });
  std::size_t extra = 0;
  std::string first_extra;
  for (const auto& t : file.tensors())
    if (!used.count(t.name)) {
      if (extra++ == 0) first_extra = t.name;
    }
  if (extra)
    detail::fail(fn, file.source(),
                 "has tensor '" + first_extra + "'" +
                     (extra > 1 ? " (and " + std::to_string(extra - 1) + " more)" : "") +
                     " that the model does not have");
  if constexpr (detail::has_check_loaded<Model>::value) {
    const auto values = [&](const std::string& name) -> std::vector<double> {
      const tensor_info* t = file.find(name);
      if (t == nullptr) detail::fail(fn, file.source(), "has no tensor '" + name + "'");
      return file.values<double>(*t);
    };
    const auto reject = [&](const std::string& what) {
      detail::fail(fn, file.source(), what);
    };
    static_cast<const Model&>(model).check_loaded(values, reject);
  }
  // Pass 2: copy.
  model.visit_parameters([&](const std::string& name, auto& p) {
    using T = typename std::decay_t<decltype(p.data)>::value_type;
    p.data = file.values<T>(*file.find(name));
  });
}

template <class Model>
void load(Model& model, const std::string& path) {
  load(model, safetensors_file::read(path));
}

}  // namespace io
}  // namespace attnmix
