// libFuzzer target: the safetensors parser must either accept a file or throw attnmix::error,
// never crash, hang or read out of bounds. Accepted files are read back in full.
//   cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DATTNMIX_BUILD_FUZZERS=ON
//   cmake --build build/fuzz --target fuzz_safetensors
//   ./build/fuzz/tests/fuzz/fuzz_safetensors tests/io/corpus -max_total_time=60
// Inputs that once failed are kept in tests/io/corpus/, which test_io replays on every CI run.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnmix/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto f =
        attnmix::io::safetensors_file::parse(std::vector<unsigned char>(data, data + size), "fuzz");
    for (const auto& t : f.tensors()) {
      if (t.type == attnmix::io::dtype::f64) (void)f.values<double>(t);
      if (t.type == attnmix::io::dtype::f32 || t.type == attnmix::io::dtype::f16 ||
          t.type == attnmix::io::dtype::bf16)
        (void)f.values<float>(t);
    }
  } catch (const attnmix::error&) {
  }
  return 0;
}
