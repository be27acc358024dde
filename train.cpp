// ctitan's training recipe, top to bottom:
//   config → environment → tokenizer/data → model → init weights → optimizer/LR → loop.
// Every stage is a build_* / maybe_* call; the details live in the component folders.
//
// Dimensions used in comments: B = local batch size, T = seq_len, V = vocab size.
#include <unistd.h>

#include <cctype>
#include <cstdio>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <iostream>
#include <numeric>
#include <random>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/cpu_allocator.h"
#include "components/gpu_metrics.h"
#include "components/lr_scheduler.h"
#include "components/memory_estimate.h"
#include "components/metrics.h"
#include "components/optimizer.h"
#include "components/preemption.h"
#include "components/system.h"
#include "components/validate.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "util/text.h"
#include "datasets/dataloader.h"
#include "datasets/tokenizer.h"
#include "models/init.h"
#include "kernels/attention_direct.h"
#include "kernels/gemm.h"
#include "kernels/fused_cuda.h"
#include "kernels/sdpa_choice.h"
#include "models/hf_adapter.h"
#include "models/registry.h"
#include "models/train_model.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm.h"
#include "parallelisms/device.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/launch_env.h"
#include "parallelisms/parallel_dims.h"
#include "train.h"
#include "training/checkpointing.h"
#include "training/hooks.h"
#include "kernels/device_route.h"
#include "training/parallelize.h"
#include "training/step_graph.h"
#include "training/prefetcher.h"
#include "training/trainer.h"
#include "training/world.h"
#include "util/env.h"
#include "util/files.h"
#include "util/strings.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace ctitan {
namespace {

// f(), where f reads a kernel choice from the environment (CTITAN_GEMM: kernels/gemm.h;
// CTITAN_GPU_KERNELS, CUDA build: kernels/fused_cuda.h): a bad value is bad input, reported
// before any output is written, whatever the device.
template <class F>
auto environment_checked(F f) {
  try {
    return f();
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
    throw UserError("config error: training.global_batch_size=" + std::to_string(t.global_batch_size) +
                    " is not a multiple of local_batch_size (" + std::to_string(t.local_batch_size) + ") × dp (" +
                    std::to_string(dp) + ")");
  return t.global_batch_size / per_step;
}

uint64_t pick_seed(const JobConfig& cfg) {
  if (cfg.debug.seed) return static_cast<uint64_t>(*cfg.debug.seed);
  // torchtitan picks a random seed when debug.seed is unset; log it so a run can be repeated.
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32 | rd()) & 0x7fffffffffffffffULL;
}

// Data: the tokenizer and this rank's stream of packed windows [B, T+1], read ahead of the
// step by `batches` (made after the device is chosen; destroyed, its thread stopped, first).
struct DataPipeline {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<BatchPrefetcher> batches;
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
  d.loader = std::make_unique<DataLoader>(*d.tokenizer, d.source, cfg.training.seq_len, cfg.training.local_batch_size,
                                          dp_rank, dp_world);
  if (cfg.training.on_bad_document == BadDocumentPolicy::Skip)
    d.loader->set_bad_documents(DataLoader::BadDocuments::kSkip);
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
                  " ids but model.flavor = \"" + cfg.model.flavor + "\" of " + cfg.model.name + " has vocab_size " +
                  std::to_string(model_vocab) +
                  ": use a tokenizer with at most that many ids or a flavor with a larger vocabulary");
}

// model.name must name a registered family (the config cannot know them: models/ is built
// after config/).
const ModelSpec& configured_model_spec(const JobConfig& cfg) {
  if (const ModelSpec* spec = find_model_spec(cfg.model.name)) return *spec;
  throw UserError("config error: model.name = \"" + cfg.model.name + "\" is not one of: " + join(model_names(), ", "));
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
  const std::string where =
      at.step > 0 ? "at step " + std::to_string(at.step) + " (" + at.phase + ")" : "at start-up (" + at.phase + ")";
  const size_t nl = what.find('\n');
  return "error: out of memory on rank " + std::to_string(at.rank) + " " + where + ": " + asked + "; " + held +
         " (HINT: activation_checkpoint.mode = \"full\", a smaller training.local_batch_size or seq_len, or more "
         "ranks) [" +
         what.substr(0, nl) + "]";
}

// The sizes tensor parallelism would split: the flavor's heads, kv heads, FFN width, vocabulary.
TPSplitSizes tp_split_sizes(const JobConfig& cfg) {
  const ModelSizes z = configured_model_spec(cfg).sizes(cfg.model.flavor, cfg.training.seq_len);
  TPSplitSizes s{cfg.model.name + " " + cfg.model.flavor, z.n_heads, z.n_kv_heads, z.ffn_hidden, z.vocab_size};
  s.seq_len = cfg.training.seq_len;
  s.validation_seq_len = cfg.validation.enable ? cfg.validation.seq_len : 0;
  return s;
}

// The mesh [dp_replicate, dp_shard, tp] on this world size: the degrees' product first
// (ParallelDims::build), then with tp > 1 the model's sizes and the sequence tp must divide, and
// the mesh shown (`show`, a line at a time: every rank's groups). The run and
// job.validate_only both call this, so both refuse alike.
ParallelDims build_parallel_dims(const JobConfig& cfg, int64_t world_size,
                                 const std::function<void(const std::string&)>& show) {
  const auto& c = cfg.parallelism;
  const ParallelDims dims =
      ParallelDims::build(c.data_parallel_replicate_degree, c.data_parallel_shard_degree, c.context_parallel_degree,
                          c.tensor_parallel_degree, c.pipeline_parallel_degree, world_size);
  if (!dims.tp_enabled()) return dims;
  check_tp_divides(dims.tp, tp_split_sizes(cfg));
  for (const std::string& line : dims.describe()) show(line);
  return dims;
}

