// Mixtral-style MoE: flavors and analytic counts; one MoE layer (forward, backward, the
// load-balancing loss) against a per-token reference written here with plain ATen loops;
// no token dropped; AC none / full / selective 2 / selective op give bitwise-identical
// losses, gradients, parameters and routing statistics over 5 steps with router jitter
// and the expert bias on (1 process and 2 FSDP ranks); a router logit moved by one ulp
// during the recompute cannot change the routing; load counters move once per step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "components/optimizer.h"
#include "config/errors.h"
#include "models/mixtral/model.h"
#include "models/recompute.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"
#include "parallelisms/launch_env.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"

using namespace ctitan;
using ctitan::testing::all_ok;
using ctitan::testing::spawn_ranks;

// ---- flavors and counts -------------------------------------------------------------------
TEST(MixtralArgs, EightBySevenBCountsWithoutAllocating) {
  const auto a = mixtral::mixtral_flavor("8x7B");
  EXPECT_EQ(a.dim, 4096);
  EXPECT_EQ(a.n_layers, 32);
  EXPECT_EQ(a.moe.num_experts, 8);
  EXPECT_EQ(a.moe.top_k, 2);
  const auto c = mixtral::count_params(a);
  // Per block: attention 2·4096² + 2·4096·1024, experts 8·3·4096·14336, gate 8·4096, 2 norms.
  const int64_t attn = 2LL * 4096 * 4096 + 2LL * 4096 * 1024, expert = 3LL * 4096 * 14336;
  const int64_t outer = 2LL * 32000 * 4096 + 4096;
  EXPECT_EQ(c.total, outer + 32 * (attn + 8 * expert + 8 * 4096 + 2 * 4096));
  EXPECT_EQ(c.active, outer + 32 * (attn + 2 * expert + 8 * 4096 + 2 * 4096));
  EXPECT_EQ(c.total, 46702792704LL);   // "46.7B"
  EXPECT_EQ(c.active, 12879925248LL);  // "12.9B active"
  EXPECT_EQ(c.embedding, 32000LL * 4096);
  // Only active experts count: 6 (N_active - N_emb) + 12 L H hd T.
  EXPECT_DOUBLE_EQ(mixtral::flops_per_token(a, 4096),
                   6.0 * double(c.active - c.embedding) + 12.0 * 32 * 32 * 128 * 4096);
}

TEST(MixtralArgs, UnknownFlavorAndBadTopK) {
  try {
    mixtral::mixtral_flavor("8x22B");
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "unknown model.flavor \"8x22B\" for mixtral; valid: debugmodel, 8x7B");
  }
  auto a = mixtral::mixtral_flavor("debugmodel");
  a.moe.top_k = 9;
  try {
    mixtral::validate(a);
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "[mixtral] top_k=9 must be in [1, num_experts=8]");
  }
}

TEST(MixtralModel, DebugModelNamesShapesAndCountMatchTheFormula) {
  auto a = mixtral::mixtral_flavor("debugmodel");
  a.max_seq_len = 64;
  mixtral::Transformer model(a);
  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t total = 0;
  for (const auto& kv : model->named_parameters()) {
    shapes[kv.key()] = kv.value().sizes().vec();
    total += kv.value().numel();
  }
  EXPECT_EQ(shapes.size(), 3u + 6u * 10u);  // 10 per block: 4 attention, gate, 3 experts, 2 norms
  using V = std::vector<int64_t>;
  EXPECT_EQ(shapes.at("tok_embeddings.weight"), (V{2048, 256}));
  EXPECT_EQ(shapes.at("layers.5.moe.router.gate.weight"), (V{8, 256}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.w1"), (V{8, 768, 256}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.w2"), (V{8, 256, 768}));
  EXPECT_EQ(shapes.at("layers.0.moe.experts.w3"), (V{8, 768, 256}));
  EXPECT_EQ(shapes.at("layers.3.attention.wk.weight"), (V{256, 256}));
  EXPECT_EQ(shapes.at("layers.3.ffn_norm.weight"), (V{256}));
  EXPECT_EQ(shapes.at("output.weight"), (V{2048, 256}));
  EXPECT_EQ(total, mixtral::count_params(a).total);
  std::vector<std::string> buffers;
  for (const auto& b : model->named_buffers()) buffers.push_back(b.key());
  EXPECT_EQ(buffers.size(), 1u + 2u * 6u);
  EXPECT_EQ(buffers[1], "layers.0.moe.expert_bias");
  EXPECT_EQ(buffers[2], "layers.0.moe.tokens_per_expert");
  // units(): every parameter exactly once, experts in their block's unit.
  size_t n = 0;
  for (const auto& u : model->units()) n += u.params.size();
  EXPECT_EQ(n, shapes.size());
  EXPECT_EQ(model->units()[1].params[4].first, "layers.0.moe.router.gate.weight");
}

