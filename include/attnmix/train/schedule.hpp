#pragma once
// Learning-rate schedules: plain functions of the step, so that a resumed run continues on the
// same curve.

#include <cmath>

#include "attnmix/config.hpp"

namespace attnmix {
namespace train {

// Linear warm-up from 0 to `peak` over `warmup` steps, then a cosine decay to `floor` at step
// `total` (and `floor` after it). Steps count from 1, as the optimiser's.
struct warmup_cosine {
  index_t warmup = 0;
  index_t total = 1;
  double peak = 1e-3;
  double floor = 0.0;

  double operator()(index_t step) const {
    if (step <= 0) return 0.0;
    if (step <= warmup) return peak * double(step) / double(warmup);
    if (step >= total) return floor;
    const double progress = double(step - warmup) / double(total - warmup);
    return floor + 0.5 * (peak - floor) * (1.0 + std::cos(3.14159265358979323846 * progress));
  }
};

// The same rate at every step (after an optional linear warm-up).
struct constant_rate {
  double rate = 1e-3;
  index_t warmup = 0;

  double operator()(index_t step) const {
    if (step <= 0) return 0.0;
    return step < warmup ? rate * double(step) / double(warmup) : rate;
  }
};

}  // namespace train
}  // namespace attnmix
