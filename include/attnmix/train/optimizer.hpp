#pragma once
// train::adamw: AdamW (Loshchilov and Hutter; PyTorch's torch.optim.AdamW) over every
// parameter of a model (anything with visit_parameters whose parameters carry .grad), with
// optional clipping of the global gradient norm. Its state (the two moments of every parameter
// and the step count) is itself a model for io::save / io::load, so that a checkpoint of the
// optimiser sits beside the weights and a resumed run continues bit for bit.
//
// Weight decay applies to parameters of rank >= 2 (projection and embedding matrices), not to
// biases, norm weights or convolution taps of rank 1 (the GPT-2 / nanoGPT convention).

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnmix/core/error.hpp"
#include "attnmix/core/scalar.hpp"
#include "attnmix/core/tags.hpp"
#include "attnmix/layers/common.hpp"
#include "attnmix/layers/ops.hpp"

namespace attnmix {
namespace train {

struct adamw_config {
  // Each beta in [0, 1), eps, weight_decay and clip_norm finite and >= 0 (PyTorch's bounds).
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;
  // > 0: before the step, scale every gradient so that their global L2 norm is at most this.
  double clip_norm = 0.0;
};

// The moments in double (those of float weights are kept in double so that they round once,
// into the weight), in the backend's memory beside the parameters (the step count on the host).
// On a device the state is saved through a host optimiser: layers::transfer_parameters(gpu_opt,
// host_opt) after host_opt.init(host_model), then io::save(host_opt, ...); and back.
//
// Mixed precision: for every parameter stored in 16 bits (bfloat16 or half, as a device stack in
// that type holds its projections) the optimiser keeps float master weights. A step updates the
// master and rounds it into the parameter, so that updates smaller than the 16-bit spacing
// accumulate. init() makes the masters from the parameters' values; master_weights(model) is the
// model's weights with the masters in place of the 16-bit ones, for layers::transfer_parameters:
// from a float host model (a run that starts from float weights, or resumes from a checkpoint of
// them), and into one (to save the float weights with io::save). Parameters of 32 or 64 bits
// have no master.
template <class Backend = backend::cpu>
class adamw {
  static_assert(layers::has_training_ops_v<Backend>,
                "attnmix::train::adamw: layers::ops<Backend> lacks a training operation (the list "
                "is in attnmix/layers/ops.hpp)");
  using O = layers::ops<Backend>;
  using state = layers::parameter<double, typename Backend::memory_space>;
  using master = layers::parameter<float, typename Backend::memory_space>;
  template <class P>
  static constexpr bool needs_master =
      sizeof(std::remove_cv_t<std::remove_pointer_t<decltype(std::declval<P&>().ptr())>>) == 2;

 public:
  // The largest step count: every count up to it is a double exactly.
  static constexpr double max_steps = 9007199254740992.0;  // 2^53

  // Throws attnmix::error for a setting out of range (see adamw_config).
  explicit adamw(adamw_config cfg = {}) : cfg_(checked(cfg)), step_({1}, 0.0) {}

  const adamw_config& config() const { return cfg_; }
  // Steps taken so far.
  index_t steps() const { return step_count("attnmix::train::adamw::steps"); }

  // Sizes the state for `model` (zero moments, step 0). step() does it on first use; call it
  // before io::load of a checkpoint.
  template <class Model>
  void init(Model& model) {
    moments_.clear();
    model.visit_parameters([&](const std::string& name, auto& p) {
      moments_.push_back({name, state(p.shape), state(p.shape), {}});
      if constexpr (needs_master<std::decay_t<decltype(p)>>) {
        std::vector<double> values;
        p.get_values(values);
        moments_.back().w = master(p.shape);
        moments_.back().w.set_values(values);
      }
    });
    step_.data[0] = 0;
  }

