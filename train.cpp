// ctitan's training recipe, top to bottom:
//   config → environment → tokenizer/data → model → init weights → optimizer/LR → loop.
// Every stage is a build_* / maybe_* call; the details live in the component folders.
//
// Dimensions used in comments: B = local batch size, T = seq_len, V = vocab size.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "components/lr_scheduler.h"
#include "components/metrics.h"
#include "components/optimizer.h"
#include "components/system.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "datasets/dataloader.h"
#include "datasets/tokenizer.h"
#include "models/llama/args.h"
#include "models/llama/model.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace ctitan {
namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Console + <dump_folder>/logs/rank<r>.log. The file sink is added once the dump folder
// may be written (after the config has been validated: bad input writes nothing).
void init_logging(bool color) {
  std::shared_ptr<spdlog::sinks::sink> console;
  if (color)
    console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  else
    console = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("ctitan", console);
  logger->set_pattern("[%H:%M:%S] [rank0] %^%l%$ %v");
  spdlog::set_default_logger(logger);
}

void add_log_file(const std::string& dump_folder) {
  fs::create_directories(dump_folder + "/logs");
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(dump_folder + "/logs/rank0.log");
  file->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank0] %l %v");
  spdlog::default_logger()->sinks().push_back(file);
  spdlog::flush_every(std::chrono::seconds(5));
}

// Global batch = local_batch_size × dp × gradient-accumulation steps (torchtitan).
int64_t gradient_accumulation_steps(const JobConfig& cfg, int64_t dp) {
  const auto& t = cfg.training;
  const int64_t per_step = t.local_batch_size * dp;
  if (t.global_batch_size < 0) return 1;
  if (t.global_batch_size % per_step != 0)
    throw UserError("config error: training.global_batch_size=" +
                    std::to_string(t.global_batch_size) + " is not a multiple of local_batch_size (" +
                    std::to_string(t.local_batch_size) + ") × dp (" + std::to_string(dp) + ")");
  return t.global_batch_size / per_step;
}

uint64_t pick_seed(const JobConfig& cfg) {
  if (cfg.debug.seed) return static_cast<uint64_t>(*cfg.debug.seed);
  // torchtitan picks a random seed when debug.seed is unset; log it so a run can be repeated.
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32 | rd()) & 0x7fffffffffffffffULL;
}

// Data: the tokenizer and this rank's stream of packed windows [B, T+1].
struct DataPipeline {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<DataLoader> loader;
  std::string source;
};

DataPipeline build_data(const JobConfig& cfg, int64_t dp_rank, int64_t dp_world) {
  DataPipeline d;
  const std::string tok_path = resolve_tokenizer_path(cfg.model.tokenizer_path, cfg.model.hf_assets_path);
  d.tokenizer = Tokenizer::load(tok_path);
  const char* env_root = std::getenv("CTITAN_DATA_DIR");
  const std::string data_root = env_root && *env_root ? env_root : "./data";
  d.source = resolve_dataset_path(cfg.training.dataset, cfg.training.dataset_path, data_root);
  d.loader = std::make_unique<DataLoader>(*d.tokenizer, d.source, cfg.training.seq_len,
                                          cfg.training.local_batch_size, dp_rank, dp_world);
  spdlog::info("tokenizer: {} (vocab {}, bos {}, eos {})", tok_path, d.tokenizer->vocab_size(),
               d.tokenizer->bos_id(), d.tokenizer->eos_id());
  spdlog::info("dataset: {} (dp rank {} of {})", d.source, dp_rank, dp_world);
  return d;
}

// The model args of the flavor, completed from the tokenizer and the training config
// (as torchtitan's update_from_config: vocab from the tokenizer, max_seq_len = seq_len).
TransformerModelArgs build_model_args(const JobConfig& cfg, const Tokenizer& tok) {
  if (cfg.model.name != "llama3")
    throw UserError("not supported yet: model.name = \"" + cfg.model.name + "\" (ctitan supports: llama3)");
  TransformerModelArgs args = llama3_flavor(cfg.model.flavor);
  args.vocab_size = tok.vocab_size();
  args.max_seq_len = cfg.training.seq_len;
  return args;
}

LRScheduleSpec lr_spec(const JobConfig& cfg) {
  LRScheduleSpec s;
  s.training_steps = cfg.training.steps;
  s.warmup_steps = cfg.lr_scheduler.warmup_steps;
  s.decay_ratio = cfg.lr_scheduler.decay_ratio;
  s.decay_type = cfg.lr_scheduler.decay_type;
  s.min_lr_factor = cfg.lr_scheduler.min_lr_factor;
  return s;
}

OptimizerSpec optimizer_spec(const JobConfig& cfg) {
  const auto& o = cfg.optimizer;
  return OptimizerSpec{o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay};
}

void write_effective_config(const JobConfig& cfg) {
  fs::create_directories(cfg.job.dump_folder);
  const std::string path = cfg.job.dump_folder + "/job_config.toml";
  std::ofstream out(path);
  out << job_config_to_toml(cfg);
  if (!out) throw RuntimeFailure("cannot write " + path);
  spdlog::info("effective config written to {}", path);
}