// ---- one MoE layer against a per-token reference ------------------------------------------
namespace {
mixtral::MoEArgs small_moe_args() {
  mixtral::MoEArgs m;
  m.num_experts = 4;
  m.top_k = 2;
  m.hidden_dim = 12;
  m.load_balance_loss_coeff = 0.05;
  return m;
}
}  // namespace

TEST(MixtralMoE, ForwardBackwardAndAuxLossMatchPerTokenReference) {
  torch::manual_seed(21);
  const int64_t D = 16, E = 4, k = 2;
  mixtral::MoE moe(D, small_moe_args());
  moe->init_weights(0.1);
  {
    torch::NoGradGuard ng;
    moe->router->gate->weight.normal_(0, 0.5);  // decisive routing
  }
  auto x = torch::randn({2, 5, D}, torch::requires_grad());
  auto R = torch::randn({2, 5, D});
  std::vector<mixtral::Routing> seen;
  moe->routing_observer = [&](const mixtral::Routing& r) { seen.push_back(r); };
  auto y = moe->forward(x);
  (y * R).sum().backward();  // the aux term joins through the block's backward

  // Reference: independent leaves, one token at a time.
  auto xr = x.detach().clone().requires_grad_(true);
  auto gw = moe->router->gate->weight.detach().clone().requires_grad_(true);
  auto w1 = moe->experts->w1.detach().clone().requires_grad_(true);
  auto w2 = moe->experts->w2.detach().clone().requires_grad_(true);
  auto w3 = moe->experts->w3.detach().clone().requires_grad_(true);
  const auto xf = xr.reshape({-1, D}), Rf = R.reshape({-1, D});
  const int64_t N = xf.size(0);
  std::vector<int64_t> count(E, 0);
  std::vector<torch::Tensor> probs, outs;
  for (int64_t t = 0; t < N; ++t) {
    const auto xt = xf[t];                                // [D]
    const auto p = torch::softmax(torch::mv(gw, xt), 0);  // [E]
    std::vector<int64_t> chosen;
    for (int64_t j = 0; j < k; ++j) {  // k rounds of "largest not yet chosen"
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end() &&
            (best < 0 || p[e].item<float>() > p[best].item<float>()))
          best = e;
      chosen.push_back(best);
      ++count[best];
    }
    auto denom = p[chosen[0]];
    for (int64_t j = 1; j < k; ++j) denom = denom + p[chosen[j]];
    auto yt = torch::zeros({D});
    for (int64_t e : chosen) {
      const auto h = torch::silu(torch::mv(w1[e], xt)) * torch::mv(w3[e], xt);  // [F]
      yt = yt + (p[e] / denom) * torch::mv(w2[e], h);
    }
    probs.push_back(p);
    outs.push_back(yt);
  }
  const auto y_ref = torch::stack(outs).view({2, 5, D});
  const auto P = torch::stack(probs).mean(0);  // [E]
  auto aux = torch::zeros({});
  for (int64_t e = 0; e < E; ++e) aux = aux + double(count[e]) / double(N * k) * P[e];
  aux = aux * double(E);
  const auto gate_grad_without_aux =
      torch::autograd::grad({(y_ref.reshape({-1, D}) * Rf).sum()}, {gw}, {}, /*retain_graph=*/true)[0];
  ((y_ref.reshape({-1, D}) * Rf).sum() + 0.05 * aux).backward();

  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-6)) << (y - y_ref).abs().max();
  EXPECT_NEAR(moe->last_aux_loss(), aux.item<double>(), 1e-6);
  EXPECT_GT(aux.item<double>(), 1.0);  // random routing is not perfectly balanced
  auto close = [](const torch::Tensor& a, const torch::Tensor& b) { return torch::allclose(a, b, 1e-4, 1e-6); };
  EXPECT_TRUE(close(x.grad(), xr.grad())) << (x.grad() - xr.grad()).abs().max();
  EXPECT_TRUE(close(moe->router->gate->weight.grad(), gw.grad()))
      << (moe->router->gate->weight.grad() - gw.grad()).abs().max();
  EXPECT_TRUE(close(moe->experts->w1.grad(), w1.grad()));
  EXPECT_TRUE(close(moe->experts->w2.grad(), w2.grad()));
  EXPECT_TRUE(close(moe->experts->w3.grad(), w3.grad()));
  // The aux gradient is there: without it the gate gradient differs.
  EXPECT_FALSE(close(moe->router->gate->weight.grad(), gate_grad_without_aux));
  // No token dropped: counts sum to N·k, match the reference's, each token k times.
  ASSERT_EQ(seen.size(), 1u);
  const auto& r = seen[0];
  EXPECT_EQ(r.counts.sum().item<int64_t>(), N * k);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(r.counts[e].item<int64_t>(), count[e]) << "expert " << e;
  EXPECT_TRUE(torch::equal(torch::bincount(torch::div(r.order, k, "floor"), {}, N), torch::full({N}, k, torch::kLong)));
  EXPECT_TRUE(torch::equal(moe->tokens_per_expert, r.counts.to(torch::kFloat)));
  // The experts' split reads the host copy of the counts (on a GPU the routing's one copy).
  EXPECT_TRUE(r.counts_host.device().is_cpu());
  EXPECT_TRUE(torch::equal(r.counts_host, r.counts.cpu()));
}

