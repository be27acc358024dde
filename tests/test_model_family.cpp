// Model families behind one seam (models/model_spec.h, models/registry.h): the registry's
// lookups and errors, the third family (llama2: one folder + one registration line) built
// from its spec with the names and sizes Meta's Llama 2 has, and llama2 through the ordinary
// paths with the real executables: train on 2 ranks with checkpoints, resume bit for bit,
// checkpoint_tool convert to HF, the export's config.json, and the export loaded back (by
// checkpoint_tool and by train's initial_load_in_hf) equal to the checkpoint bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "config/errors.h"
#include "models/hf_adapter.h"
#include "models/llama/args.h"
#include "models/mixtral/model.h"
#include "models/registry.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"

namespace fs = std::filesystem;
using namespace ctitan;

namespace {

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

}  // namespace

TEST(ModelRegistry, NamesLookupsAndTheUnknownNameError) {
  EXPECT_EQ(model_names(), (std::vector<std::string>{"llama3", "mixtral", "llama2"}));
  EXPECT_EQ(model_spec("llama2").name, "llama2");
  EXPECT_TRUE(model_spec("mixtral").moe);
  EXPECT_FALSE(model_spec("llama2").moe);
  EXPECT_EQ(find_model_spec("gpt2"), nullptr);
  EXPECT_EQ(user_error([] { model_spec("gpt2"); }), "model.name = \"gpt2\" is not one of: llama3, mixtral, llama2");
  EXPECT_EQ(user_error([] { model_spec("llama2").sizes("9B", 128); }),
            "unknown model.flavor \"9B\" for llama2; valid: debugmodel, 7B, 13B, 70B");
  EXPECT_EQ(user_error([] { hf_adapter().config_for("gpt2", "debugmodel", 10); }),
            "HF interop: model \"gpt2\" is not one of: llama3, mixtral, llama2");
}

// An HF folder names an architecture; LlamaForCausalLM loads as llama3 unless llama2 is named
// (models/registry.h), so today's behaviour for HF Llama folders is kept.
TEST(ModelRegistry, HuggingFaceArchitecturesPickAFamilyDeterministically) {
  ASSERT_NE(find_model_spec_for_hf("LlamaForCausalLM"), nullptr);
  EXPECT_EQ(find_model_spec_for_hf("LlamaForCausalLM")->name, "llama3");
  EXPECT_EQ(find_model_spec_for_hf("MixtralForCausalLM")->name, "mixtral");
  EXPECT_EQ(find_model_spec_for_hf("GPT2LMHeadModel"), nullptr);
  EXPECT_EQ(hf_architecture_of_model_type("llama"), "LlamaForCausalLM");
  EXPECT_EQ(hf_architecture_of_model_type("mixtral"), "MixtralForCausalLM");
  EXPECT_EQ(hf_architectures(), (std::vector<std::string>{"LlamaForCausalLM", "MixtralForCausalLM"}));
  const HFAdapter& families = hf_adapter();
  HFModelConfig c = families.config_for("llama2", "debugmodel", 2048);
  EXPECT_EQ(families.family_of(c.architecture), "llama3");
  EXPECT_EQ(families.model_type_of(c.architecture), "llama");
  const std::vector<std::pair<std::string, std::string>> dense = {{"attention_bias", "false"}, {"mlp_bias", "false"}};
  EXPECT_EQ(families.family_json(c), dense);  // a dense feed-forward's fields
  EXPECT_EQ(find_flavor(c, families, "llama2"), "debugmodel");
  EXPECT_EQ(find_flavor(c, families), "");  // llama3's debugmodel has 6 layers, llama2's 8
  // The config.json text round-trips.
  const HFModelConfig back = parse_hf_config(hf_config_json(c, families), "config.json", families);
  EXPECT_EQ(structure_difference(back, c), "");
  EXPECT_EQ(back.rope_theta, 10000);
  EXPECT_FALSE(back.rope_scaling.has_value());
}

// Llama 2 7B as Meta published it: 6,738,415,616 parameters, SwiGLU width 11008, no GQA.
TEST(Llama2Family, SevenBSizesAndHuggingFaceConfig) {
  const ModelSpec& s = model_spec("llama2");
  const ModelSizes z = s.sizes("7B", 4096);
  EXPECT_EQ(z.total_params, 6738415616);
  EXPECT_EQ(z.embedding_params, 32000LL * 4096);
  EXPECT_EQ(z.ffn, 11008);
  EXPECT_EQ(z.kv_dim, 4096);
  EXPECT_EQ(z.vocab_size, 32000);
  EXPECT_EQ(s.max_seq_len("7B"), 4096);
  const HFModelConfig c = s.hf_config("7B", 32000);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.rope_theta, 10000);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_EQ(s.hf_config("70B", 32000).intermediate_size, 28672);  // 1.3 x, multiple of 4096, 8 kv heads
  EXPECT_EQ(s.hf_config("70B", 32000).num_key_value_heads, 8);
}

