#pragma once
// What the state-tracking examples (train_flipflop, state_tracking) share: a language model
// trained on batches of a synthetic task (train/tasks.hpp) with AdamW and a warm-up + cosine
// schedule, on the CPU or, built by nvcc, on the GPU in float or bfloat16 mixed precision; its
// predictions counted at a batch's scored positions; and the runs spread over threads.
//
// Options: any struct with steps, batch, length, every (index_t), lr (double), threads (int),
// device ("cpu" | "cuda") and precision ("float" | "bf16").

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attnmix/attnmix.hpp"
#ifdef __CUDACC__
#include "attnmix/cuda.cuh"
#endif
#include "attnmix/train/language_model.hpp"
#include "attnmix/train/optimizer.hpp"
#include "attnmix/train/progress.hpp"
#include "attnmix/train/schedule.hpp"
#include "attnmix/train/tasks.hpp"

// run(i) for i = 0 .. runs - 1, `jobs` at a time (this thread is one of them). The first exception
// a run throws stops the runs not yet started and is rethrown here once every thread has joined.
template <class Run>
void run_jobs(std::size_t runs, int jobs, Run&& run) {
  std::atomic<std::size_t> next{0};
  std::exception_ptr failed;
  std::mutex m;
  const auto worker = [&] {
    for (std::size_t i; (i = next++) < runs;) {
      try {
        run(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(m);
        if (!failed) failed = std::current_exception();
        next = runs;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int j = 1; j < jobs; ++j) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (failed) std::rethrow_exception(failed);
}

// run(model, backend) on the device the options choose: the host model itself, or a device copy
// of it (the host model then stays as it is: the source of the initial weights).
template <class Options, class Stack, class Run>
auto on_chosen_device(attnmix::train::language_model<Stack>& model, const Options& o, Run&& run) {
#ifdef __CUDACC__
  if (o.device == "cuda" && o.precision == "bf16") {
    attnmix::train::language_model<attnmix::device_stack<Stack, attnmix::bfloat16>> gpu(model);
    return run(gpu, attnmix::backend::cuda{});
  }
  if (o.device == "cuda") {
    attnmix::train::language_model<attnmix::device_stack<Stack, float>> gpu(model);
    return run(gpu, attnmix::backend::cuda{});
  }
#endif
  return run(model, attnmix::backend::cpu{o.threads});
}

// o.steps steps of AdamW (beta2 0.98, weight decay 0.1, gradients clipped to norm 1) on batches
// make(gen) of o.batch sequences of o.length tokens, at a learning rate warmed up over the first
// 5 % of the steps and then cosine-decayed to a tenth. `model`'s weights (16-bit ones through
// their float masters) start as `start`'s. A progress line prefixed by `label`.
template <class Model, class Start, class Options, class Make, class Backend>
void train_on_task(Model& model, const Start& start, const Options& o, std::mt19937_64& gen,
                   Make&& make, const std::string& label, const Backend& be) {
  attnmix::train::adamw_config ac;
  ac.beta2 = 0.98, ac.weight_decay = 0.1, ac.clip_norm = 1.0;
  attnmix::train::adamw<Backend> opt(ac);
  opt.init(model);
  auto weights = opt.master_weights(model);
  attnmix::layers::transfer_parameters(start, weights);
  const attnmix::train::warmup_cosine lr{std::max<attnmix::index_t>(1, o.steps / 20), o.steps, o.lr,
                                         o.lr / 10};
  attnmix::train::progress bar(o.steps, o.batch * o.length, o.every, stdout, label);
  using ids = attnmix::tensor_view<const std::int32_t, 2>;
  for (attnmix::index_t step = 1; step <= o.steps; ++step) {
    const attnmix::train::task_batch b = make(gen);
    attnmix::train::adamw<Backend>::zero_grad(model, be);
    const double loss = model.loss(ids(b.tokens.data(), {o.batch, o.length}),
                                   ids(b.labels.data(), {o.batch, o.length}), true, be);
    opt.step(model, lr(step), be);
    bar.step(step, loss);
  }
}

// Counts a model's predictions (the arg max of its logits) at the scored positions of batches of
// fresh sequences: the logits are read back to the host as float (written there by a host
// model, copied from the device otherwise).
template <class Model, class Backend>
class scored_predictions {
  using T = typename Model::scalar;

 public:
  scored_predictions(const Model& model, const Backend& be) : model_(model), be_(be) {}

  // Adds b's (B sequences of `length` tokens) right predictions and scored positions.
  void add(const attnmix::train::task_batch& b, attnmix::index_t B, attnmix::index_t length) {
    const attnmix::index_t V = model_.vocab();
    host_.resize(static_cast<std::size_t>(B * length * V));
    attnmix::view3<T> logits(host_.data(), {B, length, V});
    if constexpr (!attnmix::layers::on_host_v<Backend>) {
      mem_.resize(B * length * V);
      logits = attnmix::view3<T>(mem_.data(), {B, length, V}, attnmix::memory_space::device);
    }
    model_.forward(attnmix::tensor_view<const std::int32_t, 2>(b.tokens.data(), {B, length}),
                   logits, be_);
#ifdef __CUDACC__
    if constexpr (!attnmix::layers::on_host_v<Backend>)
      attnmix::detail::cuda::check(
          cudaMemcpy(host_.data(), mem_.data(), host_.size() * sizeof(T), cudaMemcpyDeviceToHost),
          "cudaMemcpy(logits)");
#endif
    for (attnmix::index_t r = 0; r < B * length; ++r) {
      if (!b.scored[std::size_t(r)]) continue;
      const T* z = host_.data() + r * V;
      const auto best = std::max_element(z, z + V, [](const T& x, const T& y) {
        return static_cast<float>(x) < static_cast<float>(y);
      });
      right += std::int32_t(best - z) == b.labels[std::size_t(r)];
      ++scored;
    }
  }

  attnmix::index_t right = 0, scored = 0;

 private:
  const Model& model_;
  const Backend& be_;
  std::vector<T> host_;
  attnmix::layers::buffer<T, typename Backend::memory_space> mem_;
};