TEST(MixtralMoE, AuxLossIsOneWhenBalancedAndManyTokensNoneDropped) {
  torch::manual_seed(2);
  mixtral::MoE moe(16, small_moe_args());
  moe->init_weights(0.02);
  {
    torch::NoGradGuard ng;
    moe->router->gate->weight.zero_();  // uniform scores: P_e = 1/E, Σ f_e = 1
  }
  moe->forward(torch::randn({3, 7, 16}));
  EXPECT_FLOAT_EQ(float(moe->last_aux_loss()), 1.0f);
  // Decisive router, 4096 tokens: every token routed k times, none dropped.
  {
    torch::NoGradGuard ng;
    moe->router->gate->weight.normal_(0, 1.0);
    moe->tokens_per_expert.zero_();
  }
  moe->forward(torch::randn({4, 1024, 16}));
  EXPECT_EQ(moe->tokens_per_expert.sum().item<double>(), 4.0 * 1024 * 2);
}

// ---- training: AC modes bitwise equal --------------------------------------------------------
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
  o.force_recompute_mm_fqns = {"moe.router.gate"};  // torchtitan's default
  return o;
}

// The debug flavor itself, on 1 process and on 2 FSDP ranks, with jitter and expert bias on.
mixtral::TransformerModelArgs debug_args() {
  auto a = mixtral::mixtral_flavor("debugmodel");
  a.max_seq_len = kSeq;
  a.moe.router_jitter_noise = 0.1;
  a.moe.expert_bias_update_rate = 1e-3;
  return a;
}

torch::Tensor global_batch(int64_t step) {
  // One batch for every step: the model memorises it, so the loss must fall.
  auto g = at::detail::createCPUGenerator(900 + 0 * step);
  return torch::randint(0, 2048, {kBatch, kSeq + 1}, g, torch::kInt64);
}

struct TrainRun {
  std::vector<double> losses;         // cross-entropy + coeff · load-balance loss
  std::vector<torch::Tensor> grads1;  // after step 1
  std::vector<torch::Tensor> params;  // after the last step
  std::vector<torch::Tensor> loads;   // [L, E] tokens per expert of each step (all ranks)
  torch::Tensor bias;                 // [L, E] expert bias after the last step
  ACStats ac;
};

