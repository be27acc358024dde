#include "parallelisms/parallel_dims.h"

#include <string>

#include "config/errors.h"

namespace ctitan {

ParallelDims ParallelDims::build(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp,
                                 int64_t world_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  for (auto [name, v] : {std::pair<const char*, int64_t>{"tensor_parallel_degree", tp},
                         {"pipeline_parallel_degree", pp},
                         {"context_parallel_degree", cp}})
    if (v != 1)
      throw UserError(std::string("not supported yet: parallelism.") + name + " = " + s(v) + " (ctitan supports: 1)");
  if (dp_replicate < 1)
    throw UserError("config error: parallelism.data_parallel_replicate_degree = " + s(dp_replicate) +
                    " is out of range (must be >= 1)");
  if (dp_shard == -1) {
    if (world_size % dp_replicate != 0)
      throw UserError("parallelism: WORLD_SIZE (" + s(world_size) +
                      ") is not divisible by data_parallel_replicate_degree (" + s(dp_replicate) +
                      "), so data_parallel_shard_degree = -1 cannot take the rest");
    dp_shard = world_size / dp_replicate;
  } else if (dp_shard < 1) {
    throw UserError("config error: parallelism.data_parallel_shard_degree = " + s(dp_shard) +
                    " is out of range (must be -1 or >= 1)");
  }
  const int64_t product = dp_replicate * dp_shard * cp * tp * pp;
  if (product != world_size)
    throw UserError("parallelism: dp_replicate (" + s(dp_replicate) + ") · dp_shard (" + s(dp_shard) + ") · cp (" +
                    s(cp) + ") · tp (" + s(tp) + ") · pp (" + s(pp) + ") = " + s(product) + " ≠ WORLD_SIZE (" +
                    s(world_size) + ")");
  ParallelDims d;
  d.dp_replicate = dp_replicate;
  d.dp_shard = dp_shard;
  d.cp = cp;
  d.tp = tp;
  d.pp = pp;
  d.world_size = world_size;
  return d;
}

std::vector<int64_t> ParallelDims::shard_group(int64_t rank) const {
  std::vector<int64_t> g;
  const int64_t base = replicate_index(rank) * dp_shard;
  for (int64_t i = 0; i < dp_shard; ++i) g.push_back(base + i);
  return g;
}

std::vector<int64_t> ParallelDims::replicate_group(int64_t rank) const {
  std::vector<int64_t> g;
  for (int64_t i = 0; i < dp_replicate; ++i) g.push_back(i * dp_shard + shard_index(rank));
  return g;
}

}  // namespace ctitan