  // `model`'s weights at full precision, as a model for layers::transfer_parameters in either
  // direction: under each parameter's name its float master where it is 16-bit, else the
  // parameter itself. Visiting it throws attnmix::error when the state was not made for `model`
  // (call init first).
  template <class Self, class Model>
  struct weights_view {
    Self* self;
    Model* model;
    template <class F>
    void visit_parameters(F&& f) const {
      std::size_t i = 0;
      model->visit_parameters([&](const std::string& name, auto& p) {
        self->check_entry("attnmix::train::adamw::master_weights", i, name, p);
        if constexpr (needs_master<std::decay_t<decltype(p)>>)
          f(name, self->moments_[i].w);
        else
          f(name, p);
        ++i;
      });
    }
  };
  template <class Model>
  weights_view<adamw, Model> master_weights(Model& model) {
    return {this, &model};
  }
  template <class Model>
  weights_view<const adamw, const Model> master_weights(const Model& model) const {
    return {this, &model};
  }

  // Zeroes every gradient of `model`; with a backend, on its stream (the gradients are
  // allocated, zero, where they were not yet).
  template <class Model>
  static void zero_grad(Model& model) {
    model.visit_parameters([](const std::string&, auto& p) { p.zero_grad(); });
  }
  template <class Model>
  static void zero_grad(Model& model, const Backend& be) {
    model.visit_parameters([&](const std::string&, auto& p) {
      if (p.numel() > 0) O::zero(be, p.grad_ptr(), p.numel());
    });
  }

  // One step at learning rate `lr` (finite, >= 0) over every parameter of `model` from its
  // .grad. Returns the global gradient norm before clipping: the step's one read of a device
  // value, after every update is queued (the norm and the clipping factor stay in the backend's
  // memory until then). Throws attnmix::error, and changes nothing, for a bad lr or a state sized
  // for another model.
  template <class Model>
  double step(Model& model, double lr, const Backend& be = Backend{}) {
    const std::string fn = "attnmix::train::adamw::step";
    detail::require(std::isfinite(lr) && lr >= 0, fn, "lr", "must be finite and >= 0 but is ", lr);
    const index_t t = step_count(fn) + 1;
    detail::require(double(t) <= max_steps, fn, "this", "has taken ", t - 1,
                    " steps, the most its step count holds");
    if (moments_.empty()) init(model);
    // Each entry is checked before any parameter is written (the sum is the optimiser's own).
    sum_squares_.resize(1);
    double* ss = sum_squares_.data();
    O::zero(be, ss, 1);
    std::size_t i = 0;
    model.visit_parameters([&](const std::string& name, auto& p) {
      check_entry(fn, i++, name, p);
      O::sum_squares(be, p.grad_ptr(), p.numel(), ss);
    });
    detail::require(i == moments_.size(), fn, "model", "has ", i,
                    " parameters but the optimiser state holds ", moments_.size());
    i = 0;
    model.visit_parameters([&](const std::string&, auto& p) {
      auto& s = moments_[i++];
      const index_t n = p.numel();
      if (cfg_.clip_norm > 0) O::clip(be, p.grad_ptr(), n, ss, cfg_.clip_norm);
      const double wd = p.shape.size() >= 2 ? cfg_.weight_decay : 0.0;
      if constexpr (needs_master<std::decay_t<decltype(p)>>)
        O::adamw(be, s.w.ptr(), p.grad_ptr(), s.m.ptr(), s.v.ptr(), n, lr, cfg_.beta1, cfg_.beta2,
                 cfg_.eps, wd, t, p.ptr());
      else
        O::adamw(be, p.ptr(), p.grad_ptr(), s.m.ptr(), s.v.ptr(), n, lr, cfg_.beta1, cfg_.beta2,
                 cfg_.eps, wd, t);
    });
    step_.data[0] = double(t);
    double norm2 = 0;
    O::download(be, &norm2, ss, 1);
    return std::sqrt(norm2);
  }