TrainRun train(Comm* world, const Mode& m) {
  at::globalContext().setDeterministicAlgorithms(true, false);
  torch::manual_seed(7);
  mixtral::Transformer model(debug_args());
  model->init_weights();
  model->train();
  const int64_t N = world ? world->size() : 1, r = world ? world->rank() : 0;
  std::shared_ptr<FSDP> fsdp;
  if (world) {
    std::shared_ptr<Comm> shard(world, [](Comm*) {});
    fsdp = std::make_shared<FSDP>(model->units(), shard, nullptr, fsdp_options("default", "float32", "float32"));
  }
  ActivationCheckpoint ac(options_of(m), model->units());
  model->set_unit_wrapper(compose(fsdp ? fsdp->wrapper() : UnitWrapper(), ac.transform()));
  std::vector<torch::Tensor> params = fsdp ? fsdp->sharded_parameters() : model->parameters();
  auto opt = build_optimizer(params, OptimizerSpec{"AdamW", 8e-4, 0.9, 0.95, 1e-8, 0.1});
  auto sum = [world](torch::Tensor t) {
    if (world) world->all_reduce_sum(t, "test").wait();
    return t;
  };
  SumOverRanks reduce;
  if (world) reduce = [&](torch::Tensor& t) { sum(t); };
  TrainRun out;
  for (int64_t step = 1; step <= kSteps; ++step) {
    opt->zero_grad();
    auto batch = global_batch(step).narrow(0, r * kBatch / N, kBatch / N);
    auto inputs = batch.narrow(1, 0, kSeq), labels = batch.narrow(1, 1, kSeq);
    auto logits = model->forward(inputs);
    auto ce = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
    ce.backward();  // + coeff · load-balance loss, through the blocks' backward
    if (fsdp) fsdp->finish_backward();
    if (step == 1)
      for (auto& p : params) out.grads1.push_back(p.grad().clone());
    clip_grad_norm(params, 1.0, reduce);
    opt->step();
    auto load = sum(model->tokens_per_expert());
    out.loads.push_back(load);
    model->step_load_balance(load);
    out.losses.push_back(ce.item<double>() + model->aux_loss());
  }
  for (auto& p : params) out.params.push_back(p.detach().clone());
  std::vector<torch::Tensor> b;
  for (int64_t i = 0; i < model->n_layers(); ++i) b.push_back(model->block(i)->moe->expert_bias.clone());
  out.bias = torch::stack(b);
  out.ac = ac.stats();
  return out;
}

void expect_bitwise_equal(const TrainRun& want, const TrainRun& got, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_EQ(got.losses[s], want.losses[s]) << what << ": loss at step " << s + 1;
    EXPECT_TRUE(torch::equal(got.loads[s], want.loads[s])) << what << ": tokens per expert at step " << s + 1;
  }
  int bad_grads = 0, bad_params = 0;
  for (size_t i = 0; i < want.grads1.size(); ++i) bad_grads += !torch::equal(got.grads1[i], want.grads1[i]);
  for (size_t i = 0; i < want.params.size(); ++i) bad_params += !torch::equal(got.params[i], want.params[i]);
  EXPECT_EQ(bad_grads, 0) << what << ": step-1 gradients differ in " << bad_grads << " tensors";
  EXPECT_EQ(bad_params, 0) << what << ": final parameters differ in " << bad_params << " tensors";
  EXPECT_TRUE(torch::equal(got.bias, want.bias)) << what << ": expert bias";
}

void expect_sane(const TrainRun& run, const Mode& m, int64_t tokens) {
  EXPECT_LT(run.losses.back(), run.losses.front()) << m.label;  // it trained
  const int64_t L = run.bias.size(0);
  const int64_t blocks = m.mode == "none" ? 0 : (m.mode == "selective" && m.option == "2" ? L / 2 : L);
  EXPECT_EQ(run.ac.checkpointed_forwards, blocks * kSteps) << m.label;
  EXPECT_EQ(run.ac.recomputes, blocks * kSteps) << m.label;
  // Counters moved once per step: each layer counted every token k = 2 times, not 4.
  for (const auto& l : run.loads) EXPECT_TRUE(torch::equal(l.sum(1), torch::full({L}, 2.0 * tokens))) << m.label;
  EXPECT_GT(run.bias.abs().sum().item<double>(), 0.0) << m.label;  // the bias did move
}
}  // namespace

TEST(MixtralACParity, OneProcessAllModesBitwiseEqualWithJitter) {
  const TrainRun ref = train(nullptr, kModes[0]);
  expect_sane(ref, kModes[0], kBatch * kSeq);
  for (size_t k = 1; k < kModes.size(); ++k) {
    const TrainRun run = train(nullptr, kModes[k]);
    expect_sane(run, kModes[k], kBatch * kSeq);
    expect_bitwise_equal(ref, run, kModes[k].label + " vs none (1 process)");
  }
}

