// The PaTH paper's flip-flop experiment (Yang et al. 2025, Table 1; flip-flop language modelling,
// Liu et al. 2023) on attnmix: a 1-layer, 2-head, width-64 model trained on length-512 sequences
// of write / read / ignore instructions, each followed by a bit, with ignore probability 0.8.
// After a read the model must output the last written bit. The read-bit error is measured in
// distribution (ignore 0.8) and out of distribution (0.98: sparse; 0.1: dense).
//
//   train_flipflop [--kinds path,path_fox,fox,sa_rope] [--seeds 3] [--first-seed 0]
//                  [--steps 1000] [--batch 16] [--length 512] [--eval 256] [--lr 3e-3]
//                  [--threads 0] [--jobs 1] [--every 100] [--device cpu|cuda]
//                  [--precision float|bf16]
//
// --jobs N trains N of the (kind, seed) runs at a time, each on its own model and (unless
// --threads says otherwise) one thread: the small model keeps one core busy at most, so on the
// CPU that is the faster way to use several. The results do not depend on N.
// --device cuda (when built by nvcc: train_flipflop_cuda) trains the same model, from the same
// initial weights, on the GPU in float, or with --precision bf16 in mixed precision (bfloat16
// projections and activations, float residual stream and master weights). Prints a progress line
// per run and the table beside the paper's figures.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/tasks.hpp"
#include "task_training.hpp"

namespace {

using attnmix::index_t;

// The task's tokens and its batches (train/tasks.hpp): (instruction, bit) pairs; `scored` marks
// the positions whose label is a read bit, where the error is measured.
using attnmix::train::task_batch;
using attnmix::train::flip_flop::vocab;

struct options {
  std::vector<std::string> kinds{"path", "path_fox", "fox", "sa_rope"};
  int seeds = 3, first_seed = 0;
  index_t steps = 1000, batch = 16, length = 512, eval = 256, every = 100;
  double lr = 3e-3;
  int threads = 0, jobs = 1;
  std::string device = "cpu", precision = "float";
};

struct errors {
  double in_dist, sparse, dense;
};

// Read-bit error of `model` on o.eval fresh sequences of ignore probability p.
template <class Model, class Backend>
double read_error(const Model& model, std::uint64_t seed, const options& o, double p,
                  const Backend& be) {
  std::mt19937_64 gen(seed);
  const index_t chunk = std::min<index_t>(o.eval, 32);
  scored_predictions<Model, Backend> count(model, be);
  for (index_t done = 0; done < o.eval; done += chunk) {
    const index_t B = std::min(chunk, o.eval - done);
    count.add(attnmix::train::flip_flop::make(gen, B, o.length, p), B, o.length);
  }
  return count.scored > 0 ? double(count.scored - count.right) / double(count.scored) : 0.0;
}

template <class Layer>
errors run(const std::string& name, int seed, const options& o) {
  using host_stack = attnmix::stack<float, Layer>;
  attnmix::layers::config c;
  c.hidden_size = 64;
  c.num_heads = 2;
  attnmix::train::language_model<host_stack> model(c, vocab);
  attnmix::layers::randomize_parameters(model, 1000 + seed, 0.02);
  return on_chosen_device(model, o, [&](auto& trained, const auto& be) {
    std::mt19937_64 gen(seed);
    train_on_task(
        trained, model, o, gen,
        [&](std::mt19937_64& g) {
          return attnmix::train::flip_flop::make(g, o.batch, o.length, 0.8);
        },
        "  " + name + " seed " + std::to_string(seed) + ": ", be);
    const std::uint64_t eval_seed = 7777 + std::uint64_t(seed);
    return errors{read_error(trained, eval_seed, o, 0.8, be),
                  read_error(trained, eval_seed + 1, o, 0.98, be),
                  read_error(trained, eval_seed + 2, o, 0.1, be)};
  });
}

errors run_kind(const std::string& kind, int seed, const options& o) {
  namespace layer = attnmix::layer;
  if (kind == "path") return run<layer::path>(kind, seed, o);
  if (kind == "path_fox") return run<layer::path_fox>(kind, seed, o);
  if (kind == "fox") return run<layer::fox>(kind, seed, o);
  if (kind == "sa_rope") return run<attnmix::layer::causal_sa_rope>(kind, seed, o);
  std::fprintf(stderr, "unknown kind '%s' (path, path_fox, fox, sa_rope)\n", kind.c_str());
  std::exit(2);
}

const char* usage =
    "usage: train_flipflop [--kinds path,path_fox,fox,sa_rope] [--seeds 3] [--first-seed 0]\n"
    "                      [--steps 1000] [--batch 16] [--length 512] [--eval 256] [--lr 3e-3]\n"
    "                      [--threads 0] [--jobs 1] [--every 100] [--device cpu|cuda]\n"
    "                      [--precision float|bf16]\n";

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 == argc) {
      std::fprintf(stderr, "option %s needs a value\n%s", k.c_str(), usage);
      std::exit(2);
    }
    const std::string v = argv[i + 1];
    if (k == "--kinds") {
      o.kinds.clear();
      std::stringstream ss(v);
      for (std::string s; std::getline(ss, s, ',');) o.kinds.push_back(s);
    } else if (k == "--seeds") {
      o.seeds = std::atoi(v.c_str());
    } else if (k == "--first-seed") {
      o.first_seed = std::atoi(v.c_str());
    } else if (k == "--steps") {
      o.steps = std::atol(v.c_str());
    } else if (k == "--batch") {
      o.batch = std::atol(v.c_str());
    } else if (k == "--length") {
      o.length = std::atol(v.c_str());
    } else if (k == "--eval") {
      o.eval = std::atol(v.c_str());
    } else if (k == "--lr") {
      o.lr = std::atof(v.c_str());
    } else if (k == "--threads") {
      o.threads = std::atoi(v.c_str());
    } else if (k == "--jobs") {
      o.jobs = std::atoi(v.c_str());
    } else if (k == "--every") {
      o.every = std::atol(v.c_str());
    } else if (k == "--device") {
      o.device = v;
    } else if (k == "--precision") {
      o.precision = v;
    } else {
      std::fprintf(stderr, "unknown option %s\n%s", k.c_str(), usage);
      std::exit(2);
    }
  }
