// The training loop and its step, as torchtitan's Trainer: train_step runs one optimizer
// step over the micro-batches (forward_backward_step each), then the loop logs the metrics,
// saves, validates and agrees on stops. train.cpp builds the parts (config → parallelism →
// model → data → optimizer → checkpoint) and hands them over.
//
// Dimensions used in comments: B = local batch size, T = seq_len, V = vocab size.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/lr_scheduler.h"
#include "components/metrics.h"
#include "components/validate.h"
#include "config/job_config.h"
#include "datasets/dataloader.h"
#include "models/train_model.h"
#include "parallelisms/device.h"
#include "parallelisms/fsdp.h"
#include "training/checkpointing.h"
#include "training/hooks.h"
#include "training/prefetcher.h"
#include "training/step_graph.h"
#include "training/world.h"

namespace ctitan {

struct GradNorm;  // components/optimizer.h

// Everything the loop runs on, built by train.cpp; references outlive the Trainer.
struct TrainerParts {
  const JobConfig& cfg;
  Parallelism& par;
  const DeviceChoice& device;
  TrainModel& model;
  FSDP* fsdp;  // null without FSDP
  torch::optim::Optimizer& optimizer;
  std::vector<torch::Tensor> params;                  // the optimizer's (FSDP's local shards)
  SumOverRanks grad_sq_all_reduce;                    // empty: this rank's norm is the norm
  std::vector<torch::Tensor> grad_counted_elsewhere;  // of params: squares another rank adds (TP)
  LRScheduler& lr;
  BatchPrefetcher& batches;    // the DataLoader's batches, read ahead by training.prefetch_batches
  double data_setup_s;         // tokenizer and corpus opened (first-batch line)
  const Validator* validator;  // null without [validation]
  CheckpointManager& checkpoints;
  TrainState& train_state;
  RunProgress& at;
  int64_t accum;  // micro-batches per step
  // The MFU reference's measurement (at the first metrics line, and again if a step beats it),
  // and what the first one's log line says it is: "<dtype> ... (MFU reference: <what>)".
  std::function<double()> measure_peak;
  std::string peak_dtype, peak_reference;
  // After the step's backward, before the norm: tensor parallelism's sum of the replicated
  // parameters' gradients over the tp group (empty: nothing).
  std::function<void()> sync_gradients;
  int64_t tp = 1;  // tensor-parallel degree: a tp group's ranks share their tokens (tokens/s per rank)
  // > 0: the MFU reference in FLOP/s given by the job (peak_reference says where from); nothing
  // is measured.
  double given_peak = 0;
  // training.cuda_graphs: the step captured once and replayed (training/step_graph.h); train.cpp
  // has refused what the capture cannot take.
  bool cuda_graphs = false;
};

// What one step did, for the metrics (host values, read back by Trainer::settle).
struct StepResult {
  double loss_sum = 0;   // this rank's objective summed over its micro-batches
  double loss_mean = 0;  // loss_sum's mean over the ranks
  double grad_norm = 0;  // before clipping
  double lr = 0;         // the step's learning rate
};

// One step's results where they were computed (float64 0-d tensors on the compute device),
// kept until the host needs them: on a GPU reading one waits for the step's work, so the
// step itself reads none (with several ranks the world mean and the norm's squares are summed
// where they are: over NCCL on GPUs).
struct StepValues {
  int64_t step = 0;
  double lr = 0;
  torch::Tensor loss_sum;   // this rank's objective over its micro-batches
  torch::Tensor loss_mean;  // loss_sum's mean over the ranks
  torch::Tensor grad_norm;  // before clipping
  torch::Tensor skipped;    // bool: the loss or the norm not finite, so no optimizer update
};

class Trainer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Trainer(TrainerParts parts);
  // The loop from the step after the loaded one to training.steps (or an agreed stop), then
  // the checkpoint finalised; returns the exit code (0).
  int train();
  // One optimizer step: every micro-batch's forward and backward, the clipping, the optimizer
  // (skipped on the device when the loss or the norm is not finite) and the LR schedule, the
  // family's after-step hook (models/train_model.h). Its values wait in pending_ for settle().
  // capture (training.cuda_graphs): this step's work is captured as the graph later steps replay.
  void train_step(int64_t step, bool capture = false);
  // One micro-batch's forward and backward ([B, T] tokens and labels on the compute device);
  // adds its share of the objective (with the family's extra term) to v.
  void forward_backward_step(int64_t step, int64_t micro, const torch::Tensor& inputs, const torch::Tensor& labels,
                             StepValues& v);
  // Reads the pending steps' values back to the host in one read and applies, step by step,
  // what needs them: training.on_nonfinite's warning or stop, the loss-spike warning. Called
  // on log steps, before a save and at the end; returns the last step's values.
  StepResult settle();

 private:
  void next_batch(int64_t step, int64_t micro, torch::Tensor& inputs, torch::Tensor& labels);
  // The step's work from zeroing the gradients to the optimizer's update, each micro-batch's
  // tokens and labels given by batch_for; returns its values (loss, mean, norm, skip flag).
  using BatchFor = std::function<void(int64_t micro, torch::Tensor& inputs, torch::Tensor& labels)>;
  StepValues step_work(int64_t step, const BatchFor& batch_for);
  // training.cuda_graphs: this step's batches copied into the graph's input buffers, then the
  // step captured (the first time) and replayed; returns copies of the graph's values.
  StepValues graph_step(int64_t step);
  void apply_update(StepValues& v, const GradNorm& clip);
  void settle_one(int64_t step, double loss_mean, double grad_norm, bool skipped);
  void after_first_step();
  void maybe_log_metrics(int64_t step, const StepResult& r);
  StepMetrics step_metrics(int64_t step, const StepResult& r);
  void add_extra_metrics(StepMetrics& m, const StepResult& r, const std::vector<double>& maxes, double gpu_alloc);
  void maybe_validate(int64_t step);
  bool maybe_stop(int64_t step);
  int finish();
  std::string of_micro(int64_t micro) const;

  TrainerParts p_;
  MetricsLogger metrics_;
  const int64_t B_, T_;
  // Each rank's loss is its token mean; FSDP averages gradients over the dp ranks, so the
  // step follows the mean over every token of the global batch.
  const double local_tokens_;
  const int64_t first_step_;
  Clock::time_point train_start_, window_start_;
  // The logging window: tokens, data time, activation peak, FSDP's comm wait at its start.
  int64_t window_tokens_ = 0;
  double data_s_ = 0, comm_mark_ = 0, state_gib_ = 0, activation_gib_ = 0;
  double peak_flops_ = 0;  // measured at the first metrics line
  int peak_remeasures_ = 0;
  LossSpikeDetector spikes_;
  int64_t skipped_steps_ = 0;        // non-finite steps skipped (training.on_nonfinite = "skip")
  std::vector<StepValues> pending_;  // steps not read back yet (settle)
  StepResult settled_;               // the last step read back
  StopRequest stop_;
  bool stop_saved_ = false;
  int64_t last_step_;
  // The step's loss summed over every rank where it is (sum_over: NCCL on GPUs); empty on one
  // process.
  SumOverRanks loss_sum_over_world_;
  // training.cuda_graphs: the graph (null without), whether it is captured yet, the learning rate
  // the AdamW kernel reads on the device, the input buffers the graph reads (one per
  // micro-batch) and the values it writes.
  std::unique_ptr<StepGraph> graph_;
  bool captured_ = false, capturing_ = false;
  torch::Tensor lr_on_device_;
  std::vector<torch::Tensor> graph_inputs_, graph_labels_;
  StepValues graph_values_;
};

}  // namespace ctitan
