// End-to-end: the real `train` executable (and the launcher) on a corpus and tokenizer
// built here. Loss falls, same seed → bitwise-equal losses, bad input → exit 2 with one
// line and nothing written, a NaN stops the run, a failing rank stops the job, a stop
// signal saves a checkpoint and the rerun resumes.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"

namespace fs = std::filesystem;
using ctitan::testing::all_ok;
using ctitan::testing::spawn_processes;
using namespace ctitan::testing;

namespace {

class TrainE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_e2e_" + std::to_string(getpid()));
    corpus_ = make_corpus(root_ / "data");
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ + " 400");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  // Common arguments of a small, fast run of the debug model.
  static std::string args(const std::string& dump, int steps) {
    return " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " +
           tokenizer_ + " --training.dataset_path " + corpus_ + " --job.dump_folder " + dump +
           " --training.steps " + std::to_string(steps) +
           " --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 1"
           " --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3";
  }

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path TrainE2E::root_;
std::string TrainE2E::corpus_, TrainE2E::tokenizer_;

// The argv of the train binary for spawn_processes.
std::vector<std::string> train_argv(const std::string& args) {
  std::vector<std::string> argv = {kTrain};
  std::istringstream is(args);
  for (std::string a; is >> a;) argv.push_back(a);
  return argv;
}

TEST_F(TrainE2E, TwentyStepsLossFalls) {
  const std::string dump = (root_ / "run20").string();
  auto r = sh(kTrain + args(dump, 20));
  ASSERT_EQ(r.code, 0) << r.out;
  auto losses = jsonl_field(dump + "/metrics.jsonl", "loss");
  ASSERT_EQ(losses.size(), 20u);
  const double first = std::stod(losses.front()), last = std::stod(losses.back());
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
  // Contract outputs: effective config, per-rank log, every metrics field.
  EXPECT_TRUE(fs::exists(dump + "/job_config.toml"));
  EXPECT_TRUE(fs::exists(dump + "/logs/rank0.log"));
  for (const char* k : {"grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "data_loading_s", "elapsed_s"})
    EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", k).size(), 20u) << k;
  // The effective config re-parses to the same run (seq_len override survived).
  std::ifstream cfg(dump + "/job_config.toml");
  std::stringstream ss;
  ss << cfg.rdbuf();
  EXPECT_NE(ss.str().find("seq_len = 64"), std::string::npos);
}

TEST_F(TrainE2E, SameSeedGivesBitwiseEqualLosses) {
  std::vector<std::vector<std::string>> runs;
  for (int i = 0; i < 2; ++i) {
    const std::string dump = (root_ / ("seed" + std::to_string(i))).string();
    auto r = sh(kTrain + args(dump, 5) + " --debug.seed 7");
    ASSERT_EQ(r.code, 0) << r.out;
    runs.push_back(jsonl_field(dump + "/metrics.jsonl", "loss"));
  }
  ASSERT_EQ(runs[0].size(), 5u);
  EXPECT_EQ(runs[0], runs[1]);  // printed with 17 significant digits: bitwise equality
  auto other = sh(kTrain + args((root_ / "seed_other").string(), 5) + " --debug.seed 8");
  ASSERT_EQ(other.code, 0) << other.out;
  EXPECT_NE(jsonl_field((root_ / "seed_other").string() + "/metrics.jsonl", "loss"), runs[0]);
}

TEST_F(TrainE2E, BadConfigExitsTwoWithOneLineAndWritesNothing) {
  struct Case {
    std::string extra, expect;
  };
  const std::vector<Case> cases = {
      {" --training.seq_length 5", "config error: command line: unknown option --training.seq_length (did you mean --training.seq_len?)"},
      {" --lr_scheduler.decay_type exp", "lr_scheduler.decay_type = \"exp\" is not one of: linear, sqrt, cosine"},
      {" --training.steps 0", "training.steps = 0 is out of range (must be >= 1)"},
      {" --training.global_batch_size 6", "training.global_batch_size=6 is not a multiple of local_batch_size (4) × dp (1)"},
      {" --model.flavor 9B", "unknown model.flavor \"9B\" for llama3; valid: debugmodel, debugmodel_gqa, 33M, 150M, 8B, 70B, 405B"},
      {" --compile.enable", "not supported yet: compile.enable = true (ctitan supports: false)"},
  };
  for (const auto& c : cases) {
    const std::string dump = (root_ / "bad").string();
    auto r = sh(kTrain + args(dump, 5) + c.extra);
    EXPECT_EQ(r.code, 2) << c.extra << ": " << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.extra << ": " << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << c.extra << ": " << r.out;
    EXPECT_FALSE(fs::exists(dump)) << c.extra;
  }
  auto missing = sh(kTrain + " --job.config_file /nonexistent/x.toml");
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.out.find("/nonexistent/x.toml"), std::string::npos) << missing.out;
  auto help = sh(kTrain + " --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--training.seq_len"), std::string::npos);
}

