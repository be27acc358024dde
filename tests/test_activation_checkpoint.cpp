// Activation checkpointing: training with AC none / full / selective 2 / selective op gives
// bitwise-identical losses, gradients and parameters (1 process, and 2 real ranks with
// FSDP, where the collective counts must not change either); a recompute that changes a
// tensor's metadata fails with a message naming it; decisions and state updates happen
// once; the RNG is replayed; activation memory falls; the real `train` binary agrees.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>

#include "components/optimizer.h"
#include "components/system.h"
#include "config/errors.h"
#include "models/llama/model.h"
#include "models/recompute.h"
#include "models/train_model.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"

namespace fs = std::filesystem;
using namespace ctitan;
using ctitan::testing::all_ok;
using ctitan::testing::spawn_ranks;

namespace {

constexpr int64_t kSteps = 5, kBatch = 4, kSeq = 32;

struct Mode {
  std::string label, mode, option;
};
const std::vector<Mode> kModes = {{"none", "none", "2"},
                                  {"full", "full", "2"},
                                  {"selective 2", "selective", "2"},
                                  {"selective op", "selective", "op"}};

// activation_checkpoint.mode's value spelled s (config/job_config.h).
ACMode mode_named(const std::string& s) {
  ACMode m = ACMode::None;
  EXPECT_TRUE(key_value(s, m)) << s;
  return m;
}

ACOptions options_of(const Mode& m) {
  ACOptions o;
  o.mode = mode_named(m.mode);
  o.selective_ac_option = m.option;
  return o;  // preserve_rng_state true, determinism_check "default"
}

// The debug model itself (dim 256, 6 layers, 16 heads, vocab 2048) on short sequences.
llama::TransformerModelArgs debug_args(int64_t seq) {
  auto a = llama::llama3_flavor("debugmodel");
  a.max_seq_len = seq;
  return a;
}

// The global batch of a step (every rank takes its own rows).
torch::Tensor global_batch(int64_t step) {
  auto g = at::detail::createCPUGenerator(500 + step);
  return torch::randint(0, 2048, {kBatch, kSeq + 1}, g, torch::kInt64);
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads1;  // the optimizer's parameters' gradients after step 1
  std::vector<torch::Tensor> params;  // the optimizer's parameters after the last step
  ACStats ac;
  std::vector<int64_t> gathers, reduce_scatters;  // FSDP collectives per step
};

// How AC and FSDP go onto the model: compose() by hand (FSDP's wrapper over AC's transform,
// the reference), or through TrainModel's unit slots, as train.cpp does, in either order.
enum class Order { Compose, AcThenFsdp, FsdpThenAc };

// world == nullptr: one process, no FSDP. Else FSDP over the world (fp32 parameters).
TrainRun train(Comm* world, const Mode& m, Order order = Order::Compose) {
  at::globalContext().setDeterministicAlgorithms(true, false);
  torch::manual_seed(7);
  llama::Transformer model(debug_args(kSeq));
  model->init_weights();
  model->train();
  const int64_t N = world ? world->size() : 1, r = world ? world->rank() : 0;
  TrainModel slots;  // only its unit slots, installing into `model`
  slots.set_unit_wrapper = [model](UnitWrapper w) mutable { model->set_unit_wrapper(std::move(w)); };
  std::shared_ptr<FSDP> fsdp;
  const auto apply_fsdp = [&] {
    if (!world) return;
    std::shared_ptr<Comm> shard(world, [](Comm*) {});
    fsdp = std::make_shared<FSDP>(model->units(), shard, nullptr, fsdp_options("default", "float32", "float32"));
    if (order != Order::Compose) slots.set_unit_runner(fsdp->wrapper());
  };
  std::unique_ptr<ActivationCheckpoint> ac;
  const auto apply_ac = [&] {
    ac = std::make_unique<ActivationCheckpoint>(options_of(m), model->units());
    if (order != Order::Compose) slots.set_unit_transform(ac->transform());
  };
  if (order == Order::AcThenFsdp) {
    apply_ac();
    apply_fsdp();
  } else {
    apply_fsdp();
    apply_ac();
  }
  if (order == Order::Compose)
    model->set_unit_wrapper(compose(fsdp ? fsdp->wrapper() : UnitWrapper(), ac->transform()));
  std::vector<torch::Tensor> params = fsdp ? fsdp->sharded_parameters() : model->parameters();
  auto opt = build_optimizer(params, OptimizerSpec{"AdamW", 8e-4, 0.9, 0.95, 1e-8, 0.1});
  SumOverRanks reduce;
  if (world) reduce = [world](torch::Tensor& t) { world->all_reduce_sum(t, "grad_norm").wait(); };
  TrainRun out;
  for (int64_t step = 1; step <= kSteps; ++step) {
    opt->zero_grad();
    const int64_t g0 = fsdp ? fsdp->stats().all_gathers : 0, rs0 = fsdp ? fsdp->stats().reduce_scatters : 0;
    auto batch = global_batch(step).narrow(0, r * kBatch / N, kBatch / N);
    auto inputs = batch.narrow(1, 0, kSeq), labels = batch.narrow(1, 1, kSeq);
    auto logits = model->forward(inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
    loss.backward();
    if (fsdp) {
      fsdp->finish_backward();
      out.gathers.push_back(fsdp->stats().all_gathers - g0);
      out.reduce_scatters.push_back(fsdp->stats().reduce_scatters - rs0);
    }
    if (step == 1)
      for (auto& p : params) out.grads1.push_back(p.grad().clone());
    clip_grad_norm(params, 1.0, reduce);
    opt->step();
    out.losses.push_back(loss.item<double>());
  }
  for (auto& p : params) out.params.push_back(p.detach().clone());
  out.ac = ac->stats();
  return out;
}

// Bitwise equality of everything two runs report.
void expect_bitwise_equal(const TrainRun& want, const TrainRun& got, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_EQ(got.losses[s], want.losses[s]) << what << ": loss at step " << s + 1;
  ASSERT_EQ(got.grads1.size(), want.grads1.size()) << what;
  int bad_grads = 0, bad_params = 0;
  for (size_t i = 0; i < want.grads1.size(); ++i) bad_grads += !torch::equal(got.grads1[i], want.grads1[i]);
  for (size_t i = 0; i < want.params.size(); ++i) bad_params += !torch::equal(got.params[i], want.params[i]);
  EXPECT_EQ(bad_grads, 0) << what << ": step-1 gradients differ in " << bad_grads << " of " << want.grads1.size()
                          << " tensors";
  EXPECT_EQ(bad_params, 0) << what << ": final parameters differ in " << bad_params << " of " << want.params.size()
                           << " tensors";
}

// What each mode must have done per step on the 6-block debug model.
void expect_ac_activity(const Mode& m, const ACStats& s) {
  const int64_t blocks = m.mode == "none" ? 0 : (m.option == "2" && m.mode == "selective" ? 3 : 6);
  EXPECT_EQ(s.checkpointed_forwards, blocks * kSteps) << m.label;
  EXPECT_EQ(s.recomputes, blocks * kSteps) << m.label;
  // op SAC keeps matmuls 1, 3, 5, 7 of the 7 per block (wq wk wv wo w1 w3 w2) and reuses them.
  const int64_t kept = m.option == "op" && m.mode == "selective" ? 4 * 6 * kSteps : 0;
  EXPECT_EQ(s.kept_matmuls, kept) << m.label;
  EXPECT_EQ(s.reused_matmuls, kept) << m.label;
}

}  // namespace

// ---- 1. bitwise parity, one process -----------------------------------------------------------
TEST(ACParity, OneProcessAllModesBitwiseEqual) {
  const TrainRun ref = train(nullptr, kModes[0]);
  EXPECT_LT(ref.losses.back(), ref.losses.front());  // it trained: parity is not vacuous
  for (size_t k = 1; k < kModes.size(); ++k) {
    const TrainRun run = train(nullptr, kModes[k]);
    expect_bitwise_equal(ref, run, kModes[k].label + " vs none (1 process)");
    expect_ac_activity(kModes[k], run.ac);
  }
  expect_ac_activity(kModes[0], ref.ac);
}

// ---- 1 + 5. bitwise parity and collective counts, 2 ranks with FSDP ------------------------------
namespace {
std::vector<torch::Tensor> flatten(const TrainRun& r) {
  std::vector<torch::Tensor> ts{torch::tensor(r.losses, torch::kFloat64)};
  for (auto& g : r.grads1) ts.push_back(g);
  for (auto& p : r.params) ts.push_back(p);
  ts.push_back(torch::tensor(
      std::vector<int64_t>{r.ac.checkpointed_forwards, r.ac.recomputes, r.ac.kept_matmuls, r.ac.reused_matmuls}));
  ts.push_back(torch::tensor(r.gathers));
  ts.push_back(torch::tensor(r.reduce_scatters));
  return ts;
}
TrainRun unflatten(const std::vector<torch::Tensor>& ts, size_t& at, size_t n_params) {
  TrainRun r;
  auto l = ts.at(at++);
  for (int64_t i = 0; i < l.numel(); ++i) r.losses.push_back(l[i].item<double>());
  for (size_t i = 0; i < n_params; ++i) r.grads1.push_back(ts.at(at++));
  for (size_t i = 0; i < n_params; ++i) r.params.push_back(ts.at(at++));
  auto s = ts.at(at++);
  r.ac.checkpointed_forwards = s[0].item<int64_t>();
  r.ac.recomputes = s[1].item<int64_t>();
  r.ac.kept_matmuls = s[2].item<int64_t>();
  r.ac.reused_matmuls = s[3].item<int64_t>();
  auto g = ts.at(at++), rs = ts.at(at++);
  for (int64_t i = 0; i < g.numel(); ++i) r.gathers.push_back(g[i].item<int64_t>());
  for (int64_t i = 0; i < rs.numel(); ++i) r.reduce_scatters.push_back(rs[i].item<int64_t>());
  return r;
}
}  // namespace

CTITAN_CHILD(ac_fsdp_parity) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  std::vector<torch::Tensor> all;
  for (const auto& m : kModes)
    for (auto& t : flatten(train(d->world.get(), m))) all.push_back(t);
  torch::save(all, std::string(std::getenv("CTITAN_TEST_OUT")) + "." + std::to_string(d->world->rank()));
  d->world->barrier("done");
  return 0;
}