// use_nccl: FSDP's tensor collectives go over NCCL groups of the same ranks (GPUs), the Gloo
// groups staying for the CPU-side control.
Parallelism build_parallelism(const JobConfig& cfg, bool use_nccl) {
  Parallelism p;
  p.env = detect_launch_env(environment_map());
  // Rank 0's console shows the mesh (the other ranks' consoles show warnings only).
  p.dims = build_parallel_dims(cfg, p.env.world_size, [](const std::string& line) { spdlog::info("{}", line); });
  if (!p.env.distributed()) return p;
  p.dist = init_distributed(p.env, std::chrono::seconds(cfg.comm.init_timeout_seconds));
  // Every rank creates every group, in the same order (group creation is collective).
  // The shard groups over NCCL twice: all-gathers on one, reduce-scatters on the other, so that
  // each kind has a stream of its own (FSDP::use_reduce_scatter_group).
  auto make = [&](const std::vector<int64_t>& ranks, const std::string& name, std::shared_ptr<Comm>& gloo,
                  std::shared_ptr<Comm>& fsdp, std::shared_ptr<Comm>* fsdp_rs) {
    if (auto g = p.dist->new_group(ranks, name)) gloo = fsdp = g;
    if (!use_nccl || ranks.size() <= 1) return;  // a group of one has no collective to run
    if (auto g = p.dist->new_nccl_group(ranks, name + "_nccl")) fsdp = g;
    if (fsdp_rs)
      if (auto g = p.dist->new_nccl_group(ranks, name + "_nccl_rs")) *fsdp_rs = g;
  };
  // With tp = 1 group g is replicate index g's shard group and shard index g's replicate group.
  const auto shard_groups = p.dims.shard_groups(), replicate_groups = p.dims.replicate_groups();
  for (size_t g = 0; g < shard_groups.size(); ++g)
    make(shard_groups[g], "dp_shard" + std::to_string(g), p.shard, p.fsdp_shard, &p.fsdp_reduce_scatter);
  for (size_t g = 0; g < replicate_groups.size(); ++g)
    make(replicate_groups[g], "dp_replicate" + std::to_string(g), p.replicate, p.fsdp_replicate, nullptr);
  if (p.dims.tp_enabled()) {  // tp's collectives over NCCL on GPUs; the norm's sum over Gloo
    std::shared_ptr<Comm> gloo_tp;
    const auto tp_groups = p.dims.tp_groups(), shard_tp_groups = p.dims.shard_tp_groups();
    for (size_t g = 0; g < tp_groups.size(); ++g) make(tp_groups[g], "tp" + std::to_string(g), gloo_tp, p.tp, nullptr);
    for (size_t g = 0; g < shard_tp_groups.size(); ++g) {
      const std::string name = "dp_shard_tp" + std::to_string(g);
      if (auto c = p.dist->new_group(shard_tp_groups[g], name)) p.shard_tp = c;
      if (use_nccl && shard_tp_groups[g].size() > 1)
        if (auto c = p.dist->new_nccl_group(shard_tp_groups[g], name + "_nccl")) p.shard_tp_nccl = c;
    }
  }
  // The step's loss mean over every rank, summed on the GPUs (Trainer::train_step): over the
  // shard group's NCCL communicator when that group is the world (FSDP alone, the usual case;
  // the same on every rank, so either every rank makes the world group or none does).
  if (use_nccl && p.env.world_size > 1) {
    if (p.fsdp_shard && p.fsdp_shard->kind() == CommKind::Nccl && p.fsdp_shard->size() == p.env.world_size) {
      p.world_nccl = p.fsdp_shard;
    } else {
      std::vector<int64_t> all(static_cast<size_t>(p.env.world_size));
      std::iota(all.begin(), all.end(), int64_t{0});
      p.world_nccl = p.dist->new_nccl_group(all, "world_nccl");
    }
  }
  p.dp_rank = p.dims.dp_rank(p.env.rank);  // the global rank while tp = 1
  return p;
}

// Values every rank must agree on, decided by rank 0.
uint64_t agree_on_seed(const Parallelism& par, uint64_t seed) {
  if (!par.dist) return seed;
  auto t = torch::tensor({static_cast<int64_t>(seed)}, torch::kInt64);
  par.dist->world->broadcast(t, 0, "seed");
  return static_cast<uint64_t>(t.item<int64_t>());
}

