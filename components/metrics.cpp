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

void MetricsLogger::enable_tensorboard(const std::string& folder) {
  tb_ = std::make_unique<TensorBoardWriter>(folder);
  spdlog::info("TensorBoard logging enabled: {}", tb_->path());
}

std::string MetricsLogger::tensorboard_tag(const std::string& field) {
  // torchtitan's tags (components/metrics.py) for the quantities it logs too. memory_gib is
  // the peak RSS: on a CPU the memory the process holds, what "reserved" is on a GPU.
  static const std::pair<const char*, const char*> kTags[] = {
      {"loss", "loss_metrics/global_avg_loss"},
      {"max_loss", "loss_metrics/global_max_loss"},
      {"grad_norm", "grad_norm"},
      {"lr", "lr"},
      {"n_tokens_seen", "n_tokens_seen"},
      {"tps", "throughput(tps)"},
      {"tflops", "tflops"},
      {"mfu", "mfu(%)"},
      {"memory_gib", "memory/max_reserved(GiB)"},
      {"validation_loss", "validation_metrics/loss"},
      {"validation_tps", "validation_metrics/throughput(tps)"},
      // ctitan's own quantities, grouped as torchtitan groups its tags.
      {"data_loading_s", "time_metrics/data_loading_since_last_log(s)"},
      {"elapsed_s", "time_metrics/elapsed(s)"},
      {"comm_wait_s", "time_metrics/comm_wait_since_last_log(s)"},
      {"state_gib", "memory/training_state(GiB)"},
      {"activation_gib", "memory/activations(GiB)"},
      {"lb_loss", "moe/load_balance_loss"},
      {"expert_spread", "moe/expert_spread"},
      {"validation_tokens", "validation_metrics/tokens"},
      {"validation_batches", "validation_metrics/steps"},
      {"validation_s", "validation_metrics/time(s)"},
  };
  for (const auto& [f, tag] : kTags)
    if (field == f) return tag;
  return field;
}

static std::string num(double v) {
  if (!std::isfinite(v)) return std::isnan(v) ? "NaN" : (v > 0 ? "Infinity" : "-Infinity");
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // round-trips a double exactly
  return buf;
}

std::vector<std::pair<std::string, double>> MetricsLogger::fields(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> f = {{"loss", m.loss},
                                                   {"max_loss", m.max_loss},
                                                   {"grad_norm", m.grad_norm},
                                                   {"lr", m.lr},
                                                   {"n_tokens_seen", m.n_tokens_seen},
                                                   {"tps", m.tps},
                                                   {"tflops", m.tflops},
                                                   {"mfu", m.mfu},
                                                   {"memory_gib", m.memory_gib},
                                                   {"data_loading_s", m.data_loading_s},
                                                   {"elapsed_s", m.elapsed_s}};
  f.insert(f.end(), m.extra.begin(), m.extra.end());
  return f;
}

std::vector<std::pair<std::string, double>> MetricsLogger::fields(const ValidationMetrics& v) {
  return {{"validation_loss", v.loss},
          {"validation_tokens", v.tokens},
          {"validation_batches", v.batches},
          {"validation_tps", v.tps},
          {"validation_s", v.seconds}};
}

static std::string json_object(int64_t step, const std::vector<std::pair<std::string, double>>& fields) {
  std::string s = "{\"step\": " + std::to_string(step);
  for (const auto& [k, v] : fields) s += ", \"" + k + "\": " + num(v);
  return s + "}";
}

std::string MetricsLogger::to_json(const StepMetrics& m) { return json_object(m.step, fields(m)); }
std::string MetricsLogger::to_json(const ValidationMetrics& v) { return json_object(v.step, fields(v)); }

// TensorBoard gets exactly the fields metrics.jsonl gets, under their tags.
static std::vector<std::pair<std::string, double>> tagged(std::vector<std::pair<std::string, double>> fields) {
  for (auto& f : fields) f.first = MetricsLogger::tensorboard_tag(f.first);
  return fields;
}

void MetricsLogger::write_line(const std::string& json) {
  if (out_.is_open()) {
    out_ << json << '\n';
    out_.flush();
  }
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
      m.step, total_steps_, m.loss, m.grad_norm, m.lr, m.memory_gib, m.tps, m.tflops, m.mfu, m.data_loading_s, extra,
      format_duration(eta));
  write_line(to_json(m));
  if (tb_) tb_->add_scalars(m.step, tagged(fields(m)));
}

void MetricsLogger::log_validation(const ValidationMetrics& v) {
  spdlog::info(
      "validate step: {:>5}  loss: {:7.4f}  tokens: {:.0f} ({:.0f} batches per rank)  tps: {:.0f}  time: {:.2f}s",
      v.step, v.loss, v.tokens, v.batches, v.tps, v.seconds);
  write_line(to_json(v));
  if (tb_) tb_->add_scalars(v.step, tagged(fields(v)));
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
