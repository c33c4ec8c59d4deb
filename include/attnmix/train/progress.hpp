#pragma once
// train::progress: the one-line report of a training run, "step 120/2000  loss 0.4132
// 35.2k tok/s  ETA 3m12s", printed every `every` steps and at the last.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"

namespace attnmix {
namespace train {

class progress {
 public:
  // total: the steps of the run; tokens: tokens per step; every: steps between lines (0: none);
  // each >= 0. out: where the lines go, not null. Throws attnmix::error otherwise.
  progress(index_t total, index_t tokens, index_t every, std::FILE* out = stdout,
           std::string label = "")
      : total_(checked("total", total)),
        tokens_(checked("tokens", tokens)),
        every_(checked("every", every)),
        out_(out),
        label_(std::move(label)),
        start_(clock::now()) {
    attnmix::detail::require(out != nullptr, "attnmix::train::progress", "out",
                             "is a null FILE pointer");
  }

  // After step `step` (1-based, >= 0) with its loss.
  void step(index_t step, double loss) {
    attnmix::detail::require(step >= 0, "attnmix::train::progress::step", "step",
                             "must be >= 0 but is ", step);
    if (every_ <= 0 || (step % every_ != 0 && step != total_)) return;
    const double s = seconds();
    const double rate = s > 0 ? double(step) * double(tokens_) / s : 0.0;
    const double eta = step > 0 && step < total_ ? s / double(step) * double(total_ - step) : 0.0;
    std::fprintf(out_, "%sstep %lld/%lld  loss %.4f  %s tok/s  ETA %s\n", label_.c_str(),
                 static_cast<long long>(step), static_cast<long long>(total_), loss,
                 count(rate).c_str(), duration(eta).c_str());
    std::fflush(out_);
  }
  // Seconds since the start.
  double seconds() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

  // "1h02m" or "3m12s" of s seconds; "?" for a negative or NaN time.
  static std::string duration(double s) {
    if (!(s >= 0)) return "?";
    char buf[32];
    // Capped at about 3000 years, so that the conversion to an integer stays in range.
    const long long t = static_cast<long long>(std::fmin(s, 1e11) + 0.5);
    if (t >= 3600)
      std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, (t / 60) % 60);
    else
      std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
    return buf;
  }

 private:
  using clock = std::chrono::steady_clock;
  static index_t checked(const char* name, index_t x) {
    attnmix::detail::require(x >= 0, "attnmix::train::progress", name, "must be >= 0 but is ", x);
    return x;
  }
  static std::string count(double x) {
    char buf[32];
    if (x >= 1e6)
      std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
    else if (x >= 1e3)
      std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
    else
      std::snprintf(buf, sizeof buf, "%.0f", x);
    return buf;
  }

  index_t total_, tokens_, every_;
  std::FILE* out_;
  std::string label_;
  clock::time_point start_;
};

}  // namespace train
}  // namespace attnmix
