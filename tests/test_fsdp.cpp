// FSDP against the plain single-process model: same global batch, same seed, 1–4 real
// ranks. Losses at every step and the gathered final parameters must match the
// reference trained here without FSDP (independent code path: full parameters, plain
// autograd, plain AdamW).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>

#include "components/memory_estimate.h"
#include "components/optimizer.h"
#include "models/init.h"
#include "models/llama/model.h"
#include "models/mixtral/model.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/parallel_dims.h"
#include "tests/multiprocess.h"

using namespace ctitan;
using ctitan::testing::all_ok;
using ctitan::testing::spawn_ranks;

namespace {

constexpr int64_t kSteps = 10, kGlobalBatch = 12, kSeq = 32;

// The debug model itself (dim 256, 6 layers, 16 heads, vocab 2048: 2048 rows over 3 ranks
// are 683, 683, 682 + 1 padding row), on short sequences.
llama::TransformerModelArgs tiny_args() {
  auto a = llama::llama3_flavor("debugmodel");
  a.max_seq_len = kSeq;
  return a;
}

// The global batch of a step: identical on every rank, which takes its own rows.
torch::Tensor global_batch(int64_t step) {
  auto g = at::detail::createCPUGenerator(1000 + step);
  return torch::randint(0, 2048, {kGlobalBatch, kSeq + 1}, g, torch::kInt64);
}

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

// world == nullptr: the reference (no FSDP, whole batch in one process).
// replicate > 1: HSDP, `replicate` groups of N / replicate ranks each holding the shards.
// rs_group: reduce-scatters over a second group of the shard ranks (what train does on GPUs).
RunResult train(Comm* world, const std::string& param_dtype, bool prefetch, const std::string& reshard,
                Distributed* dist = nullptr, int64_t replicate = 1, bool rs_group = false) {
  torch::manual_seed(7);
  llama::Transformer model(tiny_args());
  model->init_weights();
  const int64_t N = world ? world->size() : 1, r = world ? world->rank() : 0;
  std::shared_ptr<FSDP> fsdp;
  std::vector<torch::Tensor> params;
  if (world) {
    std::shared_ptr<Comm> shard(world, [](Comm*) {}), rep, rs;
    const auto dims = ParallelDims::build(replicate, -1, 1, 1, 1, N);
    if (replicate > 1) {
      for (int64_t g = 0; g < replicate; ++g)
        if (auto c = dist->new_group(dims.shard_group(g * dims.dp_shard), "shard" + std::to_string(g))) shard = c;
      for (int64_t g = 0; g < dims.dp_shard; ++g)
        if (auto c = dist->new_group(dims.replicate_group(g), "rep" + std::to_string(g))) rep = c;
    }
    if (rs_group)
      for (int64_t g = 0; g < replicate; ++g)
        if (auto c = dist->new_group(dims.shard_group(g * dims.dp_shard), "shard_rs" + std::to_string(g))) rs = c;
    auto opts = fsdp_options(reshard, param_dtype, "float32");
    opts.prefetch = prefetch;
    fsdp = std::make_shared<FSDP>(model->units(), shard, rep, opts);
    if (rs) fsdp->use_reduce_scatter_group(rs);
    model->set_unit_wrapper(fsdp->wrapper());
    params = fsdp->sharded_parameters();
  } else {
    params = model->parameters();
  }
  auto opt = build_optimizer(params, OptimizerSpec{"AdamW", 8e-4, 0.9, 0.95, 1e-8, 0.1});
  RunResult out;
  for (int64_t step = 1; step <= kSteps; ++step) {
    opt->zero_grad();
    auto batch = global_batch(step).narrow(0, r * kGlobalBatch / N, kGlobalBatch / N);
    auto inputs = batch.narrow(1, 0, kSeq), labels = batch.narrow(1, 1, kSeq);
    auto logits = model->forward(inputs).to(torch::kFloat);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
    loss.backward();
    auto reported = loss.detach().clone();
    SumOverRanks reduce;
    if (world) {
      fsdp->finish_backward();
      world->all_reduce_sum(reported, "loss").wait();
      reported.div_(static_cast<double>(N));
      // Sum of squares over the shard group only: replicas hold identical shards.
      Comm* shard_group = fsdp->shard_size() == N ? world : nullptr;
      reduce = [world, shard_group, replicate](torch::Tensor& t) {
        if (shard_group) {
          shard_group->all_reduce_sum(t, "grad_norm").wait();
          return;
        }
        world->all_reduce_sum(t, "grad_norm").wait();  // every replica adds the same value
        t.div_(static_cast<double>(replicate));
      };
    }
    clip_grad_norm(params, 1.0, reduce);
    opt->step();
    out.losses.push_back(reported.item<double>());
  }
  if (world) {
    out.params = fsdp->gather_full_parameters();  // over the shard group
  } else {
    for (auto& kv : model->named_parameters()) out.params[kv.key()] = kv.value().detach().clone();
  }
  return out;
}

void save_result(const RunResult& r, const std::string& path) {
  std::vector<torch::Tensor> ts{torch::tensor(r.losses, torch::kFloat64)};
  for (auto& [k, v] : r.params) ts.push_back(v);
  torch::save(ts, path);
}

std::string result_path() { return std::string(std::getenv("CTITAN_TEST_OUT")); }

}  // namespace

