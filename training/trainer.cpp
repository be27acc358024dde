#include "training/trainer.h"

#include <cmath>
#include <ctime>
#include <filesystem>

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include "components/gpu_metrics.h"
#include "components/optimizer.h"
#include "components/system.h"
#include "config/errors.h"
#include "components/preemption.h"
#include "kernels/device_route.h"
#include "kernels/fused_ops.h"
#include "util/env.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {
namespace {

using Clock = Trainer::Clock;

// profiling.enable_profiling: every profile_freq-th step is recorded by LibTorch's profiler
// (op names, shapes off) into a Chrome trace, in torchtitan's folder layout.
std::string profile_path(const JobConfig& cfg, int64_t rank, int64_t step) {
  return (fs::path(cfg.job.dump_folder) / cfg.profiling.save_traces_folder / ("iteration_" + std::to_string(step)) /
          ("rank" + std::to_string(rank) + "_trace.json"))
      .string();
}

// One profiled step. On the CPU, LibTorch's legacy profiler (the ops' host times). On a GPU,
// Kineto with CUDA activity: the trace also holds every kernel with its GPU time ("cat":
// "kernel"), which scripts/profile_summary.py sums; the device is synchronised before the
// profiler stops, so the step's last kernels are in it.
class StepProfile {
 public:
  StepProfile(std::string path, const DeviceChoice& device) : path_(std::move(path)), device_(device) {
    if (!device_.cuda) {
      legacy_ = std::make_unique<torch::autograd::profiler::RecordProfile>(path_);
      return;
    }
    torch::autograd::profiler::prepareProfiler(config(), activities());
    torch::autograd::profiler::enableProfiler(config(), activities());
  }
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;
  ~StepProfile() {
    if (legacy_) return;  // its destructor writes the trace
    gpu_synchronize(device_.index);
    torch::autograd::profiler::disableProfiler()->save(path_);
  }

