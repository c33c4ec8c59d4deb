// The PaTH paper's other two state-tracking experiments (Yang et al. 2025, §4.1) on attnmix:
//   --task mqrar  multi-query repeated associative recall, N-back (train/tasks.hpp mqrar::make):
//                 keys are assigned values again and again, and a query asks for the value its
//                 key was assigned N assignments of it ago. The paper: 2 layers, width 256,
//                 2 heads, 32 keys, length 768; accuracy on the queries for N = 1 ... 4 (PaTH
//                 strong for N < 4, dropping at N = 4). One model a (kind, N, seed).
//   --task a5     words over the alternating group A5, the label at each position the
//                 composition so far (a5::make); accuracy for 1 ... 4 layers, and the fewest
//                 layers that reach 90 % (the paper: PaTH needs fewer than RoPE). One model a
//                 (kind, layers, seed).
//
//   state_tracking --task mqrar|a5 [--kinds path,path_fox,fox,sa_rope] [--seeds 1]
//                  [--first-seed 0] [--nback 1,2,3,4] [--layers 1,2,3,4] [--steps 2000]
//                  [--batch 32] [--length 768 | 128] [--width 256 | 128] [--heads 2]
//                  [--keys 32] [--values 32] [--eval 256] [--lr 1e-3] [--threads 0] [--jobs 1]
//                  [--every 200] [--device cpu|cuda] [--precision float|bf16]
//
// The defaults are the paper's settings as far as it states them (mqrar: --layers 2); at that
// size a run takes hours on a CPU. --jobs N trains N models at a time (each on one thread unless
// --threads says otherwise). --device cuda (the nvcc build, state_tracking_cuda) trains on the GPU,
// in float or in bfloat16 mixed precision (--precision bf16). Prints a progress line per run and
// the accuracy table.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "attnmix/attnmix.hpp"
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/tasks.hpp"
#include "task_training.hpp"

