// ctitan's training recipe, top to bottom:
//   config → environment → tokenizer/data → model → init weights → optimizer/LR → loop.
// Every stage is a build_* / maybe_* call; the details live in the component folders.
//
// Dimensions used in comments: B = local batch size, T = seq_len, V = vocab size.
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <iostream>
#include <random>
#include <sstream>
#include <iterator>
#include <thread>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/train_adapters.h"
#include "components/cpu_allocator.h"
#include "components/gpu_metrics.h"
#include "components/lr_scheduler.h"
#include "components/memory_estimate.h"
#include "components/metrics.h"
#include "components/optimizer.h"
#include "components/preemption.h"
#include "components/system.h"
#include "components/tensorboard.h"
#include "components/validate.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "util/text.h"
#include "datasets/dataloader.h"
#include "datasets/tokenizer.h"
#include "kernels/fused_ops.h"
#include "models/init.h"
#include "kernels/gemm.h"
#include "models/registry.h"
#include "models/train_model.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm.h"
#include "parallelisms/device.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/launch_env.h"
#include "parallelisms/parallel_dims.h"
#include "train.h"
#include "util/env.h"
#include "util/strings.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace ctitan {
namespace {

// The matmul backend (kernels/gemm.h); a bad CTITAN_GEMM is bad input, reported before any
// output is written.
gemm::Backend gemm_backend_checked() {
  try {
    return gemm::backend();
  } catch (const std::runtime_error& e) {
    throw UserError(std::string("environment error: ") + e.what());
  }
}

// Console + <dump_folder>/logs/rank<r>.log. The file sink is added once the dump folder
// may be written (after the config has been validated: bad input writes nothing).
void init_logging(bool color, int64_t rank) {
  std::shared_ptr<spdlog::sinks::sink> console;
  if (color)
    console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  else
    console = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("ctitan", console);
  logger->set_pattern("[%H:%M:%S] [rank" + std::to_string(rank) + "] %^%l%$ %v");
  // Ranks other than 0 only report warnings and errors on the console (their file has all).
  console->set_level(rank == 0 ? spdlog::level::info : spdlog::level::warn);
  logger->set_level(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void add_log_file(const std::string& dump_folder, int64_t rank) {
  fs::create_directories(dump_folder + "/logs");
  const std::string r = std::to_string(rank);
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(dump_folder + "/logs/rank" + r + ".log");
  file->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank" + r + "] %l %v");
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
  double setup_s = 0;  // loading the tokenizer and opening the corpus (for the start-up line)
};

DataPipeline build_data(const JobConfig& cfg, int64_t dp_rank, int64_t dp_world) {
  DataPipeline d;
  const auto t0 = Clock::now();
  const std::string tok_path = resolve_tokenizer_path(cfg.model.tokenizer_path, cfg.model.hf_assets_path);
  d.tokenizer = Tokenizer::load(tok_path);
  const std::string& env_root = runtime_env().data_dir;
  const std::string data_root = env_root.empty() ? "./data" : env_root;
  d.source = resolve_dataset_path(cfg.training.dataset, cfg.training.dataset_path, data_root);
  d.loader = std::make_unique<DataLoader>(*d.tokenizer, d.source, cfg.training.seq_len,
                                          cfg.training.local_batch_size, dp_rank, dp_world);
  if (cfg.training.on_bad_document == "skip") d.loader->set_bad_documents(DataLoader::BadDocuments::kSkip);
  d.setup_s = seconds_since(t0);
  return d;
}

// The model of the config: its family (model.name, looked up in models/registry.h), flavor
// and sizes with max_seq_len = training.seq_len (torchtitan v0.2.x's update_from_config),
// validated. The vocabulary is the flavor's, as in torchtitan v0.2.x (8B: 128256, debugmodel:
// 2048), not the tokenizer's: a model's embedding may have more rows than its tokenizer has
// ids (never fewer: that is an error here, before anything runs).
struct ModelArgs {
  const ModelSpec* spec = nullptr;
  std::string flavor;
  int64_t seq_len = 0;
  ModelSizes sizes;
};

void check_vocab_fits(const JobConfig& cfg, int64_t model_vocab, const Tokenizer& tok) {
  if (tok.vocab_size() <= model_vocab) return;
  throw UserError("tokenizer " + tok.model_path() + " has " + std::to_string(tok.vocab_size()) +
                  " ids but model.flavor = \"" + cfg.model.flavor + "\" of " + cfg.model.name +
                  " has vocab_size " + std::to_string(model_vocab) +
                  ": use a tokenizer with at most that many ids or a flavor with a larger vocabulary");
}

// model.name must name a registered family (the config cannot know them: models/ is built
// after config/).
const ModelSpec& configured_model_spec(const JobConfig& cfg) {
  if (const ModelSpec* spec = find_model_spec(cfg.model.name)) return *spec;
  std::string names;
  for (const auto& n : model_names()) names += (names.empty() ? "" : ", ") + n;
  throw UserError("config error: model.name = \"" + cfg.model.name + "\" is not one of: " + names);
}

ModelArgs build_model_args(const JobConfig& cfg, const Tokenizer& tok) {
  ModelArgs a;
  a.spec = &configured_model_spec(cfg);
  a.flavor = cfg.model.flavor;
  a.seq_len = cfg.training.seq_len;
  a.sizes = a.spec->sizes(a.flavor, a.seq_len);
  check_vocab_fits(cfg, a.sizes.vocab_size, tok);
  return a;
}

// Model name and flavor are checked with the rest of the config, before anything runs.
void build_model_args_check(const JobConfig& cfg) {
  configured_model_spec(cfg).sizes(cfg.model.flavor, cfg.training.seq_len);
}

TrainModel build_model(const ModelArgs& a, int64_t seq_len, ModelInit init) {
  std::optional<DeferredParameters> deferred;
  if (init == ModelInit::Deferred) deferred.emplace();
  return a.spec->build(a.flavor, seq_len, init);
}

// The LR schedule of the config's [lr_scheduler] and training.steps.
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

// Test hook: CTITAN_FAULT=<kind>:<rank>:<step> makes that rank misbehave mid-step, after its
// backward, so tests can check what the job does. kind: raise (an exception), kill (SIGKILL),
// hang (sleeps for an hour), term | int | usr1 (the process sends itself that stop signal),
// nan | inf (its loss becomes NaN / inf), nangrad (a gradient element becomes NaN), spike
// (its reported loss is multiplied by 10). Under torchrun only the first attempt meets it: the
// workers it restarts (TORCHELASTIC_RESTART_COUNT > 0) inherit the variable but run clean.
void maybe_inject_fault(int64_t rank, int64_t step, double& loss, const std::vector<torch::Tensor>& params) {
  const auto& hook = runtime_env().fault;
  if (!hook || runtime_env().restart_count > 0 || !hook->at(rank, step)) return;
  const std::string& k = hook->kind;
  if (k == "oom") return;  // maybe_inject_oom's
  if (k == "kill") raise(SIGKILL);
  if (k == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (k == "term" || k == "int" || k == "usr1") {
    request_stop_for_test(k == "term" ? SIGTERM : k == "int" ? SIGINT : SIGUSR1);
    return;
  }
  if (k == "nan" || k == "inf" || k == "spike") {
    loss = k == "nan" ? std::nan("") : k == "inf" ? HUGE_VAL : 10 * loss;
    return;
  }
  if (k == "nangrad") {
    for (const auto& p : params)
      if (p.grad().defined() && p.grad().numel() > 0) {
        p.grad().view(-1)[0] = std::nan("");
        return;
      }
  }
  throw RuntimeFailure("injected fault (CTITAN_FAULT=" + hook->spec + ")");
}

// Seconds since this process started (/proc/self/stat's start time against /proc/uptime;
// 10 ms resolution): start-up as the user waits for it, loading of shared libraries included.
double process_age_s() {
  std::ifstream stat("/proc/self/stat"), up("/proc/uptime");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(text.substr(paren + 2));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
  }
  double uptime = 0;
  up >> uptime;
  if (f.empty() || f.find_first_not_of("0123456789") != std::string::npos) return 0;
  return uptime - std::stod(f) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Bytes this process has read through read(2) and friends (/proc/self/io rchar), 0 if unknown.
int64_t process_rchar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t v = 0;
  while (io >> key >> v)
    if (key == "rchar:") return v;
  return 0;
}

// Where a run is, for the line an allocation failure ends with: the step (0 before the
// first) and the phase, plus what the start-up estimate said.
struct RunProgress {
  int64_t step = 0;
  std::string phase = "start-up";
  int64_t rank = 0;
  double estimate_bytes = 0;
};

// Test hook: CTITAN_FAULT=oom:<rank>:<step>:<phase> makes that rank ask LibTorch for 1 PiB
// (more than any address space) when it enters that phase of that step (phase as
// RunProgress names it, e.g. "backward", "optimizer", "checkpoint save"; step 0 with a
// start-up phase such as "optimizer"), so tests see a real allocation failure reported.
void maybe_inject_oom(const RunProgress& at) {
  const auto& hook = runtime_env().fault;
  if (!hook || hook->kind != "oom" || hook->detail.empty() || !hook->at(at.rank, at.step)) return;
  if (at.phase != hook->detail) return;
  (void)torch::empty({int64_t{1} << 48}, torch::kFloat);  // 2^48 floats = 1 PiB
}

// Is this LibTorch error an allocation that failed? c10's OutOfMemoryError (ctitan's caching
// CPU allocator throws it), or LibTorch's default CPU allocator's "can't allocate memory".
bool is_out_of_memory(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return true;
  const std::string m = e.what_without_backtrace();
  return m.find("can't allocate memory") != std::string::npos || m.find("not enough memory") != std::string::npos ||
         m.find("out of memory") != std::string::npos;
}

// One line: where (rank, step, phase), how much was asked for (when the allocator says: the
// number before " bytes"), what the rank held and what the estimate said, and what helps.
std::string allocation_failure_line(const RunProgress& at, const std::string& what) {
  const double G = 1024.0 * 1024.0 * 1024.0;
  std::string asked = "an allocation failed (the allocator gave no size)";
  const size_t b = what.find(" bytes");
  if (b != std::string::npos) {
    size_t a = b;
    while (a > 0 && std::isdigit(static_cast<unsigned char>(what[a - 1]))) --a;
    if (a < b) {
      double v = std::stod(what.substr(a, b - a));
      const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
      int u = 0;
      for (; v >= 1024 && u < 6; ++u) v /= 1024;
      char buf[96];
      std::snprintf(buf, sizeof buf, "asked for %.3g %s (%s bytes)", v, units[u], what.substr(a, b - a).c_str());
      asked = buf;
    }
  } else if (size_t t = what.find("allocate "); t != std::string::npos) {
    // CUDA's caching allocator: "Tried to allocate 2.00 GiB. GPU 0 has ..."
    const size_t from = t + 9, to = what.find_first_of(".\n", what.find(' ', from) + 1);
    asked = "asked for " + what.substr(from, to == std::string::npos ? std::string::npos : to - from);
  }
  char held[160];
  std::snprintf(held, sizeof held, "this rank's RSS %.3f GiB (peak %.3f GiB), start-up estimate %.3f GiB",
                current_rss_gib(), peak_rss_gib(), at.estimate_bytes / G);
  const std::string where = at.step > 0 ? "at step " + std::to_string(at.step) + " (" + at.phase + ")"
                                        : "at start-up (" + at.phase + ")";
  const size_t nl = what.find('\n');
  return "error: out of memory on rank " + std::to_string(at.rank) + " " + where + ": " + asked + "; " + held +
         " (HINT: activation_checkpoint.mode = \"full\", a smaller training.local_batch_size or seq_len, or more "
         "ranks) [" + what.substr(0, nl) + "]";
}

// Test hook: CTITAN_TRACE_WINDOWS=<prefix> appends every window this rank trains on to
// <prefix>.rank<r>, one line "<step> <token ids...>", so tests can check which data a run saw.
void maybe_trace_batch(const Batch& b, int64_t rank, int64_t step) {
  const std::string& prefix = runtime_env().trace_windows;
  if (prefix.empty()) return;
  static std::ofstream out(prefix + ".rank" + std::to_string(rank), std::ios::app);
  for (int64_t i = 0; i < b.batch; ++i) {
    out << step;
    for (int64_t t = 0; t < b.seq; ++t) out << ' ' << b.inputs[i * b.seq + t];
    out << ' ' << b.labels[i * b.seq + b.seq - 1] << '\n';
  }
  out.flush();
}

// profiling.enable_profiling: every profile_freq-th step is recorded by LibTorch's profiler
// (op names, shapes off) into a Chrome trace, in torchtitan's folder layout.
std::string profile_path(const JobConfig& cfg, int64_t rank, int64_t step) {
  return (std::filesystem::path(cfg.job.dump_folder) / cfg.profiling.save_traces_folder /
          ("iteration_" + std::to_string(step)) / ("rank" + std::to_string(rank) + "_trace.json"))
      .string();
}

std::unique_ptr<torch::autograd::profiler::RecordProfile> maybe_profile(const JobConfig& cfg, int64_t rank,
                                                                         int64_t step) {
  if (!cfg.profiling.enable_profiling || step % cfg.profiling.profile_freq != 0) return nullptr;
  const std::string path = profile_path(cfg, rank, step);
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  return std::make_unique<torch::autograd::profiler::RecordProfile>(path);
}

// The process groups of a job: world, FSDP shard group, HSDP replicate group.
struct Parallelism {
  LaunchEnv env;
  ParallelDims dims;
  std::unique_ptr<Distributed> dist;  // null for one process
  std::shared_ptr<Comm> shard, replicate;
  int64_t dp_rank = 0;
};

ParallelDims build_parallel_dims(const JobConfig& cfg, int64_t world_size) {
  const auto& c = cfg.parallelism;
  return ParallelDims::build(c.data_parallel_replicate_degree, c.data_parallel_shard_degree,
                             c.context_parallel_degree, c.tensor_parallel_degree, c.pipeline_parallel_degree,
                             world_size);
}

Parallelism build_parallelism(const JobConfig& cfg) {
  Parallelism p;
  p.env = detect_launch_env(environment_map());
  p.dims = build_parallel_dims(cfg, p.env.world_size);
  if (!p.env.distributed()) return p;
  p.dist = init_distributed(p.env, std::chrono::seconds(cfg.comm.init_timeout_seconds));
  // Every rank creates every group, in the same order (group creation is collective).
  for (int64_t rep = 0; rep < p.dims.dp_replicate; ++rep) {
    auto g = p.dist->new_group(p.dims.shard_group(rep * p.dims.dp_shard), "dp_shard" + std::to_string(rep));
    if (g) p.shard = g;
  }
  for (int64_t sh = 0; sh < p.dims.dp_shard; ++sh) {
    auto g = p.dist->new_group(p.dims.replicate_group(sh), "dp_replicate" + std::to_string(sh));
    if (g) p.replicate = g;
  }
  p.dp_rank = p.env.rank;  // only data parallelism: the dp rank is the global rank
  return p;
}

// Values every rank must agree on, decided by rank 0.
uint64_t agree_on_seed(const Parallelism& par, uint64_t seed) {
  if (!par.dist) return seed;
  auto t = torch::tensor({static_cast<int64_t>(seed)}, torch::kInt64);
  par.dist->world->broadcast(t, 0, "seed");
  return static_cast<uint64_t>(t.item<int64_t>());
}

// Mean over ranks (sum / world) of a scalar, or the value itself on one process.
double world_mean(const Parallelism& par, double v, const char* tag) {
  if (!par.dist) return v;
  auto t = torch::tensor({v}, torch::kFloat64);
  par.dist->world->all_reduce_sum(t, tag).wait();
  return t.item<double>() / static_cast<double>(par.env.world_size);
}

// Max over ranks of each value (per-rank peak memory, communication wait).
std::vector<double> world_max(const Parallelism& par, std::vector<double> v) {
  if (!par.dist) return v;
  const int64_t n = static_cast<int64_t>(v.size()), W = par.env.world_size;
  auto local = torch::tensor(v, torch::kFloat64);
  auto all = torch::empty({W * n}, torch::kFloat64);
  par.dist->world->all_gather_flat(local, all, "metrics").wait();
  auto mx = std::get<0>(all.view({W, n}).max(0));
  for (int64_t i = 0; i < n; ++i) v[i] = mx[i].item<double>();
  return v;
}

// In place: each value summed over every rank (identity on one process).
void world_sum(const Parallelism& par, std::vector<double>& v, const char* tag) {
  if (!par.dist) return;
  auto t = torch::tensor(v, torch::kFloat64);
  par.dist->world->all_reduce_sum(t, tag).wait();
  for (size_t i = 0; i < v.size(); ++i) v[i] = t[static_cast<int64_t>(i)].item<double>();
}

// metrics.enable_tensorboard: an event file in <dump_folder>/<save_tb_folder>/<%Y%m%d-%H%M>/
// (torchtitan's layout), written by rank 0, or by every rank into rank_<r>/ with
// metrics.save_for_all_ranks. The minute is rank 0's, so all ranks of a job share the folder.
void maybe_enable_tensorboard(MetricsLogger& metrics, const JobConfig& cfg, const Parallelism& par) {
  if (!cfg.metrics.enable_tensorboard) return;
  int64_t now = static_cast<int64_t>(std::time(nullptr));
  if (par.dist) {
    auto t = torch::tensor({now}, torch::kInt64);
    par.dist->world->broadcast(t, 0, "tensorboard_folder");
    now = t.item<int64_t>();
  }
  if (par.env.rank != 0 && !cfg.metrics.save_for_all_ranks) return;
  const std::time_t tt = static_cast<std::time_t>(now);
  std::tm local{};
  localtime_r(&tt, &local);
  char minute[32];
  std::strftime(minute, sizeof minute, "%Y%m%d-%H%M", &local);
  fs::path dir = fs::path(cfg.job.dump_folder) / cfg.metrics.save_tb_folder / minute;
  if (cfg.metrics.save_for_all_ranks) dir /= "rank_" + std::to_string(par.env.rank);
  metrics.enable_tensorboard(dir.string());
}

// [validation]: the held-out data, checked (found, one whole batch on this rank) with the rest
// of the config, before the run writes anything.
std::unique_ptr<Validator> maybe_build_validator(const JobConfig& cfg, const Tokenizer& tok, int64_t dp_rank,
                                                 int64_t dp_world) {
  const auto& v = cfg.validation;
  if (!v.enable) return nullptr;
  const std::string& env_root = runtime_env().data_dir;
  ValidationSpec spec;
  spec.source = resolve_dataset_path(v.dataset, v.dataset_path, env_root.empty() ? "./data" : env_root,
                                     "validation");
  spec.local_batch_size = v.local_batch_size;
  spec.seq_len = v.seq_len;
  spec.freq = v.freq;
  spec.steps = v.steps;
  return std::make_unique<Validator>(tok, spec, dp_rank, dp_world);
}

// The model's RoPE table holds training.seq_len positions (max_seq_len, as torchtitan).
void check_validation_config(const JobConfig& cfg) {
  if (cfg.validation.enable && cfg.validation.seq_len > cfg.training.seq_len)
    throw UserError("config error: validation.seq_len = " + std::to_string(cfg.validation.seq_len) +
                    " exceeds training.seq_len = " + std::to_string(cfg.training.seq_len) +
                    " (the model's max_seq_len: its RoPE table has that many positions)");
}

// One validation run in the training setup: evaluation mode (no router jitter), no-grad, FSDP
// gathering units as in training. Afterwards the model is as the training step left it: every
// unit resharded, the MoE routing counters (tokens_per_expert buffers, zeroed by the step's
// load-balance update just before) zeroed again, so the next step is the same with or without
// validation.
ValidationMetrics run_validation(const Validator& validator, TrainModel& model, FSDP* fsdp, const Parallelism& par,
                                 int64_t step) {
  model.module->eval();
  ValidationMetrics v = validator.validate(step, model.forward, [&par](std::vector<double>& x) {
    world_sum(par, x, "validation");
  });
  model.module->train();
  if (fsdp) fsdp->reshard_all();
  torch::NoGradGuard no_grad;
  for (auto& b : model.module->named_buffers())
    if (b.key().size() >= 17 && b.key().compare(b.key().size() - 17, 17, "tokens_per_expert") == 0) b.value().zero_();
  return v;
}

// A stop request (preemption signal) seen by any rank, agreed at a step boundary so that
// every rank stops after the same step: one tiny all-gather of each rank's signal number.
struct StopRequest {
  int signal = 0;
  int64_t rank = -1;
};

StopRequest agree_on_stop(const Parallelism& par) {
  const int mine = stop_signal_received();
  if (!par.dist) return mine ? StopRequest{mine, 0} : StopRequest{};
  auto local = torch::tensor({static_cast<int64_t>(mine)}, torch::kInt64);
  auto all = torch::empty({par.env.world_size}, torch::kInt64);
  par.dist->world->all_gather_flat(local, all, "stop_request").wait();
  for (int64_t r = 0; r < par.env.world_size; ++r)
    if (all[r].item<int64_t>() != 0) return {static_cast<int>(all[r].item<int64_t>()), r};
  return {};
}

// What torchtitan's trainer checkpoints of itself: the steps done and the tokens seen.
struct TrainState {
  int64_t step = 0;
  int64_t ntokens_seen = 0;
};

// Every stateful component under its torchtitan name, and the manager that saves and
// loads them (checkpoint/checkpoint.h states each one's reshard rule).
struct Checkpointing {
  std::unique_ptr<ModelState> model;
  std::unique_ptr<OptimizerState> optimizer;
  std::unique_ptr<ScalarsState> lr_scheduler, train_state;
  std::unique_ptr<DataLoaderState> dataloader;
  std::unique_ptr<RngState> rng;
  std::unique_ptr<CheckpointManager> manager;
};

std::unique_ptr<Checkpointing> build_checkpointing(const JobConfig& cfg, const Parallelism& par, TrainModel& model,
                                                   FSDP* fsdp, torch::optim::Optimizer& opt, LRScheduler& lr,
                                                   DataPipeline& data, TrainState& ts, uint64_t seed) {
  auto c = std::make_unique<Checkpointing>();
  CheckpointOptions o = checkpoint_options(cfg);
  o.dp_replicate = par.dims.dp_replicate;
  o.dp_shard = par.dims.dp_shard;
  c->manager = std::make_unique<CheckpointManager>(
      o, par.dist ? checkpoint_comm(par.dist->world, par.dist->store) : CheckpointComm::single_process());
  // HSDP replicas hold the same rows: the first replica stores them.
  const bool first_replica = par.dims.replicate_index(par.env.rank) == 0;
  const std::vector<ShardedParam> sp = sharded_params(*model.module, fsdp);
  c->model = std::make_unique<ModelState>(sp, first_replica);
  c->optimizer = std::make_unique<OptimizerState>(opt, sp, first_replica);
  c->lr_scheduler = std::make_unique<ScalarsState>("lr_scheduler", std::vector<std::pair<std::string, int64_t*>>{
                                                                       {"last_step", &lr.last_step}});
  c->train_state = std::make_unique<ScalarsState>(
      "train_state", std::vector<std::pair<std::string, int64_t*>>{{"step", &ts.step}, {"ntokens_seen", &ts.ntokens_seen}});
  DataLoader* loader = data.loader.get();
  c->dataloader = std::make_unique<DataLoaderState>(
      [loader] { return loader->state_dict(); }, [loader](const std::string& s) { loader->load_state_dict(s); },
      par.dp_rank, par.dims.dp(), cfg.checkpoint.dataloader_reshard,
      [loader](const std::vector<std::string>& saved, int64_t, int64_t) { return loader->redistributed_state(saved); });
  c->rng = std::make_unique<RngState>(par.env.rank, seed);
  std::vector<std::string> fqns;
  for (const auto& p : sp) fqns.push_back(p.fqn);
  c->manager->set_dcp_extras(torchtitan_dcp_extras(opt, fqns, lr));
  c->manager->add("model", c->model.get());
  c->manager->add("optimizer", c->optimizer.get());
  c->manager->add("lr_scheduler", c->lr_scheduler.get());
  c->manager->add("dataloader", c->dataloader.get());
  c->manager->add("train_state", c->train_state.get());
  c->manager->add("rng", c->rng.get());
  return c;
}

// The periodic save. A save that failed on some rank fails on every rank alike, leaving the
// previous checkpoint intact (a disk full, an I/O error; a dead rank is a CollectiveFailure,
// never continued from). checkpoint.on_save_failure = "continue" logs it and goes on to the
// next save, except after the last step, where nothing would come after it.
void maybe_save(CheckpointManager& manager, int64_t step, bool last_step, const std::string& on_failure) {
  try {
    manager.save(step, last_step);
  } catch (const CollectiveFailure&) {
    throw;
  } catch (const RuntimeFailure& e) {
    if (on_failure != "continue" || last_step) throw;
    spdlog::warn("{}; training continues (checkpoint.on_save_failure = \"continue\")", e.what());
  }
}

// What the GPU path runs today (issue 17): one rank, float32, no FSDP. Several ranks need
// FSDP's NCCL collectives and its stream plan executed on the device: until then a GPU run
// on several ranks stops before writing anything, saying how to run instead. (bf16 on one
// GPU falls back to float32 in fsdp_applies, as on a CPU without native bf16.)
void check_device_supports(const DeviceChoice& device, const LaunchEnv& launch) {
  if (!device.cuda || launch.world_size <= 1) return;
  throw UserError("device: " + std::to_string(launch.world_size) + " ranks on GPUs (FSDP over NCCL) are not "
                  "implemented yet (issue 17: one rank on " + device.name() + " is); run one rank, or the CPU "
                  "(CUDA_VISIBLE_DEVICES=)");
}

// FSDP over the shard group (HSDP: plus the replicate group) whenever there is more than
// one data-parallel rank. Applied from outside the model: it wraps the model's units.
bool fsdp_applies(const JobConfig& cfg, const Parallelism& par, const DeviceChoice& device) {
  if (par.dims.dp() > 1) return true;
  // One process: FSDP's machinery over a group of one gives bf16 mixed precision (bf16
  // compute parameters, fp32 master weights, optimizer state and gradients) with the same
  // code and the same rounding as on N ranks. Only where the CPU has native bf16 matmuls:
  // elsewhere bf16 is emulated and slower than float32.
  if (cfg.training.mixed_precision_param == "float32") return false;
  if (device.cuda) {
    spdlog::info("training.mixed_precision_param = {}: bf16 on {} needs FSDP's mixed precision on the GPU, not "
                 "implemented yet (issue 17), so one process trains in float32",
                 cfg.training.mixed_precision_param, device.name());
    return false;
  }
  if (!cpu_has_native_bf16()) {
    spdlog::info("training.mixed_precision_param = {}: this CPU has no native bf16 matmul (avx512_bf16 / "
                 "amx_bf16), so one process trains in float32",
                 cfg.training.mixed_precision_param);
    return false;
  }
  return true;
}

// FSDP's reshard_after_forward as it applies on dp ranks. One process: freeing the bf16
// copies after forward saves little and costs a second cast in backward, so "default" keeps
// them (explicit "always" still frees).
std::string fsdp_reshard_policy(const JobConfig& cfg, int64_t dp) {
  return dp <= 1 && cfg.parallelism.fsdp_reshard_after_forward == "default"
             ? "never"
             : cfg.parallelism.fsdp_reshard_after_forward;
}

// init_unit: for a model built with ModelInit::Deferred, what fills each unit before FSDP
// keeps this rank's rows (empty: the shards start as zeros for a checkpoint to fill).
std::shared_ptr<FSDP> maybe_apply_fsdp(TrainModel& model, const JobConfig& cfg, Parallelism& par, bool sharded,
                                       const std::function<void(size_t)>& init_unit) {
  if (!sharded) return nullptr;
  if (par.dims.dp() <= 1) par.shard = Comm::single("local");
  const std::string reshard = fsdp_reshard_policy(cfg, par.dims.dp());
  auto opts = fsdp_options(reshard, cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce);
  opts.prefetch = cfg.parallelism.fsdp_prefetch;
  auto fsdp = std::make_shared<FSDP>(model.units(), par.shard, par.replicate, opts, init_unit);
  model.set_unit_wrapper(fsdp->wrapper());
  if (par.dims.dp() <= 1)
    spdlog::info("mixed precision on one process: {} compute, float32 master weights and optimizer state, {} "
                 "gradients",
                 cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce);
  else
    spdlog::info("FSDP: {} units sharded over {} ranks (replicate {}), params {}, reduce {}, reshard_after_forward {}",
                 model.units().size(), par.dims.dp_shard, par.dims.dp_replicate,
                 cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce,
                 cfg.parallelism.fsdp_reshard_after_forward);
  return fsdp;
}

// Activation checkpointing of the blocks. torchtitan applies AC, then FSDP: the model's
// wrapper runs FSDP(AC(block)) — FSDP's wrapper, when there is one, calls the unit function
// AC made checkpointed, so a recompute re-uses the parameters FSDP gathered for backward.
std::shared_ptr<ActivationCheckpoint> maybe_apply_ac(TrainModel& model, const JobConfig& cfg, FSDP* fsdp) {
  const auto& c = cfg.activation_checkpoint;
  if (c.mode == "none") return nullptr;
  const std::vector<ModelUnit> units = model.units();
  auto ac = std::make_shared<ActivationCheckpoint>(ac_options(c), units);
  model.set_unit_wrapper(compose(fsdp ? fsdp->wrapper() : UnitWrapper(),
                                 [ac](const std::string& u, const UnitFn& fn) { return ac->wrap(u, fn); }));
  spdlog::info("activation checkpointing: {}{} on {} of {} blocks (preserve_rng_state {}, determinism_check {})",
               c.mode, c.mode == "selective" ? " " + c.selective_ac_option : "", ac->checkpointed_units(units),
               model.n_layers, c.preserve_rng_state, c.determinism_check);
  return ac;
}

std::string format_gib(double gib) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", gib);
  return buf;
}

// The sizes the memory estimate needs, from the model args (nothing allocated).
MemoryModel memory_model(const ModelArgs& a) {
  MemoryModel m;
  const ModelSizes& z = a.sizes;
  const int64_t V = z.vocab_size, D = z.dim, L = z.n_layers, total = z.total_params;
  m.kv_dim = z.kv_dim;
  m.ffn = z.ffn;
  m.head_dim = z.head_dim;
  m.params = total;
  m.dim = D, m.vocab = V, m.n_layers = L;
  const int64_t block = (total - 2 * V * D - D) / std::max<int64_t>(1, L);
  m.largest_unit = std::max({V * D, V * D + D, block});
  m.last_unit = V * D + D;  // norm + output
  return m;
}

MemoryRun memory_run(const JobConfig& cfg, int64_t dp, bool sharded) {
  MemoryRun r;
  r.dp = dp;
  r.fsdp = sharded;
  r.compute_bytes = sharded && cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  r.reshard_after_forward = fsdp_reshard_policy(cfg, dp);
  r.batch = cfg.training.local_batch_size;
  r.seq = cfg.training.seq_len;
  r.ac_mode = cfg.activation_checkpoint.mode;
  r.async_checkpoint = cfg.checkpoint.enable && cfg.checkpoint.async_mode != "disabled";
  return r;
}

// Before anything of the model is allocated: the estimate of this rank's peak, and when it
// cannot fit in what the rank can have, one line with the numbers and what would fit (exit 2).
MemoryEstimate check_memory_fits(const JobConfig& cfg, const ModelArgs& margs, const LaunchEnv& env, int64_t dp,
                                 bool sharded) {
  const MemoryModel mm = memory_model(margs);
  const MemoryRun run = memory_run(cfg, dp, sharded);
  const double base = current_rss_gib() * (1 << 30);
  const MemoryEstimate est = estimate_memory(mm, run, base);
  std::string how;
  const double avail = memory_available_per_rank(env.local_world_size, &how);
  if (est.total() <= avail) return est;
  const double G = 1 << 30;
  std::vector<std::string> fits;
  for (int64_t n = std::max<int64_t>(2, 2 * dp); n <= (1 << 20); n *= 2) {
    const MemoryRun more = memory_run(cfg, n, /*sharded=*/true);  // FSDP's dtype and reshard policy on n ranks
    if (estimate_memory(mm, more, base).total() <= avail) {
      fits.push_back(std::to_string(n) + " ranks with as much memory each");
      break;
    }
  }
  if (run.ac_mode != "full") {
    MemoryRun ac = run;
    ac.ac_mode = "full";
    const double t = estimate_memory(mm, ac, base).total();
    if (t <= avail) fits.push_back("activation_checkpoint.mode = \"full\" (" + format_gib(t / G) + " GiB)");
  }
  for (int64_t b = run.batch / 2; b >= 1; b /= 2) {
    MemoryRun small = run;
    small.batch = b;
    if (estimate_memory(mm, small, base).total() <= avail) {
      fits.push_back("training.local_batch_size = " + std::to_string(b));
      break;
    }
  }
  for (int64_t t = run.seq / 2; t >= 1; t /= 2) {
    MemoryRun shorter = run;
    shorter.seq = t;
    if (estimate_memory(mm, shorter, base).total() <= avail) {
      fits.push_back("training.seq_len = " + std::to_string(t));
      break;
    }
  }
  throw UserError("memory: " + cfg.model.name + " " + cfg.model.flavor + " at local_batch_size " +
                  std::to_string(run.batch) + " × seq_len " + std::to_string(run.seq) + " (AC " + run.ac_mode + ", " +
                  std::to_string(dp) + " dp rank(s)) needs an estimated " + describe(est) + " per rank, but a rank can have " +
                  format_gib(avail / G) + " GiB (" + how + "); would fit: " +
                  (fits.empty() ? std::string("nothing this estimate can find on this machine") : join(fits, ", or ")));
}

// job.validate_only: the checks a run makes before it writes anything — the config, the
// launch environment against the parallelism degrees, the batch arithmetic, the tokenizer
// (loaded) and the model built on its vocabulary, the dataset (found) — then one line on
// `out` and exit 0. No communication between ranks, no output folder.
int validate_only(const JobConfig& cfg, std::ostream& out) {
  const LaunchEnv env = detect_launch_env(environment_map());
  const ParallelDims dims = build_parallel_dims(cfg, env.world_size);
  const int64_t accum = gradient_accumulation_steps(cfg, dims.dp());
  const DataPipeline data = build_data(cfg, std::min(env.rank, dims.dp() - 1), dims.dp());
  const ModelArgs margs = build_model_args(cfg, *data.tokenizer);
  const int64_t model_vocab = margs.sizes.vocab_size;
  maybe_build_validator(cfg, *data.tokenizer, std::min(env.rank, dims.dp() - 1), dims.dp());
  out << "config ok: " << (cfg.job.config_file.empty() ? "defaults" : cfg.job.config_file) << "; " << cfg.model.name
      << " " << cfg.model.flavor << "; " << env.world_size << " rank(s), dp " << dims.dp() << " x " << accum
      << " micro-batch(es); tokenizer " << data.tokenizer->model_path() << " (" << data.tokenizer->kind()
      << ", " << data.tokenizer->vocab_size() << " ids; model vocab " << model_vocab << "); dataset "
      << data.source << std::endl;
  return 0;
}

int run(const std::vector<std::string>& argv, std::ostream& out, RunProgress& at) {
  // ---- config -----------------------------------------------------------------------
  ConfigLoadResult loaded = load_job_config(argv);
  if (loaded.help_requested) {
    out << job_config_help();
    return 0;
  }
  const JobConfig cfg = loaded.config;
  if (cfg.job.print_config) {
    out << job_config_to_toml(cfg);
    return 0;
  }
  check_supported(cfg);
  check_checkpoint_config(cfg);
  check_validation_config(cfg);
  const gemm::Backend matmuls = gemm_backend_checked();
  build_model_args_check(cfg);
  if (cfg.job.validate_only) return validate_only(cfg, out);
  // Before any thread exists: SIGTERM / SIGINT / SIGUSR1 become a stop request.
  install_stop_signal_watcher();

  // ---- distributed environment and process groups ----------------------------------------
  const LaunchEnv launch = detect_launch_env(environment_map());
  at.rank = launch.rank;
  // Enters a phase of a step (0: start-up); an allocation failure names the last one entered.
  const auto phase = [&at](int64_t step, std::string name) {
    at.step = step;
    at.phase = std::move(name);
    maybe_inject_oom(at);
  };
  init_logging(!cfg.metrics.disable_color_printing && isatty(STDERR_FILENO), launch.rank);
  // cuda:LOCAL_RANK in the CUDA build when a GPU is visible, else the CPU (parallelisms/device.h).
  const DeviceChoice device = choose_device(device_facts(launch.local_rank, launch.local_world_size));
  check_device_supports(device, launch);
  exit_when_agent_dies(launch);
  Parallelism par = build_parallelism(cfg);
  const int64_t dp_world = par.dims.dp();
  const int64_t accum = gradient_accumulation_steps(cfg, dp_world);
  const uint64_t seed = agree_on_seed(par, pick_seed(cfg));
  if (cfg.debug.deterministic) at::globalContext().setDeterministicAlgorithms(true, false);

  // ---- tokenizer and data (validated before anything is written) ----------------------
  DataPipeline data = build_data(cfg, par.dp_rank, dp_world);
  const ModelArgs margs = build_model_args(cfg, *data.tokenizer);
  const std::unique_ptr<Validator> validator = maybe_build_validator(cfg, *data.tokenizer, par.dp_rank, dp_world);
  const bool sharded = fsdp_applies(cfg, par, device);
  const MemoryEstimate mem_estimate = check_memory_fits(cfg, margs, launch, dp_world, sharded);
  at.estimate_bytes = mem_estimate.total();

  // ---- everything validated: from here on the run writes its outputs --------------------
  add_log_file(cfg.job.dump_folder, launch.rank);
  if (launch.rank == 0) write_effective_config(cfg);
  spdlog::info("tokenizer: {} ({}, {} ids, bos {}, eos {}; model vocab {})", data.tokenizer->model_path(),
               data.tokenizer->kind(), data.tokenizer->vocab_size(), data.tokenizer->bos_id(),
               data.tokenizer->eos_id(), margs.sizes.vocab_size);
  spdlog::info("dataset: {} (dp rank {} of {})", data.source, par.dp_rank, dp_world);
  check_blas_and_warn();
  const int threads = configure_threads(launch.local_world_size);
  const std::string& wait_policy = runtime_env().omp_wait_policy;
  spdlog::info("launch: {} rank {} of {} (local {} of {}); intra-op threads: {} (OpenMP wait policy: {}); "
               "matmuls: {}; seed: {}{}; LibTorch {}",
               launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, threads,
               wait_policy.empty() ? "libgomp default" : wait_policy, gemm::backend_name(matmuls), seed,
               cfg.debug.seed ? "" : " (random: set debug.seed to repeat this run)", TORCH_VERSION);
  spdlog::info("device: {} ({})", device.name(), device.why);
  if (launch.elastic())
    spdlog::info("torchrun: run {}, restart count {} (at most {}){}", launch.run_id, launch.restart_count,
                 launch.max_restarts, launch.agent_store ? ", ranks join the agent's store" : "");

  // ---- model: build without storage, shard, initialise unit by unit. With FSDP the full
  // model never exists on a rank: each unit is given storage, initialised from the seed as
  // the full init would (same draws, same order), cut to this rank's rows and freed. A run
  // that loads a checkpoint draws nothing: the checkpoint gives the values. ------------
  spdlog::info("memory estimate: {} per rank", describe(mem_estimate));
  const bool loads_weights = !cfg.checkpoint.create_seed_checkpoint && will_load_model(checkpoint_options(cfg));
  reset_peak_rss();
  const double rss_before_model = current_rss_gib();
  torch::manual_seed(seed);
  phase(0, "model build");
  TrainModel model = build_model(margs, cfg.training.seq_len,
                                 sharded ? ModelInit::Deferred : loads_weights ? ModelInit::None : ModelInit::Full);
  const double flops_per_tok = model.flops_per_token;  // MoE: active experts only
  spdlog::info("model: {} {} — {:.3f}M parameters ({:.3f}M non-embedding), {:.1f} MFLOP/token",
               cfg.model.name, cfg.model.flavor, model.total_params / 1e6,
               (model.total_params - model.embedding_params) / 1e6, flops_per_tok / 1e6);
  const size_t n_units = model.units().size();
  size_t units_initialised = !sharded && !loads_weights ? n_units : 0;
  std::function<void(size_t)> init_unit;
  if (!loads_weights)
    init_unit = [&model, &units_initialised, sharded](size_t i) {
      // The previous unit's full values are freed by now; the caching CPU allocator would
      // keep them (units differ in size, so the next one is a fresh block): give them back,
      // so at most one unit exists beside the shards.
      if (sharded) release_cached_cpu_memory();
      model.init_unit(i);
      ++units_initialised;
    };
  phase(0, sharded ? "sharding and initialisation" : "initialisation");
  std::shared_ptr<FSDP> fsdp = maybe_apply_fsdp(model, cfg, par, sharded, init_unit);
  spdlog::info("model init: {} of {} units randomly initialised on this rank ({})", units_initialised, n_units,
               loads_weights ? "the weights come from the checkpoint"
               : sharded     ? "one unit at a time, this rank keeping its rows"
                             : "the full model");
  // The full-size parameters sharding freed sit in the CPU allocator's cache; they are
  // the memory FSDP exists to give back.
  if (fsdp) release_cached_cpu_memory();
  // A GPU: the model, initialised on the CPU from the seed (the same values as a CPU run's),
  // moves there; every forward takes its inputs there (validation's too).
  const torch::Device compute_device = device.cuda ? torch::Device(torch::kCUDA, device.index) : torch::kCPU;
  if (device.cuda) {
    use_device(device);
    model.module->to(compute_device);
    model.forward = [forward = model.forward, compute_device](const torch::Tensor& x) {
      return forward(x.to(compute_device, /*non_blocking=*/true));
    };
  }
  std::shared_ptr<ActivationCheckpoint> ac = maybe_apply_ac(model, cfg, fsdp.get());

  // ---- optimizer and LR schedule (on the local shards with FSDP) ---------------------
  phase(0, "optimizer");
  std::vector<torch::Tensor> params = fsdp ? fsdp->sharded_parameters() : model.module->parameters();
  auto optimizer = build_optimizer(params, optimizer_spec(cfg));
  LRScheduler lr_sched(cfg.optimizer.lr, lr_spec(cfg));
  spdlog::info("lr schedule: warmup {} / stable {} / decay {} ({}), min_lr_factor {}",
               lr_sched.warmup_steps(), lr_sched.stable_steps(), lr_sched.decay_steps(),
               cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor);
  std::function<double(double)> grad_sq_all_reduce;
  if (fsdp)
    grad_sq_all_reduce = [shard = par.shard](double v) {
      auto t = torch::tensor({v}, torch::kFloat64);
      shard->all_reduce_sum(t, "grad_norm").wait();
      return t.item<double>();
    };

  // ---- checkpoint: resume from the latest complete checkpoint (or initial_load_path) ----
  TrainState train_state;
  phase(0, "checkpoint load");
  std::unique_ptr<Checkpointing> ckpt =
      build_checkpointing(cfg, par, model, fsdp.get(), *optimizer, lr_sched, data, train_state, seed);
  if (cfg.checkpoint.create_seed_checkpoint) {
    // torchtitan: the full model initialised on one process, saved as step 0, then exit.
    if (launch.world_size != 1)
      throw UserError("config error: checkpoint.create_seed_checkpoint = true must run on one process, not " +
                      std::to_string(launch.world_size));
    ckpt->manager->save_to(ckpt->manager->options().folder, 0, /*model_only=*/true);
    return 0;
  }
  ckpt->manager->load();
  const int64_t first_step = train_state.step + 1;
  if (launch.restart_count > 0)  // torchrun restarted the workers: say where this attempt starts
    spdlog::info("restart {} of run {}: {}", launch.restart_count, launch.run_id,
                 train_state.step > 0 ? "resumed from step " + std::to_string(train_state.step)
                                      : std::string("no complete checkpoint, starting from step 1"));

  {
    // Start-up memory: the growth of the peak RSS from just before the model was built to
    // here: the shards, the unit being initialised, the optimizer, a checkpoint load.
    int64_t largest_unit = 0;
    for (const auto& u : model.units()) {
      int64_t n = 0;
      for (const auto& [fqn, t] : u.params) n += t.numel();
      largest_unit = std::max(largest_unit, n * 4);
    }
    const double MiB = 1024.0 * 1024.0, GiB_in_MiB = 1024.0;
    const double shard_mib = (fsdp ? fsdp->sharded_param_bytes() : model.total_params * 4) / MiB;
    const double peak = peak_rss_gib();
    spdlog::info("start-up memory: RSS before the model {:.1f} MiB, peak before step 1 {:.1f} MiB (+{:.1f} MiB; "
                 "this rank's fp32 parameters {:.1f} MiB, largest unit {:.1f} MiB fp32)",
                 rss_before_model * GiB_in_MiB, peak * GiB_in_MiB, (peak - rss_before_model) * GiB_in_MiB, shard_mib,
                 largest_unit / MiB);
  }
  // ---- training loop --------------------------------------------------------------------
  const std::string peak_dtype = fsdp && cfg.training.mixed_precision_param == "bfloat16" ? "bfloat16" : "float32";
  // The better of ATen's matmul and the GEMM the model's projections use (kernels/gemm.h),
  // so MFU is never taken against a slower kernel than the one training runs; on a GPU,
  // cuBLAS's matmul there (components/gpu_metrics.h).
  const auto measure_peak = [&] {
    if (device.cuda) return gpu_matmul_peak_flops(peak_dtype, device.index);
    const double f = std::max(measure_matmul_peak_flops(peak_dtype),
                              gemm::peak_flops(peak_dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat));
    // Its matrices' sizes are none of training's: the cache would keep them for good.
    release_cached_cpu_memory();
    return f;
  };
  double peak_flops = measure_peak();
  int peak_remeasures = 0;  // see the metrics below
  spdlog::info("measured {} matmul peak: {:.1f} GFLOP/s per rank (MFU reference: {})", peak_dtype, peak_flops / 1e9,
               device.cuda ? "cuBLAS matmul on " + device.name()
                           : std::string("the better of ") + gemm::backend_name(matmuls) + " and ATen matmul");
  MetricsLogger metrics(cfg.job.dump_folder, /*write=*/launch.rank == 0, cfg.training.steps);
  maybe_enable_tensorboard(metrics, cfg, par);
  const int64_t B = cfg.training.local_batch_size, T = cfg.training.seq_len;
  // Each rank's loss is its token mean; FSDP averages gradients over the dp ranks, so the
  // step follows the mean over every token of the global batch.
  const double local_tokens = static_cast<double>(B * T * accum);

  const auto train_start = Clock::now();
  auto window_start = Clock::now();
  double data_s = 0, comm_mark = 0, state_gib = 0, activation_gib = 0;
  // MoE: each micro-batch's load-balance gradient is scaled like its cross-entropy.
  if (model.moe()) model.set_aux_loss_scale(1.0 / static_cast<double>(accum));
  torch::Tensor expert_load;  // [L, E] tokens per expert of the last step, summed over ranks
  int64_t window_tokens = 0;
  spdlog::info("training {} steps: global batch {} × {} tokens ({} ranks × {} micro-batches of {})",
               cfg.training.steps, B * dp_world * accum, T, dp_world, accum, B);

  LossSpikeDetector spikes(cfg.training.loss_spike_factor);
  double spike_mean = 0;
  int64_t skipped_steps = 0;  // non-finite steps skipped (training.on_nonfinite = "skip")
  StopRequest stop;
  bool stop_saved = false;
  int64_t last_step = first_step - 1;
  for (int64_t step = first_step; step <= cfg.training.steps; ++step) {
    CommContext::set_step(step);
    std::unique_ptr<torch::autograd::profiler::RecordProfile> profile = maybe_profile(cfg, launch.rank, step);
    set_learning_rate(*optimizer, lr_sched.current_lr());
    optimizer->zero_grad();
    double loss_sum = 0.0, lb_sum = 0.0;
    // " (micro-batch m of n)" in the phase names when there are several.
    const auto of_micro = [accum](int64_t micro) {
      return accum > 1 ? " (micro-batch " + std::to_string(micro + 1) + " of " + std::to_string(accum) + ")"
                       : std::string();
    };
    for (int64_t micro = 0; micro < accum; ++micro) {
      phase(step, "data" + of_micro(micro));
      const auto t_data = Clock::now();
      Batch batch = data.loader->next();
      if (step == first_step && micro == 0)
        spdlog::info("first batch ready {:.2f} s after the process started (the data's part: {:.3f} s opening the "
                     "tokenizer and corpus, {:.3f} s reading this batch)",
                     process_age_s(), data.setup_s, seconds_since(t_data));
      maybe_trace_batch(batch, launch.rank, step);
      auto inputs = torch::from_blob(batch.inputs.data(), {B, T}, torch::kInt64).clone();  // [B, T]
      auto labels = torch::from_blob(batch.labels.data(), {B, T}, torch::kInt64).clone();  // [B, T]
      if (device.cuda) {  // from pinned host memory, queued behind nothing the host waits for
        inputs = inputs.pin_memory().to(compute_device, /*non_blocking=*/true);
        labels = labels.pin_memory().to(compute_device, /*non_blocking=*/true);
      }
      data_s += seconds_since(t_data);

      const double heap_before = heap_in_use_gib();
      phase(step, "forward" + of_micro(micro));
      // Token-sum cross-entropy / local_tokens, on float32 row statistics of the logits in
      // their compute dtype (kernels/fused_ops.h: no float32 copy of [B·T, V]).
      auto logits = model.forward(inputs);  // [B, T, V]
      auto loss = fused_cross_entropy(logits.view({B * T, -1}), labels.view({B * T}), 1.0 / local_tokens);
      // What the forward left alive for backward (activations, logits): the heap growth.
      activation_gib = std::max(activation_gib, heap_in_use_gib() - heap_before);
      phase(step, "backward" + of_micro(micro));
      loss.backward();
      if (fsdp) fsdp->finish_backward();
      loss_sum += loss.item<double>();
      if (model.moe()) {  // the objective is CE + coeff · load-balance loss
        loss_sum += model.aux_loss() / static_cast<double>(accum);
        lb_sum += model.load_balance_loss() / static_cast<double>(accum);
      }
      window_tokens += B * T;
    }
    maybe_inject_fault(launch.rank, step, loss_sum, params);
    // Both values are the same on every rank (a world mean; a norm all-reduced over the
    // shards, whose replicas hold equal gradients), so every rank takes the same branch.
    phase(step, "optimizer");
    const double loss_mean = world_mean(par, loss_sum, "loss");
    const double grad_norm = clip_grad_norm(params, cfg.training.max_norm, grad_sq_all_reduce);
    const double lr = lr_sched.current_lr();
    if (std::isfinite(loss_mean) && std::isfinite(grad_norm)) {
      optimizer->step();
      if (launch.rank == 0 && (spike_mean = spikes.observe(loss_mean)) > 0)
        spdlog::warn("step {}: loss spike: {:.4f} is {:.1f}x the mean of the previous steps ({:.4f}; "
                     "training.loss_spike_factor = {})",
                     step, loss_mean, loss_mean / spike_mean, spike_mean, cfg.training.loss_spike_factor);
    } else {
      const std::string what = "step " + std::to_string(step) + ": " +
                               (std::isfinite(loss_mean) ? "gradient norm is " + std::to_string(grad_norm)
                                                         : "loss is " + std::to_string(loss_mean));
      if (cfg.training.on_nonfinite == "stop")
        throw RuntimeFailure(what + "; stopping (HINT: lower optimizer.lr or training.max_norm, or set "
                                    "training.on_nonfinite = \"skip\")");
      ++skipped_steps;  // the batch is dropped; the schedule and the step count go on
      spdlog::warn("{}; skipped: no optimizer update ({} step{} skipped in this run)", what, skipped_steps,
                   skipped_steps == 1 ? "" : "s");
    }
    lr_sched.step();
    if (model.moe()) {  // expert-bias update and counter reset, from every rank's load
      expert_load = model.tokens_per_expert();
      if (par.dist) par.dist->world->all_reduce_sum(expert_load, "expert_load").wait();
      model.step_load_balance(expert_load);
    }
    if (step == first_step) {
      CommContext::set_timeout(std::chrono::seconds(cfg.comm.train_timeout_seconds));
      const TrainingStateBytes sb = training_state_bytes(*optimizer);
      state_gib = sb.total() / double(1 << 30);
      spdlog::info("training state on this rank: params {:.1f} MiB + grads {:.1f} MiB + optimizer {:.1f} MiB",
                   sb.params / double(1 << 20), sb.grads / double(1 << 20), sb.optimizer / double(1 << 20));
    }

    phase(step, "metrics");
    if (step == 1 || step % cfg.metrics.log_freq == 0 || step == cfg.training.steps) {
      if (device.cuda) gpu_synchronize(device.index);  // the window ends when the GPU's work does
      const double dt = seconds_since(window_start);
      const double comm_s = fsdp ? fsdp->stats().comm_wait_s - comm_mark : 0.0;
      comm_mark = fsdp ? fsdp->stats().comm_wait_s : 0.0;
      // memory_gib: the peak RSS; on a GPU, torchtitan's memory/max_reserved(GiB) of the device.
      const GpuMemory gpu_mem = device.cuda ? gpu_memory(device.index) : GpuMemory{};
      const auto maxes = world_max(
          par, {device.cuda ? gpu_mem.peak_reserved_gib : peak_rss_gib(), comm_s, data_s, activation_gib, loss_sum});
      StepMetrics m;
      m.step = step;
      m.loss = loss_mean;
      m.max_loss = maxes[4];
      m.n_tokens_seen = static_cast<double>(train_state.ntokens_seen + B * T * accum * dp_world);
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.tps = window_tokens / dt;
      m.tflops = m.tps * flops_per_tok / 1e12;
      if (m.tps * flops_per_tok > peak_flops && peak_remeasures < 3) {
        // Training ran faster than the start-up peak: that measurement met a busy moment of a
        // shared machine. Measure again (outside the timed window) rather than report MFU > 100%.
        ++peak_remeasures;
        peak_flops = std::max(peak_flops, measure_peak());
        spdlog::info("step {} ran at {:.1f} GFLOP/s, above the start-up matmul peak: re-measured, {:.1f} GFLOP/s",
                     step, m.tps * flops_per_tok / 1e9, peak_flops / 1e9);
      }
      m.mfu = 100.0 * m.tps * flops_per_tok / peak_flops;
      m.memory_gib = maxes[0];
      m.data_loading_s = maxes[2];
      m.elapsed_s = seconds_since(train_start);
      if (fsdp) m.extra.emplace_back("comm_wait_s", maxes[1]);
      m.extra.emplace_back("state_gib", state_gib);
      if (device.cuda) m.extra.emplace_back("gpu_peak_allocated_gib", gpu_mem.peak_allocated_gib);
      m.extra.emplace_back("activation_gib", maxes[3]);
      if (skipped_steps) m.extra.emplace_back("skipped_steps", static_cast<double>(skipped_steps));
      if (cfg.training.on_bad_document == "skip") {
        // Over the dp ranks and the whole run (the count is in the loader's checkpointed state);
        // ranks of one dp rank (TP/PP peers) share a loader: mean over all ranks × dp.
        const double mine = static_cast<double>(data.loader->skipped_documents());
        m.extra.emplace_back("bad_documents_skipped",
                             std::round(world_mean(par, mine, "bad_docs") * static_cast<double>(dp_world)));
      }
      if (model.moe()) {
        // Load-balance loss (1 = balanced; mean over ranks) and the tokens-per-expert
        // spread of the last step: max / mean load of the most unbalanced layer.
        m.extra.emplace_back("lb_loss", world_mean(par, lb_sum, "lb_loss"));
        const auto spread = std::get<0>(expert_load.max(1)) / expert_load.mean(1);
        m.extra.emplace_back("expert_spread", spread.max().item<double>());
      }
      metrics.log(m);
      window_start = Clock::now();
      window_tokens = 0;
      data_s = 0;
      activation_gib = 0;
    }
    if (profile) {
      profile.reset();  // writes the trace
      spdlog::info("profiler trace of step {} written to {}", step, profile_path(cfg, launch.rank, step));
    }
    train_state.step = step;
    train_state.ntokens_seen += B * T * accum * dp_world;
    phase(step, "checkpoint save");
    maybe_save(*ckpt->manager, step, step == cfg.training.steps, cfg.checkpoint.on_save_failure);
    if (validator && validator->should_validate(step)) {
      phase(step, "validation");
      // Validation time and communication are not the training window's.
      const auto t_val = Clock::now();
      const double comm_before = fsdp ? fsdp->stats().comm_wait_s : 0.0;
      metrics.log_validation(run_validation(*validator, model, fsdp.get(), par, step));
      window_start += Clock::now() - t_val;
      if (fsdp) comm_mark += fsdp->stats().comm_wait_s - comm_before;
    }
    last_step = step;
    if (step < cfg.training.steps && (stop = agree_on_stop(par)).signal) {
      spdlog::warn("stopping after step {} of {}: {} on rank {}", step, cfg.training.steps,
                   stop_signal_name(stop.signal), stop.rank);
      stop_saved = ckpt->manager->save_now(step);
      if (!stop_saved) spdlog::warn("no checkpoint is saved (checkpoint.enable is off or load_only is on)");
      break;
    }
  }
  phase(last_step, "checkpoint finalize");
  ckpt->manager->finalize();
  if (par.dist) par.dist->world->barrier("end of training");
  // The measured counterpart of the start-up estimate (bench/memory_estimate.sh reads it).
  spdlog::info("peak RSS: {:.3f} GiB on this rank since the model was built (start-up estimate {:.3f} GiB: {:+.1f}%)",
               peak_rss_gib(), at.estimate_bytes / (1 << 30),
               100.0 * (at.estimate_bytes / (1 << 30) - peak_rss_gib()) / peak_rss_gib());
  if (stop.signal) {
    spdlog::info("stopped after step {} of {} ({} on rank {}) in {}{}", last_step, cfg.training.steps,
                 stop_signal_name(stop.signal), stop.rank, format_duration(seconds_since(train_start)),
                 stop_saved ? "; run the same command to resume from step-" + std::to_string(last_step) : "");
    spdlog::default_logger()->flush();
    return 0;
  }
  spdlog::info("training done: {} steps in {}", cfg.training.steps,
               format_duration(seconds_since(train_start)));
  spdlog::info("data: dp rank {} read {} bytes of the corpus ({} documents parsed); the process read {} bytes "
               "(rchar), peak RSS {:.0f} MiB",
               par.dp_rank, data.loader->bytes_read(), data.loader->documents_parsed(), process_rchar(),
               peak_rss_gib() * 1024);
  spdlog::default_logger()->flush();
  return 0;
}

}  // namespace