 private:
  static torch::profiler::impl::ProfilerConfig config() {
    return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO);
  }
  static std::set<torch::profiler::impl::ActivityType> activities() {
    return {torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
  }
  std::string path_;
  DeviceChoice device_;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> legacy_;
};

std::unique_ptr<StepProfile> maybe_profile(const JobConfig& cfg, int64_t rank, int64_t step,
                                           const DeviceChoice& device) {
  if (!cfg.profiling.enable_profiling || step % cfg.profiling.profile_freq != 0) return nullptr;
  const std::string path = profile_path(cfg, rank, step);
  fs::create_directories(fs::path(path).parent_path());
  return std::make_unique<StepProfile>(path, device);
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
    now = read_to_host(t).item<int64_t>();
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

// One validation run in the training setup: evaluation mode (no router jitter), no-grad, FSDP
// gathering units as in training. Afterwards the model is as the training step left it: every
// unit resharded, the family's step counters (reset by the step's hooks just before) reset
// again, so the next step is the same with or without validation.
ValidationMetrics run_validation(const Validator& validator, TrainModel& model, FSDP* fsdp, const Parallelism& par,
                                 int64_t step) {
  model.module->eval();
  ValidationMetrics v = validator.validate(
      step, model.forward, [&par](std::vector<double>& x) { world_sum(par, x, "validation"); }, model.loss);
  model.module->train();
  if (fsdp) fsdp->reshard_all();
  if (model.step.reset_step_counters) model.step.reset_step_counters();
  return v;
}

}  // namespace

Trainer::Trainer(TrainerParts parts)
    : p_(std::move(parts)),
      metrics_(p_.cfg.job.dump_folder, /*write=*/p_.par.env.rank == 0, p_.cfg.training.steps),
      B_(p_.cfg.training.local_batch_size),
      T_(p_.cfg.training.seq_len),
      local_tokens_(static_cast<double>(B_ * T_ * p_.accum)),
      first_step_(p_.train_state.step + 1),
      spikes_(p_.cfg.training.loss_spike_factor),
      last_step_(first_step_ - 1),
      loss_sum_over_world_(sum_over_world(p_.par, "loss")) {
  maybe_enable_tensorboard(metrics_, p_.cfg, p_.par);
  train_start_ = Clock::now();
  window_start_ = Clock::now();
  if (p_.model.step.set_micro_batches) p_.model.step.set_micro_batches(p_.accum);
  const int64_t dp_world = p_.par.dims.dp();
  spdlog::info("training {} steps: global batch {} × {} tokens ({} ranks × {} micro-batches of {})",
               p_.cfg.training.steps, B_ * dp_world * p_.accum, T_, dp_world, p_.accum, B_);
  if (p_.cuda_graphs) {
    lr_on_device_ = torch::zeros({}, torch::TensorOptions()
                                         .dtype(torch::kFloat64)
                                         .device(torch::kCUDA, static_cast<c10::DeviceIndex>(p_.device.index)));
    if (!read_lr_from_device(p_.optimizer, lr_on_device_))
      throw RuntimeFailure("training.cuda_graphs: the optimizer is not ctitan's fused AdamW");
    graph_ = make_step_graph(static_cast<int>(p_.device.index));
    spdlog::info(
        "CUDA graphs (training.cuda_graphs): {} eager step{}, then the step is captured once and replayed; AdamW runs "
        "ctitan's kernel, reading each step's learning rate on the device",
        kEagerStepsBeforeCapture, kEagerStepsBeforeCapture == 1 ? "" : "s");
  }
}

int Trainer::train() {
  const JobConfig& cfg = p_.cfg;
  p_.batches.start();  // from the loaded checkpoint's data position
  for (int64_t step = first_step_; step <= cfg.training.steps; ++step) {
    CommContext::set_step(step);
    const int64_t reads_before = host_reads();
    std::unique_ptr<StepProfile> profile = maybe_profile(cfg, p_.par.env.rank, step, p_.device);
    // The step's values are read back only where the host needs them (settle): here, before
    // a save (a checkpoint must not follow a step the non-finite policy stops at), at a stop.
    const bool last = step == cfg.training.steps;
    const bool log = step == 1 || step % cfg.metrics.log_freq == 0 || last;
    const bool reads = log || p_.checkpoints.should_save(step, last);
    // training.cuda_graphs: captured after the eager steps, in a step the profiler leaves alone.
    const bool capture = graph_ && !captured_ && step >= first_step_ + kEagerStepsBeforeCapture && !profile;
    // Test hook: in a step that reads nothing back, any GPU synchronisation is an error (but for
    // the capture's own, once).
    const bool sync_check = runtime_env().sync_check && p_.device.cuda && !reads && !capture;
    if (sync_check) set_sync_errors(true);
    train_step(step, capture);
    if (sync_check) set_sync_errors(false);
    if (step == first_step_) after_first_step();
    enter_phase(p_.at, step, "metrics");
    if (reads) {
      const StepResult r = settle();
      if (log) maybe_log_metrics(step, r);
    }
    if (profile) {
      profile.reset();  // writes the trace
      spdlog::info("profiler trace of step {} written to {}", step, profile_path(cfg, p_.par.env.rank, step));
    }
    p_.train_state.step = step;
    p_.train_state.ntokens_seen += B_ * T_ * p_.accum * p_.par.dims.dp();
    enter_phase(p_.at, step, "checkpoint save");
    maybe_save(p_.checkpoints, step, step == cfg.training.steps, cfg.checkpoint.on_save_failure);
    maybe_validate(step);
    last_step_ = step;
    const bool stop = maybe_stop(step);
    maybe_trace_host_reads(p_.par.env.rank, step, host_reads() - reads_before);
    if (stop) break;
  }
  return finish();
}

std::string Trainer::of_micro(int64_t micro) const {
  // " (micro-batch m of n)" in the phase names when there are several.
  return p_.accum > 1 ? " (micro-batch " + std::to_string(micro + 1) + " of " + std::to_string(p_.accum) + ")"
                      : std::string();
}

void Trainer::next_batch(int64_t step, int64_t micro, torch::Tensor& inputs, torch::Tensor& labels) {
  enter_phase(p_.at, step, "data" + of_micro(micro));
  // The wait for a batch read ahead (or the reading itself with training.prefetch_batches = 0);
  // on a GPU it comes from pinned host memory with a non-blocking copy (training/prefetcher.h).
  const auto t_data = Clock::now();
  StepBatch batch = p_.batches.next();
  if (step == first_step_ && micro == 0)
    spdlog::info(
        "first batch ready {:.2f} s after main started (the data's part: {:.3f} s opening the "
        "tokenizer and corpus, {:.3f} s reading this batch)",
        seconds_since(p_.at.started), p_.data_setup_s, seconds_since(t_data));
  maybe_trace_batch(batch.tokens, p_.par.env.rank, step);
  inputs = std::move(batch.inputs);  // [B, T]
  labels = std::move(batch.labels);  // [B, T]
  data_s_ += seconds_since(t_data);
}

void Trainer::forward_backward_step(int64_t step, int64_t micro, const torch::Tensor& inputs,
                                    const torch::Tensor& labels, StepValues& v) {
  const double heap_before = heap_in_use_gib();
  enter_phase(p_.at, step, "forward" + of_micro(micro));
  // Token-sum cross-entropy / local_tokens, on float32 row statistics of the logits in
  // their compute dtype (kernels/fused_ops.h: no float32 copy of [B·T, V]).
  auto logits = p_.model.forward(inputs);  // [B, T, V]
  // With loss parallelism the logits are this tp rank's share of the vocabulary and the family's
  // loss (TrainModel::loss) combines the shares.
  const auto flat_logits = logits.view({B_ * T_, -1}), flat_labels = labels.view({B_ * T_});
  auto loss = p_.model.loss ? p_.model.loss(flat_logits, flat_labels, 1.0 / local_tokens_)
                            : fused_cross_entropy(flat_logits, flat_labels, 1.0 / local_tokens_);
  // What the forward left alive for backward (activations, logits): the heap growth.
  activation_gib_ = std::max(activation_gib_, heap_in_use_gib() - heap_before);
  enter_phase(p_.at, step, "backward" + of_micro(micro));
  loss.backward();
  if (p_.fsdp) p_.fsdp->finish_backward();
  // Summed in float64 where the loss is (no read back): the same sums as on the host.
  if (!v.loss_sum.defined()) v.loss_sum = torch::zeros({}, loss.options().dtype(torch::kFloat64));
  v.loss_sum.add_(loss.detach());
  if (p_.model.step.extra_loss) v.loss_sum.add_(p_.model.step.extra_loss());  // the family's term
  window_tokens_ += B_ * T_;
}

void Trainer::train_step(int64_t step, bool capture) {
  const double lr = p_.lr.current_lr();
  set_learning_rate(p_.optimizer, lr);
  if (lr_on_device_.defined()) lr_on_device_.fill_(lr);  // queued: read by the step's AdamW
  StepValues v = graph_ && (capture || captured_)
                     ? graph_step(step)
                     : step_work(step, [this, step](int64_t micro, torch::Tensor& inputs, torch::Tensor& labels) {
                         next_batch(step, micro, inputs, labels);
                       });
  v.step = step;
  v.lr = lr;
  p_.lr.step();
  if (p_.model.step.after_optimizer_step)
    p_.model.step.after_optimizer_step([this](torch::Tensor& t, const char* tag) {
      // Where t is: Gloo on the CPU, the world's NCCL group on GPUs (the family's state update
      // reads nothing back).
      if (const SumOverRanks sum = sum_over_world(p_.par, tag)) sum(t);
    });
  pending_.push_back(std::move(v));
}

StepValues Trainer::step_work(int64_t step, const BatchFor& batch_for) {
  p_.optimizer.zero_grad();
  StepValues v;
  for (int64_t micro = 0; micro < p_.accum; ++micro) {
    torch::Tensor inputs, labels;
    batch_for(micro, inputs, labels);
    forward_backward_step(step, micro, inputs, labels, v);
  }
  if (p_.sync_gradients) p_.sync_gradients();
  // The test hook's faults change tensors once, in eager steps only: captured, one would repeat
  // in every replay.
  if (!capturing_) maybe_inject_fault(p_.par.env.rank, step, v.loss_sum, p_.params);
  // Both values are the same on every rank (a world mean; a norm all-reduced over the
  // shards, whose replicas hold equal gradients), so every rank skips or updates alike.
  enter_phase(p_.at, step, "optimizer");
  v.loss_mean = v.loss_sum;
  if (loss_sum_over_world_) {  // summed where the loss is: nothing read back
    v.loss_mean = v.loss_sum.clone();
    loss_sum_over_world_(v.loss_mean);
    v.loss_mean.div_(static_cast<double>(p_.par.env.world_size));
  }
  // Where the loss is (the compute device), so the step's values sit together for settle().
  // The clip itself happens inside the optimizer's pass (grad_scale, cpu_grad_coef).
  const GradNorm g =
      grad_norm_for_step(p_.params, p_.cfg.training.max_norm, p_.grad_sq_all_reduce, p_.grad_counted_elsewhere);
  v.grad_norm = g.norm.to(v.loss_sum.device());
  apply_update(v, g);
  return v;
}

StepValues Trainer::graph_step(int64_t step) {
  // The batches into the buffers the graph reads, made before the capture (outside its memory
  // pool) and copied into on the step's stream, which the replay then runs on.
  for (int64_t micro = 0; micro < p_.accum; ++micro) {
    torch::Tensor inputs, labels;
    next_batch(step, micro, inputs, labels);
    if (!captured_) {
      graph_inputs_.push_back(torch::empty_like(inputs));
      graph_labels_.push_back(torch::empty_like(labels));
    }
    graph_inputs_[micro].copy_(inputs, /*non_blocking=*/true);
    graph_labels_[micro].copy_(labels, /*non_blocking=*/true);
  }
  if (!captured_) {
    enter_phase(p_.at, step, "CUDA graph capture");
    const auto t0 = Clock::now();
    capturing_ = true;
    graph_->capture([this, step] {
      graph_values_ = step_work(step, [this](int64_t micro, torch::Tensor& inputs, torch::Tensor& labels) {
        inputs = graph_inputs_[micro];
        labels = graph_labels_[micro];
      });
    });
    capturing_ = false;
    captured_ = true;
    spdlog::info("step {}: the training step captured as a CUDA graph in {:.2f} s; each step replays it from here on",
                 step, seconds_since(t0));
  } else {
    window_tokens_ += B_ * T_ * p_.accum;  // forward_backward_step's count, which a replay does not run
    note_replayed_step(p_.optimizer);      // the host step counts the step's host code raises
  }
  enter_phase(p_.at, step, "CUDA graph replay");
  graph_->replay();
  // The next replay overwrites the graph's values: this step's are copies (queued after it).
  StepValues v;
  v.loss_sum = graph_values_.loss_sum.clone();
  v.loss_mean = graph_values_.loss_mean.clone();
  v.grad_norm = graph_values_.grad_norm.clone();
  v.skipped = graph_values_.skipped.clone();
  return v;
}

// The optimizer step, skipped on the device when the loss or the norm is not finite;
// training.on_nonfinite's policy follows when settle() reads the flag back.
void Trainer::apply_update(StepValues& v, const GradNorm& clip) {
  v.skipped = (v.loss_mean.isfinite() & v.grad_norm.isfinite()).logical_not();
  step_unless(p_.optimizer, v.skipped, clip.grad_scale, clip.cpu_grad_coef);
}

StepResult Trainer::settle() {
  if (pending_.empty()) return settled_;
  std::vector<torch::Tensor> rows;
  for (const StepValues& v : pending_)
    rows.push_back(torch::stack({v.loss_sum, v.loss_mean, v.grad_norm, v.skipped.to(torch::kFloat64)}));
  const auto host = read_to_host(torch::stack(rows));  // [steps, 4]: the one read
  const auto a = host.accessor<double, 2>();
  int64_t skipped = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const int64_t k = static_cast<int64_t>(i);
    skipped += a[k][3] != 0;
    settle_one(pending_[i].step, a[k][1], a[k][2], a[k][3] != 0);
    settled_ = StepResult{a[k][0], a[k][1], a[k][2], pending_[i].lr};
  }
  if (skipped) note_skipped_steps(p_.optimizer, skipped);
  pending_.clear();
  return settled_;
}

