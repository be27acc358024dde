// Launch environment, ParallelDims, and the collectives built on Gloo — the latter with
// real ranks (processes) over TCP, checked against all-reduce results.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <thread>
#include <utility>

#include "config/errors.h"
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "parallelisms/comm.h"
#include "parallelisms/launch_env.h"
#include "parallelisms/parallel_dims.h"
#include "tests/multiprocess.h"

using namespace ctitan;
using ctitan::testing::all_ok;
using ctitan::testing::spawn_ranks;

// ---------------------------------------------------------------- launch environment
TEST(LaunchEnv, NoLauncherIsOneProcess) {
  auto e = detect_launch_env({});
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.launcher, "none");
}

TEST(LaunchEnv, Torchrun) {
  auto e = detect_launch_env({{"RANK", "3"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "10.1.2.3"},
                              {"MASTER_PORT", "29999"}});
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 29999);
}

TEST(LaunchEnv, MpirunAndSrun) {
  auto m = detect_launch_env({{"OMPI_COMM_WORLD_RANK", "2"},
                              {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(m.launcher, "mpirun");
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.world_size, 4);
  EXPECT_EQ(m.master_addr, "127.0.0.1");  // one node: loopback
  auto s = detect_launch_env({{"SLURM_PROCID", "5"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NTASKS_PER_NODE", "4"},
                              {"MASTER_ADDR", "node01"},
                              {"SLURM_JOB_ID", "1234"}});
  EXPECT_EQ(s.launcher, "srun");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.master_addr, "node01");
  EXPECT_EQ(s.master_port, 29500 + 234);
}

// srun -n N without --ntasks-per-node: the tasks on this node come from Slurm's compressed list.
TEST(LaunchEnv, SrunTasksPerNodeList) {
  std::map<std::string, std::string> e = {{"SLURM_PROCID", "7"},  {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2),2"},
                                          {"SLURM_NODEID", "2"},  {"MASTER_ADDR", "node01"}};
  EXPECT_EQ(detect_launch_env(e).local_world_size, 2);
  e["SLURM_NODEID"] = "1";
  e["SLURM_LOCALID"] = "1";
  EXPECT_EQ(detect_launch_env(e).local_world_size, 3);
  e["SLURM_STEP_TASKS_PER_NODE"] = "2";
  e["SLURM_NODEID"] = "0";
  e["SLURM_PROCID"] = "1";
  e["SLURM_NTASKS"] = "2";
  e.erase("MASTER_ADDR");
  EXPECT_EQ(detect_launch_env(e).local_world_size, 2);  // srun -n 2 on one node
  e["SLURM_STEP_TASKS_PER_NODE"] = "2(x";
  try {
    detect_launch_env(e);
    FAIL();
  } catch (const UserError& err) {
    EXPECT_STREQ(err.what(), "launch: SLURM_STEP_TASKS_PER_NODE=2(x is not a Slurm task list");
  }
}

TEST(LaunchEnv, Errors) {
  try {
    detect_launch_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}});
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "launch: rank 4 (torchrun) is not below the world size 4");
  }
  try {
    detect_launch_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_NTASKS_PER_NODE", "4"}});
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "launch: srun with 8 ranks on several nodes needs MASTER_ADDR (the address of rank 0's node)");
  }
  try {
    detect_launch_env({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "launch: RANK=x is not an integer >= 0");
  }
}