int run(const std::vector<std::string>& argv) {
  // ---- config -----------------------------------------------------------------------
  ConfigLoadResult loaded = load_job_config(argv);
  if (loaded.help_requested) {
    std::cout << job_config_help();
    return 0;
  }
  const JobConfig cfg = loaded.config;
  check_supported(cfg);
  if (cfg.job.print_config) {
    std::cout << job_config_to_toml(cfg);
    return 0;
  }
  init_logging(!cfg.metrics.disable_color_printing && isatty(STDERR_FILENO));

  // ---- environment (one process; FSDP ranks come with the distributed runtime) ---------
  const int64_t dp_rank = 0, dp_world = 1;
  const int64_t accum = gradient_accumulation_steps(cfg, dp_world);
  const uint64_t seed = pick_seed(cfg);
  if (cfg.debug.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);

  // ---- tokenizer and data (validated before anything is written) ----------------------
  DataPipeline data = build_data(cfg, dp_rank, dp_world);
  const TransformerModelArgs margs = build_model_args(cfg, *data.tokenizer);

  add_log_file(cfg.job.dump_folder);
  write_effective_config(cfg);
  check_blas_and_warn();
  spdlog::info("torch threads: {}; seed: {}{}", torch::get_num_threads(), seed,
               cfg.debug.seed ? "" : " (random: set debug.seed to repeat this run)");

  // ---- model: build, then initialise (construction and init are separate so that a
  // sharded or meta-device build can initialise only what it holds) --------------------
  torch::manual_seed(seed);
  Transformer model(margs);
  model->init_weights();
  model->train();
  const ParamCounts counts = count_params(margs);
  const double flops_per_tok = flops_per_token(margs, cfg.training.seq_len);
  spdlog::info("model: {} {} — {:.3f}M parameters ({:.3f}M non-embedding), {:.1f} MFLOP/token",
               cfg.model.name, cfg.model.flavor, counts.total / 1e6,
               (counts.total - counts.embedding) / 1e6, flops_per_tok / 1e6);
  if (cfg.training.mixed_precision_param != "float32")
    spdlog::info("training.mixed_precision_param = {} applies to FSDP units; one process trains in float32",
                 cfg.training.mixed_precision_param);

  // ---- optimizer and LR schedule -------------------------------------------------------
  std::vector<torch::Tensor> params = model->parameters();
  auto optimizer = build_optimizer(params, optimizer_spec(cfg));
  LRScheduler lr_sched(cfg.optimizer.lr, lr_spec(cfg));
  spdlog::info("lr schedule: warmup {} / stable {} / decay {} ({}), min_lr_factor {}",
               lr_sched.warmup_steps(), lr_sched.stable_steps(), lr_sched.decay_steps(),
               cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor);

  // ---- training loop --------------------------------------------------------------------
  const double peak_flops = measure_matmul_peak_flops("float32");
  spdlog::info("measured fp32 matmul peak: {:.1f} GFLOP/s (MFU reference)", peak_flops / 1e9);
  MetricsLogger metrics(cfg.job.dump_folder, /*write=*/dp_rank == 0, cfg.training.steps);
  const int64_t B = cfg.training.local_batch_size, T = cfg.training.seq_len;
  const double global_tokens = static_cast<double>(B * T * dp_world * accum);

  const auto train_start = Clock::now();
  auto window_start = Clock::now();
  double data_s = 0;
  int64_t window_tokens = 0;
  spdlog::info("training {} steps: global batch {} × {} tokens ({} micro-batches of {})",
               cfg.training.steps, B * dp_world * accum, T, accum, B);

  for (int64_t step = 1; step <= cfg.training.steps; ++step) {
    set_learning_rate(*optimizer, lr_sched.current_lr());
    optimizer->zero_grad();
    double loss_sum = 0.0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      const auto t_data = Clock::now();
      Batch batch = data.loader->next();
      auto inputs = torch::from_blob(batch.inputs.data(), {B, T}, torch::kInt64).clone();  // [B, T]
      auto labels = torch::from_blob(batch.labels.data(), {B, T}, torch::kInt64).clone();  // [B, T]
      data_s += seconds_since(t_data);

      auto logits = model->forward(inputs);  // [B, T, V]
      // Sum of token losses over the global batch's token count: the mean over every
      // token of the step, whatever the split into micro-batches and ranks.
      auto loss = torch::nn::functional::cross_entropy(
                      logits.view({B * T, -1}), labels.view({B * T}),
                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                  global_tokens;
      loss.backward();
      loss_sum += loss.item<double>();
      window_tokens += B * T;
    }
    if (!std::isfinite(loss_sum))
      throw RuntimeFailure("step " + std::to_string(step) + ": loss is " + std::to_string(loss_sum) +
                           "; stopping (HINT: lower optimizer.lr or training.max_norm)");
    const double grad_norm = clip_grad_norm(params, cfg.training.max_norm);
    const double lr = lr_sched.current_lr();
    optimizer->step();
    lr_sched.step();

    if (step == 1 || step % cfg.metrics.log_freq == 0 || step == cfg.training.steps) {
      const double dt = seconds_since(window_start);
      StepMetrics m;
      m.step = step;
      m.loss = loss_sum;
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.tps = window_tokens / dt;
      m.tflops = m.tps * flops_per_tok / 1e12;
      m.mfu = 100.0 * m.tps * flops_per_tok / peak_flops;
      m.memory_gib = peak_rss_gib();
      m.data_loading_s = data_s;
      m.elapsed_s = seconds_since(train_start);
      metrics.log(m);
      window_start = Clock::now();
      window_tokens = 0;
      data_s = 0;
    }
  }
  spdlog::info("training done: {} steps in {}", cfg.training.steps,
               format_duration(seconds_since(train_start)));
  spdlog::default_logger()->flush();
  return 0;
}

}  // namespace
}  // namespace ctitan

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return ctitan::run(args);
  } catch (const ctitan::UserError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const ctitan::RuntimeFailure& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