CTITAN_CHILD(fsdp_train) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  const std::string dtype = std::getenv("FSDP_DTYPE");
  const bool prefetch = std::string(std::getenv("FSDP_PREFETCH")) == "1";
  const char* rep = std::getenv("FSDP_REPLICATE");
  const char* rs = std::getenv("FSDP_RS_GROUP");
  auto res = train(d->world.get(), dtype, prefetch, std::getenv("FSDP_RESHARD"), d.get(), rep ? std::atoi(rep) : 1,
                   rs && std::string(rs) == "1");
  if (d->world->rank() == 0) save_result(res, result_path());
  d->world->barrier("done");
  return 0;
}

// (ranks, reshard_after_forward, prefetch, replicate degree (HSDP when > 1), reduce-scatters
// over a second group of the shard ranks)
class FSDPParity : public ::testing::TestWithParam<std::tuple<int, std::string, bool, int, bool>> {};

TEST_P(FSDPParity, LossesAndFinalParametersMatchOneProcess) {
  const auto [n, reshard, prefetch, replicate, rs_group] = GetParam();
  static RunResult reference = train(nullptr, "float32", true, "default");
  const std::string out = "/tmp/ctitan_fsdp_" + std::to_string(getpid()) + ".pt";
  auto rs = spawn_ranks("fsdp_train", n,
                        {{"CTITAN_TEST_OUT", out},
                         {"FSDP_DTYPE", "float32"},
                         {"FSDP_PREFETCH", prefetch ? "1" : "0"},
                         {"FSDP_RESHARD", reshard},
                         {"FSDP_REPLICATE", std::to_string(replicate)},
                         {"FSDP_RS_GROUP", rs_group ? "1" : "0"}});
  ASSERT_TRUE(all_ok(rs));
  std::vector<torch::Tensor> ts;
  torch::load(ts, out);
  std::remove(out.c_str());
  auto losses = ts[0];
  ASSERT_EQ(losses.numel(), kSteps);
  for (int64_t s = 0; s < kSteps; ++s) {
    const double got = losses[s].item<double>(), want = reference.losses[s];
    EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "step " << s + 1 << " on " << n << " ranks";
  }
  size_t i = 1;
  double worst_rel = 0, worst_abs = 0;
  for (auto& [name, want] : reference.params) {
    ASSERT_LT(i, ts.size());
    auto got = ts[i++];
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    // Relative to the tensor's norm: Adam turns last-bit differences in near-zero
    // gradients (the summation order differs with the batch split) into small absolute
    // differences of single elements.
    const double rel = ((got - want).norm() / want.norm()).item<double>();
    const double abs_max = (got - want).abs().max().item<double>();
    EXPECT_LE(rel, 1e-5) << name << " relative difference " << rel << " (max abs " << abs_max << ")";
    worst_rel = std::max(worst_rel, rel);
    worst_abs = std::max(worst_abs, abs_max);
  }
  std::printf("%d ranks: worst parameter difference %.3g relative, %.3g absolute\n", n, worst_rel, worst_abs);
  // Training moved the parameters (a parity of untouched weights would prove nothing).
  EXPECT_LT(reference.losses.back(), reference.losses.front());
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, FSDPParity,
    ::testing::Values(std::make_tuple(1, "default", true, 1, false), std::make_tuple(2, "default", true, 1, true),
                      std::make_tuple(3, "always", false, 1, false), std::make_tuple(4, "never", true, 1, false),
                      // HSDP: 2 replicas × 2 shards (reduce-scatters on a second group, as on GPUs)
                      std::make_tuple(4, "default", true, 2, true)));

