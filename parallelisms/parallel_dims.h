// The parallelism degrees of a job and the rank layout they imply (torchtitan's
// ParallelDims): the mesh [dp_replicate, dp_shard, tp], tp innermost, so that
//   rank = (replicate_index · dp_shard + shard_index) · tp + tp_index.
// A tp group is a contiguous run of tp ranks (one node's GPUs, when tp ≤ ranks/node); a
// dp_shard group holds the ranks of one replicate index and one tp index. With tp = 1 this
// is the layout data parallelism has always had: rank = replicate_index · dp_shard + shard_index.
// Tensor parallelism's layers: parallelisms/tensor_parallel.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

struct ParallelDims {
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t cp = 1, tp = 1, pp = 1;
  int64_t world_size = 1;

  // dp_shard = -1 takes the ranks left over by dp_replicate and tp. Throws UserError showing
  // every factor when the product is not the world size, and rejects pp/cp ≠ 1 (not built yet).
  static ParallelDims build(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp,
                            int64_t world_size);

  int64_t dp() const { return dp_replicate * dp_shard; }
  bool fsdp_enabled() const { return dp_shard > 1; }
  bool hsdp_enabled() const { return dp_replicate > 1; }
  bool tp_enabled() const { return tp > 1; }
  int64_t tp_index(int64_t rank) const { return rank % tp; }
  int64_t shard_index(int64_t rank) const { return (rank / tp) % dp_shard; }
  int64_t replicate_index(int64_t rank) const { return rank / (tp * dp_shard); }
  // The data-parallel rank (which batch a rank reads): the tp ranks of one dp rank share it.
  int64_t dp_rank(int64_t rank) const { return rank / tp; }
  // The global ranks of `rank`'s shard group, replicate group and tp group, ascending.
  std::vector<int64_t> shard_group(int64_t rank) const;
  std::vector<int64_t> replicate_group(int64_t rank) const;
  std::vector<int64_t> tp_group(int64_t rank) const;
  // Every group of one kind, in the order every rank creates them (group creation is
  // collective): shard groups by (replicate index, tp index), replicate groups by (shard index,
  // tp index), tp groups by dp rank. With tp = 1, shard group g is replicate index g's and
  // replicate group g is shard index g's, as before tp existed.
  std::vector<std::vector<int64_t>> shard_groups() const;
  std::vector<std::vector<int64_t>> replicate_groups() const;
  std::vector<std::vector<int64_t>> tp_groups() const;
  // The dp_shard × tp ranks of each replicate index (contiguous), where every parameter's
  // gradient is held exactly once: the gradient norm's squares add up over one of these.
  std::vector<std::vector<int64_t>> shard_tp_groups() const;
  // The mesh in a few lines for the log: the degrees, then every group of each kind.
  std::vector<std::string> describe() const;
};

// The sizes tensor parallelism splits, as plain numbers (parallelisms/ does not see models/).
struct TPSplitSizes {
  std::string model;  // "<model.name> <model.flavor>", for the error line
  int64_t n_heads = 0, n_kv_heads = 0;
  int64_t ffn_hidden = 0;  // the FFN's hidden width (MoE: one expert's)
  int64_t vocab = 0;
  // Sequence parallelism splits the residual stream over the sequence: training.seq_len and,
  // with validation, validation.seq_len (0: none).
  int64_t seq_len = 0, validation_seq_len = 0;
};

// Throws UserError naming the numbers when tp does not divide the attention heads, the kv
// heads, the FFN's hidden width, the vocabulary or a sequence length (the first that fails).
void check_tp_divides(int64_t tp, const TPSplitSizes& s);

}  // namespace ctitan