TEST_F(TrainE2E, NonFiniteLossStopsNamingTheStep) {
  const std::string dump = (root_ / "nan").string();
  auto r = sh(kTrain + args(dump, 30) + " --optimizer.lr 1e9 --training.max_norm 0 --lr_scheduler.warmup_steps 0");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("error: step [0-9]+: loss is (nan|inf|-nan)"))) << r.out;
}

// training.on_nonfinite on 2 ranks, with a NaN injected on rank 1 only: "stop" (default)
// stops both ranks naming the step; "skip" drops the step on both (no update: the model and
// optimizer state saved after step 3 are bitwise those saved after step 2), counts and logs it,
// and training goes on. An injected spike in the reported loss is a warning.
TEST_F(TrainE2E, NonFiniteStepsStopOrSkipOnEveryRank) {
  const std::string dump = (root_ / "nonfinite").string();
  auto rs = spawn_processes(train_argv(args(dump, 5)), 2, {{"CTITAN_FAULT", "nan:1:3"}});
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error: step 3: loss is nan; stopping"), std::string::npos) << r.output;
  }
  fs::remove_all(dump);
  rs = spawn_processes(train_argv(args(dump, 6) + " --training.on_nonfinite skip --checkpoint.enable "
                                                  "--checkpoint.interval 1 --checkpoint.no_last_save_model_only"),
                       2, {{"CTITAN_FAULT", "nangrad:1:3"}});
  ASSERT_TRUE(all_ok(rs));
  for (const auto& r : rs)
    EXPECT_NE(r.output.find("step 3: gradient norm is nan; skipped: no optimizer update (1 step skipped in this run)"),
              std::string::npos)
        << r.output;
  EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", "step").size(), 6u);
  EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", "skipped_steps").size(), 4u) << "steps 3-6 report the count";
  ctitan::CheckpointReader s2(dump + "/checkpoint/step-2"), s3(dump + "/checkpoint/step-3"),
      s4(dump + "/checkpoint/step-4");
  int compared = 0;
  for (const auto& [key, e] : s3.meta().entries) {
    if (e.is_bytes || (key.rfind("layers.", 0) != 0 && key.rfind("optimizer.", 0) != 0)) continue;
    EXPECT_TRUE(s2.read_tensor(key).equal(s3.read_tensor(key))) << key << " changed in the skipped step";
    compared += !s3.read_tensor(key).equal(s4.read_tensor(key));
  }
  EXPECT_GT(compared, 20) << "step 4 updates the parameters and moments again";

  fs::remove_all(dump);
  auto r = sh("CTITAN_FAULT=spike:0:8 " + kTrain + args(dump, 8) + " --training.loss_spike_factor 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("warning step 8: loss spike: [0-9.]+ is [0-9.]+x the mean of the "
                                                  "previous steps \\([0-9.]+; training.loss_spike_factor = 2\\)")))
      << r.out;
  EXPECT_EQ(r.out.find("loss spike", r.out.find("loss spike") + 1), std::string::npos) << "one warning only";
}

TEST_F(TrainE2E, TwoRanksThroughTheLauncher) {
  const std::string dump = (root_ / "two").string();
  auto r = sh("NPROC=2 CTITAN_BUILD_DIR=" + fs::path(kTrain).parent_path().string() + " CONFIG_FILE=" + kSrc +
              "/train_configs/debug_model.toml " + kSrc + "/scripts/run_train.sh" +
              args(dump, 6).substr(args(dump, 6).find(" --model")) + " --debug.seed 3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[rank1]"), std::string::npos);
  EXPECT_NE(r.out.find("FSDP:"), std::string::npos) << r.out;
  EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", "loss").size(), 6u);  // rank 0 only writes
  EXPECT_TRUE(fs::exists(dump + "/logs/rank1.log"));
}

