// The parallelism degrees of a job and the rank layout they imply (torchtitan's
// ParallelDims). Only data parallelism exists so far: HSDP = dp_replicate × dp_shard.
// Ranks are laid out replicate-major: rank = replicate_index · dp_shard + shard_index,
// so a shard group is a contiguous run of ranks (one node, when dp_shard = ranks/node).
#pragma once
#include <cstdint>
#include <vector>

namespace ctitan {

struct ParallelDims {
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t cp = 1, tp = 1, pp = 1;
  int64_t world_size = 1;

  // dp_shard = -1 takes the ranks left over. Throws UserError showing every factor when
  // the product is not the world size, and rejects tp/pp/cp ≠ 1 (not built yet).
  static ParallelDims build(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp,
                            int64_t world_size);

  int64_t dp() const { return dp_replicate * dp_shard; }
  bool fsdp_enabled() const { return dp_shard > 1; }
  bool hsdp_enabled() const { return dp_replicate > 1; }
  int64_t shard_index(int64_t rank) const { return rank % dp_shard; }
  int64_t replicate_index(int64_t rank) const { return rank / dp_shard; }
  // The global ranks of `rank`'s shard group and of its replicate group.
  std::vector<int64_t> shard_group(int64_t rank) const;
  std::vector<int64_t> replicate_group(int64_t rank) const;
};

}  // namespace ctitan