TEST(ACParity, TwoRanksFSDPAllModesBitwiseEqualSameCollectives) {
  const std::string out = "/tmp/ctitan_ac_" + std::to_string(getpid()) + ".pt";
  auto rs = spawn_ranks("ac_fsdp_parity", 2, {{"CTITAN_TEST_OUT", out}}, 300);
  ASSERT_TRUE(all_ok(rs));
  // 9 parameter tensors per block × 6 + tok_embeddings + norm + output.
  const size_t n_params = 9 * 6 + 3;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<torch::Tensor> ts;
    const std::string path = out + "." + std::to_string(rank);
    torch::load(ts, path);
    std::remove(path.c_str());
    size_t at = 0;
    std::vector<TrainRun> runs;
    for (size_t k = 0; k < kModes.size(); ++k) runs.push_back(unflatten(ts, at, n_params));
    ASSERT_EQ(at, ts.size());
    const std::string where = " (rank " + std::to_string(rank) + " of 2, FSDP)";
    EXPECT_LT(runs[0].losses.back(), runs[0].losses.front());
    for (size_t k = 0; k < kModes.size(); ++k) {
      expect_ac_activity(kModes[k], runs[k].ac);
      if (k > 0) expect_bitwise_equal(runs[0], runs[k], kModes[k].label + " vs none" + where);
      // Per step: 8 units gathered in forward, all but the last re-gathered in backward,
      // 8 reduce-scatters — whatever AC does.
      EXPECT_EQ(runs[k].gathers, std::vector<int64_t>(kSteps, 15)) << kModes[k].label << where;
      EXPECT_EQ(runs[k].reduce_scatters, std::vector<int64_t>(kSteps, 8)) << kModes[k].label << where;
    }
  }
}