TEST(FSDP, Bf16ParametersFollowTheFp32Curve) {
  static RunResult reference = train(nullptr, "float32", true, "default");
  const std::string out = "/tmp/ctitan_fsdp_bf16_" + std::to_string(getpid()) + ".pt";
  auto rs = spawn_ranks(
      "fsdp_train", 2,
      {{"CTITAN_TEST_OUT", out}, {"FSDP_DTYPE", "bfloat16"}, {"FSDP_PREFETCH", "1"}, {"FSDP_RESHARD", "default"}});
  ASSERT_TRUE(all_ok(rs));
  std::vector<torch::Tensor> ts;
  torch::load(ts, out);
  std::remove(out.c_str());
  for (int64_t s = 0; s < kSteps; ++s) {
    const double got = ts[0][s].item<double>(), want = reference.losses[s];
    EXPECT_LE(std::abs(got - want), 1e-2 * std::abs(want)) << "step " << s + 1;
    EXPECT_NE(got, want);  // bf16 compute really happened
  }
}

// One process, bf16 compute over a shard group of one (what train runs for mixed precision on
// one CPU with native bf16 or one GPU), trained as the trainer does: the norm and clip of
// grad_norm_for_step inside ctitan's AdamW (step_unless). keep: FSDPOptions::keep_compute_grads.
struct OneRankRun {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
  std::vector<int64_t> grad_bytes;       // after each step's backward
  std::set<at::ScalarType> grad_dtypes;  // of the shards' gradients, every step
  int64_t numel = 0;                     // of the shards
};

OneRankRun train_one_rank(bool keep, int64_t accum) {
  torch::manual_seed(7);
  auto args = tiny_args();
  args.n_layers = 2;  // bf16 matmuls are emulated on CPUs without native bf16: keep it small
  llama::Transformer model(args);
  model->init_weights();
  auto opts = fsdp_options("default", "bfloat16", "float32");
  opts.keep_compute_grads = keep;
  FSDP fsdp(model->units(), Comm::single("local"), nullptr, opts);
  model->set_unit_wrapper(fsdp.wrapper());
  const auto params = fsdp.sharded_parameters();
  auto opt = build_optimizer(params, OptimizerSpec{"AdamW", 8e-4, 0.9, 0.95, 1e-8, 0.1});
  OneRankRun out;
  for (const auto& p : params) out.numel += p.numel();
  for (int64_t step = 1; step <= 4; ++step) {
    opt->zero_grad();
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      auto batch = global_batch(step).narrow(0, micro * 4 / accum, 4 / accum);
      auto logits = model->forward(batch.narrow(1, 0, kSeq)).to(torch::kFloat);
      auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                       batch.narrow(1, 1, kSeq).reshape({-1})) /
                  static_cast<double>(accum);
      loss.backward();
      loss_sum += loss.item<double>();
    }
    fsdp.finish_backward();
    out.grad_bytes.push_back(fsdp.sharded_grad_bytes());
    for (const auto& p : params) out.grad_dtypes.insert(p.grad().scalar_type());
    const GradNorm gn = grad_norm_for_step(params, 0.5);  // clips on some steps
    step_unless(*opt, torch::tensor(false), gn.grad_scale, gn.cpu_grad_coef);
    out.losses.push_back(loss_sum);
  }
  out.params = fsdp.gather_full_parameters();
  return out;
}

