// The metrics line (console), <dump_folder>/metrics.jsonl (one JSON object per logged step)
// and, with metrics.enable_tensorboard, a TensorBoard event file. Field names are a contract
// (ARCHITECTURE.md): step, loss, grad_norm, lr, tps, tflops, mfu, memory_gib, data_loading_s,
// elapsed_s. Every field is also a TensorBoard scalar under torchtitan's tag for it
// (tensorboard_tag()), so TensorBoard and metrics.jsonl hold the same numbers.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "components/tensorboard.h"

namespace ctitan {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // mean token cross-entropy over the global batch (nats)
  double max_loss = 0;   // the largest rank's own mean loss (torchtitan's global_max_loss)
  double grad_norm = 0;  // global L2 norm before clipping
  double lr = 0;
  double n_tokens_seen = 0;   // tokens trained on so far, all ranks
  double tps = 0;             // tokens per second per rank since the last log
  double tflops = 0;          // achieved TFLOP/s per rank (model FLOPs, 6N + attention)
  double mfu = 0;             // percent of the peak FLOP/s the run measured or was given
  double memory_gib = 0;      // peak RSS of this process
  double data_loading_s = 0;  // time spent producing batches since the last log
  double elapsed_s = 0;       // since training started
  // Optional extras appended to the JSON object (name, value), e.g. component losses.
  std::vector<std::pair<std::string, double>> extra;
};

// One validation run (validation.freq): its own line in metrics.jsonl with the step it
// followed, {"step": N, "validation_loss": ..., ...}; torchtitan's validation_metrics/ tags.
struct ValidationMetrics {
  int64_t step = 0;
  double loss = 0;     // mean token cross-entropy over every validation token of every rank
  double tokens = 0;   // validation tokens, all ranks
  double batches = 0;  // validation batches per rank
  double tps = 0;      // validation tokens per second per rank
  double seconds = 0;  // wall time of the validation run
};

class MetricsLogger {
 public:
  // Appends to <dump_folder>/metrics.jsonl when `write` (rank 0 only).
  MetricsLogger(const std::string& dump_folder, bool write, int64_t total_steps);
  // Also writes every logged step to a TensorBoard event file in `folder`.
  void enable_tensorboard(const std::string& folder);
  void log(const StepMetrics& m);
  void log_validation(const ValidationMetrics& v);
  static std::string to_json(const StepMetrics& m);
  static std::string to_json(const ValidationMetrics& v);
  // (jsonl field, value) of every field, in the JSON object's order (step excluded).
  static std::vector<std::pair<std::string, double>> fields(const StepMetrics& m);
  static std::vector<std::pair<std::string, double>> fields(const ValidationMetrics& v);
  // The TensorBoard tag of a metrics.jsonl field: torchtitan's name where torchtitan logs
  // the same quantity ("loss" -> "loss_metrics/global_avg_loss"), else a tag of ctitan's.
  static std::string tensorboard_tag(const std::string& field);
  const TensorBoardWriter* tensorboard() const { return tb_.get(); }

 private:
  void write_line(const std::string& json);
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tb_;
  int64_t total_steps_;
};

// Loss spikes: a step whose loss exceeds `factor` × the mean of the previous kWindow finite
// losses (once there are at least kMinHistory of them) is a spike. Only a warning: a spike
// is often the data, and stopping is the non-finite check's job.
class LossSpikeDetector {
 public:
  static constexpr size_t kWindow = 20, kMinHistory = 5;
  explicit LossSpikeDetector(double factor) : factor_(factor) {}  // factor 0: never
  // Records `loss` (non-finite losses are ignored); returns the mean it was compared with
  // when it is a spike, else 0.
  double observe(double loss);

 private:
  double factor_;
  std::vector<double> recent_;  // ring of the last kWindow losses
  size_t next_ = 0;
};

// "1h02m" / "3m05s" / "12s".
std::string format_duration(double seconds);

}  // namespace ctitan