namespace {

using attnmix::index_t;
using attnmix::train::task_batch;

struct options {
  std::string task;
  std::vector<std::string> kinds{"path", "path_fox", "fox", "sa_rope"};
  std::vector<int> nback{1, 2, 3, 4}, layers{1, 2, 3, 4};
  int seeds = 1, first_seed = 0, threads = 0, jobs = 1;
  index_t steps = 2000, batch = 32, length = 0, width = 0, heads = 2, keys = 32, values = 32;
  index_t eval = 256, every = 200;
  double lr = 1e-3;
  std::string device = "cpu", precision = "float";
};

// One batch of the task; `variant` is N for mqrar.
task_batch make(const options& o, std::mt19937_64& g, index_t B, int variant) {
  if (o.task == "mqrar")
    return attnmix::train::mqrar::make(g, B, o.length, variant, o.keys, o.values);
  return attnmix::train::a5::make(g, B, o.length);
}
std::int32_t vocab(const options& o) {
  return o.task == "mqrar" ? attnmix::train::mqrar::vocab(o.keys, o.values)
                           : std::int32_t(attnmix::train::a5::order);
}

// A model of `Layers` blocks of Layer, trained on the chosen device; its accuracy on the scored
// positions of o.eval fresh sequences.
template <int Layers, class Layer>
double run(const std::string& name, int variant, int seed, const options& o) {
  using stack = attnmix::stack<float, attnmix::repeat<Layers, Layer>>;
  attnmix::layers::config c;
  c.hidden_size = o.width;
  c.num_heads = o.heads;
  attnmix::train::language_model<stack> model(c, vocab(o));
  attnmix::layers::randomize_parameters(model, 1000 + std::uint64_t(seed), 0.02);
  const std::string label = "  " + name + " x" + std::to_string(Layers) +
                            (o.task == "mqrar" ? " N=" + std::to_string(variant) : "") + " seed " +
                            std::to_string(seed) + ": ";
  return on_chosen_device(model, o, [&](auto& trained, const auto& be) {
    std::mt19937_64 gen(std::uint64_t(seed) * 1000003 + std::uint64_t(variant));
    train_on_task(
        trained, model, o, gen, [&](std::mt19937_64& g) { return make(o, g, o.batch, variant); },
        label, be);
    std::mt19937_64 eval(7777 + std::uint64_t(seed) * 31 + std::uint64_t(variant));
    scored_predictions<std::decay_t<decltype(trained)>, std::decay_t<decltype(be)>> count(trained,
                                                                                          be);
    for (index_t done = 0; done < o.eval; done += 16) {
      const index_t B = std::min<index_t>(16, o.eval - done);
      count.add(make(o, eval, B, variant), B, o.length);
    }
    return count.scored > 0 ? double(count.right) / double(count.scored) : 0.0;
  });
}

template <class Layer>
double run_layers(const std::string& name, int layers, int variant, int seed, const options& o) {
  switch (layers) {
    case 1:
      return run<1, Layer>(name, variant, seed, o);
    case 2:
      return run<2, Layer>(name, variant, seed, o);
    case 3:
      return run<3, Layer>(name, variant, seed, o);
    default:
      return run<4, Layer>(name, variant, seed, o);
  }
}

double run_kind(const std::string& kind, int layers, int variant, int seed, const options& o) {
  namespace layer = attnmix::layer;
  if (kind == "path") return run_layers<layer::path>(kind, layers, variant, seed, o);
  if (kind == "path_fox") return run_layers<layer::path_fox>(kind, layers, variant, seed, o);
  if (kind == "fox") return run_layers<layer::fox>(kind, layers, variant, seed, o);
  return run_layers<attnmix::layer::causal_sa_rope>(kind, layers, variant, seed, o);
}

const char* usage =
    "usage: state_tracking --task mqrar|a5 [--kinds path,path_fox,fox,sa_rope] [--seeds 1]\n"
    "                      [--first-seed 0] [--nback 1,2,3,4] [--layers 1,2,3,4] [--steps 2000]\n"
    "                      [--batch 32] [--length T] [--width D] [--heads 2] [--keys 32]\n"
    "                      [--values 32] [--eval 256] [--lr 1e-3] [--threads 0] [--jobs 1]\n"
    "                      [--every 200] [--device cpu|cuda] [--precision float|bf16]\n";

template <class V>
std::vector<V> split(const std::string& s) {
  std::vector<V> out;
  std::stringstream ss(s);
  for (std::string e; std::getline(ss, e, ',');)
    if constexpr (std::is_same_v<V, int>)
      out.push_back(std::atoi(e.c_str()));
    else
      out.push_back(e);
  return out;
}

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "%s\n%s", why.c_str(), usage);
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  bool layers_given = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 == argc) fail("option " + k + " needs a value");
    const std::string v = argv[i + 1];
    const long n = std::atol(v.c_str());
    if (k == "--task")
      o.task = v;
    else if (k == "--kinds")
      o.kinds = split<std::string>(v);
    else if (k == "--seeds")
      o.seeds = int(n);
    else if (k == "--first-seed")
      o.first_seed = int(n);
    else if (k == "--nback")
      o.nback = split<int>(v);
    else if (k == "--layers")
      o.layers = split<int>(v), layers_given = true;
    else if (k == "--steps")
      o.steps = n;
    else if (k == "--batch")
      o.batch = n;
    else if (k == "--length")
      o.length = n;
    else if (k == "--width")
      o.width = n;
    else if (k == "--heads")
      o.heads = n;
    else if (k == "--keys")
      o.keys = n;
    else if (k == "--values")
      o.values = n;
    else if (k == "--eval")
      o.eval = n;
    else if (k == "--lr")
      o.lr = std::atof(v.c_str());
    else if (k == "--threads")
      o.threads = int(n);
    else if (k == "--jobs")
      o.jobs = int(n);
    else if (k == "--every")
      o.every = n;
    else if (k == "--device")
      o.device = v;
    else if (k == "--precision")
      o.precision = v;
    else
      fail("unknown option " + k);
  }
  if (o.task != "mqrar" && o.task != "a5") fail("--task is mqrar or a5");
  if (o.task == "mqrar") {
    if (!layers_given) o.layers = {2};
    if (o.length == 0) o.length = 768;
    if (o.width == 0) o.width = 256;
  } else {
    o.nback = {0};
    if (o.length == 0) o.length = 128;
    if (o.width == 0) o.width = 128;
  }
  for (const auto& k : o.kinds)
    if (k != "path" && k != "path_fox" && k != "fox" && k != "sa_rope")
      fail("unknown kind '" + k + "' (path, path_fox, fox, sa_rope)");
  for (const int l : o.layers)
    if (l < 1 || l > 4) fail("--layers are each 1, 2, 3 or 4");
  if (o.task == "mqrar")
    for (const int n : o.nback)
      if (n < 1) fail("--nback values are each >= 1");
  if (o.steps < 1 || o.batch < 1 || o.eval < 1 || o.seeds < 1 || o.jobs < 1 || o.heads < 1 ||
      o.width < o.heads || o.kinds.empty() || o.layers.empty() || o.nback.empty())
    fail("steps, batch, eval, seeds, jobs and heads must be >= 1, width >= heads");