// [validation]: the held-out data, checked (found, one whole batch on this rank) with the rest
// of the config, before the run writes anything.
std::unique_ptr<Validator> maybe_build_validator(const JobConfig& cfg, const Tokenizer& tok, int64_t dp_rank,
                                                 int64_t dp_world) {
  const auto& v = cfg.validation;
  if (!v.enable) return nullptr;
  const std::string& env_root = runtime_env().data_dir;
  ValidationSpec spec;
  spec.source = resolve_dataset_path(v.dataset, v.dataset_path, env_root.empty() ? "./data" : env_root, "validation");
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

// FSDP over the shard group (HSDP: plus the replicate group) whenever there is more than
// one data-parallel rank. Applied from outside the model: it wraps the model's units. `say`:
// log why bf16 is emulated or not used (the run does; job.validate_only does not).
bool fsdp_applies(const JobConfig& cfg, int64_t dp, const DeviceChoice& device, bool say) {
  if (dp > 1) {
    // Kept as configured (every rank must round alike), but said: on such a CPU the bf16
    // matmuls are emulated (debug model, 2 ranks: ~4x the float32 step time).
    if (say && cfg.training.mixed_precision_param == "bfloat16" && !device.cuda && !cpu_has_native_bf16())
      spdlog::warn(
          "training.mixed_precision_param = bfloat16: this CPU has no native bf16 matmul (avx512_bf16 / "
          "amx_bf16), so FSDP's bf16 compute is emulated and several times slower per step than with float32 "
          "parameters (--training.mixed_precision_param float32)");
    return true;
  }
  // One process: FSDP's machinery over a group of one gives bf16 mixed precision (bf16
  // compute parameters, fp32 master weights, optimizer state and gradients) with the same
  // code and the same rounding as on N ranks. On a GPU, or where the CPU has native bf16
  // matmuls: elsewhere bf16 is emulated and slower than float32.
  if (cfg.training.mixed_precision_param == "float32") return false;
  if (device.cuda) return true;  // GPUs multiply bf16 natively
  if (!cpu_has_native_bf16()) {
    if (say)
      spdlog::info(
          "training.mixed_precision_param = {}: this CPU has no native bf16 matmul (avx512_bf16 / "
          "amx_bf16), so one process trains in float32",
          cfg.training.mixed_precision_param);
    return false;
  }
  return true;
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

MemoryRun memory_run(const JobConfig& cfg, int64_t dp, bool sharded, bool cuda) {
  MemoryRun r;
  r.dp = dp;
  r.fsdp = sharded;
  r.compute_bytes = sharded && cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  r.compute_dtype_grads = sharded && dp <= 1 &&
                          one_rank_keeps_bf16_grads(cfg, cuda, cfg.parallelism.tensor_parallel_degree > 1,
                                                    gradient_accumulation_steps(cfg, dp));
  r.reshard_after_forward = fsdp_reshard_policy(cfg, dp);
  r.batch = cfg.training.local_batch_size;
  r.seq = cfg.training.seq_len;
  r.ac_mode = cfg.activation_checkpoint.mode;
  r.async_checkpoint = cfg.checkpoint.enable && cfg.checkpoint.async_mode != "disabled";
  return r;
}

// Before anything of the model is allocated: the estimate of this rank's peak, and when it
// cannot fit in what the rank can have, one line with the numbers and what would fit (exit 2).
// On a GPU the model's state and activations live in the GPU's memory, not the host's: the
// estimate (without the host process) is compared with the GPU's free memory and only warned
// about, since the estimate has not been checked against a GPU run yet.
MemoryEstimate check_memory_fits(const JobConfig& cfg, const ModelArgs& margs, const LaunchEnv& env, int64_t dp,
                                 bool sharded, const DeviceChoice& device) {
  const MemoryModel mm = memory_model(margs);
  const MemoryRun run = memory_run(cfg, dp, sharded, device.cuda);
  if (device.cuda) {
    const MemoryEstimate est = estimate_memory(mm, run, /*base=*/0);
    const GpuMemoryInfo gpu = gpu_memory_info(device.index);
    const double G = 1 << 30;
    if (est.total() > gpu.free_bytes)
      spdlog::warn(
          "memory: {} {} needs an estimated {} per rank, more than {}'s {} GiB free of {} GiB; going on (the "
          "estimate is made for the CPU and not yet checked on a GPU)",
          cfg.model.name, cfg.model.flavor, describe(est), device.name(), format_gib(gpu.free_bytes / G),
          format_gib(gpu.total_bytes / G));
    return est;
  }
  const double base = current_rss_gib() * (1 << 30);
  const MemoryEstimate est = estimate_memory(mm, run, base);
  std::string how;
  const double avail = memory_available_per_rank(env.local_world_size, &how);
  if (est.total() <= avail) return est;
  const double G = 1 << 30;
  std::vector<std::string> fits;
  for (int64_t n = std::max<int64_t>(2, 2 * dp); n <= (1 << 20); n *= 2) {
    const MemoryRun more =
        memory_run(cfg, n, /*sharded=*/true, device.cuda);  // FSDP's dtype and reshard policy on n ranks
    if (estimate_memory(mm, more, base).total() <= avail) {
      fits.push_back(std::to_string(n) + " ranks with as much memory each");
      break;
    }
  }
  if (run.ac_mode != ACMode::Full) {
    MemoryRun ac = run;
    ac.ac_mode = ACMode::Full;
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
                  std::to_string(run.batch) + " × seq_len " + std::to_string(run.seq) + " (AC " +
                  key_name(run.ac_mode) + ", " + std::to_string(dp) + " dp rank(s)) needs an estimated " +
                  describe(est) + " per rank, but a rank can have " + format_gib(avail / G) + " GiB (" + how +
                  "); would fit: " +
                  (fits.empty() ? std::string("nothing this estimate can find on this machine") : join(fits, ", or ")));
}

// torchtitan: the full model initialised on one process, saved as step 0, then exit.
void check_seed_checkpoint_launch(const JobConfig& cfg, int64_t world_size) {
  if (cfg.checkpoint.create_seed_checkpoint && world_size != 1)
    throw UserError("config error: checkpoint.create_seed_checkpoint = true must run on one process, not " +
                    std::to_string(world_size));
}

// The folders the run will write into, each named by its key: the dump folder, and under it
// those of the enabled outputs. One that cannot be a folder this process writes into (a file
// is in the way, no permission) is refused now, not when the first save or trace comes.
void check_output_folders(const JobConfig& cfg, const CheckpointOptions& checkpoint) {
  const fs::path dump(cfg.job.dump_folder);
  const auto setting = [](const std::string& key, const std::string& value) { return key + " = \"" + value + "\""; };
  std::vector<std::pair<std::string, std::string>> folders = {
      {setting("job.dump_folder", cfg.job.dump_folder), cfg.job.dump_folder}};
  if (checkpoint.enable) folders.emplace_back(setting("checkpoint.folder", cfg.checkpoint.folder), checkpoint.folder);
  if (cfg.metrics.enable_tensorboard)
    folders.emplace_back(setting("metrics.save_tb_folder", cfg.metrics.save_tb_folder),
                         (dump / cfg.metrics.save_tb_folder).string());
  if (cfg.profiling.enable_profiling)
    folders.emplace_back(setting("profiling.save_traces_folder", cfg.profiling.save_traces_folder),
                         (dump / cfg.profiling.save_traces_folder).string());
  for (const auto& [key, folder] : folders) {
    const std::string why = why_not_a_writable_folder(folder);
    if (!why.empty())
      throw UserError("config error: " + key + ": this run cannot write into the folder " + folder + " (" + why + ")");
  }
}

// training.cuda_graphs (training/step_graph.h): what the capture cannot take, refused with the
// other start-up checks, before anything is written.
void check_cuda_graphs(const JobConfig& cfg, const ModelArgs& margs, const LaunchEnv& launch,
                       const DeviceChoice& device) {
  if (!cfg.training.cuda_graphs) return;
  CudaGraphsJob g;
  g.gpu = device.cuda;
  g.device = device.name() + (device.why.empty() ? "" : " (" + device.why + ")");
  g.world_size = launch.world_size;
  g.optimizer = cfg.optimizer.name;
  g.family = cfg.model.name;
  g.family_step_hooks = margs.spec->moe;
  g.preserve_rng_state = cfg.activation_checkpoint.preserve_rng_state;
  const std::string why = cuda_graphs_refusal(g);
  if (!why.empty()) throw UserError(why);
}

// The start-up checks that need the launch, the device and the model's size, after the
// config's own: a seed checkpoint on one process, training.cuda_graphs's conditions, the output
// folders, the memory estimate.
// The run makes them before it writes anything and job.validate_only makes the same calls,
// so both refuse with the same line (exit 2). Returns the estimate.
MemoryEstimate check_start(const JobConfig& cfg, const CheckpointOptions& checkpoint, const ModelArgs& margs,
                           const LaunchEnv& launch, int64_t dp, bool sharded, const DeviceChoice& device) {
  check_seed_checkpoint_launch(cfg, launch.world_size);
  check_cuda_graphs(cfg, margs, launch, device);
  check_output_folders(cfg, checkpoint);
  return check_memory_fits(cfg, margs, launch, dp, sharded, device);
}

// job.validate_only: the checks a run makes before it writes anything, in its order — the
// config, the launch environment and the device, the parallelism degrees (with tp > 1: the
// model's sizes, then rank 0 prints the mesh on `out` before the refusal), the batch
// arithmetic, the tokenizer (loaded) and the model built on its vocabulary, the dataset
// (found), then check_start's (a seed checkpoint's one process, the output folders, the
// memory estimate) — then one line on `out` and exit 0. No communication between ranks,
// nothing written.
int validate_only(const JobConfig& cfg, const CheckpointOptions& checkpoint, std::ostream& out) {
  const LaunchEnv env = detect_launch_env(environment_map());
  const DeviceChoice device = choose_device(device_facts(env.local_rank, env.local_world_size));
  const ParallelDims dims = build_parallel_dims(cfg, env.world_size, [&](const std::string& line) {
    if (env.rank == 0) out << line << "\n";  // a tp > 1 mesh, shown before its refusal
  });
  const int64_t dp_rank = std::min(env.rank, dims.dp() - 1);
  const int64_t accum = gradient_accumulation_steps(cfg, dims.dp());
  const DataPipeline data = build_data(cfg, dp_rank, dims.dp());
  const ModelArgs margs = build_model_args(cfg, *data.tokenizer);
  const int64_t model_vocab = margs.sizes.vocab_size;
  maybe_build_validator(cfg, *data.tokenizer, dp_rank, dims.dp());
  check_start(cfg, checkpoint, margs, env, dims.dp(), fsdp_applies(cfg, dims.dp(), device, /*say=*/false), device);
  out << "config ok: " << (cfg.job.config_file.empty() ? "defaults" : cfg.job.config_file) << "; " << cfg.model.name
      << " " << cfg.model.flavor << "; " << env.world_size << " rank(s), dp " << dims.dp() << " x " << accum
      << " micro-batch(es); tokenizer " << data.tokenizer->model_path() << " (" << data.tokenizer->kind() << ", "
      << data.tokenizer->vocab_size() << " ids; model vocab " << model_vocab << "); dataset " << data.source
      << std::endl;
  return 0;
}

// Everything a run builds, in the order it builds it; the Trainer (training/trainer.h) runs on it.
struct Job {
  Job(const JobConfig& c, CheckpointOptions o, RunProgress& a) : cfg(c), checkpoint(std::move(o)), at(a) {}
  const JobConfig& cfg;
  const CheckpointOptions checkpoint;  // checkpoint_options(cfg), made once
  RunProgress& at;
  LaunchEnv launch;
  DeviceChoice device;
  Parallelism par;
  int64_t accum = 1;
  uint64_t seed = 0;
  DataPipeline data;
  std::unique_ptr<Validator> validator;
  bool sharded = false;
  MemoryEstimate mem_estimate;
  double rss_before_model = 0;
  TrainModel model;
  std::shared_ptr<TensorParallel> tp;
  std::shared_ptr<ActivationCheckpoint> ac;
  std::shared_ptr<FSDP> fsdp;
  std::vector<torch::Tensor> tp_replicated;  // the optimizer's tensors of parameters every tp rank holds whole
  std::vector<torch::Tensor> params;         // the optimizer's: FSDP's local shards, or the model's
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<LRScheduler> lr;
  SumOverRanks grad_sq_all_reduce;
  std::vector<torch::Tensor> grad_counted_elsewhere;  // of params: squares another rank adds to the norm
  TrainState train_state;
  std::unique_ptr<Checkpointing> ckpt;
};

// Whether the model computes in bfloat16: mixed precision runs through FSDP's machinery (over a
// group of one on one process), so without FSDP the compute is float32.
bool bf16_compute(const Job& j) { return j.fsdp && j.cfg.training.mixed_precision_param == "bfloat16"; }

// The distributed environment and process groups, the device, the seed every rank agrees on.
void setup_environment(Job& j) {
  const JobConfig& cfg = j.cfg;
  j.launch = detect_launch_env(environment_map());
  j.at.rank = j.launch.rank;
  init_logging(!cfg.metrics.disable_color_printing && isatty(STDERR_FILENO), j.launch.rank);
  // cuda:LOCAL_RANK in the CUDA build when a GPU is visible, else the CPU (parallelisms/device.h).
  j.device = choose_device(device_facts(j.launch.local_rank, j.launch.local_world_size));
  use_device(j.device);  // before any NCCL group: each binds to the current GPU
  exit_when_agent_dies(j.launch);
  j.par = build_parallelism(cfg, j.device.cuda);
  j.accum = gradient_accumulation_steps(cfg, j.par.dims.dp());
  j.seed = agree_on_seed(j.par, pick_seed(cfg));
  if (cfg.debug.deterministic) spdlog::info(use_deterministic_algorithms(j.device));
}

// training.prefetch_batches on this device: pinned host batches copied to a GPU, plain ones on
// the CPU; the loader's vectors kept only for the CTITAN_TRACE_WINDOWS trace.
PrefetchOptions prefetch_options(const JobConfig& cfg, const DeviceChoice& device) {
  PrefetchOptions o;
  o.depth = cfg.training.prefetch_batches;
  o.pin = device.cuda;
  o.device = device.cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device.index))
                         : torch::Device(torch::kCPU);
  o.keep_tokens = !runtime_env().trace_windows.empty();
  return o;
}