// ---- AC and FSDP compose by construction: either order, the same model -------------------------
namespace {
const std::vector<Mode> kOrderModes = {kModes[1], kModes[3]};  // full, selective op
const std::vector<std::pair<Order, std::string>> kOrders = {
    {Order::Compose, "compose(FSDP, AC)"}, {Order::AcThenFsdp, "AC then FSDP"}, {Order::FsdpThenAc, "FSDP then AC"}};
}  // namespace

CTITAN_CHILD(ac_fsdp_order) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  std::vector<torch::Tensor> all;
  for (const auto& m : kOrderModes)
    for (const auto& o : kOrders)
      for (auto& t : flatten(train(d->world.get(), m, o.first))) all.push_back(t);
  torch::save(all, std::string(std::getenv("CTITAN_TEST_OUT")) + "." + std::to_string(d->world->rank()));
  d->world->barrier("done");
  return 0;
}

// torchtitan applies AC, then FSDP; the reverse once silently dropped AC (its compose() replaced
// FSDP's wrapper). Through the unit slots both orders give the hand-composed FSDP(AC(block)):
// bitwise the same losses, step-1 gradients and parameters, the same AC work and collectives.
TEST(ACComposition, AcThenFsdpAndFsdpThenAcBitwiseEqualOnTwoRanks) {
  const std::string out = "/tmp/ctitan_ac_order_" + std::to_string(getpid()) + ".pt";
  auto rs = spawn_ranks("ac_fsdp_order", 2, {{"CTITAN_TEST_OUT", out}}, 300);
  ASSERT_TRUE(all_ok(rs));
  const size_t n_params = 9 * 6 + 3;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<torch::Tensor> ts;
    const std::string path = out + "." + std::to_string(rank);
    torch::load(ts, path);
    std::remove(path.c_str());
    size_t at = 0;
    for (const auto& m : kOrderModes) {
      std::vector<TrainRun> runs;
      for (size_t k = 0; k < kOrders.size(); ++k) runs.push_back(unflatten(ts, at, n_params));
      const std::string where = " (" + m.label + ", rank " + std::to_string(rank) + " of 2)";
      EXPECT_LT(runs[0].losses.back(), runs[0].losses.front()) << where;
      for (size_t k = 0; k < kOrders.size(); ++k) {
        expect_ac_activity(m, runs[k].ac);  // AC is not lost, whichever came first
        if (k > 0) expect_bitwise_equal(runs[0], runs[k], kOrders[k].second + " vs " + kOrders[0].second + where);
        EXPECT_EQ(runs[k].gathers, runs[0].gathers) << kOrders[k].second << where;
        EXPECT_EQ(runs[k].reduce_scatters, runs[0].reduce_scatters) << kOrders[k].second << where;
      }
    }
    ASSERT_EQ(at, ts.size());
  }
}

