// attnmix path_generate: a small PaTH-FoX language model (fla's PaTHAttentionForCausalLM
// layout: model.embeddings, model.layers.{i}.{attn_norm,attn,mlp_norm,mlp}, model.norm, lm_head)
// with random weights saved to and loaded from a safetensors file, a prompt prefilled into the
// decoding caches, then greedy decoding token by token. Checks that every decoded step's logits
// equal those of the full forward over the same tokens; exits non-zero if not.
//   path_generate [prompt=24] [new tokens=40] [file=path_generate.safetensors]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <attnmix/attnmix.hpp>
#include <attnmix/io/safetensors.hpp>

namespace {

using attnmix::index_t;
namespace layer = attnmix::layer;
namespace L = attnmix::layers;

// Embeddings, a causal stack and an untied LM head.
struct path_lm {
  using body_type = attnmix::stack<float, attnmix::repeat<2, layer::path_fox>>;
  index_t vocab, D;
  L::parameter<float> embeddings, lm_head;
  body_type body;

  path_lm(const L::config& c, index_t v)
      : vocab(v),
        D(c.hidden_size),
        embeddings({v, c.hidden_size}),
        lm_head({v, c.hidden_size}),
        body(c) {}

  template <class F>
  void visit_parameters(F&& f) {
    f("model.embeddings.weight", embeddings);
    body.visit_parameters(f, "model.");
    f("lm_head.weight", lm_head);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    f("model.embeddings.weight", embeddings);
    body.visit_parameters(f, "model.");
    f("lm_head.weight", lm_head);
  }

  attnmix::host_tensor<float, 3> embed(const std::vector<int>& tokens, index_t rows,
                                       index_t cols) const {
    attnmix::host_tensor<float, 3> x({rows, cols, D});
    for (std::size_t i = 0; i < tokens.size(); ++i)
      std::copy_n(embeddings.ptr() + tokens[i] * D, D, x.data() + static_cast<index_t>(i) * D);
    return x;
  }
  // logits [rows, vocab] of hidden states [rows, D].
  std::vector<float> logits(const float* h, index_t rows) const {
    std::vector<float> out(static_cast<std::size_t>(rows * vocab));
    L::linear<float> head(D, vocab);
    head.weight = lm_head;
    head.apply(h, rows, out.data(), attnmix::backend::cpu{});
    return out;
  }
};

int argmax(const float* v, index_t n) {
  return static_cast<int>(std::max_element(v, v + n) - v);
}

}  // namespace

int main(int argc, char** argv) {
  const index_t prompt = argc > 1 ? std::atol(argv[1]) : 24;
  const index_t steps = argc > 2 ? std::atol(argv[2]) : 40;
  const std::string file = argc > 3 ? argv[3] : "path_generate.safetensors";
  if (prompt < 1 || steps < 1) {
    std::fprintf(stderr, "usage: path_generate [prompt>=1] [new tokens>=1] [file]\n");
    return 2;
  }
  try {
    L::config c;
    c.hidden_size = 64;
    c.num_heads = 4;
    const index_t V = 512;
    path_lm saved(c, V);
    L::randomize_parameters(saved, 7, 0.1, 0.1);
    attnmix::io::save(saved, file);
    path_lm m(c, V);  // a fresh model: everything comes from the file
    attnmix::io::load(m, file);
    std::size_t count = 0;
    m.visit_parameters([&](const std::string&, const auto& p) { count += p.data.size(); });
    std::printf(
        "attnmix path_generate: PaTH-FoX LM, 2 layers, D = 64, 4 heads, vocab %lld, "
        "%zu parameters loaded from %s\n",
        static_cast<long long>(V), count, file.c_str());

    std::mt19937 gen(3);
    std::vector<int> tokens;
    for (index_t i = 0; i < prompt; ++i)
      tokens.push_back(std::uniform_int_distribution<int>(0, int(V) - 1)(gen));

    // Prefill the prompt, then decode greedily.
    auto cache = m.body.make_cache(1, prompt + steps);
    auto xp = m.embed(tokens, 1, prompt);
    attnmix::host_tensor<float, 3> hp(xp.shape());
    m.body.prefill(xp.view(), hp.view(), cache);
    std::vector<float> step_logits;  // [steps, V]: logits that chose each new token
    auto last = m.logits(hp.data() + (prompt - 1) * c.hidden_size, 1);
    for (index_t s = 0; s < steps; ++s) {
      step_logits.insert(step_logits.end(), last.begin(), last.end());
      tokens.push_back(argmax(last.data(), V));
      if (s + 1 == steps) break;
      auto x1 = m.embed({tokens.back()}, 1, 1);
      attnmix::host_tensor<float, 3> h1(x1.shape());
      m.body.decode(x1.view(), h1.view(), cache);
      last = m.logits(h1.data(), 1);
    }
    std::printf("generated:");
    for (index_t i = prompt; i < prompt + steps; ++i)
      std::printf(" %d", tokens[static_cast<std::size_t>(i)]);
    std::printf("\n");

    // The full forward over prompt + generated tokens gives the same logits at every step.
    const index_t total = prompt + steps - 1;
    auto xf = m.embed(std::vector<int>(tokens.begin(), tokens.begin() + total), 1, total);
    attnmix::host_tensor<float, 3> hf(xf.shape());
    m.body.forward(xf.view(), hf.view());
    const auto full = m.logits(hf.data() + (prompt - 1) * c.hidden_size, steps);
    double num = 0, den = 0;
    bool same_tokens = true;
    for (index_t s = 0; s < steps; ++s) {
      for (index_t v = 0; v < V; ++v) {
        const double d = double(step_logits[static_cast<std::size_t>(s * V + v)]) -
                         full[static_cast<std::size_t>(s * V + v)];
        num += d * d;
        den += double(full[static_cast<std::size_t>(s * V + v)]) *
               full[static_cast<std::size_t>(s * V + v)];
      }
      same_tokens = same_tokens &&
                    argmax(full.data() + s * V, V) == tokens[static_cast<std::size_t>(prompt + s)];
    }
    const double rel = std::sqrt(num / den);
    const bool ok = std::isfinite(rel) && rel < 1e-4;  // argmax ties may differ, logits may not
    std::printf("decoding vs full forward: relative logit error %.2e, greedy tokens %s -> %s\n",
                rel, same_tokens ? "identical" : "DIFFERENT",
                ok ? "decode matches the full forward" : "MISMATCH");
    return ok ? 0 : 1;
  } catch (const attnmix::error& e) {
    std::fprintf(stderr, "path_generate: %s\n", e.what());
    return 1;
  }
}