// training.on_nonfinite for a skipped step ("stop": the run ends naming it; "skip": counted and
// logged), and the loss-spike warning for an updated one.
void Trainer::settle_one(int64_t step, double loss_mean, double grad_norm, bool skipped) {
  const JobConfig& cfg = p_.cfg;
  if (!skipped) {
    double spike_mean = 0;
    if (p_.par.env.rank == 0 && (spike_mean = spikes_.observe(loss_mean)) > 0)
      spdlog::warn(
          "step {}: loss spike: {:.4f} is {:.1f}x the mean of the previous steps ({:.4f}; "
          "training.loss_spike_factor = {})",
          step, loss_mean, loss_mean / spike_mean, spike_mean, cfg.training.loss_spike_factor);
    return;
  }
  const std::string what = "step " + std::to_string(step) + ": " +
                           (std::isfinite(loss_mean) ? "gradient norm is " + std::to_string(grad_norm)
                                                     : "loss is " + std::to_string(loss_mean));
  if (cfg.training.on_nonfinite == NonfinitePolicy::Stop)
    throw RuntimeFailure(what +
                         "; stopping (HINT: lower optimizer.lr or training.max_norm, or set "
                         "training.on_nonfinite = \"skip\")");
  ++skipped_steps_;  // the batch is dropped; the schedule and the step count go on
  spdlog::warn("{}; skipped: no optimizer update ({} step{} skipped in this run)", what, skipped_steps_,
               skipped_steps_ == 1 ? "" : "s");
}

