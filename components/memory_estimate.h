// What a rank will hold at its peak, estimated from the config before anything is allocated,
// and what the rank can have. A start that cannot fit ends with one line and exit 2 instead
// of std::bad_alloc minutes later.
//
// Legend: P = parameters, U = the largest FSDP unit's parameters, N = dp ranks, L = layers,
// D = dim, Dkv = kv dim, F = FFN hidden size per token (MoE: top_k experts), V = vocab,
// B = local_batch_size, T = seq_len, e = bytes of the compute dtype.
#pragma once
#include <cstdint>
#include <string>

#include "config/job_config.h"

namespace ctitan {

struct MemoryModel {  // the model's sizes
  int64_t params = 0, largest_unit = 0, last_unit = 0, n_layers = 0, dim = 0, kv_dim = 0, ffn = 0, vocab = 0,
          head_dim = 0;
};

struct MemoryRun {    // the run's choices
  int64_t dp = 1;     // N
  bool fsdp = false;  // sharded (also bf16 on one process)
  // FSDP's policy as it applies (one process turns "default" into "never"): always | default | never.
  std::string reshard_after_forward = "default";
  int64_t compute_bytes = 4;  // e
  // One rank keeps autograd's gradients in the compute dtype as the shards' gradients
  // (training/parallelize.h's one_rank_keeps_bf16_grads): e·P of them, no float32 copy.
  bool compute_dtype_grads = false;
  int64_t batch = 1, seq = 1;
  ACMode ac_mode = ACMode::None;  // none | full | selective
  bool async_checkpoint = false;  // checkpoint.enable with async_mode other than "disabled"
};

struct MemoryEstimate {  // bytes
  double base = 0;       // the process before the model (LibTorch, data, tokenizer): measured
  double workspace = 0;  // MKL's kept GEMM buffers + the code and thread state training touches
  double params = 0;     // fp32 shard, 4P/N
  double grads = 0;      // fp32, 4P/N (e·P where one rank keeps the compute dtype's)
  double optimizer = 0;  // AdamW exp_avg + exp_avg_sq, 8P/N
  double gathered = 0;   // FSDP: unsharded units in e (those kept from forward to backward, the
                         // one running and the one prefetched) + the gradient reduction's buffers
  double activations = 0;
  double logits = 0;   // [B·T, V] in e and its fp32 gradient
  double staging = 0;  // async checkpoints: a copy of the parameters and optimizer state
  double total() const {
    return base + workspace + params + grads + optimizer + gathered + activations + logits + staging;
  }
};

MemoryEstimate estimate_memory(const MemoryModel& m, const MemoryRun& r, double base_bytes);

// What this rank can have: MemAvailable / ranks on the node, lowered to the cgroup's
// memory.max / ranks when that is smaller. Bytes; `how` says which applied.
double memory_available_per_rank(int64_t local_world_size, std::string* how);

// One line: the estimate's parts in GiB.
std::string describe(const MemoryEstimate& e);

}  // namespace ctitan