// torchrun's elastic agent adds its own variables; scripts/run_train.sh sets none of them.
TEST(LaunchEnv, TorchrunElasticAgent) {
  auto e = detect_launch_env({{"RANK", "1"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "127.0.0.1"},
                              {"MASTER_PORT", "40000"},
                              {"TORCHELASTIC_RUN_ID", "job7"},
                              {"TORCHELASTIC_RESTART_COUNT", "2"},
                              {"TORCHELASTIC_MAX_RESTARTS", "3"},
                              {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                              {"TORCHELASTIC_ERROR_FILE", "/tmp/x/error.json"}});
  EXPECT_TRUE(e.elastic());
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.run_id, "job7");
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_EQ(e.max_restarts, 3);
  EXPECT_EQ(e.error_file, "/tmp/x/error.json");
  auto f = detect_launch_env({{"RANK", "0"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_PORT", "40000"},
                              {"TORCHELASTIC_RUN_ID", "job7"},
                              {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(f.agent_store);  // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 serves, as without torchrun
  auto g = detect_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "40000"}});
  EXPECT_FALSE(g.elastic());
  EXPECT_FALSE(g.agent_store);
  EXPECT_EQ(g.restart_count, 0);
}

// The schema torchrun's ProcessFailure reads: message.message shown, message.extraInfo.timestamp
// parsed as an integer; the line is a JSON string whatever it holds.
TEST(LaunchEnv, TorchelasticErrorFile) {
  EXPECT_EQ(torchelastic_error_json("error: rank 1: no \"data\" at C:\\x\t", 1700000000),
            "{\"message\": {\"message\": \"error: rank 1: no \\\"data\\\" at C:\\\\x\\u0009\", "
            "\"extraInfo\": {\"timestamp\": \"1700000000\"}}}");
}

// ---------------------------------------------------------------- ParallelDims
TEST(ParallelDims, ShardTakesTheRest) {
  auto d = ParallelDims::build(2, -1, 1, 1, 1, 8);
  EXPECT_EQ(d.dp_shard, 4);
  EXPECT_EQ(d.dp(), 8);
  EXPECT_EQ(d.shard_group(5), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(d.replicate_group(5), (std::vector<int64_t>{1, 5}));
}

TEST(ParallelDims, ProductMustEqualWorld) {
  try {
    ParallelDims::build(1, 3, 1, 1, 1, 4);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "parallelism: dp_replicate (1) · dp_shard (3) · cp (1) · tp (1) · pp (1) = 3 ≠ WORLD_SIZE (4)");
  }
  try {
    ParallelDims::build(1, -1, 1, 1, 2, 4);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "not supported yet: parallelism.pipeline_parallel_degree = 2 (ctitan supports: 1)");
  }
}