// ---- units AC applies to ----------------------------------------------------------------------
TEST(ACUnits, BlocksOnlyEveryNthAsTorchtitan) {
  auto names = [](const ActivationCheckpoint& ac) {
    std::vector<std::string> out;
    for (const char* u :
         {"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "output"})
      if (ac.applies_to(u)) out.push_back(u);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "none", "2"}), {})), V{});
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "full", "2"}), {})),
            (V{"layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5"}));
  // torchtitan counts blocks from 1 and wraps those whose count is a multiple of N.
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "selective", "2"}), {})),
            (V{"layers.1", "layers.3", "layers.5"}));
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "selective", "3"}), {})), (V{"layers.2", "layers.5"}));
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "selective", "1"}), {})).size(), 6u);
  EXPECT_EQ(names(ActivationCheckpoint(options_of({"", "selective", "op"}), {})).size(), 6u);
  try {
    ActivationCheckpoint(options_of({"", "memory_budget", "2"}), {});
    ADD_FAILURE() << "memory_budget accepted";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "not supported yet: activation_checkpoint.mode = \"memory_budget\" (ctitan supports: \"none\", "
                 "\"full\", \"selective\")");
  }
}

// ---- 2. the determinism check -----------------------------------------------------------------
namespace {
// A unit whose 2nd call (the recompute) differs at its 19th produced tensor (position 18):
// 18 additions of [1, 1, 32, 128] tensors, then one broadcast against a tensor made
// outside the unit (so its creation is not among the unit's tensors), then the output.
at::Tensor run_changing_unit(const at::Tensor& first, const at::Tensor& second, const std::string& check) {
  auto x = torch::randn({1, 1, 32, 128}, torch::requires_grad());
  auto calls = std::make_shared<int>(0);
  UnitFn fn = [=](const at::Tensor& in) {
    const at::Tensor& other = ++*calls == 1 ? first : second;
    auto h = in;
    for (int i = 0; i < 18; ++i) h = h + in;
    return h + other;
  };
  ACOptions o = options_of({"", "full", "2"});
  o.determinism_check = check;
  ActivationCheckpoint ac(o, {});
  auto y = ac.wrap("layers.3", fn)(x);
  y.sum().backward();
  return x.grad();
}

std::string error_of(const at::Tensor& first, const at::Tensor& second) {
  try {
    run_changing_unit(first, second, "default");
  } catch (const RuntimeFailure& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no error";
}
}  // namespace

TEST(ACDeterminismCheck, ShapeChangeNamesBlockPositionAndBothShapes) {
  EXPECT_EQ(error_of(torch::zeros({1, 25, 32, 128}), torch::zeros({1, 50, 32, 128})),
            "layers.3: recomputed tensor 18 has shape [1,50,32,128] but the forward saved [1,25,32,128]");
}

TEST(ACDeterminismCheck, DtypeChangeNamesBothDtypes) {
  // float + bfloat16 promotes to float; float + float64 to float64.
  EXPECT_EQ(error_of(torch::zeros({1, 1, 32, 128}, torch::kFloat), torch::zeros({1, 1, 32, 128}, torch::kFloat64)),
            "layers.3: recomputed tensor 18 has dtype Double but the forward saved Float");
}

TEST(ACDeterminismCheck, IdenticalRecomputePassesAndNoneSkipsTheCheck) {
  auto same = torch::zeros({1, 25, 32, 128});
  EXPECT_EQ(error_of(same, same), "no error");
  // With the check off, a changed shape still never passes silently: autograd refuses the
  // incoming gradient of the forward's shape.
  EXPECT_ANY_THROW(run_changing_unit(same, torch::zeros({1, 50, 32, 128}), "none"));
}

TEST(ACDeterminismCheck, DifferentTensorCountIsReported) {
  auto calls = std::make_shared<int>(0);
  UnitFn fn = [calls](const at::Tensor& in) {
    auto h = in + in;
    if (++*calls == 1) h = h + in;
    return h;
  };
  ActivationCheckpoint ac(options_of({"", "full", "2"}), {});
  auto x = torch::randn({4}, torch::requires_grad());
  auto y = ac.wrap("layers.0", fn)(x);
  try {
    y.sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const RuntimeFailure& e) {
    // forward: in+in, h+in, output; recompute: in+in, output.
    EXPECT_STREQ(e.what(), "layers.0: the recompute produced 2 tensors but the forward saved 3");
  }
}

TEST(ACDeterminismCheck, SecondBackwardThroughAUnitIsRefused) {
  ActivationCheckpoint ac(options_of({"", "full", "2"}), {});
  auto x = torch::randn({4}, torch::requires_grad());
  auto loss = ac.wrap("layers.2", [](const at::Tensor& in) { return in * in; })(x).sum();
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    ADD_FAILURE() << "no error";
  } catch (const RuntimeFailure& e) {
    EXPECT_STREQ(e.what(),
                 "layers.2: backward ran twice through a checkpointed unit (retain_graph is not "
                 "supported with activation checkpointing)");
  }
}