// Keeping the bf16 gradients (no float32 copy of them) changes no bit of training: the norm and
// AdamW widen them exactly as the cast did. With one micro-batch the shards' gradients stay
// bf16 (half the bytes); with two the second widens the first and adds in float32, as before.
// The start-up memory estimate counts those bytes.
TEST(FSDP, OneRankKeepsBf16GradientsAndTrainsBitwiseAsWithTheirCast) {
  for (const int64_t accum : {1, 2}) {
    const OneRankRun cast = train_one_rank(false, accum), kept = train_one_rank(true, accum);
    ASSERT_EQ(kept.losses.size(), cast.losses.size());
    for (size_t s = 0; s < cast.losses.size(); ++s)
      EXPECT_EQ(kept.losses[s], cast.losses[s]) << "step " << s + 1 << ", " << accum << " micro-batches";
    for (const auto& [name, want] : cast.params)
      EXPECT_TRUE(torch::equal(kept.params.at(name), want)) << name << ", " << accum << " micro-batches";
    EXPECT_EQ(cast.grad_dtypes, std::set<at::ScalarType>{at::kFloat});
    if (accum == 1) {
      EXPECT_EQ(kept.grad_dtypes, std::set<at::ScalarType>{at::kBFloat16});
      for (size_t s = 0; s < cast.grad_bytes.size(); ++s) EXPECT_EQ(2 * kept.grad_bytes[s], cast.grad_bytes[s]);
    } else {
      EXPECT_EQ(kept.grad_dtypes, std::set<at::ScalarType>{at::kFloat});
    }
    // The start-up memory estimate's gradients term is what the shards hold (train.cpp marks a
    // run whose one rank keeps bf16 gradients: one micro-batch).
    MemoryModel mm;
    mm.params = cast.numel;
    MemoryRun run;
    run.fsdp = true;
    run.compute_bytes = 2;
    EXPECT_EQ(estimate_memory(mm, run, 0).grads, static_cast<double>(cast.grad_bytes.back()));
    run.compute_dtype_grads = accum == 1;
    EXPECT_EQ(estimate_memory(mm, run, 0).grads, static_cast<double>(kept.grad_bytes.back())) << accum;
    EXPECT_LT(cast.losses.back(), cast.losses.front());  // it trained
  }
}

// vocab 2048 over 3 ranks: chunks of 683 rows; rank 2 holds 682 real rows + 1 zero row.
CTITAN_CHILD(shard_layout) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  torch::manual_seed(3);
  llama::Transformer model(tiny_args());
  model->init_weights();
  auto full = model->tok_embeddings->weight.detach().clone();  // [2048, D]
  const int64_t D = full.size(1);
  std::shared_ptr<Comm> shard(d->world.get(), [](Comm*) {});
  FSDP fsdp(model->units(), shard, nullptr, fsdp_options("default", "float32", "float32"));
  const int64_t r = d->world->rank();
  auto [b, e] = fsdp.local_rows("tok_embeddings.weight");
  auto sh = fsdp.local_shard("tok_embeddings.weight");
  const int64_t want_b = 683 * r, want_e = std::min<int64_t>(2048, 683 * (r + 1));
  if (b != want_b || e != want_e) return 1;
  if (sh.size(0) != 683 || sh.size(1) != D) return 2;
  if (!torch::equal(sh.narrow(0, 0, e - b), full.narrow(0, b, e - b))) return 3;
  if (r == 2 && !torch::equal(sh[682], torch::zeros({D}))) return 4;
  // The model's own tensor no longer holds data: its storage was released.
  if (model->tok_embeddings->weight.storage().nbytes() != 0) return 5;
  // Sharded bytes: a third of the fp32 parameters, plus at most one padding row each.
  int64_t total = 0, max_pad = 0;
  for (auto& u : model->units())
    for (auto& [n, t] : u.params) {
      total += t.numel() * 4;
      max_pad += (t.numel() / t.size(0)) * 4;
    }
  if (fsdp.sharded_param_bytes() < total / 3 || fsdp.sharded_param_bytes() > total / 3 + max_pad) return 6;
  auto gathered = fsdp.gather_full_parameters();
  if (!torch::equal(gathered.at("tok_embeddings.weight"), full)) return 7;
  return 0;
}