// The built model's parameters are exactly the names and shapes the HF adapter expects,
// in named_parameters() order; units and a deterministic init.
TEST(Llama2Family, DebugModelBuildsWithTheAdaptersNamesAndInitIsSeeded) {
  const ModelSpec& s = model_spec("llama2");
  torch::manual_seed(3);
  TrainModel a = s.build("debugmodel", 32, ModelInit::Full);
  ParamList got;
  for (const auto& kv : a.module->named_parameters()) got.push_back({kv.key(), kv.value().sizes().vec()});
  EXPECT_EQ(got, hf_adapter().params(hf_adapter().config_for("llama2", "debugmodel", 2048)));
  EXPECT_EQ(a.units().size(), 10u);  // tok_embeddings, 8 layers, output
  EXPECT_EQ(a.n_layers, 8);
  EXPECT_EQ(a.total_params, s.sizes("debugmodel", 32).total_params);
  EXPECT_FALSE(a.step.extra_loss);  // a dense family has no step work of its own
  torch::manual_seed(3);
  TrainModel b = s.build("debugmodel", 32, ModelInit::Full);
  const auto pa = a.module->named_parameters(), pb = b.module->named_parameters();
  for (const auto& kv : pa) EXPECT_TRUE(torch::equal(kv.value(), pb[kv.key()])) << kv.key();
  const auto logits = a.forward(torch::randint(0, 2048, {2, 16}, torch::kLong));
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 16, 2048}));
}

// A family's step work goes through TrainModel::step (models/train_model.h), never named by the
// trainer: dense families have none; mixtral's extra loss is coeff · Σ_layers load-balance loss
// / micro-batches (a float64 scalar), its after-step hook sums the tokens per expert over the
// world (tag "expert_load") before the bias update zeroes them, its metrics are lb_loss (the
// step's mean over micro-batches, through world_mean) and expert_spread (max / mean load of the
// most unbalanced layer), and reset_step_counters zeroes what later forwards counted.
TEST(ModelFamilies, StepHooksAreTheFamilysOwn) {
  for (const std::string& name : model_names()) EXPECT_FALSE(model_spec(name).parallelize) << name;  // the default
  TrainModel dense = model_spec("llama3").build("debugmodel", 16, ModelInit::Full);
  EXPECT_FALSE(dense.step.set_micro_batches || dense.step.extra_loss || dense.step.after_optimizer_step ||
               dense.step.reset_step_counters || dense.step.metrics);

  torch::manual_seed(5);
  TrainModel m = model_spec("mixtral").build("debugmodel", 16, ModelInit::Full);
  ASSERT_TRUE(m.step.set_micro_batches && m.step.extra_loss && m.step.after_optimizer_step &&
              m.step.reset_step_counters && m.step.metrics);
  auto impl = std::dynamic_pointer_cast<mixtral::TransformerImpl>(m.module);
  ASSERT_NE(impl, nullptr);
  m.step.set_micro_batches(2);
  double lb_mean = 0;
  for (int micro = 0; micro < 2; ++micro) {
    m.forward(torch::randint(0, 2048, {2, 16}, torch::kLong)).sum().backward();
    const torch::Tensor extra = m.step.extra_loss();
    EXPECT_EQ(extra.scalar_type(), torch::kFloat64);
    EXPECT_EQ(extra.dim(), 0);
    EXPECT_EQ(extra.item<double>(), impl->aux_loss() / 2.0);
    EXPECT_GT(impl->load_balance_loss(), 0);
    lb_mean += impl->load_balance_loss() / 2.0;
  }
  std::vector<std::string> tags;
  torch::Tensor summed;
  m.step.after_optimizer_step([&](torch::Tensor& t, const char* tag) {
    tags.push_back(tag);
    EXPECT_EQ(t.sizes().vec(), (std::vector<int64_t>{6, 8}));         // [L, E]
    EXPECT_EQ(t.sum(1).eq(2 * 2 * 16 * 2).all().item<bool>(), true);  // 2 micro-batches of 32 tokens, top 2
    t.mul_(3);                                                        // as if 3 ranks had routed alike
    summed = t.clone();
  });
  EXPECT_EQ(tags, (std::vector<std::string>{"expert_load"}));
  EXPECT_EQ(impl->tokens_per_expert().abs().sum().item<double>(), 0.0);  // zeroed by the bias update
  const auto metrics = m.step.metrics([&](double v, const char* tag) {
    tags.push_back(tag);
    return v;
  });
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_EQ(metrics[0].first, "lb_loss");
  EXPECT_EQ(metrics[0].second, lb_mean);
  EXPECT_EQ(metrics[1].first, "expert_spread");
  const auto spread = std::get<0>(summed.max(1)) / summed.mean(1);
  EXPECT_EQ(metrics[1].second, spread.max().item<double>());
  EXPECT_GE(metrics[1].second, 1.0);
  EXPECT_EQ(tags.back(), "lb_loss");
  {
    torch::NoGradGuard no_grad;
    m.forward(torch::randint(0, 2048, {1, 16}, torch::kLong));
  }
  EXPECT_GT(impl->tokens_per_expert().sum().item<double>(), 0.0);
  m.step.reset_step_counters();
  EXPECT_EQ(impl->tokens_per_expert().abs().sum().item<double>(), 0.0);
}