// An op whose saved output depends on whether a gradient is needed, as CUDA's memory-efficient
// attention (float32's SDPA backend there) returns its logsumexp [B, H, T] when one is and
// [B, H, 0] when none is. The AC forward runs its ops with grad enabled, as the recompute does
// (and PyTorch's non-reentrant checkpoint): the check compares like with like and passes, and
// the gradients are those of training without AC. (Run without grad, the forward recorded
// [6,0] where the recompute makes [6,4] (the narrowed columns), and the check stopped the
// run: "layers.0: recomputed tensor 12 has shape [6,4] but the forward saved [6,0]".)
namespace {
at::Tensor grad_dependent_unit(const at::Tensor& in, const at::Tensor& w1, const at::Tensor& w2,
                               std::vector<int64_t>* lse_shape = nullptr) {
  auto h = recompute::linear(in, w1);  // [6, 4]
  const bool needs_grad = at::GradMode::is_enabled() && h.requires_grad();
  // The "logsumexp": one value per column when a gradient will be needed, none otherwise;
  // it changes no output value (each of its values is multiplied by 0).
  auto lse = at::logsumexp(h.narrow(1, 0, needs_grad ? h.size(1) : 0), {0});  // [4] or [0]
  if (lse_shape) *lse_shape = lse.sizes().vec();
  h = torch::tanh(h) + 0.0 * lse.sum();
  return recompute::linear(h, w2);
}
}  // namespace

TEST(ACDeterminismCheck, OutputThatDependsOnGradModeIsRecordedAsTheRecomputeMakesIt) {
  auto run = [](const Mode& m) {
    torch::manual_seed(21);
    auto w1 = torch::randn({4, 5}, torch::requires_grad()), w2 = torch::randn({3, 4}, torch::requires_grad());
    auto x = torch::randn({6, 5}, torch::requires_grad());
    ActivationCheckpoint ac(options_of(m), {});
    UnitFn fn = [=](const at::Tensor& in) { return grad_dependent_unit(in, w1, w2); };
    auto y = ac.wrap("layers.0", fn)(x);
    y.pow(2).sum().backward();
    EXPECT_EQ(ac.stats().recomputes, m.mode == "none" ? 0 : 1) << m.label;
    return std::vector<at::Tensor>{y.detach(), x.grad(), w1.grad(), w2.grad()};
  };
  // The unit does make a tensor whose shape depends on grad mode (else this test proves nothing).
  {
    std::vector<int64_t> with_grad, without_grad;
    auto w1 = torch::randn({4, 5}, torch::requires_grad()), w2 = torch::randn({3, 4}, torch::requires_grad());
    grad_dependent_unit(torch::randn({6, 5}), w1, w2, &with_grad);
    torch::NoGradGuard no_grad;
    grad_dependent_unit(torch::randn({6, 5}), w1, w2, &without_grad);
    ASSERT_EQ(with_grad, (std::vector<int64_t>{4}));
    ASSERT_EQ(without_grad, (std::vector<int64_t>{0}));
  }
  const auto ref = run(kModes[0]);
  for (const Mode& m : {kModes[1], kModes[3]}) {
    std::vector<at::Tensor> got;
    try {
      got = run(m);
    } catch (const std::exception& e) {
      ADD_FAILURE() << m.label << ": " << e.what();
      continue;
    }
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(torch::equal(got[i], ref[i])) << m.label << ", tensor " << i;
  }
}