void Trainer::after_first_step() {
  CommContext::set_timeout(std::chrono::seconds(p_.cfg.comm.train_timeout_seconds));
  const TrainingStateBytes sb = training_state_bytes(p_.optimizer);
  state_gib_ = sb.total() / double(1 << 30);
  spdlog::info("training state on this rank: params {:.1f} MiB + grads {:.1f} MiB + optimizer {:.1f} MiB",
               sb.params / double(1 << 20), sb.grads / double(1 << 20), sb.optimizer / double(1 << 20));
}

void Trainer::maybe_log_metrics(int64_t step, const StepResult& r) {
  metrics_.log(step_metrics(step, r));
  window_start_ = Clock::now();
  window_tokens_ = 0;
  data_s_ = 0;
  activation_gib_ = 0;
}

StepMetrics Trainer::step_metrics(int64_t step, const StepResult& r) {
  const DeviceChoice& device = p_.device;
  FSDP* fsdp = p_.fsdp;
  if (device.cuda) gpu_synchronize(device.index);  // the window ends when the GPU's work does
  const double dt = seconds_since(window_start_);
  const double comm_s = fsdp ? fsdp->stats().comm_wait_s - comm_mark_ : 0.0;
  comm_mark_ = fsdp ? fsdp->stats().comm_wait_s : 0.0;
  // memory_gib: the peak RSS; on a GPU, torchtitan's memory/max_reserved(GiB) of the device.
  const GpuMemory gpu_mem = device.cuda ? gpu_memory(device.index) : GpuMemory{};
  const auto maxes = world_max(
      p_.par, {device.cuda ? gpu_mem.peak_reserved_gib : peak_rss_gib(), comm_s, data_s_, activation_gib_, r.loss_sum});
  const double flops_per_tok = p_.model.flops_per_token;  // the family's count per token
  // The MFU reference: the job's given peak, else measured here the first time, after this
  // window's time was taken and before the next one starts, so neither the start-up nor a step
  // pays for it.
  if (peak_flops_ <= 0 && p_.given_peak > 0) {
    peak_flops_ = p_.given_peak;
    spdlog::info("{} matmul peak: {:.1f} GFLOP/s per rank, not measured (MFU reference: {})", p_.peak_dtype,
                 peak_flops_ / 1e9, p_.peak_reference);
  }
  if (peak_flops_ <= 0) {
    peak_flops_ = p_.measure_peak();
    spdlog::info("measured {} matmul peak: {:.1f} GFLOP/s per rank (MFU reference: {})", p_.peak_dtype,
                 peak_flops_ / 1e9, p_.peak_reference);
  }
  StepMetrics m;
  m.step = step;
  m.loss = r.loss_mean;
  m.max_loss = maxes[4];
  m.n_tokens_seen = static_cast<double>(p_.train_state.ntokens_seen + B_ * T_ * p_.accum * p_.par.dims.dp());
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.tps = window_tokens_ / dt / static_cast<double>(p_.tp);  // torchtitan's: per rank of a tp group
  m.tflops = m.tps * flops_per_tok / 1e12;
  if (p_.given_peak <= 0 && m.tps * flops_per_tok > peak_flops_ && peak_remeasures_ < 3) {
    // Training ran faster than the start-up peak: that measurement met a busy moment of a
    // shared machine. Measure again (outside the timed window) rather than report MFU > 100%.
    ++peak_remeasures_;
    peak_flops_ = std::max(peak_flops_, p_.measure_peak());
    spdlog::info("step {} ran at {:.1f} GFLOP/s, above the start-up matmul peak: re-measured, {:.1f} GFLOP/s", step,
                 m.tps * flops_per_tok / 1e9, peak_flops_ / 1e9);
  }
  m.mfu = 100.0 * m.tps * flops_per_tok / peak_flops_;
  m.memory_gib = maxes[0];
  m.data_loading_s = maxes[2];
  m.elapsed_s = seconds_since(train_start_);
  add_extra_metrics(m, r, maxes, gpu_mem.peak_allocated_gib);
  return m;
}

