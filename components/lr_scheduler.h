// Learning-rate schedule: linear warmup → stable → decay (linear / sqrt / cosine),
// the multiplicative factor torchtitan's build_lr_schedulers feeds to LambdaLR.
// Plain C++: no LibTorch here, so tests and tools can use it cheaply.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace ctitan {

struct LRScheduleSpec {
  int64_t training_steps = 1;
  int64_t warmup_steps = 0;
  std::optional<double> decay_ratio;  // None: decay over everything after warmup
  std::string decay_type = "linear";  // linear | sqrt | cosine
  double min_lr_factor = 0.0;
};

class LRScheduler {
 public:
  // base_lr: optimizer.lr. Adjusts warmup/decay lengths exactly as torchtitan does
  // (warmup capped at training.steps; warmup + decay capped at training.steps) and
  // adds one virtual stable step so the final step's lr is not 0.
  LRScheduler(double base_lr, const LRScheduleSpec& spec);

  // Factor for 0-based scheduler position `current` (LambdaLR's last_epoch).
  double factor(int64_t current) const;
  // lr used by 1-based training step `step` (the scheduler advances after each step).
  double lr_for_step(int64_t step) const { return base_lr_ * factor(step - 1); }

  double base_lr() const { return base_lr_; }
  int64_t warmup_steps() const { return warmup_; }
  int64_t stable_steps() const { return stable_; }
  int64_t decay_steps() const { return decay_; }

  // Reshard rule: replicated. Every rank holds the same position; a checkpoint stores
  // one copy ("lr_scheduler.last_step") and every rank, on any world size, loads it.
  int64_t last_step = 0;  // number of completed scheduler steps
  double current_lr() const { return base_lr_ * factor(last_step); }
  void step() { ++last_step; }

 private:
  double base_lr_;
  int64_t warmup_, stable_, decay_;
  std::string decay_type_;
  double min_lr_factor_;
};

}  // namespace ctitan