TEST(FSDP, ShardsAreDim0SlicesPaddedWhenUneven) { EXPECT_TRUE(all_ok(spawn_ranks("shard_layout", 3))); }

// Per-rank initialisation: a model built without storage, each unit initialised by FSDP in
// turn, holds bitwise the rows a full initialisation gives (same seed), for both families;
// the generator ends in the same state (the same draws were made); the model's parameters
// never hold more than one unit at a time.
template <typename Model, typename Args>
int per_unit_init_matches_full_init(const Args& args, Comm& world) {
  std::shared_ptr<Comm> shard(&world, [](Comm*) {});
  torch::manual_seed(11);
  Model full(args);
  full->init_weights();
  const auto rng_after_full = at::detail::getDefaultCPUGenerator().get_state();
  std::map<std::string, torch::Tensor> want;
  for (auto& kv : full->named_parameters()) want[kv.key()] = kv.value().detach().clone();

  torch::manual_seed(11);
  std::optional<DeferredParameters> deferred;
  deferred.emplace();
  Model model(args);
  deferred.reset();
  for (auto& kv : model->named_parameters())
    if (kv.value().storage().nbytes() != 0) return 10;  // built without storage
  int64_t most_bytes = 0;
  const auto units = model->units();
  FSDP fsdp(units, shard, nullptr, fsdp_options("default", "float32", "float32"), [&](size_t i) {
    int64_t bytes = 0;
    for (auto& kv : model->named_parameters()) bytes += static_cast<int64_t>(kv.value().storage().nbytes());
    most_bytes = std::max(most_bytes, bytes);
    model->init_unit(i);
  });
  int64_t largest_unit = 0;
  for (const auto& u : units) {
    int64_t b = 0;
    for (const auto& [n, t] : u.params) b += t.numel() * 4;
    largest_unit = std::max(largest_unit, b);
  }
  if (most_bytes > largest_unit) return 11;  // never more than the unit being initialised
  if (!torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_after_full)) return 12;
  for (const auto& fqn : fsdp.fqns()) {
    auto [b, e] = fsdp.local_rows(fqn);
    auto sh = fsdp.local_shard(fqn);
    if (e > b && !torch::equal(sh.narrow(0, 0, e - b), want.at(fqn).narrow(0, b, e - b))) {
      std::cerr << "rank " << world.rank() << ": " << fqn << " rows [" << b << ", " << e << ") differ\n";
      return 13;
    }
    if (sh.size(0) > e - b && !torch::equal(sh.narrow(0, e - b, sh.size(0) - (e - b)),
                                            torch::zeros_like(sh.narrow(0, e - b, sh.size(0) - (e - b)))))
      return 14;  // padding rows stay zero
  }
  return 0;
}

CTITAN_CHILD(per_unit_init) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  if (int rc = per_unit_init_matches_full_init<llama::Transformer>(tiny_args(), *d->world)) return rc;
  auto m = mixtral::mixtral_flavor("debugmodel");
  m.max_seq_len = kSeq;
  if (int rc = per_unit_init_matches_full_init<mixtral::Transformer>(m, *d->world)) return 20 + rc;
  d->world->barrier("done");
  return 0;
}

class PerUnitInit : public ::testing::TestWithParam<int> {};
TEST_P(PerUnitInit, RowsEqualFullInitLlamaAndMixtral) {
  auto rs = spawn_ranks("per_unit_init", GetParam());
  for (size_t r = 0; r < rs.size(); ++r) EXPECT_EQ(rs[r].exit_code, 0) << "rank " << r << ": " << rs[r].output;
}
INSTANTIATE_TEST_SUITE_P(Ranks, PerUnitInit, ::testing::Values(1, 2, 3));

CTITAN_MULTIPROCESS_MAIN()