void Trainer::add_extra_metrics(StepMetrics& m, const StepResult& r, const std::vector<double>& maxes,
                                double gpu_alloc) {
  if (p_.fsdp) m.extra.emplace_back("comm_wait_s", maxes[1]);
  m.extra.emplace_back("state_gib", state_gib_);
  if (p_.device.cuda) m.extra.emplace_back("gpu_peak_allocated_gib", gpu_alloc);
  m.extra.emplace_back("activation_gib", maxes[3]);
  if (skipped_steps_) m.extra.emplace_back("skipped_steps", static_cast<double>(skipped_steps_));
  if (p_.cfg.training.on_bad_document == BadDocumentPolicy::Skip) {
    // Over the dp ranks and the whole run (the count is in the loader's checkpointed state);
    // ranks of one dp rank (TP/PP peers) share a loader: mean over all ranks × dp.
    const double mine = static_cast<double>(p_.batches.skipped_documents());
    m.extra.emplace_back("bad_documents_skipped",
                         std::round(world_mean(p_.par, mine, "bad_docs") * static_cast<double>(p_.par.dims.dp())));
  }
  if (p_.model.step.metrics)
    for (auto& [name, value] :
         p_.model.step.metrics([this](double v, const char*tag) { return world_mean(p_.par, v, tag); }))
      m.extra.emplace_back(std::move(name), value);
}

