// The GBLA paper's generative-retrieval experiment (Matveev et al. 2026) at a small size on
// attnmix: a recommender reads a user's history of item IDs with an encoder and generates the
// semantic ID of the next item with a one-block decoder; four encoders are trained on the same
// data and compared by Recall@K of the next item: bidirectional SA, causal SA, the hybrid
// [SA, GBLA, GBLA] and GBLA in every layer.
//
// The data (synthetic, from a seed): items carry a latent vector (a cluster centre plus noise);
// a user likes two clusters and their history is drawn from both; the next item is the item
// nearest to the mean of the whole history's vectors, so that every item of the history,
// wherever it stands, moves the answer. Semantic IDs come from residual k-means over the
// item vectors (retrieval/semantic_ids.hpp).
//
//   generative_retrieval [--encoders bi_sa,causal_sa,hybrid,gbla] [--seeds 1] [--first-seed 0]
//                        [--items 2048] [--clusters 32] [--codes 16] [--history 32]
//                        [--width 64] [--heads 4] [--steps 1500] [--batch 32]
//                        [--lr 3e-3] [--users 200] [--beam 100] [--threads 0] [--every 500]
//                        [--device cpu]
//
// Built by nvcc (generative_retrieval_cuda), --device cuda trains and evaluates each model on the
// GPU (float), its weights starting as the CPU model's of the same seed.
// Prints a progress line per run and the table of Recall@1/10/100 (those K not above the beam)
// beside the paper's figures (Recall@1000 at history 2048, on its own data).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#ifdef __CUDACC__
#include "attnmix/cuda.cuh"
#endif
#include "attnmix/retrieval/generative_retrieval.hpp"
#include "attnmix/train/optimizer.hpp"
#include "attnmix/train/progress.hpp"
#include "attnmix/train/schedule.hpp"

namespace {

using attnmix::index_t;

struct options {
  std::vector<std::string> encoders{"bi_sa", "causal_sa", "hybrid", "gbla"};
  int seeds = 1, first_seed = 0;
  index_t items = 2048, clusters = 32, history = 32, width = 64, heads = 4;
  int codes = 16, steps = 1500, batch = 32, users = 200, beam = 100, threads = 0, every = 500;
  double lr = 3e-3;
  std::string device = "cpu";
};

// The catalogue and the generative process of histories and next items.
struct world {
  static constexpr index_t dim = 8;
  index_t items, clusters;
  std::vector<float> vectors;                 // [items, dim]
  std::vector<index_t> cluster;               // of each item
  std::vector<std::vector<index_t>> members;  // items of each cluster
  attnmix::semantic_ids ids;

  world(index_t n, index_t k, int codes, std::uint64_t seed) : items(n), clusters(k) {
    std::mt19937_64 g(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> centres(static_cast<std::size_t>(k * dim));
    for (float& c : centres) c = 2.f * normal(g);
    vectors.resize(static_cast<std::size_t>(n * dim));
    cluster.resize(static_cast<std::size_t>(n));
    members.resize(static_cast<std::size_t>(k));
    for (index_t i = 0; i < n; ++i) {
      const index_t c = index_t(g() % std::uint64_t(k));
      cluster[std::size_t(i)] = c;
      members[std::size_t(c)].push_back(i);
      for (index_t d = 0; d < dim; ++d)
        vectors[std::size_t(i * dim + d)] = centres[std::size_t(c * dim + d)] + 0.7f * normal(g);
    }
    // Items of one cluster crowd a few codes: where more of them share every code than a level
    // has codes, twice the codes a level.
    attnmix::semantic_id_options o;
    o.levels = 2, o.codes = codes, o.seed = seed;
    for (;; o.codes *= 2) {
      try {
        ids = attnmix::assign_semantic_ids(vectors.data(), n, dim, o);
        break;
      } catch (const attnmix::error&) {
        if (o.codes >= n) throw;
      }
    }
  }

  static std::uint64_t item_id(index_t i) { return 0x2545f4914f6cdd1dull * std::uint64_t(i + 1); }

  // One user: a history of `length` items from two clusters, and the item nearest the mean of
  // the history's vectors.
  index_t user(std::mt19937_64& g, index_t length, std::vector<std::uint64_t>& history) const {
    index_t a = 0, b = 0;
    do {
      a = index_t(g() % std::uint64_t(clusters)), b = index_t(g() % std::uint64_t(clusters));
    } while (members[std::size_t(a)].empty() || members[std::size_t(b)].empty());
    float mean[dim] = {};
    for (index_t t = 0; t < length; ++t) {
      const auto& m = members[std::size_t(g() % 2 ? a : b)];
      const index_t i = m[std::size_t(g() % m.size())];
      history.push_back(item_id(i));
      for (index_t d = 0; d < dim; ++d)
        mean[d] += vectors[std::size_t(i * dim + d)] / float(length);
    }
    index_t best = 0;
    float best_d = 1e30f;
    for (index_t i = 0; i < items; ++i) {
      float s = 0;
      for (index_t d = 0; d < dim; ++d) {
        const float e = vectors[std::size_t(i * dim + d)] - mean[d];
        s += e * e;
      }
      if (s < best_d) best_d = s, best = i;
    }
    return best;
  }
};

struct batch {
  std::vector<std::uint64_t> items;
  std::vector<std::int32_t> offsets{0};
  std::vector<std::int32_t> codes;  // [users, depth]
  std::vector<index_t> next;