// Tokenizer, data and the model's size, validated before anything is written.
ModelArgs setup_data(Job& j) {
  const JobConfig& cfg = j.cfg;
  j.data = build_data(cfg, j.par.dp_rank, j.par.dims.dp());
  j.data.batches = std::make_unique<BatchPrefetcher>(*j.data.loader, prefetch_options(cfg, j.device));
  ModelArgs margs = build_model_args(cfg, *j.data.tokenizer);
  j.validator = maybe_build_validator(cfg, *j.data.tokenizer, j.par.dp_rank, j.par.dims.dp());
  j.sharded = fsdp_applies(cfg, j.par.dims.dp(), j.device, /*say=*/true);
  j.mem_estimate = check_start(cfg, j.checkpoint, margs, j.launch, j.par.dims.dp(), j.sharded, j.device);
  j.at.estimate_bytes = j.mem_estimate.total();
  return margs;
}

// Everything validated: from here on the run writes its outputs (log file, effective config).
void announce_run(const Job& j, const ModelArgs& margs) {
  const JobConfig& cfg = j.cfg;
  const LaunchEnv& launch = j.launch;
  const Tokenizer& tok = *j.data.tokenizer;
  add_log_file(cfg.job.dump_folder, launch.rank);
  if (launch.rank == 0) write_effective_config(cfg);
  spdlog::info("tokenizer: {} ({}, {} ids, bos {}, eos {}; model vocab {})", tok.model_path(), tok.kind(),
               tok.vocab_size(), tok.bos_id(), tok.eos_id(), margs.sizes.vocab_size);
  spdlog::info("dataset: {} (dp rank {} of {}; {} batch{} read ahead)", j.data.source, j.par.dp_rank, j.par.dims.dp(),
               cfg.training.prefetch_batches, cfg.training.prefetch_batches == 1 ? "" : "es");
  check_blas_and_warn();
  const int threads = configure_threads(launch.local_world_size);
  const std::string& wait_policy = runtime_env().omp_wait_policy;
  spdlog::info(
      "launch: {} rank {} of {} (local {} of {}); intra-op threads: {} (OpenMP wait policy: {}); "
      "matmuls: {}; seed: {}{}; LibTorch {}",
      launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, threads,
      wait_policy.empty() ? "libgomp default" : wait_policy, gemm::backend_choice(), j.seed,
      cfg.debug.seed ? "" : " (random: set debug.seed to repeat this run)", TORCH_VERSION);
  spdlog::info("device: {} ({})", j.device.name(), j.device.why);
  if (launch.elastic())
    spdlog::info("torchrun: run {}, restart count {} (at most {}){}", launch.run_id, launch.restart_count,
                 launch.max_restarts, launch.agent_store ? ", ranks join the agent's store" : "");
}