#ifdef __CUDACC__
  if (o.device != "cpu" && o.device != "cuda") fail("--device is cpu or cuda");
#else
  if (o.device != "cpu") fail("--device is cpu (cuda needs the nvcc build, state_tracking_cuda)");
#endif
  if (o.precision != "float" && !(o.precision == "bf16" && o.device == "cuda"))
    fail("--precision is float, or bf16 on the GPU (--device cuda)");
  if (o.jobs > 1 && o.device != "cpu") fail("--jobs runs several trainings on the CPU only");
  if (o.jobs > 1 && o.threads == 0) o.threads = 1;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  const bool mq = o.task == "mqrar";
  std::printf(
      "%s: width %lld, %lld heads; %lld steps of %lld x %lld tokens; accuracy on %lld "
      "sequences; on the %s in %s\n",
      mq ? "MQRAR-N" : "A5", static_cast<long long>(o.width), static_cast<long long>(o.heads),
      static_cast<long long>(o.steps), static_cast<long long>(o.batch),
      static_cast<long long>(o.length), static_cast<long long>(o.eval),
      o.device == "cuda" ? "GPU" : "CPU", o.precision == "bf16" ? "bfloat16" : "float");
  // Columns: N (mqrar, at the first --layers) or the layer counts (a5).
  struct cell {
    std::string kind;
    int layers, variant;
    std::vector<double> acc;
  };
  std::vector<cell> cells;
  for (const auto& k : o.kinds)
    for (const int l : mq ? std::vector<int>{o.layers.front()} : o.layers)
      for (const int v : o.nback) cells.push_back({k, l, v, std::vector<double>(o.seeds, 0.0)});
  try {
    run_jobs(cells.size() * std::size_t(o.seeds), o.jobs, [&](std::size_t i) {
      cell& c = cells[i / std::size_t(o.seeds)];
      const int s = int(i % std::size_t(o.seeds));
      c.acc[std::size_t(s)] = run_kind(c.kind, c.layers, c.variant, o.first_seed + s, o);
      std::printf("  %s x%d%s seed %d: accuracy %.1f %%\n", c.kind.c_str(), c.layers,
                  mq ? (" N=" + std::to_string(c.variant)).c_str() : "", o.first_seed + s,
                  100.0 * c.acc[std::size_t(s)]);
      std::fflush(stdout);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "state_tracking: %s\n", e.what());
    return 1;
  }
  std::printf("\naccuracy, %% (mean over %d seeds [min, max])%s\n", o.seeds,
              mq ? "" : "; the fewest layers reaching 90 % last");
  std::printf("%-10s", "kind");
  for (const int x : mq ? o.nback : o.layers) {
    char head[32];
    std::snprintf(head, sizeof head, mq ? "N = %d" : "%d layers", x);
    std::printf(" %-24s", head);
  }
  std::printf("\n");
  for (const auto& k : o.kinds) {
    std::printf("%-10s", k.c_str());
    int fewest = 0;
    for (const cell& c : cells) {
      if (c.kind != k) continue;
      double mean = 0, lo = 1, hi = 0;
      for (const double a : c.acc)
        mean += a / double(c.acc.size()), lo = std::min(lo, a), hi = std::max(hi, a);
      if (!mq && mean >= 0.9 && (fewest == 0 || c.layers < fewest)) fewest = c.layers;
      char text[64];
      std::snprintf(text, sizeof text, "%.1f [%.1f, %.1f]", 100 * mean, 100 * lo, 100 * hi);
      std::printf(" %-24s", text);
    }
    if (!mq) std::printf(fewest > 0 ? " %d" : " none", fewest);
    std::printf("\n");
  }
  return 0;
}