  attnmix::user_histories view() const {
    return {attnmix::view1<const std::uint64_t>(items.data(), {index_t(items.size())}),
            attnmix::view1<const std::int32_t>(offsets.data(), {index_t(offsets.size())})};
  }
};

batch make_batch(const world& w, std::mt19937_64& g, int users, index_t history) {
  batch b;
  for (int u = 0; u < users; ++u) {
    const index_t next = w.user(g, history, b.items);
    b.offsets.push_back(std::int32_t(b.items.size()));
    b.next.push_back(next);
    b.codes.insert(b.codes.end(), w.ids.of(next), w.ids.of(next) + w.ids.depth());
  }
  return b;
}

// The encoders compared (the layers of the paper's: bidirectional unless named causal).
template <class... L>
using encoder = attnmix::stack<float, L...>;
using bi_sa = attnmix::layer::sa;
using causal_sa = attnmix::layer::causal_sa;
using gbla = attnmix::layer::gbla;

struct result {
  std::string encoder;
  int seed;
  double loss;
  std::vector<double> recall;  // at each K of recall_ks
  double seconds;
};

std::vector<int> recall_ks(const options& o) {
  std::vector<int> ks;
  for (const int k : {1, 10, 100})
    if (k <= o.beam) ks.push_back(k);
  return ks;
}

// Trains `model` on o.steps batches and measures Recall@K on held-out users.
template <class Model, class Backend>
result train_and_evaluate(Model& model, const std::string& name, const options& o, const world& w,
                          int seed, const Backend& be) {
  attnmix::train::adamw<Backend> opt({0.9, 0.98, 1e-8, 0.01, 1.0});
  std::mt19937_64 g(7919 * std::uint64_t(seed) + 1);
  const attnmix::train::warmup_cosine lr{std::max<index_t>(1, o.steps / 10), o.steps, o.lr,
                                         0.1 * o.lr};
  attnmix::train::progress bar(o.steps, index_t(o.batch) * o.history, o.every, stdout,
                               name + " seed " + std::to_string(seed) + ": ");
  double loss = 0;
  for (int step = 1; step <= o.steps; ++step) {
    const batch b = make_batch(w, g, o.batch, o.history);
    attnmix::train::adamw<Backend>::zero_grad(model);
    loss = model.loss(b.view(), {b.codes.data(), {index_t(o.batch), w.ids.depth()}}, true, be);
    opt.step(model, lr(step), be);
    bar.step(step, loss);
  }
  // Held-out users (their own generator): Recall@K of the next item.
  std::mt19937_64 eval(99991 * std::uint64_t(seed) + 17);
  const batch b = make_batch(w, eval, o.users, o.history);
  const std::vector<int> ks = recall_ks(o);
  const int top = std::min(o.beam, int(w.items));
  const auto recs = model.recommend(b.view(), w.ids, top, top, be);
  std::vector<double> recall(ks.size(), 0.0);
  for (std::size_t u = 0; u < recs.size(); ++u) {
    const auto& items = recs[u].items;
    const auto at = std::find(items.begin(), items.end(), b.next[u]);
    const std::size_t rank = std::size_t(at - items.begin());
    for (std::size_t k = 0; k < ks.size(); ++k) recall[k] += rank < std::size_t(ks[k]) ? 1 : 0;
  }
  for (double& r : recall) r /= double(recs.size());
  return {name, seed, loss, recall, bar.seconds()};
}

template <class Encoder>
result run(const std::string& name, const options& o, const world& w, int seed) {
  attnmix::layers::config c;
  c.hidden_size = o.width;
  c.num_heads = o.heads;
  attnmix::retrieval_config rc;
  rc.depth = w.ids.depth(), rc.codes = w.ids.codes;
  rc.buckets = std::max<index_t>(64, 2 * w.items), rc.hashes = 2;
  attnmix::generative_retrieval<Encoder> model(c, rc);
  attnmix::layers::randomize_parameters(model, 1000 + std::uint64_t(seed));
#ifdef __CUDACC__
  if (o.device == "cuda") {
    attnmix::generative_retrieval<attnmix::device_stack<Encoder, float>> gpu(model);
    return train_and_evaluate(gpu, name, o, w, seed, attnmix::backend::cuda{});
  }
#endif
  return train_and_evaluate(model, name, o, w, seed, attnmix::backend::cpu{o.threads});
}

bool parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (a == "--encoders") {
      o.encoders.clear();
      std::stringstream ss(v);
      for (std::string e; std::getline(ss, e, ',');) o.encoders.push_back(e);
    } else if (a == "--seeds")
      o.seeds = std::atoi(v);
    else if (a == "--first-seed")
      o.first_seed = std::atoi(v);
    else if (a == "--items")
      o.items = std::atoll(v);
    else if (a == "--clusters")
      o.clusters = std::atoll(v);
    else if (a == "--codes")
      o.codes = std::atoi(v);
    else if (a == "--history")
      o.history = std::atoll(v);
    else if (a == "--width")
      o.width = std::atoll(v);
    else if (a == "--heads")
      o.heads = std::atoll(v);
    else if (a == "--steps")
      o.steps = std::atoi(v);
    else if (a == "--batch")
      o.batch = std::atoi(v);
    else if (a == "--lr")
      o.lr = std::atof(v);
    else if (a == "--users")
      o.users = std::atoi(v);
    else if (a == "--beam")
      o.beam = std::atoi(v);
    else if (a == "--threads")
      o.threads = std::atoi(v);
    else if (a == "--every")
      o.every = std::max(1, std::atoi(v));
    else if (a == "--device")
      o.device = v;
    else
      return false;
  }
#ifdef __CUDACC__
  const bool device_ok = o.device == "cpu" || o.device == "cuda";
#else
  const bool device_ok = o.device == "cpu";
#endif
  return device_ok && o.seeds >= 1 && o.items >= 2 && o.clusters >= 1 && o.history >= 1 &&
         o.steps >= 1 && o.batch >= 1 && o.users >= 1 && o.beam >= 1;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: generative_retrieval [--encoders bi_sa,causal_sa,hybrid,gbla] [--seeds N]"
                 " [--first-seed S] [--items N] [--clusters K] [--codes C] [--history T]"
                 " [--width D] [--heads H] [--steps N] [--batch B] [--lr X]"
                 " [--users N] [--beam W] [--threads N] [--every N] [--device cpu|cuda]\n"
                 "(--device cuda: the build by nvcc, generative_retrieval_cuda)\n");
    return 2;
  }
  try {
    std::vector<result> results;
    for (int s = o.first_seed; s < o.first_seed + o.seeds; ++s) {
      const world w(o.items, o.clusters, o.codes, 31 * std::uint64_t(s) + 5);
      if (s == o.first_seed)
        std::printf("catalogue: %lld items, semantic IDs of %d codes in [0, %d); history %lld\n",
                    static_cast<long long>(w.items), w.ids.depth(), w.ids.codes,
                    static_cast<long long>(o.history));
      for (const std::string& e : o.encoders) {
        if (e == "bi_sa")
          results.push_back(run<encoder<attnmix::repeat<3, bi_sa>>>(e, o, w, s));
        else if (e == "causal_sa")
          results.push_back(run<encoder<attnmix::repeat<3, causal_sa>>>(e, o, w, s));
        else if (e == "hybrid")
          results.push_back(run<encoder<bi_sa, gbla, gbla>>(e, o, w, s));
        else if (e == "gbla")
          results.push_back(run<encoder<attnmix::repeat<3, gbla>>>(e, o, w, s));
        else {
          std::fprintf(stderr, "unknown encoder '%s' (bi_sa, causal_sa, hybrid, gbla)\n",
                       e.c_str());
          return 2;
        }
      }
    }
    const std::vector<int> ks = recall_ks(o);
    std::printf("\n| encoder | final loss |");
    for (const int k : ks) std::printf(" Recall@%d |", k);
    std::printf(" paper Recall@1000 (history 2048) |\n|---|---|");
    for (std::size_t k = 0; k < ks.size(); ++k) std::printf("---|");
    std::printf("---|\n");
    const auto paper = [](const std::string& e) {
      return e == "bi_sa"       ? "0.8667"
             : e == "causal_sa" ? "0.8353"
             : e == "hybrid"    ? "0.8668"
                                : "0.8586";
    };
    for (const std::string& e : o.encoders) {
      double loss = 0;
      std::vector<double> mean(ks.size(), 0.0), lo(ks.size(), 1.0), hi(ks.size(), 0.0);
      int n = 0;
      for (const result& r : results) {
        if (r.encoder != e) continue;
        ++n, loss += r.loss;
        for (std::size_t k = 0; k < ks.size(); ++k) {
          mean[k] += r.recall[k];
          lo[k] = std::min(lo[k], r.recall[k]), hi[k] = std::max(hi[k], r.recall[k]);
        }
      }
      std::printf("| %s | %.3f |", e.c_str(), loss / n);
      for (std::size_t k = 0; k < ks.size(); ++k)
        std::printf(" %.3f [%.3f, %.3f] |", mean[k] / n, lo[k], hi[k]);
      std::printf(" %s |\n", paper(e));
    }
    std::printf("done\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generative_retrieval: %s\n", e.what());
    return 1;
  }
  return 0;
}