// A family's args derive from the decoder's (models/decoder_args.h): the shared glue reads the
// decoder's part, and each family keeps its defaults.
TEST(ModelFamilies, ArgsDeriveFromTheDecoderArgs) {
  const llama::TransformerModelArgs la;
  const DecoderArgs& llama = la;
  EXPECT_EQ(llama.dim, 4096);
  EXPECT_FALSE(llama.n_kv_heads.has_value());
  EXPECT_EQ(llama.kv_heads(), 32);
  EXPECT_TRUE(llama.rope_scaling.has_value());
  EXPECT_EQ(llama.family, "llama3");
  const mixtral::TransformerModelArgs mx = mixtral::mixtral_flavor("8x7B");
  const DecoderArgs& d = mx;
  EXPECT_EQ(d.kv_heads(), 8);
  EXPECT_EQ(d.rope_theta, 1e6);
  EXPECT_FALSE(d.rope_scaling.has_value());
  EXPECT_EQ(d.max_seq_len, 32768);
  EXPECT_EQ(d.family, "mixtral");
  const ModelSizes z = model_spec("mixtral").sizes("debugmodel", 64);
  EXPECT_EQ(z.kv_dim, 16 * 16);
  EXPECT_EQ(z.ffn, 2 * 768);  // top-2 experts of width 768
  const HFModelConfig c = model_spec("mixtral").hf_config("debugmodel", 2048);
  EXPECT_EQ(c.architecture, "MixtralForCausalLM");
  EXPECT_EQ(c.num_key_value_heads, 16);
  EXPECT_EQ(c.intermediate_size, 768);
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_FALSE(c.rope_scaling.has_value());
}

// ---- the real executables ----------------------------------------------------------------------
class Llama2E2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_family_e2e_" + std::to_string(getpid()));
    fs::create_directories(root_);
    corpus_ = ctitan::testing::make_corpus(root_ / "data");
    tokenizer_ = (root_ / "tok.model").string();
    auto r = ctitan::testing::sh(ctitan::testing::kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ +
                                 " 300");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(root_);
  }
  static std::string args(const std::string& dump, int steps, const std::string& extra,
                          const std::string& model = "llama2") {
    return "--job.config_file " + ctitan::testing::kSrc + "/train_configs/debug_model.toml --model.name " + model +
           " --model.tokenizer_path " + tokenizer_ + " --training.dataset_path " + corpus_ + " --job.dump_folder " +
           dump + " --training.steps " + std::to_string(steps) +
           " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1 --debug.seed 7"
           " --debug.deterministic --comm.train_timeout_seconds 60 " +
           extra;
  }
  // n ranks of train (no launcher).
  static std::vector<ctitan::testing::RankResult> train(int n, const std::string& a,
                                                        std::map<std::string, std::string> env = {}) {
    std::vector<std::string> argv = {ctitan::testing::kTrain};
    std::istringstream is(a);
    for (std::string w; is >> w;) argv.push_back(w);
    return ctitan::testing::spawn_processes(argv, n, env, 180);
  }
  static std::string tool() { return (fs::path(ctitan::testing::kTrain).parent_path() / "checkpoint_tool").string(); }

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path Llama2E2E::root_;
std::string Llama2E2E::corpus_, Llama2E2E::tokenizer_;

