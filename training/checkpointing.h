// The training components as the checkpoint manager sees them (Stateful adapters under
// torchtitan's names) and the loop's saving policy.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/lr_scheduler.h"
#include "config/job_config.h"
#include "models/train_model.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/tensor_parallel.h"
#include "training/prefetcher.h"
#include "training/world.h"

namespace ctitan {

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

// The manager of options (checkpoint_options(cfg), made once by train) with every component
// registered (nothing loaded yet); families: the model families' HF adapter (models/hf_adapter.h). The objects passed must outlive the result. The dataloader's state is the batches' (the position of the batches
// trained on, not of those read ahead: training/prefetcher.h).
std::unique_ptr<Checkpointing> build_checkpointing(const CheckpointOptions& options, const HFAdapter& families,
                                                   const Parallelism& par, TrainModel& model, FSDP* fsdp,
                                                   torch::optim::Optimizer& opt, LRScheduler& lr,
                                                   BatchPrefetcher& batches, TrainState& ts, uint64_t seed,
                                                   const TensorParallel* tp = nullptr);

// The periodic save. A save that failed on some rank fails on every rank alike, leaving the
// previous checkpoint intact (a disk full, an I/O error; a dead rank is a CollectiveFailure,
// never continued from). checkpoint.on_save_failure = "continue" logs it and goes on to the
// next save, except after the last step, where nothing would come after it.
void maybe_save(CheckpointManager& manager, int64_t step, bool last_step, SaveFailurePolicy on_failure);

}  // namespace ctitan