#ifdef __CUDACC__
  const bool known_device = o.device == "cpu" || o.device == "cuda";
#else
  const bool known_device = o.device == "cpu";
#endif
  if (!known_device) {
    std::fprintf(stderr, "unknown device %s (cpu%s)\n", o.device.c_str(),
#ifdef __CUDACC__
                 ", cuda"
#else
                 "; cuda needs the nvcc build, train_flipflop_cuda"
#endif
    );
    std::exit(2);
  }
  if (o.steps < 1 || o.batch < 1 || o.length < 4 || o.eval < 1 || o.seeds < 1 || o.jobs < 1) {
    std::fprintf(stderr, "steps, batch, eval, seeds and jobs must be >= 1 and length >= 4\n");
    std::exit(2);
  }
  if (o.precision != "float" && !(o.precision == "bf16" && o.device == "cuda")) {
    std::fprintf(stderr, "--precision is float, or bf16 on the GPU (--device cuda)\n");
    std::exit(2);
  }
  if (o.jobs > 1 && o.device != "cpu") {
    std::fprintf(stderr, "--jobs runs several trainings on the CPU; the GPU takes one at a time\n");
    std::exit(2);
  }
  for (const auto& k : o.kinds)
    if (k != "path" && k != "path_fox" && k != "fox" && k != "sa_rope") {
      std::fprintf(stderr, "unknown kind '%s' (path, path_fox, fox, sa_rope)\n", k.c_str());
      std::exit(2);
    }
  if (o.jobs > 1 && o.threads == 0) o.threads = 1;
  return o;
}

// The paper's Table 1 (read-bit error, %), where it reports one.
const char* paper(const std::string& kind, int column) {
  if (kind == "path") return column == 0 ? "0" : column == 1 ? "0.0001" : "-";
  if (kind == "sa_rope") return column == 0 ? "6.9" : column == 1 ? "40.3" : "-";
  return "-";
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  std::printf(
      "flip-flop: 1 layer, 2 heads, width 64; %lld steps of %lld x %lld tokens, ignore "
      "0.8; read error on %lld sequences each; on the %s in %s\n",
      static_cast<long long>(o.steps), static_cast<long long>(o.batch),
      static_cast<long long>(o.length), static_cast<long long>(o.eval),
      o.device == "cuda" ? "GPU" : "CPU", o.precision == "bf16" ? "bfloat16" : "float");
  struct row {
    std::string kind;
    std::vector<errors> e;
  };
  std::vector<row> rows;
  for (const auto& k : o.kinds) rows.push_back({k, std::vector<errors>(std::size_t(o.seeds))});
  // The (kind, seed) runs, o.jobs at a time.
  try {
    run_jobs(rows.size() * std::size_t(o.seeds), o.jobs, [&](std::size_t i) {
      row& r = rows[i / std::size_t(o.seeds)];
      const int s = int(i % std::size_t(o.seeds));
      r.e[std::size_t(s)] = run_kind(r.kind, o.first_seed + s, o);
    });
  } catch (const std::exception& e) {  // attnmix::error, attnmix::cuda_error
    std::fprintf(stderr, "train_flipflop: %s\n", e.what());
    return 1;
  }
  std::printf("\nread-bit error, %% (mean over %d seeds, [min, max]; paper in parentheses)\n",
              o.seeds);
  std::printf("%-10s %-30s %-30s %-30s\n", "kind", "in dist. (0.8)", "sparse (0.98)",
              "dense (0.1)");
  for (const auto& r : rows) {
    std::printf("%-10s", r.kind.c_str());
    for (int col = 0; col < 3; ++col) {
      double mean = 0, lo = 1, hi = 0;
      for (const auto& e : r.e) {
        const double x = col == 0 ? e.in_dist : col == 1 ? e.sparse : e.dense;
        mean += x / double(r.e.size()), lo = std::min(lo, x), hi = std::max(hi, x);
      }
      char cell[64];
      std::snprintf(cell, sizeof cell, "%.3f [%.3f, %.3f] (%s)", 100 * mean, 100 * lo, 100 * hi,
                    paper(r.kind, col));
      std::printf(" %-30s", cell);
    }
    std::printf("\n");
  }
  return 0;
}