namespace {
std::vector<torch::Tensor> flatten(const TrainRun& r) {
  std::vector<torch::Tensor> ts{torch::tensor(r.losses, torch::kFloat64)};
  for (auto& g : r.grads1) ts.push_back(g);
  for (auto& p : r.params) ts.push_back(p);
  for (auto& l : r.loads) ts.push_back(l);
  ts.push_back(r.bias);
  ts.push_back(torch::tensor(std::vector<int64_t>{r.ac.checkpointed_forwards, r.ac.recomputes}));
  return ts;
}
TrainRun unflatten(const std::vector<torch::Tensor>& ts, size_t& at, size_t n_params) {
  TrainRun r;
  auto l = ts.at(at++);
  for (int64_t i = 0; i < l.numel(); ++i) r.losses.push_back(l[i].item<double>());
  for (size_t i = 0; i < n_params; ++i) r.grads1.push_back(ts.at(at++));
  for (size_t i = 0; i < n_params; ++i) r.params.push_back(ts.at(at++));
  for (int64_t s = 0; s < kSteps; ++s) r.loads.push_back(ts.at(at++));
  r.bias = ts.at(at++);
  auto s = ts.at(at++);
  r.ac.checkpointed_forwards = s[0].item<int64_t>();
  r.ac.recomputes = s[1].item<int64_t>();
  return r;
}
}  // namespace

CTITAN_CHILD(mixtral_fsdp_parity) {
  auto env = detect_launch_env(environment_map());
  auto d = init_distributed(env, std::chrono::seconds(60));
  std::vector<torch::Tensor> all;
  for (const auto& m : kModes)
    for (auto& t : flatten(train(d->world.get(), m))) all.push_back(t);
  torch::save(all, std::string(std::getenv("CTITAN_TEST_OUT")) + "." + std::to_string(d->world->rank()));
  d->world->barrier("done");
  return 0;
}

TEST(MixtralACParity, TwoRanksFSDPAllModesBitwiseEqualWithJitter) {
  const std::string out = "/tmp/ctitan_mixtral_" + std::to_string(getpid()) + ".pt";
  auto rs = spawn_ranks("mixtral_fsdp_parity", 2, {{"CTITAN_TEST_OUT", out}}, 300);
  ASSERT_TRUE(all_ok(rs));
  const size_t n_params = 10 * static_cast<size_t>(debug_args().n_layers) + 3;  // per block 10, + 3
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
    for (size_t k = 0; k < kModes.size(); ++k) {
      expect_sane(runs[k], kModes[k], kBatch * kSeq);  // loads are summed over both ranks
      if (k > 0) expect_bitwise_equal(runs[0], runs[k], kModes[k].label + " vs none" + where);
    }
  }
}

// ---- a router logit one ulp off during the recompute ------------------------------------------
namespace {
struct UlpRun {
  std::vector<torch::Tensor> grads, forward_indices, recompute_indices;
};
// One MoE block (norm + moe) under AC; experts 1 and 2 have identical gate rows, so their
// logits tie exactly for every token. perturb: "recompute" moves expert 2's logits up one
// ulp only in the recompute, "always" in every forward.
UlpRun ulp_run(const std::string& mode, const std::string& perturb) {
  torch::manual_seed(31);
  const int64_t D = 16;
  mixtral::MoE moe(D, small_moe_args());
  moe->init_weights(0.1);
  {
    torch::NoGradGuard ng;
    auto& g = moe->router->gate->weight;  // [4, D]
    g.normal_(0, 0.5);
    g[2].copy_(g[1]);
  }
  moe->train();
  moe->logits_hook = [perturb](const torch::Tensor& l) {
    // The same ops in every pass (the determinism check compares them); only the mask
    // differs.
    const bool on = perturb == "always" || (perturb == "recompute" && recompute::in_recompute());
    const auto ld = l.detach();
    auto up = l + (torch::nextafter(ld, torch::full_like(ld, INFINITY)) - ld);  // +1 ulp, d/dl = 1
    auto mask = torch::zeros({1, l.size(1)}, torch::kBool);
    mask[0][2] = on;
    return torch::where(mask, up, l);
  };
  UlpRun out;
  moe->routing_observer = [&out](const mixtral::Routing& r) {
    (recompute::in_recompute() ? out.recompute_indices : out.forward_indices).push_back(r.indices.clone());
  };
  ACOptions o;
  o.mode = mode_named(mode);
  ActivationCheckpoint ac(o, {});
  auto x = torch::randn({2, 16, D}, torch::requires_grad());
  UnitFn fn = [moe](const at::Tensor& in) mutable { return moe->forward(in); };
  ac.wrap("layers.0", fn)(x).pow(2).sum().backward();
  out.grads = {x.grad(), moe->router->gate->weight.grad(), moe->experts->w1.grad(), moe->experts->w2.grad(),
               moe->experts->w3.grad()};
  return out;
}
}  // namespace