// ---- 3. state a forward mutates, decisions a forward makes -------------------------------------
TEST(ACRecomputeApi, GuardedCounterUpdatedOncePerStep) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto calls = std::make_shared<int64_t>(0), counted = std::make_shared<int64_t>(0),
       seen_in_recompute = std::make_shared<int64_t>(0);
  UnitFn fn = [=](const at::Tensor& x) {
    ++*calls;
    *seen_in_recompute += recompute::in_recompute();
    recompute::unless_recomputing([&] { ++*counted; });
    return torch::tanh(recompute::linear(x, w));
  };
  ActivationCheckpoint ac(options_of({"", "full", "2"}), {});
  const int64_t steps = 3, blocks = 2;
  for (int64_t s = 0; s < steps; ++s) {
    auto h = torch::randn({2, 8}, torch::requires_grad());
    for (int64_t b = 0; b < blocks; ++b) h = ac.wrap("layers." + std::to_string(b), fn)(h);
    h.sum().backward();
    EXPECT_EQ(*counted, (s + 1) * blocks) << "after step " << s + 1;
  }
  EXPECT_EQ(*calls, 2 * steps * blocks);  // the unit did run twice per step
  EXPECT_EQ(*seen_in_recompute, steps * blocks);
  EXPECT_FALSE(recompute::in_recompute());  // outside any unit
  EXPECT_EQ(ac.stats().recomputes, steps * blocks);
}

// A state update made of ATen ops (a counter buffer's add_, as a MoE block on a GPU updates
// its tokens-per-expert): counted once per forward, and its tensors are not among those the
// determinism check compares, in full and op-level SAC. The same ops run in the forward only
// but outside unless_recomputing are reported (the check can fail).
TEST(ACRecomputeApi, StateUpdatesMayUseAtenOps) {
  auto run = [](const std::string& mode, const std::string& option, bool guarded) {
    auto w = torch::randn({8, 8}, torch::requires_grad());
    auto counter = torch::zeros({8});
    UnitFn fn = [=](const at::Tensor& x) {
      auto y = torch::tanh(recompute::linear(x, w));
      auto update = [&] {
        torch::NoGradGuard ng;
        counter.add_(y.detach().gt(0).sum(0).to(torch::kFloat));
      };
      if (guarded)
        recompute::unless_recomputing(update);
      else if (!recompute::in_recompute())
        update();
      return y;
    };
    ActivationCheckpoint ac(options_of({"", mode, option}), {});
    torch::manual_seed(5);
    auto x = torch::randn({4, 8}, torch::requires_grad());
    auto expected = torch::zeros({8});
    auto h = x;
    for (int64_t b = 0; b < 2; ++b) {
      h = ac.wrap("layers." + std::to_string(b), fn)(h);
      expected += h.detach().gt(0).sum(0).to(torch::kFloat);
    }
    h.sum().backward();
    return std::make_pair(counter, expected);
  };
  for (const std::string option : {"2", "op"}) {
    const std::string mode = option == "op" ? "selective" : "full";
    auto [counter, expected] = run(mode, option, true);
    EXPECT_TRUE(torch::equal(counter, expected)) << mode << " " << option << ": " << counter << " vs " << expected;
    EXPECT_GT(counter.sum().item<double>(), 0.0);
  }
  try {
    run("full", "2", false);
    ADD_FAILURE() << "an unguarded forward-only op passed the determinism check";
  } catch (const RuntimeFailure& e) {
    EXPECT_NE(std::string(e.what()).find("layers.1: the recompute"), std::string::npos) << e.what();
  }
}

// A toy router: top-1 over logits that tie exactly in the forward; the recompute sees the
// second logit one ulp higher (numerically different recompute). decide() replays the
// forward's choice, so the gradients are those of training without AC.
TEST(ACRecomputeApi, DecisionsAreReplayedNotRecomputed) {
  auto run = [](bool checkpoint, bool use_decide) {
    torch::manual_seed(3);
    auto w = torch::randn({2, 6}, torch::requires_grad());  // two "experts"
    auto x = torch::randn({5, 6}, torch::requires_grad());  // 5 tokens
    const auto zero = torch::zeros({1, 2});
    const auto ulp = torch::tensor({{0.0f, 1e-6f}});
    UnitFn fn = [=](const at::Tensor& in) {
      auto logits = torch::zeros({in.size(0), 2}) + (recompute::in_recompute() ? ulp : zero);  // tie
      auto pick = [&] { return std::get<1>(logits.max(-1)); };                                 // [T]
      auto idx = use_decide ? recompute::decide(pick) : pick();
      return in * w.index_select(0, idx);  // each token scaled by its expert's row
    };
    ActivationCheckpoint ac(options_of({"", checkpoint ? "full" : "none", "2"}), {});
    ac.wrap("layers.0", fn)(x).pow(2).sum().backward();
    return std::make_pair(x.grad(), w.grad());
  };
  const auto ref = run(false, true);
  const auto ac = run(true, true);
  EXPECT_TRUE(torch::equal(ac.first, ref.first));
  EXPECT_TRUE(torch::equal(ac.second, ref.second));
  // Without decide() the recompute picks the other expert: the gradients change (the test
  // can fail), silently as far as shapes go.
  const auto undecided = run(true, false);
  EXPECT_FALSE(torch::equal(undecided.second, ref.second));
}