int train_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  // Failures are one line of text, whatever user input they quote (control bytes escaped),
  // on stderr and, under torchrun, in the error file its failure summary shows.
  const auto fail = [&err](int code, const std::string& line) {
    err << line << std::endl;
    maybe_write_torchelastic_error(line, /*consequence=*/code == 3);
    return code;
  };
  RunProgress at;
  try {
    return run(args, out, at);
  } catch (const UserError& e) {
    return fail(2, printable_line(e.what()));
  } catch (const CollectiveFailure& e) {
    return fail(3, "error: " + printable_line(e.what()));
  } catch (const RuntimeFailure& e) {
    return fail(1, "error: " + printable_line(e.what()));
  } catch (const c10::Error& e) {
    // An allocation that failed is a failure of the run (exit 1), not of the input: the
    // start-up estimate said it would fit, or the machine's memory went to someone else.
    if (is_out_of_memory(e)) return fail(1, printable_line(allocation_failure_line(at, e.what_without_backtrace())));
    return fail(1, "error: " + printable_line(e.what_without_backtrace()));
  } catch (const std::bad_alloc& e) {
    return fail(1, printable_line(allocation_failure_line(at, e.what())));
  } catch (const std::exception& e) {
    return fail(1, "error: " + printable_line(e.what()));
  }
}

}  // namespace ctitan
