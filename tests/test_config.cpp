// Tests of config/: defaults, TOML + command line (precedence, syntax), the exact text of
// every user error, a torchtitan v0.2.x debug_model.toml, the TOML dump round trip,
// --help coverage and check_supported().
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "config/config_value.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "util/text.h"

namespace ctitan {
namespace {

JobConfig parse_toml(const std::string& text, const std::string& name = "cfg.toml") {
  std::istringstream in(text);
  return parse_job_config_toml(in, name);
}

// The UserError message of parsing `text` (or "no error").
std::string toml_error(const std::string& text) {
  try {
    parse_toml(text);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

std::string cli_error(const std::vector<std::string>& args) {
  try {
    load_job_config(args);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

std::string supported_error(const JobConfig& cfg) {
  try {
    check_supported(cfg);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

// A file under the test's temporary directory holding `text`.
// A config file in the test's temp folder, removed when the test program exits.
std::string write_temp(const std::string& name, const std::string& text) {
  struct Made {
    std::vector<std::string> paths;
    ~Made() {
      for (const auto& p : paths) std::remove(p.c_str());
    }
  };
  static Made made;
  const std::string path = testing::TempDir() + "ctitan_cfg_" + std::to_string(getpid()) + "_" + name;
  std::ofstream(path) << text;
  made.paths.push_back(path);
  return path;
}

// torchtitan v0.2.x's torchtitan/models/llama3/train_configs/debug_model.toml: the same
// tables, keys and values (comments as in that file's style).
const char* const kDebugModelToml = R"(# torchtitan Config.toml

[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = '2'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
)";

// ---------------------------------------------------------------------------------------

TEST(ConfigDefaults, MatchTorchtitanAndCtitanChoices) {
  const JobConfig c;
  EXPECT_EQ(c.job.config_file, "");
  EXPECT_EQ(c.job.dump_folder, "./outputs");
  EXPECT_EQ(c.job.description, "default job");
  EXPECT_FALSE(c.job.print_config);
  EXPECT_EQ(c.model.name, "llama3");
  EXPECT_EQ(c.model.flavor, "debugmodel");
  EXPECT_EQ(c.model.hf_assets_path, "./tests/assets/tokenizer");
  EXPECT_EQ(c.model.tokenizer_path, "");
  EXPECT_TRUE(c.model.converters.empty());
  EXPECT_EQ(c.optimizer.name, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 8e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.optimizer.implementation, "fused");
  EXPECT_FALSE(c.optimizer.early_step_in_backward);
  EXPECT_EQ(c.lr_scheduler.warmup_steps, 200);
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_EQ(c.lr_scheduler.decay_type, "linear");
  EXPECT_DOUBLE_EQ(c.lr_scheduler.min_lr_factor, 0.0);
  EXPECT_EQ(c.training.dataset, "moby_dick");  // ctitan's default corpus (torchtitan: c4_test)
  EXPECT_EQ(c.training.dataset_path, "");
  EXPECT_EQ(c.training.local_batch_size, 8);
  EXPECT_EQ(c.training.global_batch_size, -1);
  EXPECT_EQ(c.training.seq_len, 2048);
  EXPECT_DOUBLE_EQ(c.training.max_norm, 1.0);
  EXPECT_EQ(c.training.steps, 10000);
  EXPECT_EQ(c.training.mixed_precision_param, "bfloat16");
  EXPECT_EQ(c.training.mixed_precision_reduce, "float32");
  EXPECT_FALSE(c.training.enable_cpu_offload);
  EXPECT_EQ(c.training.gc_freq, 50);
  EXPECT_EQ(c.training.dataloader.num_workers, 0);
  EXPECT_EQ(c.metrics.log_freq, 10);
  EXPECT_EQ(c.parallelism.data_parallel_replicate_degree, 1);
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  EXPECT_EQ(c.parallelism.tensor_parallel_degree, 1);
  EXPECT_EQ(c.parallelism.pipeline_parallel_degree, 1);
  EXPECT_EQ(c.parallelism.context_parallel_degree, 1);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "default");
  EXPECT_FALSE(c.checkpoint.enable);
  EXPECT_EQ(c.checkpoint.folder, "checkpoint");
  EXPECT_EQ(c.checkpoint.interval, 500);
  EXPECT_EQ(c.checkpoint.keep_latest_k, 10);
  EXPECT_EQ(c.checkpoint.load_step, -1);
  EXPECT_TRUE(c.checkpoint.exclude_from_loading.empty());
  EXPECT_TRUE(c.checkpoint.last_save_model_only);
  EXPECT_TRUE(c.checkpoint.initial_load_model_only);
  EXPECT_EQ(c.checkpoint.export_dtype, "float32");
  EXPECT_EQ(c.checkpoint.async_mode, "disabled");
  EXPECT_EQ(c.activation_checkpoint.mode, ACMode::Selective);
  EXPECT_EQ(c.activation_checkpoint.selective_ac_option, "2");
  EXPECT_FALSE(c.activation_checkpoint.preserve_rng_state);
  EXPECT_EQ(c.activation_checkpoint.determinism_check, "default");
  EXPECT_FALSE(c.compile.enable);
  EXPECT_EQ(c.compile.components, (std::vector<std::string>{"model", "loss"}));
  EXPECT_EQ(c.quantize.linear.mx.filter_fqns, (std::vector<std::string>{"output"}));
  EXPECT_EQ(c.comm.init_timeout_seconds, 300);
  EXPECT_EQ(c.comm.train_timeout_seconds, 100);
  EXPECT_EQ(c.comm.trace_buf_size, 20000);
  EXPECT_FALSE(c.validation.enable);
  EXPECT_EQ(c.validation.steps, -1);
  EXPECT_FALSE(c.debug.seed.has_value());
  EXPECT_FALSE(c.debug.deterministic);
}

TEST(ConfigDefaults, NoArgumentsGiveTheDefaults) {
  const ConfigLoadResult r = load_job_config({});
  EXPECT_FALSE(r.help_requested);
  EXPECT_EQ(r.config, JobConfig());
  EXPECT_EQ(parse_toml(""), JobConfig());
}

TEST(ConfigLoad, PrecedenceIsCommandLineThenTomlThenDefaults) {
  const std::string path = write_temp("prec.toml",
                                      "[training]\nsteps = 50\nseq_len = 256\n"
                                      "[optimizer]\nlr = 1e-3\n");
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--job.config_file", path, "--training.steps", "7"},
           {"--training.steps", "7", "--job.config_file", path}}) {  // order does not matter
    const JobConfig c = load_job_config(args).config;
    EXPECT_EQ(c.training.steps, 7);             // command line
    EXPECT_EQ(c.training.seq_len, 256);         // TOML
    EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);     // TOML
    EXPECT_EQ(c.training.local_batch_size, 8);  // default
    EXPECT_EQ(c.job.config_file, path);
  }
}

TEST(ConfigLoad, EqualsAndSpaceSeparatedValues) {
  const JobConfig c = load_job_config({"--training.seq_len=128", "--model.flavor", "8B", "--job.description=a b=c",
                                       "--parallelism.data_parallel_shard_degree", "-1",
                                       "--lr_scheduler.decay_ratio=0.25", "--optimizer.lr", "3"})
                          .config;
  EXPECT_EQ(c.training.seq_len, 128);
  EXPECT_EQ(c.model.flavor, "8B");
  EXPECT_EQ(c.job.description, "a b=c");
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  ASSERT_TRUE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_DOUBLE_EQ(*c.lr_scheduler.decay_ratio, 0.25);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3.0);  // an integer is a fine float

  // None resets an optional that the TOML set; the last occurrence of a flag wins.
  const std::string path = write_temp("none.toml", "[lr_scheduler]\ndecay_ratio = 0.8\n[debug]\nseed = 3\n");
  const JobConfig d = load_job_config({"--job.config_file", path, "--lr_scheduler.decay_ratio", "None", "--debug.seed",
                                       "5", "--debug.seed=9"})
                          .config;
  EXPECT_FALSE(d.lr_scheduler.decay_ratio.has_value());
  EXPECT_EQ(d.debug.seed, std::optional<int64_t>(9));
}

TEST(ConfigLoad, ListsAreCommaSeparated) {
  const JobConfig c = load_job_config({"--model.converters", "float8, mx,,", "--compile.components=model",
                                       "--checkpoint.exclude_from_loading=", "--parallelism.module_fqns_per_model_part",
                                       "tok_embeddings,layers.0;layers.1"})
                          .config;
  EXPECT_EQ(c.model.converters, (std::vector<std::string>{"float8", "mx"}));
  EXPECT_EQ(c.compile.components, (std::vector<std::string>{"model"}));
  EXPECT_TRUE(c.checkpoint.exclude_from_loading.empty());
  EXPECT_EQ(c.parallelism.module_fqns_per_model_part,
            (std::vector<std::vector<std::string>>{{"tok_embeddings", "layers.0"}, {"layers.1"}}));

  const JobConfig t = parse_toml("[checkpoint]\nexclude_from_loading = [\"optimizer\", \"dataloader\"]\n");
  EXPECT_EQ(t.checkpoint.exclude_from_loading, (std::vector<std::string>{"optimizer", "dataloader"}));

  config_detail::IntList ints;
  EXPECT_TRUE(config_detail::parse_text("1, 2,-3", ints));
  EXPECT_EQ(ints, (config_detail::IntList{1, 2, -3}));
  EXPECT_FALSE(config_detail::parse_text("1,x", ints));
  EXPECT_EQ(config_detail::render(ints), "[1, 2, -3]");
}

TEST(ConfigLoad, BoolFlags) {
  EXPECT_TRUE(load_job_config({"--checkpoint.enable"}).config.checkpoint.enable);
  const JobConfig c = load_job_config({"--checkpoint.enable", "--training.steps", "3"}).config;
  EXPECT_TRUE(c.checkpoint.enable);
  EXPECT_EQ(c.training.steps, 3);
  EXPECT_TRUE(load_job_config({"--checkpoint.enable", "true"}).config.checkpoint.enable);
  EXPECT_FALSE(load_job_config({"--checkpoint.enable", "false"}).config.checkpoint.enable);
  EXPECT_FALSE(load_job_config({"--checkpoint.enable=false"}).config.checkpoint.enable);
  EXPECT_FALSE(load_job_config({"--checkpoint.no_initial_load_model_only"}).config.checkpoint.initial_load_model_only);
  // Legacy spellings work on the command line too.
  EXPECT_TRUE(load_job_config({"--checkpoint.enable_checkpoint"}).config.checkpoint.enable);
  EXPECT_TRUE(load_job_config({"--job.print_args"}).config.job.print_config);
  EXPECT_TRUE(load_job_config({"--job.print_config"}).config.job.print_config);
}

TEST(ConfigLoad, HelpFlag) {
  EXPECT_TRUE(load_job_config({"--help"}).help_requested);
  EXPECT_TRUE(load_job_config({"--training.steps", "3", "-h"}).help_requested);
  EXPECT_FALSE(load_job_config({"--training.steps", "3"}).help_requested);
}

// ---- the exact text of each user error ----------------------------------------------------

TEST(ConfigErrors, UnknownKeySectionAndFlag) {
  std::string doc = "[training]\n";
  for (int i = 2; i <= 11; ++i) doc += "# line " + std::to_string(i) + "\n";
  doc += "seq_length = 512\n";  // line 12
  EXPECT_EQ(toml_error(doc),
            "config error: cfg.toml:12: unknown key training.seq_length (did you mean "
            "training.seq_len?)");
  EXPECT_EQ(toml_error("[trainig]\nsteps = 1\n"),
            "config error: cfg.toml:1: unknown section [trainig] (did you mean [training]?)");
  // Same key name in another table: an older torchtitan layout.
  EXPECT_EQ(toml_error("[training]\nwarmup_steps = 2\n"),
            "config error: cfg.toml:2: unknown key training.warmup_steps (did you mean "
            "lr_scheduler.warmup_steps?)");
  EXPECT_EQ(toml_error("[training]\nxyzzy = 2\n"), "config error: cfg.toml:2: unknown key training.xyzzy");
  EXPECT_EQ(cli_error({"--training.seq_length", "5"}),
            "config error: command line: unknown option --training.seq_length (did you mean "
            "--training.seq_len?)");
  EXPECT_EQ(cli_error({"--training.no_steps"}),
            "config error: command line: unknown option --training.no_steps (did you mean "
            "--training.steps?)");
}

TEST(ConfigErrors, WrongType) {
  EXPECT_EQ(toml_error("[job]\n\n\n[training]\nsteps = \"ten\"\n"),
            "config error: cfg.toml:5: training.steps = \"ten\" has type string, expected integer");
  EXPECT_EQ(toml_error("[training]\nseq_len = 2048.0\n"),
            "config error: cfg.toml:2: training.seq_len = 2048.0 has type float, expected integer");
  EXPECT_EQ(toml_error("[compile]\ncomponents = [\"model\", 1]\n"),
            "config error: cfg.toml:2: compile.components = [\"model\", 1] has type array of mixed "
            "types, "
            "expected array of strings");
  EXPECT_EQ(toml_error("[checkpoint]\nenable = \"yes\"\n"),
            "config error: cfg.toml:2: checkpoint.enable = \"yes\" has type string, expected boolean");
  EXPECT_EQ(toml_error("training = 5\n"),
            "config error: cfg.toml:1: training = 5 has type integer, expected table [training]");
  EXPECT_EQ(cli_error({"--training.steps", "ten"}),
            "config error: command line: training.steps = \"ten\" is not a valid integer");
  EXPECT_EQ(cli_error({"--training.steps=1.5"}),
            "config error: command line: training.steps = \"1.5\" is not a valid integer");
  EXPECT_EQ(cli_error({"--checkpoint.enable", "yes"}),
            "config error: command line: checkpoint.enable = \"yes\" is not a valid boolean (true "
            "or false)");
  // Integers are fine for float keys.
  EXPECT_DOUBLE_EQ(parse_toml("[training]\nmax_norm = 2\n").training.max_norm, 2.0);
}

TEST(ConfigErrors, InvalidChoice) {
  EXPECT_EQ(cli_error({"--lr_scheduler.decay_type", "exp"}),
            "config error: command line: lr_scheduler.decay_type = \"exp\" is not one of: linear, "
            "sqrt, cosine");
  // model.name is checked against the model registry where the model is built
  // (tests/test_model_family.cpp), not here.
  EXPECT_EQ(parse_toml("[model]\nname = \"gpt2\"\n").model.name, "gpt2");
  EXPECT_EQ(toml_error("[compile]\ncomponents = [\"model\", \"los\"]\n"),
            "config error: cfg.toml:2: compile.components = [\"model\", \"los\"] contains \"los\", "
            "which is "
            "not one of: model, loss");
  EXPECT_EQ(toml_error("[quantize.linear.float8]\nrecipe_name = \"colwise\"\n"),
            "config error: cfg.toml:2: quantize.linear.float8.recipe_name = \"colwise\" is not one of: "
            "tensorwise, rowwise, rowwise_with_gw_hp (or \"\" for None)");
  EXPECT_EQ(toml_error("[activation_checkpoint]\nselective_ac_option = \"0\"\n"),
            "config error: cfg.toml:2: activation_checkpoint.selective_ac_option = \"0\" is not valid "
            "(expected a positive integer or \"op\")");
  EXPECT_EQ(
      parse_toml("[activation_checkpoint]\nselective_ac_option = \"op\"\n").activation_checkpoint.selective_ac_option,
      "op");
  EXPECT_EQ(load_job_config({"--activation_checkpoint.selective_ac_option", "3"})
                .config.activation_checkpoint.selective_ac_option,
            "3");
}

// Enumerated keys are parsed once into their enum (config/job_config.h: KeyEnum): a bad value
// is refused with the line of any string key outside its choices, and the dump, --help and
// check_supported spell the value as the config does.
TEST(ConfigEnums, ParsedOnceIntoTheEnumAndSpelledAsWritten) {
  const JobConfig c = load_job_config({"--activation_checkpoint.mode", "full", "--training.on_nonfinite", "skip",
                                       "--training.on_bad_document=skip", "--checkpoint.on_save_failure", "continue"})
                          .config;
  EXPECT_EQ(c.activation_checkpoint.mode, ACMode::Full);
  EXPECT_EQ(c.training.on_nonfinite, NonfinitePolicy::Skip);
  EXPECT_EQ(c.training.on_bad_document, BadDocumentPolicy::Skip);
  EXPECT_EQ(c.checkpoint.on_save_failure, SaveFailurePolicy::Continue);
  EXPECT_EQ(parse_toml("[activation_checkpoint]\nmode = \"none\"\n").activation_checkpoint.mode, ACMode::None);
  EXPECT_EQ(cli_error({"--activation_checkpoint.mode", "fast"}),
            "config error: command line: activation_checkpoint.mode = \"fast\" is not one of: selective, full, "
            "memory_budget, none");
  EXPECT_EQ(toml_error("[training]\non_nonfinite = \"retry\"\n"),
            "config error: cfg.toml:2: training.on_nonfinite = \"retry\" is not one of: stop, skip");
  EXPECT_EQ(toml_error("[activation_checkpoint]\nmode = 1\n"),
            "config error: cfg.toml:2: activation_checkpoint.mode = 1 has type integer, expected string");
  const std::string text = job_config_to_toml(c);
  EXPECT_NE(text.find("\n[activation_checkpoint]\nmode = \"full\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\non_nonfinite = \"skip\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\non_save_failure = \"continue\"\n"), std::string::npos) << text;
  EXPECT_EQ(parse_toml(text, "dump.toml"), c);
  EXPECT_NE(job_config_help().find("--activation_checkpoint.mode  string = \"selective\""), std::string::npos);
  EXPECT_EQ(key_name(ACMode::MemoryBudget), std::string("memory_budget"));
  ACMode m = ACMode::None;
  EXPECT_FALSE(key_value("Full", m));
  EXPECT_EQ(m, ACMode::None);
}

TEST(ConfigErrors, OutOfRange) {
  EXPECT_EQ(toml_error("[training]\nsteps = 5\n\n\n\n\nseq_len = 0\n"),
            "config error: cfg.toml:7: training.seq_len = 0 is out of range (must be >= 1)");
  EXPECT_EQ(toml_error("[checkpoint]\nkeep_latest_k = 1\n"),
            "config error: cfg.toml:2: checkpoint.keep_latest_k = 1 is out of range (must be >= 0 "
            "and != 1: "
            "the newest checkpoint may still be being written when older ones are purged, so keep "
            "at least 2)");
  EXPECT_EQ(toml_error("[lr_scheduler]\ndecay_ratio = 1.5\n"),
            "config error: cfg.toml:2: lr_scheduler.decay_ratio = 1.5 is out of range (must be >= "
            "0 and <= 1)");
  EXPECT_EQ(cli_error({"--optimizer.eps=0"}),
            "config error: command line: optimizer.eps = 0.0 is out of range (must be > 0)");
  EXPECT_EQ(cli_error({"--parallelism.data_parallel_shard_degree", "0"}),
            "config error: command line: parallelism.data_parallel_shard_degree = 0 is out of "
            "range (must be -1 "
            "or >= 1)");
  EXPECT_EQ(cli_error({"--parallelism.tensor_parallel_degree", "-1"}),
            "config error: command line: parallelism.tensor_parallel_degree = -1 is out of range "
            "(must be >= 1)");
  EXPECT_EQ(cli_error({"--optimizer.beta2", "1"}),
            "config error: command line: optimizer.beta2 = 1.0 is out of range (must be >= 0 and < 1)");
  EXPECT_EQ(cli_error({"--comm.train_timeout_seconds", "0"}),
            "config error: command line: comm.train_timeout_seconds = 0 is out of range (must be >= 1)");
  EXPECT_EQ(cli_error({"--checkpoint.interval", "0"}),
            "config error: command line: checkpoint.interval = 0 is out of range (must be >= 1)");
  EXPECT_EQ(cli_error({"--optimizer.lr", "nan"}),
            "config error: command line: optimizer.lr = nan is out of range (must be >= 0)");
  EXPECT_EQ(load_job_config({"--checkpoint.keep_latest_k", "0"}).config.checkpoint.keep_latest_k, 0);
  EXPECT_EQ(load_job_config({"--checkpoint.keep_latest_k", "2"}).config.checkpoint.keep_latest_k, 2);
}

TEST(ConfigErrors, MalformedTomlAndMissingFile) {
  EXPECT_EQ(toml_error("[job]\n\nx = \n"),
            "config error: cfg.toml:3: malformed TOML: missing value after key-value separator '='");
  EXPECT_EQ(toml_error("[job]\ndescription = \"a\"\ndescription = \"b\"\n"),
            "config error: cfg.toml:3: malformed TOML: value (\"description\") already exists.");
  const std::string missing = testing::TempDir() + "ctitan_no_such_dir/missing.toml";
  EXPECT_EQ(cli_error({"--job.config_file", missing}),
            "config error: --job.config_file: cannot open " + missing + ": No such file or directory");
  // Errors in a file loaded from the command line name that file.
  const std::string path = write_temp("bad.toml", "[training]\nsteps = -3\n");
  EXPECT_EQ(cli_error({"--job.config_file=" + path}),
            "config error: " + path + ":2: training.steps = -3 is out of range (must be >= 1)");
}

TEST(ConfigErrors, CommandLineSyntax) {
  EXPECT_EQ(cli_error({"--training.steps"}), "config error: command line: --training.steps needs a value (integer)");
  EXPECT_EQ(cli_error({"--training.steps", "--training.seq_len", "5"}),
            "config error: command line: --training.steps needs a value (integer)");
  EXPECT_EQ(cli_error({"foo"}),
            "config error: command line: unexpected argument \"foo\" (options are --section.key VALUE or "
            "--section.key=VALUE)");
  EXPECT_EQ(cli_error({"--training.steps", "3", "extra"}),
            "config error: command line: unexpected argument \"extra\" (options are --section.key "
            "VALUE or "
            "--section.key=VALUE)");
  EXPECT_EQ(cli_error({"-x"}), "config error: command line: unknown option -x");
  EXPECT_EQ(cli_error({"--checkpoint.no_enable=true"}),
            "config error: command line: --checkpoint.no_enable takes no value");
}

TEST(ConfigErrors, FirstProblemByLineAndOneLineEach) {
  // Three problems; the one on the earliest line is reported.
  const std::string doc = "[training]\nseq_len = 0\nsteps = \"x\"\nbogus = 1\n";
  EXPECT_EQ(toml_error(doc), "config error: cfg.toml:2: training.seq_len = 0 is out of range (must be >= 1)");
  for (const std::string& msg :
       {toml_error(doc), toml_error("[job]\n\nx = \n"), cli_error({"--nope"}), cli_error({"--training.steps", "x"})})
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(ConfigErrors, LegacyAndCurrentSpellingOfOneKey) {
  EXPECT_EQ(toml_error("[checkpoint]\nenable = true\nenable_checkpoint = false\n"),
            "config error: cfg.toml:3: checkpoint.enable_checkpoint and checkpoint.enable (line 2) "
            "are the same "
            "key checkpoint.enable (one is its legacy spelling); keep one");
}

// ---- torchtitan TOMLs ---------------------------------------------------------------------

TEST(ConfigTorchtitan, DebugModelTomlOfV02Parses) {
  const JobConfig c = parse_toml(kDebugModelToml, "debug_model.toml");
  EXPECT_EQ(c.job.dump_folder, "./outputs");
  EXPECT_EQ(c.job.description, "Llama 3 debug training");
  EXPECT_FALSE(c.job.print_config);
  EXPECT_EQ(c.profiling.save_traces_folder, "profile_trace");
  EXPECT_EQ(c.profiling.profile_freq, 10);
  EXPECT_EQ(c.metrics.log_freq, 1);
  EXPECT_EQ(c.model.name, "llama3");
  EXPECT_EQ(c.model.flavor, "debugmodel");
  EXPECT_EQ(c.model.hf_assets_path, "./tests/assets/tokenizer");
  EXPECT_TRUE(c.model.converters.empty());
  EXPECT_EQ(c.optimizer.name, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 8e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.lr_scheduler.warmup_steps, 2);
  ASSERT_TRUE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_DOUBLE_EQ(*c.lr_scheduler.decay_ratio, 0.8);
  EXPECT_EQ(c.lr_scheduler.decay_type, "linear");
  EXPECT_DOUBLE_EQ(c.lr_scheduler.min_lr_factor, 0.0);
  EXPECT_EQ(c.training.local_batch_size, 8);
  EXPECT_EQ(c.training.seq_len, 2048);
  EXPECT_DOUBLE_EQ(c.training.max_norm, 1.0);
  EXPECT_EQ(c.training.steps, 10);
  EXPECT_EQ(c.training.dataset, "c4_test");
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "default");
  EXPECT_FALSE(c.checkpoint.enable);
  EXPECT_EQ(c.checkpoint.interval, 10);
  EXPECT_FALSE(c.checkpoint.last_save_model_only);
  EXPECT_EQ(c.checkpoint.export_dtype, "float32");
  EXPECT_EQ(c.checkpoint.async_mode, "disabled");
  EXPECT_EQ(c.activation_checkpoint.mode, ACMode::Selective);
  EXPECT_EQ(c.activation_checkpoint.selective_ac_option, "2");
  EXPECT_FALSE(c.compile.enable);
  EXPECT_EQ(c.compile.components, (std::vector<std::string>{"model", "loss"}));
  EXPECT_FALSE(c.quantize.linear.float8.enable_fsdp_float8_all_gather);
  EXPECT_EQ(c.quantize.linear.float8.filter_fqns, (std::vector<std::string>{"output"}));
  EXPECT_FALSE(c.validation.enable);
  EXPECT_EQ(c.validation.dataset, "c4_validation");
  EXPECT_EQ(c.validation.freq, 5);
  EXPECT_EQ(c.validation.steps, 10);
  // Keys the file does not set keep their defaults.
  EXPECT_EQ(c.comm.init_timeout_seconds, 300);
  EXPECT_FALSE(c.debug.seed.has_value());
  // Everything it sets is something ctitan runs (selective AC included).
  EXPECT_EQ(supported_error(c), "no error");
}

// Every config shipped in train_configs/ parses, names an existing flavor's model, and asks
// only for features ctitan runs.
TEST(ConfigShipped, EveryTrainConfigParsesAndIsSupported) {
  const std::string dir = std::string(CTITAN_SOURCE_DIR) + "/train_configs/";
  const char* names[] = {"debug_model.toml", "llama3_8b.toml",     "llama3_70b.toml",
                         "llama3_405b.toml", "mixtral_debug.toml", "mixtral_8x7b.toml"};
  for (const char* n : names) {
    std::ifstream in(dir + n);
    ASSERT_TRUE(in.good()) << n;
    JobConfig c;
    try {
      c = parse_job_config_toml(in, n);
    } catch (const UserError& e) {
      ADD_FAILURE() << e.what();
      continue;
    }
    EXPECT_EQ(supported_error(c), "no error") << n;
    EXPECT_EQ(c.model.name, std::string(n).rfind("mixtral", 0) == 0 ? "mixtral" : "llama3") << n;
  }
}

TEST(ConfigTorchtitan, OlderSpellingsAreReadAsTheCurrentKeys) {
  const JobConfig c = parse_toml(
      "[job]\nprint_args = true\nuse_for_integration_test = true\n"
      "[lr_scheduler]\nlr_min = 0.1\n"
      "[training]\nbatch_size = 4\nseed = 42\ndeterministic = true\n"
      "[checkpoint]\nenable_checkpoint = true\nmodel_weights_only = false\n"
      "[float8]\nenable_fsdp_float8_all_gather = true\nfilter_fqns = [\"output\"]\n"
      "[validation]\nenabled = true\n");
  EXPECT_TRUE(c.job.print_config);
  EXPECT_DOUBLE_EQ(c.lr_scheduler.min_lr_factor, 0.1);
  EXPECT_EQ(c.training.local_batch_size, 4);
  EXPECT_EQ(c.debug.seed, std::optional<int64_t>(42));
  EXPECT_TRUE(c.debug.deterministic);
  EXPECT_TRUE(c.checkpoint.enable);
  EXPECT_FALSE(c.checkpoint.last_save_model_only);
  EXPECT_TRUE(c.quantize.linear.float8.enable_fsdp_float8_all_gather);
  EXPECT_EQ(c.quantize.linear.float8.filter_fqns, (std::vector<std::string>{"output"}));
  EXPECT_TRUE(c.validation.enable);
  EXPECT_EQ(toml_error("[float8]\nforce_recompute_fp8_weight_in_bwd = true\n"),
            "config error: cfg.toml:2: unknown key float8.force_recompute_fp8_weight_in_bwd");
}

// ---- dump, help, supported ----------------------------------------------------------------

TEST(ConfigDump, TomlRoundTripGivesAnEqualConfig) {
  JobConfig c;
  c.job.description = "quote \" backslash \\ newline \n tab \t end";
  c.job.validate_only = true;
  c.model.converters = {"float8", "mx"};
  c.model.tokenizer_path = "/data/tok.model";
  c.optimizer.lr = 3e-4;
  c.optimizer.eps = 1e-15;
  c.optimizer.weight_decay = 0.1 + 0.2;  // not exactly 0.3: needs all 17 digits
  c.lr_scheduler.decay_ratio = 0.8;
  c.lr_scheduler.decay_type = "cosine";
  c.training.steps = 123456789012LL;
  c.training.max_norm = 0.0;
  c.training.dataloader.prefetch_factor = 4;
  c.parallelism.data_parallel_shard_degree = 4;
  c.parallelism.module_fqns_per_model_part = {{"tok_embeddings", "layers.0"}, {"norm", "output"}};
  c.checkpoint.enable = true;
  c.checkpoint.exclude_from_loading = {"optimizer"};
  c.compile.components = {};
  c.debug.seed = -7;

  const std::string text = job_config_to_toml(c);
  const JobConfig back = parse_toml(text, "dump.toml");
  EXPECT_EQ(back, c) << text;
  EXPECT_EQ(back.job.description, c.job.description);
  EXPECT_EQ(back.optimizer.weight_decay, c.optimizer.weight_decay);  // bit-exact
  EXPECT_EQ(back.debug.seed, std::optional<int64_t>(-7));
  EXPECT_EQ(back.training.dataloader.prefetch_factor, std::optional<int64_t>(4));
  EXPECT_EQ(back.parallelism.module_fqns_per_model_part, c.parallelism.module_fqns_per_model_part);
  EXPECT_TRUE(back.compile.components.empty());

  // Defaults round-trip too (None values are comments), and a changed key is noticed.
  EXPECT_EQ(parse_toml(job_config_to_toml(JobConfig())), JobConfig());
  JobConfig other = back;
  other.validation.dataloader.pin_memory = true;
  EXPECT_NE(other, back);
  EXPECT_NE(text.find("\n[quantize.linear.float8]\n"), std::string::npos);
  EXPECT_NE(text.find("\ndecay_ratio = 0.8\n"), std::string::npos);
  EXPECT_NE(job_config_to_toml(JobConfig()).find("\n# decay_ratio = None (unset)\n"), std::string::npos);
}

// `train --job.config_file my.toml --job.print_config > printed.toml` prints the effective
// config; `train --job.config_file printed.toml` must then train, not print it again.
TEST(ConfigDump, PrintedConfigRunsWithoutPrintingItselfAgain) {
  const JobConfig asked = load_job_config({"--job.print_config", "--training.steps", "7"}).config;
  ASSERT_TRUE(asked.job.print_config);
  const std::string text = job_config_to_toml(asked);
  EXPECT_EQ(text.find("print_config"), std::string::npos) << text;

  const std::string path = write_temp("printed.toml", text);
  const JobConfig again = load_job_config({"--job.config_file", path}).config;
  EXPECT_FALSE(again.job.print_config);
  EXPECT_EQ(again.training.steps, 7);
  JobConfig expected = asked;  // everything else as printed
  expected.job.print_config = false;
  expected.job.config_file = path;
  EXPECT_EQ(again, expected);
  EXPECT_NE(again, asked);  // operator== still compares print_config
}

TEST(ConfigHelp, MentionsEveryKeyWithTypeDefaultAndChoices) {
  const std::string help = job_config_help();
  const std::vector<std::string> keys = job_config_keys();
  EXPECT_GT(keys.size(), 150u);
  for (const std::string& k : keys) EXPECT_NE(help.find("  --" + k + "  "), std::string::npos) << k;
  // Every key the brief names exists.
  for (const char* k : {"job.config_file",
                        "job.dump_folder",
                        "job.description",
                        "job.print_config",
                        "model.name",
                        "model.flavor",
                        "model.hf_assets_path",
                        "model.tokenizer_path",
                        "model.converters",
                        "optimizer.implementation",
                        "optimizer.early_step_in_backward",
                        "lr_scheduler.decay_ratio",
                        "lr_scheduler.min_lr_factor",
                        "training.dataset_path",
                        "training.enable_cpu_offload",
                        "training.gc_freq",
                        "parallelism.fsdp_reshard_after_forward",
                        "checkpoint.enable",
                        "checkpoint.keep_latest_k",
                        "checkpoint.load_step",
                        "checkpoint.exclude_from_loading",
                        "checkpoint.last_save_model_only",
                        "checkpoint.export_dtype",
                        "checkpoint.initial_load_path",
                        "checkpoint.initial_load_model_only",
                        "checkpoint.initial_load_in_hf",
                        "checkpoint.last_save_in_hf",
                        "checkpoint.create_seed_checkpoint",
                        "checkpoint.enable_first_step_checkpoint",
                        "checkpoint.async_mode",
                        "activation_checkpoint.mode",
                        "activation_checkpoint.selective_ac_option",
                        "activation_checkpoint.preserve_rng_state",
                        "activation_checkpoint.determinism_check",
                        "compile.enable",
                        "compile.components",
                        "quantize.linear.float8.filter_fqns",
                        "comm.init_timeout_seconds",
                        "comm.train_timeout_seconds",
                        "comm.trace_buf_size",
                        "validation.enable",
                        "debug.seed",
                        "debug.deterministic",
                        "metrics.log_freq",
                        "profiling.enable_profiling"})
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  EXPECT_NE(help.find("  --lr_scheduler.decay_type  string = \"linear\"  [one of: linear, sqrt, cosine]\n"),
            std::string::npos);
  EXPECT_NE(help.find("  --training.seq_len  integer = 2048  [must be >= 1]\n      Sequence length "
                      "in tokens\n"),
            std::string::npos);
  EXPECT_NE(help.find("  --activation_checkpoint.mode  string = \"selective\"  [one of: selective, full, "
                      "memory_budget, none; ctitan supports: \"none\", \"full\", \"selective\"]"),
            std::string::npos);
  EXPECT_NE(help.find("  --lr_scheduler.decay_ratio  float or None = None"), std::string::npos);
  EXPECT_NE(help.find("  checkpoint.enable_checkpoint -> checkpoint.enable\n"), std::string::npos);
  EXPECT_NE(help.find("  job.print_args -> job.print_config\n"), std::string::npos);
  EXPECT_NE(help.find("job.use_for_integration_test"), std::string::npos);
}

TEST(ConfigSupported, FeaturesNotBuiltYetAreRefusedWithTheSupportedValues) {
  JobConfig ok;
  ok.activation_checkpoint.mode = ACMode::None;
  EXPECT_EQ(supported_error(ok), "no error");
  ok.training.mixed_precision_param = "bfloat16";  // allowed: ignored by the single-process path
  ok.parallelism.data_parallel_shard_degree = 1;
  EXPECT_EQ(supported_error(ok), "no error");

  auto refused = [&](auto change) {
    JobConfig c = ok;
    change(c);
    return supported_error(c);
  };
  // tensor_parallel_degree passes here: train checks its mesh and the model's sizes first,
  // then refuses it (tests/test_train.cpp: TensorParallelDegreeIsCheckedThenRefused).
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.tensor_parallel_degree = 2; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.enable_async_tensor_parallel = true; }),
            "not supported yet: parallelism.enable_async_tensor_parallel = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.pipeline_parallel_degree = 2; }),
            "not supported yet: parallelism.pipeline_parallel_degree = 2 (ctitan supports: 1)");
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.context_parallel_degree = 4; }),
            "not supported yet: parallelism.context_parallel_degree = 4 (ctitan supports: 1)");
  // FSDP and HSDP degrees are built.
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.data_parallel_shard_degree = 4; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.parallelism.data_parallel_replicate_degree = 2; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.compile.enable = true; }),
            "not supported yet: compile.enable = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.model.converters = {"float8"}; }),
            "not supported yet: model.converters = [\"float8\"] (ctitan supports: [])");
  EXPECT_EQ(refused([](JobConfig& c) { c.profiling.enable_profiling = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.profiling.profiler_active = 2; }),
            "not supported yet: profiling.profiler_active = 2 (ctitan supports: 1)");
  // TensorBoard and validation are built (components/tensorboard.h, components/validate.h);
  // W&B has no C++ client.
  EXPECT_EQ(refused([](JobConfig& c) { c.metrics.enable_tensorboard = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.metrics.save_for_all_ranks = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.metrics.enable_wandb = true; }),
            "not supported yet: metrics.enable_wandb = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.validation.enable = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) {
              c.validation.enable = true;
              c.validation.steps = -1;
              c.validation.freq = 5;
            }),
            "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.training.enable_cpu_offload = true; }),
            "not supported yet: training.enable_cpu_offload = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.optimizer.early_step_in_backward = true; }),
            "not supported yet: optimizer.early_step_in_backward = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.activation_checkpoint.mode = ACMode::Full; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.checkpoint.enable = true; }), "no error");
  // HF safetensors export and import are built (checkpoint/hf.h); quantized HF loads are not.
  EXPECT_EQ(refused([](JobConfig& c) { c.checkpoint.last_save_in_hf = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.checkpoint.initial_load_in_hf = true; }), "no error");
  EXPECT_EQ(refused([](JobConfig& c) { c.checkpoint.initial_load_in_hf_quantized = true; }),
            "not supported yet: checkpoint.initial_load_in_hf_quantized = true (ctitan supports: false)");
  EXPECT_EQ(refused([](JobConfig& c) { c.checkpoint.async_mode = "async_with_pinned_mem"; }),
            "not supported yet: checkpoint.async_mode = \"async_with_pinned_mem\" (ctitan supports: "
            "\"disabled\", \"async\")");
  EXPECT_EQ(refused([](JobConfig& c) { c.activation_checkpoint.mode = ACMode::MemoryBudget; }),
            "not supported yet: activation_checkpoint.mode = \"memory_budget\" (ctitan supports: "
            "\"none\", \"full\", \"selective\")");
  EXPECT_EQ(refused([](JobConfig& c) { c.lr_scheduler.total_steps = 100; }),
            "not supported yet: lr_scheduler.total_steps = 100 (ctitan supports: None)");
}

}  // namespace
}  // namespace ctitan

// Errors quote user input; printed through printable_line they stay one line of text.
TEST(ConfigText, PrintableLineEscapesControlAndNonUtf8Bytes) {
  EXPECT_EQ(ctitan::printable_line("plain, 港 🐳 é"), "plain, 港 🐳 é");
  EXPECT_EQ(ctitan::printable_line("a\nb\rc\td"), "a\\nb\\rc\\td");
  EXPECT_EQ(ctitan::printable_line(std::string("x\0y\x01\x7f", 5)), "x\\x00y\\x01\\x7f");
  EXPECT_EQ(ctitan::printable_line("caf\xe9 \xff\xfe \xc0\xaf \xe6\xb8"), "caf\\xe9 \\xff\\xfe \\xc0\\xaf \\xe6\\xb8");
  EXPECT_EQ(ctitan::printable_line("\xed\xa0\x80"), "\\xed\\xa0\\x80");          // a surrogate
  EXPECT_EQ(ctitan::invalid_utf8_at("ok \xf4\x8f\xbf\xbf"), std::string::npos);  // U+10FFFF
  EXPECT_EQ(ctitan::invalid_utf8_at("ok \xf4\x90\x80\x80"), 3u);
}