// A GPU: the model, initialised on the CPU from the seed (the same values as a CPU run's),
// moves there; every forward takes its inputs there (validation's too). With FSDP the
// parameters are there already (its shards and unsharded parameters): only the buffers move.
void maybe_move_to_device(TrainModel& model, const DeviceChoice& device, bool params_placed) {
  if (!device.cuda) return;
  const torch::Device compute_device(torch::kCUDA, static_cast<c10::DeviceIndex>(device.index));
  if (params_placed) {
    for (auto& b : model.module->buffers()) b.set_data(b.to(compute_device));
  } else {
    model.module->to(compute_device);
  }
  model.forward = [forward = model.forward, compute_device](const torch::Tensor& x) {
    return forward(x.to(compute_device, /*non_blocking=*/true));
  };
}

// On the CPU: which of flash_causal_attention's kernels this run's heads take
// (kernels/attention_direct.h's rule), said once at start-up.
void log_cpu_attention(const Job& j, const ModelArgs& margs) {
  const int64_t hd = margs.sizes.head_dim, T = j.cfg.training.seq_len;
  const int64_t set_kib = attention_direct::working_set_bytes(hd, T) / 1024;
  const int64_t l2_kib = attention_direct::l2_bytes() / 1024;
  const int64_t limit_kib = attention_direct::working_set_limit_bytes(hd) / 1024;
  // The limit's share of the L2, from the two numbers (the factor lives in the rule alone).
  const std::string vectors =
      fmt::format("{}: {}", attention_direct::wide_vectors() ? "AVX-512" : "AVX2",
                  limit_kib >= l2_kib ? fmt::format("{} times", limit_kib / l2_kib)
                                      : fmt::format("1/{} of", l2_kib / std::max<int64_t>(limit_kib, 1)));
  std::string why;
  if (bf16_compute(j))
    why = "bfloat16 compute";
  else if (!attention_direct::takes(hd))
    why = fmt::format("head dim {}: the direct kernels are built for 16, 32 and 64", hd);
  else if (limit_kib == 0)
    why = "neither AVX-512 nor AVX2: the direct kernels were measured with one of them";
  else if (!attention_direct::preferred(hd, T))
    why = fmt::format("head dim {} at seq {}: a backward task's {} KiB over {} KiB ({} the L2's {} KiB)", hd, T,
                      set_kib, limit_kib, vectors, l2_kib);
  if (why.empty())
    spdlog::info(
        "attention: ctitan's direct kernels (float32, head dim {} at seq {}: a backward task's {} KiB within {} KiB, "
        "{} the L2's {} KiB)",
        hd, T, set_kib, limit_kib, vectors, l2_kib);
  else
    spdlog::info("attention: ctitan's tiled flash attention on the GEMM ({})", why);
}