TEST_F(Llama2E2E, UnknownModelNameIsAUserErrorListingTheFamilies) {
  auto r = ctitan::testing::sh(ctitan::testing::kTrain + " " + args((root_ / "bad").string(), 1, "", "gpt2"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config error: model.name = \"gpt2\" is not one of: llama3, mixtral, llama2"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(root_ / "bad")) << "bad input writes nothing";
}

// Trains, checkpoints, resumes (steps 5-6 bitwise as the first time), exports to HF and loads
// the export back.
TEST_F(Llama2E2E, TrainsResumesExportsToHuggingFaceAndLoadsBack) {
  // The schedule depends on training.steps: resume within one 6-step run (its step-6 removed).
  const std::string run = (root_ / "run").string();
  const std::string ck = " --checkpoint.enable --checkpoint.interval 2 --checkpoint.last_save_model_only false";
  auto first = train(2, args(run, 6, ck));
  ASSERT_TRUE(ctitan::testing::all_ok(first));
  EXPECT_NE(first[0].output.find("model: llama2 debugmodel"), std::string::npos) << first[0].output;
  const auto want = ctitan::testing::jsonl_field(run + "/metrics.jsonl", "loss");
  ASSERT_EQ(want.size(), 6u);
  fs::remove_all(run + "/checkpoint/step-6");
  auto resumed = train(2, args(run, 6, ck));
  ASSERT_TRUE(ctitan::testing::all_ok(resumed));
  EXPECT_NE(resumed[0].output.find("checkpoint: loaded step 4"), std::string::npos) << resumed[0].output;
  const auto got = ctitan::testing::jsonl_field(run + "/metrics.jsonl", "loss");
  ASSERT_EQ(got.size(), 8u);  // steps 1-6, then 5-6 again after the resume
  EXPECT_EQ(std::vector<std::string>(got.begin() + 6, got.end()),
            std::vector<std::string>(want.begin() + 4, want.end()));
  const std::string step = run + "/checkpoint/step-6";
  CheckpointReader saved(step);
  EXPECT_EQ(saved.meta().model_name, "llama2");
  EXPECT_EQ(saved.meta().model_flavor, "debugmodel");

  // Export through checkpoint_tool: LlamaForCausalLM without GQA or rope scaling.
  const std::string hf = (root_ / "hf").string();
  auto conv = ctitan::testing::sh(tool() + " convert " + step + " " + hf + " --to hf");
  ASSERT_EQ(conv.code, 0) << conv.out;
  const std::string cfg = ckpt::read_whole_file(hf + "/config.json");
  for (const char* field : {"\"architectures\": [\"LlamaForCausalLM\"]", "\"model_type\": \"llama\"",
                            "\"num_attention_heads\": 16", "\"num_key_value_heads\": 16", "\"num_hidden_layers\": 8",
                            "\"intermediate_size\": 768", "\"rope_theta\": 10000.0", "\"rope_scaling\": null",
                            "\"max_position_embeddings\": 4096", "\"vocab_size\": 2048"})
    EXPECT_NE(cfg.find(field), std::string::npos) << field << "\n" << cfg;
  auto inspect = ctitan::testing::sh(tool() + " inspect " + hf + " --verify");
  ASSERT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("ctitan model: llama2 debugmodel"), std::string::npos) << inspect.out;

  // Loaded back by checkpoint_tool: the same logits as the checkpoint, bit for bit.
  const std::string la = (root_ / "la.safetensors").string(), lb = (root_ / "lb.safetensors").string();
  auto a = ctitan::testing::sh(tool() + " logits " + step + " 1,5,9,200,3 " + la);
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = ctitan::testing::sh(tool() + " logits " + hf + " 1,5,9,200,3 " + lb);
  ASSERT_EQ(b.code, 0) << b.out;
  const auto fa = safetensors::read_header(la), fb = safetensors::read_header(lb);
  EXPECT_EQ(ckpt::read_whole_file(la).substr(fa.data_start), ckpt::read_whole_file(lb).substr(fb.data_start));

  // Loaded back by train (initial_load_in_hf, 2 ranks): what the job holds equals step 6.
  const std::string dump = (root_ / "import").string(), loaded = dump + "/loaded";
  const std::string load = "--checkpoint.enable --checkpoint.initial_load_in_hf --checkpoint.initial_load_path ";
  auto imp = train(2, args(dump, 1, load + hf), {{"CTITAN_CHECKPOINT_DUMP_LOADED", loaded}});
  ASSERT_TRUE(ctitan::testing::all_ok(imp));
  CheckpointReader back(loaded + "/step-6");
  EXPECT_EQ(back.meta().entries.size(),
            hf_adapter().params(hf_adapter().config_for("llama2", "debugmodel", 2048)).size());
  for (const auto& [fqn, e] : back.meta().entries)
    EXPECT_TRUE(torch::equal(back.read_tensor(fqn), saved.read_tensor(fqn))) << fqn;
}
