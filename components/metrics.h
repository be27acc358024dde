// The metrics line (console) and <dump_folder>/metrics.jsonl, one JSON object per
// logged step. Field names are a contract (ARCHITECTURE.md): step, loss, grad_norm, lr,
// tps, tflops, mfu, memory_gib, data_loading_s, elapsed_s.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace ctitan {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;            // mean token cross-entropy over the global batch (nats)
  double grad_norm = 0;       // global L2 norm before clipping
  double lr = 0;
  double tps = 0;             // tokens per second per rank since the last log
  double tflops = 0;          // achieved TFLOP/s per rank (model FLOPs, 6N + attention)
  double mfu = 0;             // percent of the peak FLOP/s the run measured or was given
  double memory_gib = 0;      // peak RSS of this process
  double data_loading_s = 0;  // time spent producing batches since the last log
  double elapsed_s = 0;       // since training started
  // Optional extras appended to the JSON object (name, value), e.g. component losses.
  std::vector<std::pair<std::string, double>> extra;
};

class MetricsLogger {
 public:
  // Appends to <dump_folder>/metrics.jsonl when `write` (rank 0 only).
  MetricsLogger(const std::string& dump_folder, bool write, int64_t total_steps);
  void log(const StepMetrics& m);
  static std::string to_json(const StepMetrics& m);

 private:
  std::ofstream out_;
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