// model.sdpa_backend on a GPU: auto takes the first of cuDNN's, flash and memory-efficient
// attention that ATen accepts for this run's shape (local batch, seq_len, heads, head_dim) and
// compute dtype; a named backend is checked to take that shape. Each is timed on that shape
// and the timings logged beside the choice (kernels/sdpa_choice.h says why they do not decide
// it). On the CPU ctitan's own attention runs, and log_cpu_attention says which of its kernels.
void choose_attention(const Job& j, const ModelArgs& margs) {
  if (!j.device.cuda) return log_cpu_attention(j, margs);
  const JobConfig& cfg = j.cfg;
  const ModelSizes& z = margs.sizes;
  SdpaShape shape;
  shape.batch = cfg.training.local_batch_size;
  shape.seq = cfg.training.seq_len;
  shape.head_dim = z.head_dim;
  shape.heads = z.n_heads / j.par.dims.tp;  // a tp rank runs its share of the heads
  shape.kv_heads = z.n_kv_heads / j.par.dims.tp;
  shape.dtype = bf16_compute(j) ? at::kBFloat16 : at::kFloat;
  shape.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(j.device.index));
  const SdpaBackend asked = cfg.model.sdpa_backend;
  std::vector<at::SDPBackend> candidates;
  switch (asked) {
    case SdpaBackend::Auto:
      candidates = {at::SDPBackend::cudnn_attention, at::SDPBackend::flash_attention,
                    at::SDPBackend::efficient_attention};
      break;
    case SdpaBackend::CuDNN: candidates = {at::SDPBackend::cudnn_attention}; break;
    case SdpaBackend::Flash: candidates = {at::SDPBackend::flash_attention}; break;
    case SdpaBackend::Efficient: candidates = {at::SDPBackend::efficient_attention}; break;
    case SdpaBackend::Math: candidates = {at::SDPBackend::math}; break;
  }
  const SdpaChoice c = choose_sdpa(shape, candidates);
  const bool any = std::any_of(c.tried.begin(), c.tried.end(), [](const SdpaTry& t) { return t.usable; });
  const std::string what =
      fmt::format("[batch {}, seq {}, {} heads, {} kv heads, head dim {}] {}", shape.batch, shape.seq, shape.heads,
                  shape.kv_heads, shape.head_dim, c10::toString(shape.dtype));
  if (!any)
    throw UserError(fmt::format("model.sdpa_backend {}: ATen's attention cannot run {} on {} ({}); choose auto",
                                key_name(asked), what, j.device.name(), c.summary()));
  use_sdpa(c);
  spdlog::info(
      "attention: {} ({}; model.sdpa_backend {}{})", c.name(), c.summary(), key_name(asked),
      asked == SdpaBackend::Auto ? ": the first of cudnn, flash, efficient that takes " + what : ", on " + what);
#ifdef CTITAN_WITH_CUDA
  spdlog::info("SwiGLU, RoPE, cross-entropy and AdamW: {}",
               own_gpu_kernels() ? "ctitan's own CUDA kernels (CTITAN_GPU_KERNELS=ctitan; bf16 on one GPU: AdamW reads "
                                   "the bf16 gradients; not yet measured against ATen's on a GPU: "
                                   "bench/gpu_kernel_check)"
                                 : "ATen's ops (CTITAN_GPU_KERNELS=ctitan: ctitan's own CUDA kernels)");