// A rank that raises, or is killed, mid-step: the launcher stops the job, names the rank and
// exits non-zero; the surviving rank reports the collective it was in (no hang).
TEST_F(TrainE2E, FailingRankStopsTheJob) {
  for (const std::string kind : {"raise", "kill"}) {
    const std::string dump = (root_ / ("fault_" + kind)).string();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = sh("CTITAN_FAULT=" + kind + ":1:3 NPROC=2 CTITAN_BUILD_DIR=" +
                fs::path(kTrain).parent_path().string() + " " + kSrc + "/scripts/run_train.sh" +
                args(dump, 8).substr(args(dump, 8).find(" --model")) + " --comm.train_timeout_seconds 10");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.code, kind == "raise" ? 1 : 128 + SIGKILL) << r.out;
    EXPECT_LT(s, 60.0) << r.out;
    EXPECT_NE(r.out.find("[launcher] rank 1 exited with code " + std::to_string(kind == "raise" ? 1 : 137) +
                         "; stopping the other ranks"),
              std::string::npos)
        << r.out;
    if (kind == "raise") {
      EXPECT_NE(r.out.find("injected fault"), std::string::npos) << r.out;
    }
  }
}

// Without the launcher: rank 1 killed mid-step; rank 0 must exit non-zero within
// comm.train_timeout_seconds with a message naming the collective.
TEST_F(TrainE2E, SurvivorNamesTheCollective) {
  const std::string dump = (root_ / "survivor").string();
  const auto argv = train_argv(args(dump, 8) + " --comm.train_timeout_seconds 10");
  const auto t0 = std::chrono::steady_clock::now();
  auto rs = spawn_processes(argv, 2, {{"CTITAN_FAULT", "kill:1:3"}}, 90);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL);
  EXPECT_EQ(rs[0].exit_code, 3) << rs[0].output;  // 3: a collective failed
  EXPECT_FALSE(rs[0].timed_out);
  EXPECT_LT(s, 45.0);
  EXPECT_TRUE(std::regex_search(rs[0].output, std::regex("rank 0 \\(group [a-z_0-9]+\\): all_(reduce|gather)\\([a-z_:.0-9]+\\) failed at step 3")))
      << rs[0].output;
}

// Rank 1 of 2 starts, rank 0 never does: the rendezvous gives up after
// comm.init_timeout_seconds with an error naming the address, instead of waiting forever.
TEST_F(TrainE2E, RendezvousTimesOut) {
  const int port = ctitan::testing::free_port();
  const auto t0 = std::chrono::steady_clock::now();
  auto r = sh("RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
              std::to_string(port) + " " + kTrain + args((root_ / "rdzv").string(), 3) +
              " --comm.init_timeout_seconds 3");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_LT(s, 30.0);
  EXPECT_NE(r.out.find("rank 1: rendezvous at 127.0.0.1:" + std::to_string(port) + " failed within 3 s"),
            std::string::npos)
      << r.out;
}