void Trainer::maybe_validate(int64_t step) {
  if (!p_.validator || !p_.validator->should_validate(step)) return;
  enter_phase(p_.at, step, "validation");
  // Validation time and communication are not the training window's.
  const auto t_val = Clock::now();
  const double comm_before = p_.fsdp ? p_.fsdp->stats().comm_wait_s : 0.0;
  metrics_.log_validation(run_validation(*p_.validator, p_.model, p_.fsdp, p_.par, step));
  window_start_ += Clock::now() - t_val;
  if (p_.fsdp) comm_mark_ += p_.fsdp->stats().comm_wait_s - comm_before;
}

// A stop request agreed by every rank after `step`: save now and leave the loop.
bool Trainer::maybe_stop(int64_t step) {
  const JobConfig& cfg = p_.cfg;
  if (step >= cfg.training.steps || !(stop_ = agree_on_stop(p_.par)).signal) return false;
  settle();  // the non-finite policy before the save
  spdlog::warn("stopping after step {} of {}: {} on rank {}", step, cfg.training.steps, stop_signal_name(stop_.signal),
               stop_.rank);
  stop_saved_ = p_.checkpoints.save_now(step);
  if (!stop_saved_) spdlog::warn("no checkpoint is saved (checkpoint.enable is off or load_only is on)");
  return true;
}

int Trainer::finish() {
  const JobConfig& cfg = p_.cfg;
  settle();
  p_.batches.stop();  // no batch is read after the last step
  enter_phase(p_.at, last_step_, "checkpoint finalize");
  p_.checkpoints.finalize();
  if (p_.par.dist) p_.par.dist->world->barrier("end of training");
  // The measured counterpart of the start-up estimate (bench/memory_estimate.sh reads it).
  const double estimate_gib = p_.at.estimate_bytes / (1 << 30);
  spdlog::info("peak RSS: {:.3f} GiB on this rank since the model was built (start-up estimate {:.3f} GiB: {:+.1f}%)",
               peak_rss_gib(), estimate_gib, 100.0 * (estimate_gib - peak_rss_gib()) / peak_rss_gib());
  if (stop_.signal) {
    spdlog::info("stopped after step {} of {} ({} on rank {}) in {}{}", last_step_, cfg.training.steps,
                 stop_signal_name(stop_.signal), stop_.rank, format_duration(seconds_since(train_start_)),
                 stop_saved_ ? "; run the same command to resume from step-" + std::to_string(last_step_) : "");
    spdlog::default_logger()->flush();
    return 0;
  }
  spdlog::info("training done: {} steps in {}", cfg.training.steps, format_duration(seconds_since(train_start_)));
  spdlog::info(
      "data: dp rank {} read {} bytes of the corpus ({} documents parsed); the process read {} bytes "
      "since main started (rchar), peak RSS {:.0f} MiB",
      p_.par.dp_rank, p_.batches.loader().bytes_read(), p_.batches.loader().documents_parsed(),
      process_rchar() - p_.at.rchar_at_start, peak_rss_gib() * 1024);
  spdlog::default_logger()->flush();
  return 0;
}

}  // namespace ctitan