namespace {
std::string build_error(int64_t rep, int64_t shard, int64_t tp, int64_t world) {
  try {
    ParallelDims::build(rep, shard, 1, tp, 1, world);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

std::string tp_error(int64_t tp, const TPSplitSizes& s) {
  try {
    check_tp_divides(tp, s);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

// The mesh's coordinates of every rank, counted in torchtitan's order (tp innermost, then
// dp_shard, then dp_replicate) instead of computed from a formula: coords[rank] = {rep, shard, t}.
std::vector<std::array<int64_t, 3>> mesh_coords(int64_t rep, int64_t shard, int64_t tp) {
  std::vector<std::array<int64_t, 3>> coords;
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t s = 0; s < shard; ++s)
      for (int64_t t = 0; t < tp; ++t) coords.push_back({r, s, t});
  return coords;
}

// The ranks whose coordinates agree with `rank`'s on every axis but `free` (0 rep, 1 shard, 2 tp).
std::vector<int64_t> ranks_varying(const std::vector<std::array<int64_t, 3>>& coords, int64_t rank, int free) {
  std::vector<int64_t> g;
  for (int64_t q = 0; q < static_cast<int64_t>(coords.size()); ++q) {
    bool same = true;
    for (int axis = 0; axis < 3; ++axis)
      if (axis != free && coords[q][axis] != coords[rank][axis]) same = false;
    if (same) g.push_back(q);
  }
  return g;
}

// Each rank is in exactly one of `groups`, and that group is `own(rank)`.
template <class Own>
void expect_partition(const std::vector<std::vector<int64_t>>& groups, int64_t world, Own own, const char* what) {
  std::vector<int> seen(world, 0);
  for (const auto& g : groups)
    for (int64_t r : g) {
      ++seen[r];
      EXPECT_EQ(g, own(r)) << what << " group holding rank " << r;
    }
  for (int64_t r = 0; r < world; ++r) EXPECT_EQ(seen[r], 1) << what << ": rank " << r;
}
}  // namespace

// World 8 = dp_replicate 2 × dp_shard 2 × tp 2, by hand: rank 5 is (rep 1, shard 0, t 1).
TEST(ParallelDims, TpIsInnermost) {
  const auto d = ParallelDims::build(2, -1, 1, 2, 1, 8);
  EXPECT_EQ(d.dp_shard, 2);
  EXPECT_EQ(d.dp(), 4);
  EXPECT_EQ(d.tp_group(5), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(d.shard_group(5), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(d.replicate_group(5), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(d.dp_rank(5), 2);
  EXPECT_EQ(d.tp_groups(), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
}

// Every rank's groups on several meshes against the coordinates counted in mesh_coords.
TEST(ParallelDims, GroupsMatchTheMeshCoordinates) {
  const std::vector<std::array<int64_t, 3>> shapes = {{2, 2, 2}, {1, 2, 4}, {2, 1, 2}, {1, 4, 2},
                                                      {3, 2, 2}, {1, 1, 4}, {2, 3, 1}};
  for (const auto& [rep, shard, tp] : shapes) {
    const int64_t world = rep * shard * tp;
    const auto d = ParallelDims::build(rep, shard, 1, tp, 1, world);
    const auto coords = mesh_coords(rep, shard, tp);
    const std::string mesh = std::to_string(rep) + "x" + std::to_string(shard) + "x" + std::to_string(tp);
    for (int64_t r = 0; r < world; ++r) {
      EXPECT_EQ(d.replicate_index(r), coords[r][0]) << mesh << " rank " << r;
      EXPECT_EQ(d.shard_index(r), coords[r][1]) << mesh << " rank " << r;
      EXPECT_EQ(d.tp_index(r), coords[r][2]) << mesh << " rank " << r;
      EXPECT_EQ(d.dp_rank(r), coords[r][0] * shard + coords[r][1]) << mesh << " rank " << r;
      EXPECT_EQ(d.replicate_group(r), ranks_varying(coords, r, 0)) << mesh << " rank " << r;
      EXPECT_EQ(d.shard_group(r), ranks_varying(coords, r, 1)) << mesh << " rank " << r;
      EXPECT_EQ(d.tp_group(r), ranks_varying(coords, r, 2)) << mesh << " rank " << r;
    }
    expect_partition(
        d.shard_groups(), world, [&](int64_t r) { return d.shard_group(r); }, "shard");
    expect_partition(
        d.replicate_groups(), world, [&](int64_t r) { return d.replicate_group(r); }, "replicate");
    expect_partition(
        d.tp_groups(), world, [&](int64_t r) { return d.tp_group(r); }, "tp");
  }
}

// tp = 1: the groups data parallelism has always had (shard groups contiguous runs of dp_shard
// ranks, replicate groups strided by dp_shard), created in the same order (shard group g:
// replicate index g's; replicate group g: shard index g's).
TEST(ParallelDims, TpOneKeepsTheDataParallelGroups) {
  for (const auto& [rep, world] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {1, 4}, {2, 4}, {2, 8}, {4, 8}, {3, 6}}) {
    const auto d = ParallelDims::build(rep, -1, 1, 1, 1, world);
    const int64_t S = world / rep;
    ASSERT_EQ(d.dp_shard, S);
    for (int64_t r = 0; r < world; ++r) {
      std::vector<int64_t> shard, replicas;
      for (int64_t q = r - r % S; q < r - r % S + S; ++q) shard.push_back(q);
      for (int64_t q = r % S; q < world; q += S) replicas.push_back(q);
      EXPECT_EQ(d.shard_group(r), shard) << rep << "x" << S << " rank " << r;
      EXPECT_EQ(d.replicate_group(r), replicas) << rep << "x" << S << " rank " << r;
      EXPECT_EQ(d.tp_group(r), std::vector<int64_t>{r});
      EXPECT_EQ(d.dp_rank(r), r);
    }
    ASSERT_EQ(d.shard_groups().size(), static_cast<size_t>(rep));
    for (int64_t g = 0; g < rep; ++g) EXPECT_EQ(d.shard_groups()[g], d.shard_group(g * S));
    ASSERT_EQ(d.replicate_groups().size(), static_cast<size_t>(S));
    for (int64_t g = 0; g < S; ++g) EXPECT_EQ(d.replicate_groups()[g], d.replicate_group(g));
  }
}

TEST(ParallelDims, TpDegreesThatDoNotFitTheWorldAreRefusedNamingTheNumbers) {
  EXPECT_EQ(build_error(1, -1, 4, 8), "no error");
  EXPECT_EQ(build_error(3, -1, 2, 8),
            "parallelism: WORLD_SIZE (8) is not divisible by data_parallel_replicate_degree (3) · "
            "tensor_parallel_degree (2) = 6, so data_parallel_shard_degree = -1 cannot take the rest");
  EXPECT_EQ(build_error(1, -1, 2, 1),
            "parallelism: WORLD_SIZE (1) is not divisible by data_parallel_replicate_degree (1) · "
            "tensor_parallel_degree (2) = 2, so data_parallel_shard_degree = -1 cannot take the rest");
  EXPECT_EQ(build_error(1, 3, 2, 8),
            "parallelism: dp_replicate (1) · dp_shard (3) · cp (1) · tp (2) · pp (1) = 6 ≠ WORLD_SIZE (8)");
  EXPECT_EQ(build_error(2, 2, 4, 8),
            "parallelism: dp_replicate (2) · dp_shard (2) · cp (1) · tp (4) · pp (1) = 16 ≠ WORLD_SIZE (8)");
  // tp = 1: the line it has always been.
  EXPECT_EQ(build_error(3, -1, 1, 8),
            "parallelism: WORLD_SIZE (8) is not divisible by data_parallel_replicate_degree (3), so "
            "data_parallel_shard_degree = -1 cannot take the rest");
}

TEST(ParallelDims, TpMustDivideHeadsKvHeadsFfnVocabAndSequence) {
  TPSplitSizes ok{"llama3 x", 32, 8, 14336, 128256};
  ok.seq_len = 8192;
  ok.validation_seq_len = 4096;
  EXPECT_EQ(tp_error(8, ok), "no error");
  const std::string why =
      "; torchtitan requires tp to divide the attention heads, the kv heads (split over the tp ranks, never "
      "replicated), the FFN hidden width, the vocabulary and the sequence (sequence parallelism)";
  EXPECT_EQ(tp_error(3, ok), "parallelism: tensor_parallel_degree (3) does not divide llama3 x's n_heads (32)" + why);
  EXPECT_EQ(tp_error(16, ok),
            "parallelism: tensor_parallel_degree (16) does not divide llama3 x's n_kv_heads (8)" + why);
  TPSplitSizes ffn = ok;
  ffn.ffn_hidden = 14340;
  EXPECT_EQ(tp_error(8, ffn),
            "parallelism: tensor_parallel_degree (8) does not divide llama3 x's FFN hidden width (14340)" + why);
  TPSplitSizes vocab = ok;
  vocab.vocab = 128257;
  EXPECT_EQ(tp_error(2, vocab),
            "parallelism: tensor_parallel_degree (2) does not divide llama3 x's vocab_size (128257)" + why);
  // Sequence parallelism splits the residual stream over the sequence: training's and validation's.
  TPSplitSizes seq = ok;
  seq.seq_len = 8190;
  EXPECT_EQ(tp_error(4, seq), "parallelism: tensor_parallel_degree (4) does not divide training.seq_len (8190)" + why);
  EXPECT_EQ(tp_error(2, seq), "no error");
  TPSplitSizes validation = ok;
  validation.validation_seq_len = 4097;
  EXPECT_EQ(tp_error(2, validation),
            "parallelism: tensor_parallel_degree (2) does not divide validation.seq_len (4097)" + why);
  validation.validation_seq_len = 0;  // no validation: nothing to split
  EXPECT_EQ(tp_error(8, validation), "no error");
  // The first that fails is named: the heads before the sequence.
  TPSplitSizes both = seq;
  both.n_heads = 30;
  EXPECT_EQ(tp_error(4, both), "parallelism: tensor_parallel_degree (4) does not divide llama3 x's n_heads (30)" + why);
}

// shard_tp_groups: the dp_shard × tp ranks of each replicate index, contiguous; by hand for
// 2 × 2 × 2, then on several meshes against the coordinates counted in mesh_coords: one group
// per replicate index, holding exactly that index's ranks, the union of its shard groups and of
// its tp groups.
TEST(ParallelDims, ShardTpGroupsAreEachReplicateIndexsRanks) {
  EXPECT_EQ(ParallelDims::build(2, 2, 1, 2, 1, 8).shard_tp_groups(),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(ParallelDims::build(1, 2, 1, 2, 1, 4).shard_tp_groups(), (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}}));
  EXPECT_EQ(ParallelDims::build(3, 1, 1, 2, 1, 6).shard_tp_groups(),
            (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}, {4, 5}}));
  const std::vector<std::array<int64_t, 3>> shapes = {{2, 2, 2}, {1, 2, 4}, {2, 1, 2}, {1, 4, 2},
                                                      {3, 2, 2}, {1, 1, 4}, {2, 3, 1}, {4, 1, 1}};
  for (const auto& [rep, shard, tp] : shapes) {
    const int64_t world = rep * shard * tp;
    const auto d = ParallelDims::build(rep, shard, 1, tp, 1, world);
    const auto coords = mesh_coords(rep, shard, tp);
    const std::string mesh = std::to_string(rep) + "x" + std::to_string(shard) + "x" + std::to_string(tp);
    const auto groups = d.shard_tp_groups();
    ASSERT_EQ(groups.size(), static_cast<size_t>(rep)) << mesh;
    for (int64_t g = 0; g < rep; ++g) {
      std::vector<int64_t> want;
      for (int64_t r = 0; r < world; ++r)
        if (coords[r][0] == g) want.push_back(r);
      EXPECT_EQ(groups[g], want) << mesh << " replicate index " << g;
      ASSERT_EQ(groups[g].size(), static_cast<size_t>(shard * tp)) << mesh;
      for (size_t k = 1; k < groups[g].size(); ++k) EXPECT_EQ(groups[g][k], groups[g][k - 1] + 1) << mesh;
      std::vector<int64_t> shards, tps;
      for (int64_t r : groups[g]) {
        for (int64_t q : d.shard_group(r)) shards.push_back(q);
        for (int64_t q : d.tp_group(r)) tps.push_back(q);
      }
      for (auto* u : {&shards, &tps}) {
        std::sort(u->begin(), u->end());
        u->erase(std::unique(u->begin(), u->end()), u->end());
      }
      EXPECT_EQ(shards, groups[g]) << mesh << ": the shard groups of replicate index " << g;
      EXPECT_EQ(tps, groups[g]) << mesh << ": the tp groups of replicate index " << g;
    }
    // tp = 1: the shard groups themselves.
    if (tp == 1) {
      EXPECT_EQ(groups, d.shard_groups()) << mesh;
    }
  }
}

// The log's mesh: the degrees, then every group of each kind (here written out by hand).
TEST(ParallelDims, DescribeListsEveryGroup) {
  const auto lines = ParallelDims::build(2, 2, 1, 2, 1, 8).describe();
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0],
            "mesh [dp_replicate, dp_shard, tp] = [2, 2, 2] over 8 ranks, rank = (replicate · dp_shard + shard) · tp + "
            "tp_index");
  EXPECT_EQ(lines[1], "mesh tp groups: [0, 1] [2, 3] [4, 5] [6, 7]");
  EXPECT_EQ(lines[2], "mesh dp_shard groups: [0, 2] [1, 3] [4, 6] [5, 7]");
  EXPECT_EQ(lines[3], "mesh dp_replicate groups: [0, 4] [1, 5] [2, 6] [3, 7]");
}

// ---------------------------------------------------------------- collectives (real ranks)
namespace {
std::unique_ptr<Distributed> init_from_env(int timeout_s = 30) {
  auto env = detect_launch_env(environment_map());
  return init_distributed(env, std::chrono::seconds(timeout_s));
}
}  // namespace

// Every rank r contributes a distinct tensor; reduce-scatter must equal the rank's chunk of
// an all-reduce of the same tensors, and all-gather the concatenation of all of them.
CTITAN_CHILD(collectives) {
  auto d = init_from_env();
  auto& w = *d->world;
  const int64_t N = w.size(), r = w.rank();
  for (int64_t S : {1, 7, 1000}) {
    torch::manual_seed(100 + r);
    auto input = torch::randn({N * S});
    auto reference = input.clone();
    w.all_reduce_sum(reference, "ref").wait();
    auto out = torch::empty({S});
    w.reduce_scatter_sum(input, out, "rs").wait();
    auto expected = reference.narrow(0, r * S, S);
    if (!torch::allclose(out, expected, 1e-5, 1e-6)) {
      std::cerr << "reduce_scatter mismatch S=" << S << "\n";
      return 1;
    }
    auto local = torch::full({S}, static_cast<float>(r + 1)) + torch::arange(S).to(torch::kFloat);
    auto gathered = torch::empty({N * S});
    w.all_gather_flat(local, gathered, "ag").wait();
    for (int64_t q = 0; q < N; ++q) {
      auto want = torch::full({S}, static_cast<float>(q + 1)) + torch::arange(S).to(torch::kFloat);
      if (!torch::equal(gathered.narrow(0, q * S, S), want)) {
        std::cerr << "all_gather mismatch S=" << S << " q=" << q << "\n";
        return 2;
      }
    }
  }
  // The backend's own reduce-scatter (what NCCL groups use) gives what alltoall + sum gives,
  // here over a second Gloo group of the same ranks.
  {
    auto store = c10::make_intrusive<c10d::PrefixStore>("native_rs/", d->store);
    auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    Comm native(c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(r), static_cast<int>(N), opts),
                "native_rs", r, CommKind::Gloo, /*native_reduce_scatter=*/true);
    for (int64_t S : {1, 7, 1000}) {
      torch::manual_seed(200 + r);
      auto input = torch::randn({N * S});
      auto a = torch::empty({S}), b = torch::empty({S});
      w.reduce_scatter_sum(input, a, "rs_alltoall").wait();
      native.reduce_scatter_sum(input, b, "rs_native").wait();
      if (!torch::allclose(a, b, 1e-5, 1e-6) || b.abs().sum().item<float>() == 0) {
        std::cerr << "native reduce_scatter differs from alltoall + sum, S=" << S << "\n";
        return 5;
      }
    }
  }
  // bf16 all-gather (FSDP gathers in the compute dtype).
  auto lb = torch::full({5}, static_cast<float>(r)).to(torch::kBFloat16);
  auto gb = torch::empty({N * 5}, torch::kBFloat16);
  w.all_gather_flat(lb, gb, "ag_bf16").wait();
  if (gb.to(torch::kFloat).view({N, 5}).select(1, 0).sum().item<float>() != N * (N - 1) / 2.0f) return 3;
  // Sub-groups (HSDP layout 2 × N/2).
  if (N % 2 == 0) {
    auto dims = ParallelDims::build(2, -1, 1, 1, 1, N);
    std::shared_ptr<Comm> shard, rep;
    for (int64_t g = 0; g < 2; ++g) {
      auto s = d->new_group(dims.shard_group(g * dims.dp_shard), "shard" + std::to_string(g));
      if (s) shard = s;
    }
    for (int64_t g = 0; g < dims.dp_shard; ++g) {
      auto s = d->new_group(dims.replicate_group(g), "rep" + std::to_string(g));
      if (s) rep = s;
    }
    auto t = torch::full({1}, static_cast<float>(r));
    shard->all_reduce_sum(t, "shard").wait();
    const int64_t base = dims.replicate_index(r) * dims.dp_shard;
    float want = 0;
    for (int64_t q = base; q < base + dims.dp_shard; ++q) want += q;
    if (t.item<float>() != want) return 4;
  }
  w.barrier("end");
  return 0;
}

