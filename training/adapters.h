// Glue between the checkpoint manager (which knows only the Stateful interface and its
// storage format) and the trainer's objects: FSDP's shards, the world's process group,
// the optimizer and LR schedule in the form torchtitan's DCP readers expect.
// (The dataloader's state and its redistribution belong to datasets/sharding.h.)
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/lr_scheduler.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/tensor_parallel.h"

namespace ctitan {

// The parameters as this rank holds them: FSDP's fp32 shards (the optimizer's tensors), or
// the model's own full parameters on one process; with tensor parallelism (tp not null) in
// the whole parameter's coordinates: a split over rows is a range of its rows, a split over
// columns is saved as whole rows gathered over the tp group (ShardedParam::whole_rows), and
// what every tp rank holds alike (the norms, whole rows) is stored by tp rank 0.
std::vector<ShardedParam> sharded_params(const torch::nn::Module& model, FSDP* fsdp,
                                         const TensorParallel* tp = nullptr);

// The checkpoint manager's collectives over the world group: strings are all-gathered as
// their lengths, then as bytes padded to the longest. arrive/missing use the rendezvous
// store to name the ranks that never reached a point (a killed rank cannot say so itself).
CheckpointComm checkpoint_comm(const std::shared_ptr<Comm>& world, c10::intrusive_ptr<c10d::Store> store);

// checkpoint.format = "dcp": beside ctitan's entries, what torchtitan's flattened state dict
// holds and its dcp.load asks for: the optimizer's param group per parameter
// (get_optimizer_state_dict(..., flatten_optimizer_state_dict=True): lr, betas, eps,
// weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused,
// decoupled_weight_decay, initial_lr, as PyTorch 2.13's AdamW has them) and LambdaLR's state
// (base_lrs, last_epoch, _step_count, _is_initial, _get_lr_called_within_step, _last_lr).
// The LR is the one the next step uses, as PyTorch's group holds it after scheduler.step().
std::function<void(StateDict&)> torchtitan_dcp_extras(torch::optim::Optimizer& opt, std::vector<std::string> fqns,
                                                      const LRScheduler& lr);

}  // namespace ctitan
