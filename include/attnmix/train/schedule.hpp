#pragma once
// Learning-rate schedules: plain functions of the step, so that a resumed run continues on the
// same curve.

#include <cmath>
#include <string>

#include "attnmix/config.hpp"
#include "attnmix/core/error.hpp"

namespace attnmix {
namespace detail {
// A schedule's step counts >= 0 (so that their differences cannot overflow) and its rates
// finite and >= 0.
inline void check_schedule(const char* fn, const char* count_name, index_t count,
                           const char* rate_name, double rate) {
  require(count >= 0, fn, count_name, "must be >= 0 but is ", count);
  require(std::isfinite(rate) && rate >= 0, fn, rate_name, "must be finite and >= 0 but is ", rate);
}
}  // namespace detail

namespace train {

// Linear warm-up from 0 to `peak` over `warmup` steps, then a cosine decay to `floor` at step
// `total` (and `floor` after it). Steps count from 1, as the optimiser's. Throws attnmix::error
// for a negative step count or a rate that is negative, NaN or inf.
struct warmup_cosine {
  index_t warmup = 0;
  index_t total = 1;
  double peak = 1e-3;
  double floor = 0.0;

  double operator()(index_t step) const {
    const char* fn = "attnmix::train::warmup_cosine";
    detail::check_schedule(fn, "warmup", warmup, "peak", peak);
    detail::check_schedule(fn, "total", total, "floor", floor);
    if (step <= 0) return 0.0;
    if (step <= warmup) return peak * double(step) / double(warmup);
    if (step >= total) return floor;
    const double progress = double(step - warmup) / double(total - warmup);
    return floor + 0.5 * (peak - floor) * (1.0 + std::cos(3.14159265358979323846 * progress));
  }
};

// The same rate at every step (after an optional linear warm-up). Throws attnmix::error as
// warmup_cosine does.
struct constant_rate {
  double rate = 1e-3;
  index_t warmup = 0;

  double operator()(index_t step) const {
    detail::check_schedule("attnmix::train::constant_rate", "warmup", warmup, "rate", rate);
    if (step <= 0) return 0.0;
    return step < warmup ? rate * double(step) / double(warmup) : rate;
  }
};

}  // namespace train
}  // namespace attnmix