// ---- 4. RNG replay ----------------------------------------------------------------------------
TEST(ACRng, DropoutLikeUnitSameGradientsAndOuterStream) {
  struct Result {
    torch::Tensor gx, gw, after;
  };
  auto run = [](const std::string& mode, bool preserve) {
    torch::manual_seed(11);
    auto w = torch::randn({16, 16}, torch::requires_grad());
    auto x = torch::randn({4, 16}, torch::requires_grad());
    UnitFn fn = [w](const at::Tensor& in) {
      auto keep = (torch::rand(in.sizes()) > 0.5).to(in.scalar_type());  // dropout mask
      return torch::tanh(recompute::linear(in * keep * 2.0, w));
    };
    ACOptions o = options_of({"", mode, "2"});
    o.preserve_rng_state = preserve;
    ActivationCheckpoint ac(o, {});
    ac.wrap("layers.0", fn)(x).sum().backward();
    return Result{x.grad(), w.grad(), torch::rand({8})};  // the outer stream after backward
  };
  const Result ref = run("none", true);
  const Result ac = run("full", true);
  EXPECT_TRUE(torch::equal(ac.gx, ref.gx));
  EXPECT_TRUE(torch::equal(ac.gw, ref.gw));
  EXPECT_TRUE(torch::equal(ac.after, ref.after));
  // Without replay the recompute draws another mask (and moves the stream): different.
  const Result no_replay = run("full", false);
  EXPECT_FALSE(torch::equal(no_replay.gw, ref.gw));
  EXPECT_FALSE(torch::equal(no_replay.after, ref.after));
}

// ---- op-level SAC through the kept-matmul path --------------------------------------------------
TEST(ACOpSac, ForcedRecomputeShapesAreNotKept) {
  // Two "Linear modules": the gate [2, 8] (forced to recompute, like moe.router.gate) and
  // a projection [8, 8]. Matmuls: proj (kept, 1st counted), gate (forced), proj (2nd:
  // recomputed), proj (3rd: kept).
  ModelUnit unit{"layers.0",
                 {{"layers.0.moe.router.gate.weight", torch::zeros({2, 8})},
                  {"layers.0.attention.wq.weight", torch::zeros({8, 8})}}};
  ACOptions o = options_of({"", "selective", "op"});
  o.force_recompute_mm_fqns = {"moe.router.gate"};
  ActivationCheckpoint ac(o, {unit});
  torch::manual_seed(5);
  auto wp = torch::randn({8, 8}, torch::requires_grad()), wg = torch::randn({2, 8}, torch::requires_grad());
  auto x = torch::randn({3, 4, 8}, torch::requires_grad());
  UnitFn fn = [=](const at::Tensor& in) {
    auto h = torch::tanh(recompute::linear(in, wp));
    auto g = recompute::linear(h, wg).sum(-1, true);
    h = torch::tanh(recompute::linear(h * g, wp));
    return recompute::linear(h, wp);
  };
  ac.wrap("layers.0", fn)(x).pow(2).sum().backward();
  EXPECT_EQ(ac.stats().kept_matmuls, 2);
  EXPECT_EQ(ac.stats().reused_matmuls, 2);
  // Same gradients as without AC (the kept outputs' backward is linear's).
  auto gx = x.grad().clone(), gp = wp.grad().clone(), gg = wg.grad().clone();
  x.mutable_grad() = at::Tensor();
  wp.mutable_grad() = at::Tensor();
  wg.mutable_grad() = at::Tensor();
  fn(x).pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(gx, x.grad()));
  EXPECT_TRUE(torch::equal(gp, wp.grad()));
  EXPECT_TRUE(torch::equal(gg, wg.grad()));
}

TEST(ACOpSac, KeptOutputModifiedInPlaceIsRefused) {
  ActivationCheckpoint ac(options_of({"", "selective", "op"}), {});
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto x = torch::randn({2, 4}, torch::requires_grad());
  UnitFn fn = [w](const at::Tensor& in) { return recompute::linear(in, w).mul_(2); };
  try {
    ac.wrap("layers.1", fn)(x).sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const RuntimeFailure& e) {
    EXPECT_STREQ(e.what(),
                 "layers.1: matmul output 0 kept by the forward was modified in place afterwards; "
                 "op-level SAC cannot reuse it (use mode full or selective N)");
  }
}