  // The state as named tensors: "<parameter>.exp_avg", "<parameter>.exp_avg_sq" and "step".
  template <class F>
  void visit_parameters(F&& f) {
    for (auto& s : moments_) f(s.name + ".exp_avg", s.m), f(s.name + ".exp_avg_sq", s.v);
    f("step", step_);
  }
  template <class F>
  void visit_parameters(F&& f) const {
    for (const auto& s : moments_) f(s.name + ".exp_avg", s.m), f(s.name + ".exp_avg_sq", s.v);
    f("step", step_);
  }

  // io::load's check of a checkpoint before it writes any of it: the step is a count in
  // [0, max_steps], every exp_avg finite, every exp_avg_sq finite and >= 0 (a run only makes
  // those; anything else would turn the next step's weights into NaN).
  template <class Values, class Reject>
  void check_loaded(Values&& values, Reject&& reject) const {
    const std::vector<double> step = values("step");
    if (step.size() != 1 || !is_step_count(step[0]))
      reject(detail::concat("tensor 'step' holds ", step.empty() ? 0.0 : step[0],
                            ", which is not a step count (an integer in [0, 2^53])"));
    for (const auto& s : moments_)
      for (const bool second : {false, true}) {
        const std::string name = s.name + (second ? ".exp_avg_sq" : ".exp_avg");
        const std::vector<double> v = values(name);
        for (std::size_t j = 0; j < v.size(); ++j)
          if (!std::isfinite(v[j]) || (second && v[j] < 0))
            reject(detail::concat(
                "tensor '", name, "' holds ", v[j], " at [", j, "], but ",
                second ? "a second moment is finite and >= 0" : "a first moment is finite"));
      }
  }

 private:
  // Entry i of the state is parameter `name`, p, of the model.
  template <class P>
  void check_entry(const std::string& fn, std::size_t i, const std::string& name,
                   const P& p) const {
    detail::require(i < moments_.size() && moments_[i].name == name &&
                        moments_[i].m.numel() == p.numel() && moments_[i].v.numel() == p.numel() &&
                        moments_[i].w.empty() != needs_master<P>,
                    fn, "model", "has parameter '", name,
                    "', which the optimiser state was not made for (call init)");
  }

  struct moment {
    std::string name;
    state m, v;
    master w;  // 16-bit parameters only: the float master weights
  };

  static bool is_step_count(double x) {
    return std::isfinite(x) && x >= 0 && x <= max_steps && std::floor(x) == x;
  }

  // The step count, checked before it is converted (the state is reachable through
  // visit_parameters).
  index_t step_count(const std::string& fn) const {
    const double x = step_.data[0];
    detail::require(is_step_count(x), fn, "this", "holds a step count of ", x,
                    ", not an integer in [0, 2^53]");
    return static_cast<index_t>(x);
  }

  // cfg, once every setting is in range: the constructor's first member initialiser.
  static adamw_config checked(const adamw_config& c) {
    const std::string fn = "attnmix::train::adamw";
    for (const auto& [name, beta] : {std::pair<const char*, double>{"config.beta1", c.beta1},
                                     std::pair<const char*, double>{"config.beta2", c.beta2}})
      detail::require(beta >= 0 && beta < 1, fn, name, "must be in [0, 1) but is ", beta);
    for (const auto& [name, x] :
         {std::pair<const char*, double>{"config.eps", c.eps},
          std::pair<const char*, double>{"config.weight_decay", c.weight_decay},
          std::pair<const char*, double>{"config.clip_norm", c.clip_norm}})
      detail::require(std::isfinite(x) && x >= 0, fn, name, "must be finite and >= 0 but is ", x);
    return c;
  }

  adamw_config cfg_;
  std::vector<moment> moments_;
  layers::parameter<double> step_;
  // The step's sum of squared gradients, in the backend's memory (not part of the state).
  layers::buffer<double, typename Backend::memory_space> sum_squares_;
};

}  // namespace train
}  // namespace attnmix