TEST(Collectives, MatchAllReduceOn4Ranks) { EXPECT_TRUE(all_ok(spawn_ranks("collectives", 4))); }
TEST(Collectives, MatchAllReduceOn3Ranks) { EXPECT_TRUE(all_ok(spawn_ranks("collectives", 3))); }

// Rank 1 dies before the collective: the others must fail with a message naming the
// collective instead of hanging.
CTITAN_CHILD(dead_rank) {
  auto d = init_from_env();
  CommContext::set_timeout(std::chrono::seconds(5));
  // Every rank has made its groups before rank 1 dies: a rank still in Gloo's connection
  // handshake with it failed there ("connectFullMesh failed: Connection closed by peer", seen
  // once in CI), not in the collective under test.
  d->world->barrier("groups made");
  CommContext::set_step(7);
  if (d->world->rank() == 1) std::_Exit(3);
  auto t = torch::ones({1000});
  auto out = torch::empty({4000});
  try {
    d->world->all_gather_flat(t, out, "layers.3").wait();
  } catch (const RuntimeFailure& e) {
    std::cerr << "ERROR: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

TEST(Collectives, DeadRankIsAnErrorNotAHang) {
  const auto t0 = std::chrono::steady_clock::now();
  auto rs = spawn_ranks("dead_rank", 4, {}, 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 40.0);
  EXPECT_EQ(rs[1].exit_code, 3);
  for (int r : {0, 2, 3}) {
    EXPECT_FALSE(rs[r].timed_out);
    EXPECT_EQ(rs[r].exit_code, 1) << rs[r].output;
    EXPECT_NE(rs[r].output.find("all_gather(layers.3) failed at step 7"), std::string::npos) << rs[r].output;
    EXPECT_NE(rs[r].output.find("rank " + std::to_string(r)), std::string::npos) << rs[r].output;
  }
}

// Rank 1 lives on but never enters the collective: the others time out with an error.
CTITAN_CHILD(stuck_rank) {
  auto d = init_from_env();
  CommContext::set_timeout(std::chrono::seconds(3));
  CommContext::set_step(11);
  if (d->world->rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(6));
    return 0;
  }
  auto t = torch::ones({4});
  try {
    d->world->all_reduce_sum(t, "grad_norm").wait();
  } catch (const RuntimeFailure& e) {
    std::cerr << "ERROR: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

TEST(Collectives, StuckRankTimesOutWithAnError) {
  auto rs = spawn_ranks("stuck_rank", 3, {}, 60);
  for (int r : {0, 2}) {
    EXPECT_EQ(rs[r].exit_code, 1) << rs[r].output;
    EXPECT_NE(rs[r].output.find("all_reduce(grad_norm) failed at step 11: timed out after 3 s"), std::string::npos)
        << rs[r].output;
  }
}

// torchrun's agent store outlives an attempt of the workers, keys and all. Two attempts of
// 2 ranks join one store served by this process (as the agent would); in the second, rank 0
// comes late, so rank 1 first finds the first attempt's leader token and must not follow it.
CTITAN_CHILD(agent_store) {
  if (std::getenv("CTITAN_TEST_RANK0_LATE") && ctitan::testing::env_int("RANK") == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto d = init_from_env(20);
  auto t = torch::full({1}, static_cast<float>(d->world->rank() + 1));
  d->world->all_reduce_sum(t, "sum").wait();
  if (t.item<float>() != 3.0f) return 1;
  d->world->barrier("end");
  return 0;
}

TEST(Collectives, AgentStoreNamespacePerAttempt) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const std::map<std::string, std::string> env = {{"MASTER_PORT", std::to_string(agent->getPort())},
                                                  {"TORCHELASTIC_RUN_ID", "t"},
                                                  {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  EXPECT_TRUE(all_ok(spawn_ranks("agent_store", 2, env, 60)));
  const auto first = agent->get("ctitan/leader");
  auto late = env;
  late["CTITAN_TEST_RANK0_LATE"] = "1";
  late["TORCHELASTIC_RESTART_COUNT"] = "1";
  EXPECT_TRUE(all_ok(spawn_ranks("agent_store", 2, late, 60)));
  EXPECT_NE(agent->get("ctitan/leader"), first) << "the second attempt has a namespace of its own";
}

CTITAN_MULTIPROCESS_MAIN()