#endif
}

// The model: built without storage, AC applied, then FSDP, which initialises unit by unit.
// With FSDP the full model never exists on a rank: each unit is given storage, initialised
// from the seed as the full init would (same draws, same order), cut to this rank's rows and
// freed. A run that loads a checkpoint draws nothing: the checkpoint gives the values.
void setup_model(Job& j, const ModelArgs& margs) {
  const JobConfig& cfg = j.cfg;
  const bool sharded = j.sharded;
  spdlog::info("memory estimate: {} per rank", describe(j.mem_estimate));
  const bool loads_weights = will_load_model(j.checkpoint);
  reset_peak_rss();
  j.rss_before_model = current_rss_gib();
  torch::manual_seed(j.seed);
  enter_phase(j.at, 0, "model build");
  j.model = build_model(margs, cfg.training.seq_len,
                        sharded         ? ModelInit::Deferred
                        : loads_weights ? ModelInit::None
                                        : ModelInit::Full);
  TrainModel& model = j.model;
  spdlog::info("model: {} {} — {:.3f}M parameters ({:.3f}M non-embedding), {:.1f} MFLOP/token", cfg.model.name,
               cfg.model.flavor, model.total_params / 1e6, (model.total_params - model.embedding_params) / 1e6,
               model.flops_per_token / 1e6);
  const size_t n_units = model.units().size();
  size_t units_initialised = !sharded && !loads_weights ? n_units : 0;
  ParallelizeArgs p{cfg, j.par, j.device, sharded, nullptr, nullptr, nullptr, nullptr};
  if (!loads_weights)
    p.init_unit = [&model, &units_initialised, sharded](size_t i) {
      // The previous unit's full values are freed by now; the caching CPU allocator would
      // keep them (units differ in size, so the next one is a fresh block): give them back,
      // so at most one unit exists beside the shards.
      if (sharded) release_cached_cpu_memory();
      model.init_unit(i);
      ++units_initialised;
    };
  enter_phase(j.at, 0, sharded ? "sharding and initialisation" : "initialisation");
  parallelize(*margs.spec, model, p);  // TP, AC, then FSDP (the family's hook or the default)
  j.tp = p.tp;
  j.ac = p.ac;
  j.fsdp = p.fsdp;
  spdlog::info("model init: {} of {} units randomly initialised on this rank ({})", units_initialised, n_units,
               loads_weights ? "the weights come from the checkpoint"
               : sharded     ? "one unit at a time, this rank keeping its rows"
                             : "the full model");
  // The full-size parameters sharding freed sit in the CPU allocator's cache; they are
  // the memory FSDP exists to give back.
  if (j.fsdp) release_cached_cpu_memory();
  maybe_move_to_device(model, j.device, /*params_placed=*/j.fsdp != nullptr);
  choose_attention(j, margs);
}

// Tensor parallelism's gradients: the replicated parameters' (norms) are summed over the tp
// group before the norm (the trainer's sync), and the norm's squares add up over dp_shard × tp,
// each replicated parameter counted once: tp rank 0 adds its squares, the others leave them out.
void setup_tp_gradients(Job& j) {
  const auto named = j.model.module->named_parameters();
  for (const std::string& fqn : j.tp->replicated())
    j.tp_replicated.push_back(j.fsdp ? j.fsdp->local_shard(fqn) : named[fqn]);
  if (j.tp->rank() != 0) j.grad_counted_elsewhere = j.tp_replicated;
  j.grad_sq_all_reduce = sum_over(j.par.shard_tp, j.par.shard_tp_nccl, "grad_norm");
}

std::function<void()> tp_gradient_sync(const Job& j) {
  if (!j.tp) return nullptr;
  return [tp = j.tp, replicated = j.tp_replicated] { tp->sum_gradients(replicated); };
}

// Optimizer and LR schedule, on the local shards with FSDP.
void setup_optimizer(Job& j) {
  const JobConfig& cfg = j.cfg;
  enter_phase(j.at, 0, "optimizer");
  j.params = j.fsdp ? j.fsdp->sharded_parameters() : j.model.module->parameters();
  j.optimizer = build_optimizer(j.params, optimizer_spec(cfg));
  j.lr = std::make_unique<LRScheduler>(cfg.optimizer.lr, lr_spec(cfg));
  spdlog::info("lr schedule: warmup {} / stable {} / decay {} ({}), min_lr_factor {}", j.lr->warmup_steps(),
               j.lr->stable_steps(), j.lr->decay_steps(), cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor);
  // Sharded gradients: the norm's sum of squares over the shard group (a group of one, as bf16
  // on one GPU through FSDP's machinery, has nothing to add); with tp over dp_shard × tp. On
  // GPUs the sum runs over the shard's NCCL group on the device (gpu_check.sh (f)'s rule).
  if (j.fsdp) j.grad_sq_all_reduce = sum_over(j.par.shard, j.par.fsdp_shard, "grad_norm");
  if (j.tp) setup_tp_gradients(j);
}

// Checkpointing: the components registered, then resumed from the latest complete checkpoint
// (or initial_load_path). Returns false for checkpoint.create_seed_checkpoint: saved, done.
bool setup_checkpointing(Job& j) {
  enter_phase(j.at, 0, "checkpoint load");
  j.ckpt = build_checkpointing(j.checkpoint, hf_adapter(), j.par, j.model, j.fsdp.get(), *j.optimizer, *j.lr,
                               *j.data.batches, j.train_state, j.seed, j.tp.get());
  if (j.checkpoint.create_seed_checkpoint) {  // one process: check_start made sure
    j.ckpt->manager->save_to(j.ckpt->manager->options().folder, 0, /*model_only=*/true);
    return false;
  }
  j.ckpt->manager->load();
  if (j.launch.restart_count > 0)  // torchrun restarted the workers: say where this attempt starts
    spdlog::info("restart {} of run {}: {}", j.launch.restart_count, j.launch.run_id,
                 j.train_state.step > 0 ? "resumed from step " + std::to_string(j.train_state.step)
                                        : std::string("no complete checkpoint, starting from step 1"));
  return true;
}