// Training-mode forwards keep no KV cache: the Llama model's only buffer is the RoPE table,
// and a second forward of another length sees no state left by the first.
TEST(ACModel, LlamaKeepsNoCache) {
  torch::manual_seed(1);
  llama::Transformer model(debug_args(16));
  model->init_weights();
  std::vector<std::string> buffers;
  for (const auto& b : model->named_buffers()) buffers.push_back(b.key());
  EXPECT_EQ(buffers, std::vector<std::string>{"freqs_cis"});
  auto t = torch::randint(0, 2048, {1, 16});
  torch::NoGradGuard ng;
  auto a = model->forward(t.narrow(1, 0, 8));
  model->forward(t);
  EXPECT_TRUE(torch::equal(model->forward(t.narrow(1, 0, 8)), a));
}

// ---- 6. activation memory (not timed; numbers for the report) ---------------------------------
namespace {
// The heap counter train reports (components/system.h; it also works under AddressSanitizer).
int64_t heap_in_use() { return static_cast<int64_t>(ctitan::heap_in_use_gib() * (1024.0 * 1024.0 * 1024.0)); }
}  // namespace

TEST(ACMemory, FullCutsActivationMemoryOfTheDebugModel) {
  // 512 keeps the test at a few seconds; at 1024 the same measure gave none 546.7 MiB,
  // selective 2 282.4, selective op 54.2, full 18.4 (CTITAN_AC_MEMORY_SEQ=1024 to repeat).
  const char* env_t = std::getenv("CTITAN_AC_MEMORY_SEQ");
  const int64_t T = env_t ? std::atol(env_t) : 512;
  std::map<std::string, int64_t> bytes;
  for (const auto& m : {kModes[0], kModes[1], kModes[2], kModes[3]}) {
    torch::manual_seed(7);
    llama::Transformer model(debug_args(T));
    model->init_weights();
    ActivationCheckpoint ac(options_of(m), model->units());
    model->set_unit_wrapper(compose(UnitWrapper(), ac.transform()));
    auto tokens = torch::randint(0, 2048, {1, T});
    const int64_t before = heap_in_use();
    auto logits = model->forward(tokens);  // [1, T, V]: the graph holds the activations
    bytes[m.label] = heap_in_use() - before;
  }  // (no backward: dropping the logits frees the graph)
  for (auto& [k, v] : bytes)
    std::printf("debug model, 1 x %ld tokens: activations after forward, AC %-12s %8.1f MiB\n", long(T), k.c_str(),
                v / 1048576.0);
  EXPECT_GT(bytes["none"], 3 * bytes["full"]);
  EXPECT_GT(bytes["none"], bytes["selective 2"]);
  EXPECT_GT(bytes["selective 2"], bytes["full"]);
  EXPECT_GT(bytes["selective op"], bytes["full"]);
}

// ---- the real binary ---------------------------------------------------------------------------
namespace {
using namespace ctitan::testing;
}  // namespace

TEST(ACTrainBinary, FullAndSelectiveGiveTheLossesOfNone) {
  const fs::path root = fs::temp_directory_path() / ("ctitan_ac_e2e_" + std::to_string(getpid()));
  const std::string corpus = make_corpus(root / "data");
  const std::string tok = (root / "tok.model").string();
  auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus + " " + tok + " 400");
  ASSERT_EQ(r.code, 0) << r.out;
  auto run = [&](const std::string& name, const std::string& ac_args) {
    const std::string dump = (root / name).string();
    auto c = sh(kTrain + " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " +
                tok + " --training.dataset_path " + corpus + " --job.dump_folder " + dump +
                " --training.steps 5 --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 1"
                " --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3 " +
                ac_args);
    EXPECT_EQ(c.code, 0) << c.out;
    return std::make_pair(c.out, dump + "/metrics.jsonl");
  };
  const auto none = run("none", "--activation_checkpoint.mode none");
  const auto full = run("full", "--activation_checkpoint.mode full");
  const auto op = run("op", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op");
  EXPECT_NE(full.first.find("activation checkpointing: full on 6 of 6 blocks"), std::string::npos) << full.first;
  EXPECT_NE(op.first.find("activation checkpointing: selective op on 6 of 6 blocks"), std::string::npos) << op.first;
  for (const char* field : {"loss", "grad_norm"}) {
    const auto want = jsonl_field(none.second, field);
    ASSERT_EQ(want.size(), 5u) << field;
    EXPECT_EQ(jsonl_field(full.second, field), want) << field << " (full vs none)";
    EXPECT_EQ(jsonl_field(op.second, field), want) << field << " (selective op vs none)";
  }
  fs::remove_all(root);
}

CTITAN_MULTIPROCESS_MAIN()