TEST(MixtralRecompute, OneUlpRouterLogitChangeInRecomputeKeepsRoutingAndGradients) {
  const UlpRun ref = ulp_run("none", "none");
  const UlpRun ac = ulp_run("full", "recompute");
  ASSERT_EQ(ac.forward_indices.size(), 1u);
  ASSERT_EQ(ac.recompute_indices.size(), 1u);
  // The recompute routed exactly as the forward did, and as training without AC.
  EXPECT_TRUE(torch::equal(ac.recompute_indices[0], ac.forward_indices[0]));
  EXPECT_TRUE(torch::equal(ac.forward_indices[0], ref.forward_indices[0]));
  // The one-ulp move would have changed the routing: the tie between experts 1 and 2
  // decides some tokens' second expert, and with expert 2 one ulp ahead it wins them.
  const UlpRun moved = ulp_run("none", "always");
  EXPECT_FALSE(torch::equal(moved.forward_indices[0], ref.forward_indices[0]));
  // Gradients: bitwise those of training without AC (the recompute differentiates its
  // logits at the forward's values). Re-deciding would move gradient between experts.
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(ac.grads[i], ref.grads[i]))
        << "gradient " << i << " max diff " << (ac.grads[i] - ref.grads[i]).abs().max();
    if (i >= 2) {
      EXPECT_FALSE(torch::allclose(moved.grads[i], ref.grads[i], 1e-3, 1e-5)) << "gradient " << i;
    }
  }
}

// ---- the real binary: model.name = "mixtral" ------------------------------------------------
TEST(MixtralTrainBinary, TrainsReportsLoadBalanceAndFullACGivesTheLossesOfNone) {
  namespace fs = std::filesystem;
  using ctitan::testing::jsonl_field;
  using ctitan::testing::sh;
  const std::string src = ctitan::testing::kSrc, bin = ctitan::testing::kTrain;
  const fs::path root = fs::temp_directory_path() / ("ctitan_mixtral_e2e_" + std::to_string(getpid()));
  const std::string corpus = ctitan::testing::make_corpus(root / "data");
  const std::string tok = (root / "tok.model").string();
  auto t = sh(src + "/scripts/train_tokenizer.sh " + corpus + " " + tok + " 300");
  ASSERT_EQ(t.code, 0) << t.out;
  auto run = [&](const std::string& mode) {
    const std::string dump = (root / mode).string();
    auto c = sh(bin + " --job.config_file " + src + "/train_configs/mixtral_debug.toml --model.tokenizer_path " + tok +
                " --training.dataset_path " + corpus + " --job.dump_folder " + dump +
                " --training.steps 4 --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 1"
                " --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3 --activation_checkpoint.mode " +
                mode);
    EXPECT_EQ(c.code, 0) << c.out;
    return std::make_pair(c.out, dump + "/metrics.jsonl");
  };
  const auto none = run("none");
  const auto full = run("full");
  EXPECT_NE(none.first.find("model: mixtral debugmodel"), std::string::npos) << none.first;
  EXPECT_NE(full.first.find("activation checkpointing: full on 6 of 6 blocks"), std::string::npos) << full.first;
  for (const char* field : {"loss", "grad_norm", "lb_loss", "expert_spread"}) {
    const auto want = jsonl_field(none.second, field);
    ASSERT_EQ(want.size(), 4u) << field;
    EXPECT_EQ(jsonl_field(full.second, field), want) << field << " (full vs none)";
  }
  const auto loss = jsonl_field(none.second, "loss");
  EXPECT_LT(std::stod(loss.back()), std::stod(loss.front()));
  for (const auto& v : jsonl_field(none.second, "lb_loss")) {  // Σ over 6 layers, each about 1 (balanced) to E
    EXPECT_GE(std::stod(v), 5.0);
    EXPECT_LE(std::stod(v), 48.0);
  }
  for (const auto& v : jsonl_field(none.second, "expert_spread")) EXPECT_GE(std::stod(v), 1.0);
  fs::remove_all(root);
}

CTITAN_MULTIPROCESS_MAIN()
