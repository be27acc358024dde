#include "parallelisms/parallel_dims.h"

#include <string>
#include <utility>

#include "config/errors.h"
#include "util/strings.h"

namespace ctitan {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

// dp_shard = -1: the ranks dp_replicate · tp leave over. With tp = 1 the line names only
// dp_replicate, as it always has.
int64_t shard_degree_taking_the_rest(int64_t dp_replicate, int64_t tp, int64_t world_size) {
  const int64_t others = dp_replicate * tp;
  if (world_size % others == 0) return world_size / others;
  const std::string by = tp == 1 ? "data_parallel_replicate_degree (" + num(dp_replicate) + ")"
                                 : "data_parallel_replicate_degree (" + num(dp_replicate) +
                                       ") · tensor_parallel_degree (" + num(tp) + ") = " + num(others);
  throw UserError("parallelism: WORLD_SIZE (" + num(world_size) + ") is not divisible by " + by +
                  ", so data_parallel_shard_degree = -1 cannot take the rest");
}

std::string group_list(const std::vector<std::vector<int64_t>>& groups) {
  std::vector<std::string> parts;
  for (const auto& g : groups) {
    std::vector<std::string> ranks;
    for (int64_t r : g) ranks.push_back(num(r));
    parts.push_back("[" + join(ranks, ", ") + "]");
  }
  return join(parts, " ");
}

}  // namespace

ParallelDims ParallelDims::build(int64_t dp_replicate, int64_t dp_shard, int64_t cp, int64_t tp, int64_t pp,
                                 int64_t world_size) {
  for (auto [name, v] :
       {std::pair<const char*, int64_t>{"pipeline_parallel_degree", pp}, {"context_parallel_degree", cp}})
    if (v != 1)
      throw UserError(std::string("not supported yet: parallelism.") + name + " = " + num(v) + " (ctitan supports: 1)");
  if (dp_replicate < 1)
    throw UserError("config error: parallelism.data_parallel_replicate_degree = " + num(dp_replicate) +
                    " is out of range (must be >= 1)");
  if (tp < 1)
    throw UserError("config error: parallelism.tensor_parallel_degree = " + num(tp) +
                    " is out of range (must be >= 1)");
  if (dp_shard == -1) {
    dp_shard = shard_degree_taking_the_rest(dp_replicate, tp, world_size);
  } else if (dp_shard < 1) {
    throw UserError("config error: parallelism.data_parallel_shard_degree = " + num(dp_shard) +
                    " is out of range (must be -1 or >= 1)");
  }
  const int64_t product = dp_replicate * dp_shard * cp * tp * pp;
  if (product != world_size)
    throw UserError("parallelism: dp_replicate (" + num(dp_replicate) + ") · dp_shard (" + num(dp_shard) + ") · cp (" +
                    num(cp) + ") · tp (" + num(tp) + ") · pp (" + num(pp) + ") = " + num(product) + " ≠ WORLD_SIZE (" +
                    num(world_size) + ")");
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
  const int64_t rep = replicate_index(rank), t = tp_index(rank);
  for (int64_t i = 0; i < dp_shard; ++i) g.push_back((rep * dp_shard + i) * tp + t);
  return g;
}

std::vector<int64_t> ParallelDims::replicate_group(int64_t rank) const {
  std::vector<int64_t> g;
  const int64_t sh = shard_index(rank), t = tp_index(rank);
  for (int64_t i = 0; i < dp_replicate; ++i) g.push_back((i * dp_shard + sh) * tp + t);
  return g;
}

std::vector<int64_t> ParallelDims::tp_group(int64_t rank) const {
  std::vector<int64_t> g;
  const int64_t first = dp_rank(rank) * tp;
  for (int64_t i = 0; i < tp; ++i) g.push_back(first + i);
  return g;
}

// Group (a, b) is named by its first member: replicate index a, tp index b for the shard
// groups, shard index a, tp index b for the replicate groups.
std::vector<std::vector<int64_t>> ParallelDims::shard_groups() const {
  std::vector<std::vector<int64_t>> gs;
  for (int64_t rep = 0; rep < dp_replicate; ++rep)
    for (int64_t t = 0; t < tp; ++t) gs.push_back(shard_group(rep * dp_shard * tp + t));
  return gs;
}

std::vector<std::vector<int64_t>> ParallelDims::replicate_groups() const {
  std::vector<std::vector<int64_t>> gs;
  for (int64_t sh = 0; sh < dp_shard; ++sh)
    for (int64_t t = 0; t < tp; ++t) gs.push_back(replicate_group(sh * tp + t));
  return gs;
}

std::vector<std::vector<int64_t>> ParallelDims::tp_groups() const {
  std::vector<std::vector<int64_t>> gs;
  for (int64_t d = 0; d < dp(); ++d) gs.push_back(tp_group(d * tp));
  return gs;
}

std::vector<std::vector<int64_t>> ParallelDims::shard_tp_groups() const {
  std::vector<std::vector<int64_t>> gs;
  for (int64_t r = 0; r < dp_replicate; ++r) {
    gs.emplace_back();
    for (int64_t k = 0; k < dp_shard * tp; ++k) gs.back().push_back(r * dp_shard * tp + k);
  }
  return gs;
}

std::vector<std::string> ParallelDims::describe() const {
  return {"mesh [dp_replicate, dp_shard, tp] = [" + num(dp_replicate) + ", " + num(dp_shard) + ", " + num(tp) +
              "] over " + num(world_size) + " ranks, rank = (replicate · dp_shard + shard) · tp + tp_index",
          "mesh tp groups: " + group_list(tp_groups()), "mesh dp_shard groups: " + group_list(shard_groups()),
          "mesh dp_replicate groups: " + group_list(replicate_groups())};
}

void check_tp_divides(int64_t tp, const TPSplitSizes& s) {
  const std::pair<std::string, int64_t> split[] = {{s.model + "'s n_heads", s.n_heads},
                                                   {s.model + "'s n_kv_heads", s.n_kv_heads},
                                                   {s.model + "'s FFN hidden width", s.ffn_hidden},
                                                   {s.model + "'s vocab_size", s.vocab},
                                                   {"training.seq_len", s.seq_len},
                                                   {"validation.seq_len", s.validation_seq_len}};
  for (const auto& [what, n] : split)
    if (n % tp != 0)
      throw UserError("parallelism: tensor_parallel_degree (" + num(tp) + ") does not divide " + what + " (" + num(n) +
                      "); torchtitan requires tp to divide the attention heads, the kv heads (split over " +
                      "the tp ranks, never replicated), the FFN hidden width, the vocabulary and the sequence " +
                      "(sequence parallelism)");
}

}  // namespace ctitan
