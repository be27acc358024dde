#include "components/lr_scheduler.h"

#include <cmath>
#include <stdexcept>

#include <spdlog/spdlog.h>

namespace ctitan {

namespace {

// Python's round(), which torchtitan's decay steps use: a half goes to the even neighbour
// (round(2.5) == 2, round(3.5) == 4), where std::llround goes away from zero.
int64_t python_round(double x) {
  if (std::fabs(x - std::trunc(x)) == 0.5) return static_cast<int64_t>(2.0 * std::round(x / 2.0));
  return static_cast<int64_t>(std::round(x));
}

}  // namespace

LRScheduler::LRScheduler(double base_lr, const LRScheduleSpec& spec)
    : base_lr_(base_lr), decay_type_(spec.decay_type), min_lr_factor_(spec.min_lr_factor) {
  const int64_t steps = spec.training_steps;
  warmup_ = spec.warmup_steps;
  if (warmup_ > steps) {
    spdlog::warn("lr_scheduler.warmup_steps ({}) exceeds training.steps ({}); using {}", warmup_, steps, steps);
    warmup_ = steps;
  }
  if (spec.decay_ratio) {
    decay_ = python_round(static_cast<double>(steps) * *spec.decay_ratio);
    if (warmup_ + decay_ > steps) {
      spdlog::warn("warmup ({}) + decay ({}) steps exceed training.steps ({}); decaying over {}", warmup_, decay_,
                   steps, steps - warmup_);
      decay_ = steps - warmup_;
    }
  } else {
    decay_ = steps - warmup_;
  }
  // One virtual stable step so the last real step does not train at lr 0.
  stable_ = steps + 1 - warmup_ - decay_;
  if (decay_type_ != "linear" && decay_type_ != "sqrt" && decay_type_ != "cosine")
    throw std::logic_error("[lr_scheduler] unknown decay_type " + decay_type_);
}

double LRScheduler::factor(int64_t current) const {
  if (current < warmup_) {
    // 0-based position, hence +1: the first step already trains at lr/warmup.
    return static_cast<double>(current + 1) / static_cast<double>(warmup_);
  }
  if (current < warmup_ + stable_) return 1.0;
  const double progress = static_cast<double>(current + 1 - warmup_ - stable_) / static_cast<double>(decay_);
  double f;
  if (decay_type_ == "linear") {
    f = 1.0 - progress;
  } else if (decay_type_ == "sqrt") {
    f = 1.0 - std::sqrt(progress);
  } else {
    f = 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return min_lr_factor_ + (1.0 - min_lr_factor_) * f;
}

}  // namespace ctitan
