#include "components/metrics.h"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <spdlog/spdlog.h>

namespace ctitan {

MetricsLogger::MetricsLogger(const std::string& dump_folder, bool write, int64_t total_steps)
    : total_steps_(total_steps) {
  if (!write) return;
  std::filesystem::create_directories(dump_folder);
  const std::string path = dump_folder + "/metrics.jsonl";
  out_.open(path, std::ios::app);
  if (!out_) spdlog::warn("metrics: cannot open {} for appending", path);
}

static std::string num(double v) {
  if (!std::isfinite(v)) return std::isnan(v) ? "NaN" : (v > 0 ? "Infinity" : "-Infinity");
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // round-trips a double exactly
  return buf;
}

std::string MetricsLogger::to_json(const StepMetrics& m) {
  std::string s = "{\"step\": " + std::to_string(m.step);
  const std::pair<const char*, double> fields[] = {
      {"loss", m.loss}, {"grad_norm", m.grad_norm}, {"lr", m.lr},
      {"tps", m.tps}, {"tflops", m.tflops}, {"mfu", m.mfu},
      {"memory_gib", m.memory_gib}, {"data_loading_s", m.data_loading_s},
      {"elapsed_s", m.elapsed_s}};
  for (const auto& [k, v] : fields) s += std::string(", \"") + k + "\": " + num(v);
  for (const auto& [k, v] : m.extra) s += ", \"" + k + "\": " + num(v);
  return s + "}";
}

std::string format_duration(double seconds) {
  const auto t = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(t / 3600), long(t / 60 % 60));
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", long(t / 60), long(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%lds", long(t));
  return buf;
}

void MetricsLogger::log(const StepMetrics& m) {
  const double per_step = m.step > 0 ? m.elapsed_s / m.step : 0.0;
  const double eta = per_step * static_cast<double>(total_steps_ - m.step);
  std::string extra;
  for (const auto& [k, v] : m.extra) extra += fmt::format("  {}: {:.4f}", k, v);
  spdlog::info(
      "step: {:>5}/{}  loss: {:7.4f}  grad_norm: {:7.4f}  lr: {:.3e}  memory: {:.2f}GiB  "
      "tps: {:.0f}  tflops: {:.3f}  mfu: {:.2f}%  data: {:.3f}s{}  eta: {}",
      m.step, total_steps_, m.loss, m.grad_norm, m.lr, m.memory_gib, m.tps, m.tflops, m.mfu,
      m.data_loading_s, extra, format_duration(eta));
  if (out_.is_open()) {
    out_ << to_json(m) << '\n';
    out_.flush();
  }
}

double LossSpikeDetector::observe(double loss) {
  if (!std::isfinite(loss)) return 0;
  double mean = 0;
  for (double l : recent_) mean += l;
  mean = recent_.empty() ? 0 : mean / static_cast<double>(recent_.size());
  const bool spike = factor_ > 0 && recent_.size() >= kMinHistory && loss > factor_ * mean;
  if (recent_.size() < kWindow) {
    recent_.push_back(loss);
  } else {
    recent_[next_] = loss;
    next_ = (next_ + 1) % kWindow;
  }
  return spike ? mean : 0;
}

}  // namespace ctitan