// Preemption: a stop signal on rank 1 at step 3 (CTITAN_FAULT=term sends it through the real
// signal path) stops both ranks after step 3 with exit 0 and a checkpoint of step 3 (off the
// interval); the same command then resumes and steps 4..8 have bitwise the losses of a run
// that was never interrupted.
TEST_F(TrainE2E, StopSignalSavesAndTheRerunResumesExactly) {
  auto common = [&](const std::string& dump) {
    return args(dump, 8) + " --debug.seed 5 --checkpoint.enable --checkpoint.interval 100";
  };
  const std::string ref = (root_ / "stop_ref").string(), dump = (root_ / "stop").string();
  ASSERT_TRUE(all_ok(spawn_processes(train_argv(common(ref)), 2)));
  const auto want = jsonl_field(ref + "/metrics.jsonl", "loss");
  ASSERT_EQ(want.size(), 8u);

  for (const std::string sig : {"term", "usr1"}) {
    fs::remove_all(dump);
    auto rs = spawn_processes(train_argv(common(dump)), 2, {{"CTITAN_FAULT", sig + ":1:3"}});
    ASSERT_TRUE(all_ok(rs)) << sig;
    const std::string name = sig == "term" ? "SIGTERM" : "SIGUSR1";
    for (const auto& r : rs)
      EXPECT_NE(r.output.find("stopping after step 3 of 8: " + name + " on rank 1"), std::string::npos) << r.output;
    EXPECT_NE(rs[0].output.find("checkpoint: saved step 3 to"), std::string::npos) << rs[0].output;
    EXPECT_NE(rs[0].output.find("run the same command to resume from step-3"), std::string::npos) << rs[0].output;
    EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", "step"), (std::vector<std::string>{"1", "2", "3"}));
    std::vector<std::string> saved;
    for (const auto& e : fs::directory_iterator(dump + "/checkpoint")) saved.push_back(e.path().filename());
    EXPECT_EQ(saved, (std::vector<std::string>{"step-3"}));
  }
  auto rs = spawn_processes(train_argv(common(dump)), 2);
  ASSERT_TRUE(all_ok(rs));
  EXPECT_NE(rs[0].output.find("checkpoint: loaded step 3"), std::string::npos) << rs[0].output;
  EXPECT_EQ(jsonl_field(dump + "/metrics.jsonl", "loss"), want);  // steps 1-3, then 4-8 resumed
}

// The launcher passes SIGTERM on to its ranks and exits with their code (0); the checkpoint
// is of the step the ranks stopped after.
TEST_F(TrainE2E, LauncherPassesStopSignalsOn) {
  const std::string dump = (root_ / "launcher_stop").string();
  const std::string cmd = "NPROC=2 CTITAN_BUILD_DIR=" + fs::path(kTrain).parent_path().string() + " " + kSrc +
                          "/scripts/run_train.sh" + args(dump, 200).substr(args(dump, 200).find(" --model")) +
                          " --checkpoint.enable --checkpoint.interval 1000";
  // Signal the launcher once rank 0 has logged two steps.
  auto r = sh("{ (" + cmd + ") & lp=$!; for i in $(seq 600); do [ -f " + dump + "/metrics.jsonl ] && "
              "[ $(wc -l < " + dump + "/metrics.jsonl) -ge 2 ] && break; sleep 0.1; done; kill -TERM $lp; wait $lp; "
              "echo \"launcher exit $?\"; }");
  EXPECT_NE(r.out.find("launcher exit 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[launcher] received SIGTERM: passing it on to the ranks"), std::string::npos) << r.out;
  const auto steps = jsonl_field(dump + "/metrics.jsonl", "step");
  ASSERT_FALSE(steps.empty()) << r.out;
  EXPECT_LT(std::stoi(steps.back()), 200) << r.out;
  EXPECT_NE(r.out.find("stopping after step " + steps.back() + " of 200: SIGTERM"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dump + "/checkpoint/step-" + steps.back() + "/COMPLETE")) << r.out;
}

// A second signal (after the first has been waiting for a stuck step) ends the process at
// once, killed by that signal, without saving.
TEST_F(TrainE2E, SecondSignalExitsAtOnce) {
  const std::string dump = (root_ / "second_signal").string();
  auto r = sh("{ CTITAN_FAULT=hang:0:2 " + kTrain + args(dump, 5) + " --checkpoint.enable & p=$!; "
              "for i in $(seq 600); do [ -f " + dump + "/metrics.jsonl ] && break; sleep 0.1; done; sleep 0.5; "
              "kill -TERM $p; sleep 1.5; t0=$(date +%s%N); kill -TERM $p; wait $p; code=$?; "
              "echo \"exit $code after $(( ($(date +%s%N) - t0) / 1000000 )) ms\"; }");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("exit ([0-9]+) after ([0-9]+) ms"))) << r.out;
  EXPECT_EQ(m[1], std::to_string(128 + SIGTERM)) << r.out;
  EXPECT_LT(std::stoi(m[2]), 2000) << r.out;
  EXPECT_NE(r.out.find("received SIGTERM again: exiting now, without a checkpoint"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dump + "/checkpoint")) << r.out;
}

}  // namespace

CTITAN_MULTIPROCESS_MAIN()