// Start-up memory: the growth of the peak RSS from just before the model was built to here:
// the shards, the unit being initialised, the optimizer, a checkpoint load.
void log_startup_memory(const Job& j) {
  int64_t largest_unit = 0;
  for (const auto& u : j.model.units()) {
    int64_t n = 0;
    for (const auto& [fqn, t] : u.params) n += t.numel();
    largest_unit = std::max(largest_unit, n * 4);
  }
  const double MiB = 1024.0 * 1024.0, GiB_in_MiB = 1024.0;
  const double shard_mib = (j.fsdp ? j.fsdp->sharded_param_bytes() : j.model.total_params * 4) / MiB;
  const double peak = peak_rss_gib();
  spdlog::info(
      "start-up memory: RSS before the model {:.1f} MiB, peak before step 1 {:.1f} MiB (+{:.1f} MiB; "
      "this rank's fp32 parameters {:.1f} MiB, largest unit {:.1f} MiB fp32)",
      j.rss_before_model * GiB_in_MiB, peak * GiB_in_MiB, (peak - j.rss_before_model) * GiB_in_MiB, shard_mib,
      largest_unit / MiB);
}

// The MFU reference: the better of ATen's matmul and the GEMM the model's projections use
// (kernels/gemm.h), so MFU is never taken against a slower kernel than the one training
// runs; on a GPU, cuBLAS's matmul there (components/gpu_metrics.h).
std::function<double()> matmul_peak_measure(const Job& j, const std::string& peak_dtype) {
  const DeviceChoice device = j.device;
  return [peak_dtype, device] {
    if (device.cuda) return gpu_matmul_peak_flops(peak_dtype, device.index);
    // Measured between steps: the cache's free blocks go back first, so that the operands
    // reuse the pages and do not raise the peak RSS above what training reached.
    release_cached_cpu_memory();
    const double f = std::max(measure_matmul_peak_flops(peak_dtype),
                              gemm::peak_flops(peak_dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat));
    // Its matrices' sizes are none of training's: the cache would keep them for good.
    release_cached_cpu_memory();
    return f;
  };
}

// The loop (training/trainer.h) on the parts the job built. The matmul peak is measured when
// the first metrics line is due (after that step's time was taken), not before step 1: it is
// not part of the start-up.
int train_job(Job& j, gemm::Backend matmuls) {
  const std::string peak_dtype = bf16_compute(j) ? "bfloat16" : "float32";
  // A peak the job gives (the config's, else the environment's) is taken as it is.
  const double given_tflops =
      j.cfg.metrics.mfu_peak_tflops > 0 ? j.cfg.metrics.mfu_peak_tflops : runtime_env().mfu_peak_tflops;
  const std::string reference = j.cfg.metrics.mfu_peak_tflops > 0 ? "metrics.mfu_peak_tflops"
                                : given_tflops > 0                ? "CTITAN_PEAK_TFLOPS"
                                : j.device.cuda
                                    ? "cuBLAS matmul on " + j.device.name()
                                    : std::string("the better of ") + gemm::backend_name(matmuls) + " and ATen matmul";
  Trainer trainer(TrainerParts{j.cfg,
                               j.par,
                               j.device,
                               j.model,
                               j.fsdp.get(),
                               *j.optimizer,
                               j.params,
                               j.grad_sq_all_reduce,
                               j.grad_counted_elsewhere,
                               *j.lr,
                               *j.data.batches,
                               j.data.setup_s,
                               j.validator.get(),
                               *j.ckpt->manager,
                               j.train_state,
                               j.at,
                               j.accum,
                               matmul_peak_measure(j, peak_dtype),
                               peak_dtype,
                               reference,
                               tp_gradient_sync(j),
                               j.par.dims.tp,
                               given_tflops > 0 ? given_tflops * 1e12 : 0.0,
                               j.cfg.training.cuda_graphs});
  return trainer.train();
}

int run(const std::vector<std::string>& argv, std::ostream& out, RunProgress& at) {
  // ---- config ---------------------------------------------------------------------------
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
  const CheckpointOptions checkpoint = checkpoint_options(cfg);  // checkpoint.*'s checks and translation
  check_validation_config(cfg);
  const gemm::Backend matmuls = environment_checked([] { return gemm::backend(); });
#ifdef CTITAN_WITH_CUDA
  environment_checked([] { return own_gpu_kernels(); });
#endif
  build_model_args_check(cfg);
  if (cfg.job.validate_only) return validate_only(cfg, checkpoint, out);
  // Before any thread exists: SIGTERM / SIGINT / SIGUSR1 become a stop request.
  install_stop_signal_watcher();

  Job j(cfg, checkpoint, at);
  setup_environment(j);                   // process groups, device, seed
  const ModelArgs margs = setup_data(j);  // tokenizer, data, model size, memory estimate
  announce_run(j, margs);                 // the run's outputs begin
  setup_model(j, margs);                  // build, AC, FSDP (initialising unit by unit)
  setup_optimizer(j);
  if (!setup_checkpointing(j)) return 0;  // a seed checkpoint ends the run
  log_startup_memory(j);
  return train_job(j, matmuls);
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
