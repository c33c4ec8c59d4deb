// attnmix::io from a downstream project: a small GBLA stack saved and loaded back bit-exactly.
#include <attnmix/attnmix.hpp>
#include <attnmix/io/safetensors.hpp>

#include <cstdio>

int main() {
  using model = attnmix::stack<float, attnmix::layer::gbla>;
  attnmix::layers::config cfg;
  cfg.hidden_size = 32;
  cfg.num_heads = 2;
  model saved(cfg), loaded(cfg);
  attnmix::layers::randomize_parameters(saved, 7);
  attnmix::io::save(saved, "consumer.safetensors");
  attnmix::io::load(loaded, "consumer.safetensors");
  attnmix::host_tensor<float, 3> x({1, 5, 32}, 0.5f), a({1, 5, 32}), b({1, 5, 32});
  saved.forward(x.view(), a.view());
  loaded.forward(x.view(), b.view());
  const bool ok = a.storage() == b.storage();
  std::printf("consumer io: %s\n", ok ? "ok" : "outputs differ");
  return ok ? 0 : 1;
}
