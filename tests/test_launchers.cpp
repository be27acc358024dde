// The real launchers start the real `train`: PyTorch 2.13's torchrun (from the project's venv),
// Open MPI's mpirun and Slurm (Debian's openmpi-bin, slurm-wlm, munge; scripts/install_deps.sh
// installs them). Each job's losses are compared bitwise with the same job under
// scripts/run_train.sh. A launcher that is not installed is a failure, not a skip: the tests
// would otherwise pass by testing nothing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "tests/e2e.h"
#include "tests/loader_state.h"
#include "tests/multiprocess.h"

namespace fs = std::filesystem;
using ctitan::testing::free_port;
using ctitan::testing::kSrc;
using ctitan::testing::kTrain;
using ctitan::testing::read_file;
using ctitan::testing::sh;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// step → loss as printed (17 significant digits) in metrics.jsonl; a step logged twice (a
// restarted attempt ran it again) keeps its last value.
std::map<int, std::string> losses(const std::string& metrics) {
  std::ifstream f(metrics);
  std::map<int, std::string> out;
  const std::regex re("\"step\": ([0-9]+).*\"loss\": ([^,}]+)");
  for (std::string line; std::getline(f, line);) {
    std::smatch m;
    if (std::regex_search(line, m, re)) out[std::stoi(m[1])] = m[2];
  }
  return out;
}

std::map<int, std::string> steps_from(const std::map<int, std::string>& all, int first) {
  return {all.lower_bound(first), all.end()};
}

std::string torchrun() {
  const char* env = std::getenv("CTITAN_TORCHRUN");
  return env && *env ? env : kSrc + "/.venv/bin/torchrun";
}

}  // namespace

class Launchers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One intra-op thread per rank under every launcher (ranks per node differ between them:
    // torchrun with one worker per agent would otherwise give each rank every core), so the
    // same job does the same float arithmetic whoever started it.
    setenv("OMP_NUM_THREADS", "1", 1);
    root_ = fs::temp_directory_path() / ("ctitan_launchers_" + std::to_string(getpid()));
    fs::create_directories(root_);
    corpus_ = ctitan::testing::make_corpus(root_ / "data");
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ + " 400");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(root_);
  }

  // The training arguments every launcher passes to `train` (20 steps of the debug model on
  // 32-token windows, a checkpoint every 10 steps).
  // float32 parameters: on a CPU without native bf16 matmuls (avx512_bf16 / AMX) FSDP's bf16
  // compute is emulated and ~4x slower per step; what is tested here does not depend on it,
  // and TrainE2E and FSDP.* run the bf16 path.
  static std::string args(const std::string& dump, int steps = 20) {
    return " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " + tokenizer_ +
           " --training.dataset_path " + corpus_ + " --job.dump_folder " + dump + " --training.steps " +
           std::to_string(steps) +
           " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1 --lr_scheduler.warmup_steps 2"
           " --optimizer.lr 3e-3 --debug.seed 5 --checkpoint.enable --checkpoint.interval 10"
           " --checkpoint.keep_latest_k 0 --training.mixed_precision_param float32";
  }

  // The reference: 2 ranks under scripts/run_train.sh, run once for the suite.
  static const std::map<int, std::string>& reference() {
    static std::map<int, std::string> ref;
    if (ref.empty()) {
      const std::string dump = (root_ / "reference").string();
      auto r = sh("NPROC=2 CTITAN_BUILD_DIR=" + fs::path(kTrain).parent_path().string() + " " + kSrc +
                  "/scripts/run_train.sh" + args(dump));
      EXPECT_EQ(r.code, 0) << r.out;
      ref = losses(dump + "/metrics.jsonl");
      EXPECT_EQ(ref.size(), 20u) << r.out;
    }
    return ref;
  }

  static void require_torchrun() {
    ASSERT_TRUE(fs::exists(torchrun())) << torchrun()
                                        << " is missing: scripts/install_deps.sh installs PyTorch "
                                           "2.13 (with torchrun) into .venv, or set CTITAN_TORCHRUN";
  }

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path Launchers::root_;
std::string Launchers::corpus_, Launchers::tokenizer_;

// torchrun --standalone: one agent, its store shared with the workers (every rank a client).
TEST_F(Launchers, TorchrunStandaloneMatchesRunTrainBitwise) {
  require_torchrun();
  const std::string dump = (root_ / "standalone").string();
  auto r = sh(torchrun() + " --standalone --nproc-per-node 2 --no-python " + kTrain + args(dump));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ranks join the agent's store"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("restart count 0 (at most 0)"), std::string::npos) << r.out;
  EXPECT_EQ(losses(dump + "/metrics.jsonl"), reference());
}

// Tensor parallelism under torchrun: 4 workers as dp_shard 2 × tp 2 (checkpoints are not built
// for tp yet: off). Rank 0 shows the mesh and its tp group; every rank's log names its tp rank
// (rank = shard index · 2 + tp index); the loss is finite at every step.
TEST_F(Launchers, TorchrunStandaloneTrainsDpShardTimesTensorParallel) {
  require_torchrun();
  const std::string dump = (root_ / "standalone_tp").string();
  auto r = sh(torchrun() + " --standalone --nproc-per-node 4 --no-python " + kTrain + args(dump, 4) +
              " --checkpoint.enable false --parallelism.data_parallel_shard_degree 2"
              " --parallelism.tensor_parallel_degree 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("mesh [dp_replicate, dp_shard, tp] = [1, 2, 2]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tensor parallelism: 2 ranks"), std::string::npos) << r.out;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(read_file(dump + "/logs/rank" + std::to_string(rank) + ".log")
                  .find("tensor parallelism: 2 ranks (tp rank " + std::to_string(rank % 2) + ")"),
              std::string::npos)
        << "rank " << rank;
  const auto by_step = losses(dump + "/metrics.jsonl");
  ASSERT_EQ(by_step.size(), 4u) << r.out;
  for (const auto& [step, loss] : by_step)
    EXPECT_TRUE(std::isfinite(std::stod(loss))) << "step " << step << ": " << loss;
  EXPECT_FALSE(fs::exists(dump + "/checkpoint")) << "no checkpoint was written";
}

// Two torchrun agents ("nodes") on loopback meet through the c10d rendezvous backend.
TEST_F(Launchers, TorchrunTwoAgentsC10dRendezvousMatchesRunTrainBitwise) {
  require_torchrun();
  const std::string dump = (root_ / "two_agents").string();
  const std::string rdzv =
      " --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" + std::to_string(free_port()) +
      " --rdzv-id two_agents --no-python " + kTrain + args(dump);
  const std::string log0 = (root_ / "agent0.log").string(), log1 = (root_ / "agent1.log").string();
  auto r = sh("( " + torchrun() + " --node-rank 0" + rdzv + " > " + log0 + " 2>&1 & a=$!; sleep 1; " + torchrun() +
              " --node-rank 1" + rdzv + " > " + log1 + " 2>&1 & b=$!; wait $a; ea=$?; wait $b; eb=$?; " +
              "echo exits $ea $eb; [ $ea = 0 ] && [ $eb = 0 ] )");
  ASSERT_EQ(r.code, 0) << r.out << read_file(log0) << read_file(log1);
  EXPECT_EQ(losses(dump + "/metrics.jsonl"), reference()) << read_file(log0);
}

// A rank that fails (a dataset path that does not exist, on rank 1 only): torchrun's failure
// summary shows ctitan's one line and the rank, and the job ends within seconds.
TEST_F(Launchers, TorchrunSummaryNamesTheFailingRankAndItsError) {
  require_torchrun();
  const std::string dump = (root_ / "bad_rank").string();
  const std::string good = kTrain + args(dump);
  const std::string bad = good + " --training.dataset_path " + (root_ / "no_such_corpus.txt").string();
  // --no-python runs bash, which execs train (same pid: torchrun watches train itself).
  const std::string script = root_ / "per_rank.sh";
  std::ofstream(script) << "if [ \"$RANK\" = 1 ]; then exec " << bad << "; else exec " << good << "; fi\n";
  const auto t0 = std::chrono::steady_clock::now();
  auto r = sh(torchrun() + " --standalone --nproc-per-node 2 --no-python bash " + script);
  const double s = seconds_since(t0);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(s, 30.0) << r.out;
  const std::string line =
      "training.dataset_path=" + (root_ / "no_such_corpus.txt").string() +
      " does not exist (expected a .txt/.jsonl/.json/.jsonl.gz/.json.gz/.ctok file or a folder of them)";
  const auto root_cause = r.out.find("Root Cause (first observed failure):");
  ASSERT_NE(root_cause, std::string::npos) << r.out;
  const std::string cause = r.out.substr(root_cause);
  EXPECT_NE(cause.find("rank      : 1 (local_rank: 1)"), std::string::npos) << r.out;
  EXPECT_NE(cause.find("exitcode  : 2"), std::string::npos) << r.out;
  EXPECT_NE(cause.find("traceback : " + line), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("error_file: <N/A>"), std::string::npos) << r.out;
  // Rank 0, whose collective failed because rank 1 left, is listed among the other failures.
  EXPECT_LT(r.out.find("rank      : 0 (local_rank: 0)"), root_cause) << r.out;
  std::cout << "[ torchrun ] failed rank reported, job ended after " << s << " s" << std::endl;
}

// torchrun --max-restarts: rank 1 is SIGKILLed after step 15's backward (CTITAN_FAULT fires in
// the first attempt only); rank 0 sees the dead peer at its next collective, torchrun restarts
// both, they resume from step-10 by themselves and end with the uninterrupted run's losses.
TEST_F(Launchers, TorchrunRestartResumesFromTheNewestCheckpointBitwise) {
  require_torchrun();
  const std::string dump = (root_ / "restart").string();
  const auto t0 = std::chrono::steady_clock::now();
  // A collective timeout far above the test's bound: the dead peer must be seen by its socket.
  auto r =
      sh("CTITAN_FAULT=kill:1:15 " + torchrun() + " --standalone --nproc-per-node 2 --max-restarts 2 --no-python " +
         kTrain + args(dump) + " --comm.train_timeout_seconds 600");
  const double s = seconds_since(t0);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_LT(s, 120.0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("restart 1 of run [^:]+: resumed from step 10"))) << r.out;
  const auto got = losses(dump + "/metrics.jsonl");
  ASSERT_EQ(got.size(), 20u) << r.out;
  EXPECT_EQ(steps_from(got, 11), steps_from(reference(), 11)) << r.out;
  // Steps 11-14 ran twice (before the kill and after the restart): the file has both.
  const std::string jsonl = read_file(dump + "/metrics.jsonl");
  EXPECT_EQ(std::count(jsonl.begin(), jsonl.end(), '\n'), 24) << jsonl;
  std::cout << "[ torchrun ] killed at step 15, restarted, finished in " << s << " s" << std::endl;
}

// Elastic world size: two torchrun agents (--nnodes 1:2, one worker each, --max-restarts 3)
// train with checkpoint.dataloader_reshard = "redistribute"; once 14 steps are logged, agent B
// is SIGKILLed with its process group. Its worker (in a session of its own) sees its agent
// gone and exits; A's worker fails its next collective; A's rendezvous drops the dead node and
// restarts its worker alone, which resumes from the checkpoint the 2 ranks wrote and finishes.
// Every token trained on (both attempts' traced windows, attempt 0 only up to the checkpoint it
// resumed from) plus what the loader still buffers at the end is, as a multiset, exactly the
// documents read — those the final state does not hold as unread (encoded independently by
// spm_encode).
TEST_F(Launchers, TorchrunElasticShrinksToOneAgentAndReadsEveryDocumentOnce) {
  require_torchrun();
  const std::string dump = (root_ / "elastic").string();
  const int steps = 60;
  // A hosts the rendezvous store (B is killed later): is_host in each agent's rendezvous config
  // says so. (A one-second head start alone lost the race on a loaded machine: B hosted the
  // store, and A's agent lost it with B.)
  const std::string port = std::to_string(free_port());
  auto agent = [&](bool host) {
    return torchrun() + " --nnodes 1:2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint " +
           "127.0.0.1:" + port + " --rdzv-id elastic --rdzv-conf is_host=" + (host ? "true" : "false") +
           ",last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2 --no-python " + kTrain +
           args(dump, steps) + " --checkpoint.dataloader_reshard redistribute --checkpoint.no_last_save_model_only";
  };
  const std::string trace_a = (root_ / "trace_a").string(), trace_b = (root_ / "trace_b").string();
  const std::string log_a = (root_ / "elastic_a.log").string(), log_b = (root_ / "elastic_b.log").string();
  // Each agent leads a process group of its own (setsid execs it: its pid is the group id).
  auto start = [&](bool host, const std::string& trace, const std::string& log) {
    auto r =
        sh("CTITAN_TRACE_WINDOWS=" + trace + " setsid " + agent(host) + " > " + log + " 2>&1 < /dev/null & echo $!");
    return static_cast<pid_t>(std::stol(r.out));
  };
  const pid_t a = start(true, trace_a, log_a);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const pid_t b = start(false, trace_b, log_b);
  struct KillAgents {  // on every way out of the test (their workers follow within 0.5 s)
    pid_t a, b;
    ~KillAgents() {
      kill(-a, SIGKILL);
      kill(-b, SIGKILL);
    }
  } kill_agents{a, b};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (losses(dump + "/metrics.jsonl").size() < 14 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GE(losses(dump + "/metrics.jsonl").size(), 14u) << read_file(log_a) << read_file(log_b);
  const auto killed = std::chrono::steady_clock::now();
  const auto killed_wall = std::chrono::system_clock::now();
  kill(-b, SIGKILL);
  // The agents are the shell's children, not ours: wait for A by polling its pid.
  while (kill(a, 0) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double after_kill = seconds_since(killed);
  const std::string out_a = read_file(log_a);
  ASSERT_NE(kill(a, 0), 0) << "agent A still running after 120 s\n" << out_a;
  // When A's worker failed: torchrun's log line "E<mmdd> <hh:mm:ss.us> … failed (exitcode: 3)",
  // in local time, against the local time of the kill.
  std::smatch f;
  ASSERT_TRUE(
      std::regex_search(out_a, f, std::regex("E[0-9]{4} ([0-9]{2}):([0-9]{2}):([0-9.]+) .* failed \\(exitcode")))
      << out_a;
  const std::time_t kt = std::chrono::system_clock::to_time_t(killed_wall);
  std::tm local{};
  localtime_r(&kt, &local);
  const double kill_s = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec +
                        std::chrono::duration<double>(killed_wall - std::chrono::system_clock::from_time_t(kt)).count();
  const double worker_exit = std::stoi(f[1]) * 3600 + std::stoi(f[2]) * 60 + std::stod(f[3]) - kill_s;
  EXPECT_LT(worker_exit, 30.0) << out_a;
  EXPECT_LT(after_kill, 60.0) << out_a;
  EXPECT_NE(out_a.find("training done: " + std::to_string(steps) + " steps"), std::string::npos) << out_a;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out_a, m, std::regex("restart ([0-9]+) of run elastic: resumed from step ([0-9]+)")))
      << out_a;
  const int resumed = std::stoi(m[2]);
  EXPECT_NE(out_a.find("launch: torchrun rank 0 of 1"), std::string::npos) << "restarted alone\n" << out_a;
  EXPECT_NE(out_a.find("dataloader: redistributed from dp 2 to dp 1"), std::string::npos) << out_a;
  ctitan::CheckpointReader saved(dump + "/checkpoint/step-" + std::to_string(resumed));
  EXPECT_EQ(saved.meta().world_size, 2) << "the checkpoint resumed from was written by 2 ranks";
  EXPECT_EQ(losses(dump + "/metrics.jsonl").rbegin()->first, steps);

  // The documents (one per line of the corpus) as spm_encode tokenizes them.
  std::vector<std::vector<int64_t>> docs;
  {
    const std::string lines = (root_ / "elastic_docs.txt").string();
    std::ifstream in(corpus_);
    std::ofstream o(lines);
    for (std::string l; std::getline(in, l);)
      if (!l.empty()) o << l << "\n";
    o.close();
    auto enc = sh("spm_encode --model=" + tokenizer_ + " --output_format=id < " + lines);
    ASSERT_EQ(enc.code, 0) << enc.out;
    std::istringstream is(enc.out);
    for (std::string l; std::getline(is, l);) {
      std::istringstream ls(l);
      docs.emplace_back();
      for (int64_t id; ls >> id;) docs.back().push_back(id);
    }
  }
  const auto int_field = [](const std::string& json, const std::string& key) {
    std::smatch f;
    EXPECT_TRUE(std::regex_search(json, f, std::regex("\"" + key + "\":(-?[0-9]+)"))) << key << " in " << json;
    return std::stoll(f[1]);
  };
  // want: every document the final state does not hold as unread, each with its BOS and EOS.
  ctitan::CheckpointReader fin(dump + "/checkpoint/step-" + std::to_string(steps));
  const std::string final_state = fin.read_bytes("dataloader.dp_rank_0");
  ASSERT_EQ(int_field(final_state, "epoch"), 0);
  const auto left = ctitan::testing::state_work(final_state);
  const auto doc_ids = ctitan::testing::line_documents(corpus_);
  ASSERT_EQ(doc_ids.size(), docs.size());
  std::map<int64_t, int64_t> want, have;
  std::smatch bm;
  ASSERT_TRUE(std::regex_search(out_a, bm, std::regex("bos ([0-9]+), eos ([0-9]+)"))) << out_a;
  int64_t read_docs = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    if (ctitan::testing::still_unread(left, doc_ids[d])) continue;
    ++read_docs;
    for (int64_t v : docs[d]) ++want[v];
    ++want[std::stoll(bm[1])];
    ++want[std::stoll(bm[2])];
  }
  // have: the loader's buffer at the end, and every traced window that counted: attempt 0's up
  // to step `resumed` (its later steps were rolled back), attempt 1's all. A file holds one
  // rank number's windows, attempt after attempt (attempt 1 starts at resumed + 1, attempt 0
  // at 1).
  {
    const auto b0 = final_state.find("\"buffer\":[");
    ASSERT_NE(b0, std::string::npos) << final_state;
    std::istringstream is(final_state.substr(b0 + 10));
    for (int64_t v; is >> v;) {
      ++have[v];
      if (is.peek() == ',') is.get();
    }
  }
  int64_t windows = 0;
  for (const std::string& prefix : {trace_a, trace_b})
    for (int r = 0; r < 2; ++r) {
      std::ifstream f(prefix + ".rank" + std::to_string(r));
      int64_t first = -1, last = -1, same = 0;  // same: windows of step `last` in this attempt
      for (std::string line; std::getline(f, line);) {
        std::istringstream ls(line);
        int64_t step = 0;
        ls >> step;
        // A new attempt: the step goes back, or repeats once its 2 windows (local_batch_size)
        // are there (attempt 1 may start at the very step attempt 0 died in).
        const bool new_attempt = first < 0 || step < last || (step == last && same == 2);
        if (new_attempt) first = step;
        same = step == last && !new_attempt ? same + 1 : 1;
        last = step;
        if (first == 1 && step > resumed) continue;  // attempt 0, rolled back
        ++windows;
        for (int64_t v; ls >> v;) ++have[v];
      }
    }
  // 2 windows (local_batch_size) per rank and step: 2 ranks up to `resumed`, then 1.
  EXPECT_EQ(windows, 2 * 2 * resumed + 2 * (steps - resumed));
  int64_t missing = 0, twice = 0;
  for (const auto& [tok, n] : want) missing += std::max<int64_t>(0, n - (have.count(tok) ? have[tok] : 0));
  for (const auto& [tok, n] : have) twice += std::max<int64_t>(0, n - (want.count(tok) ? want[tok] : 0));
  EXPECT_EQ(missing, 0);
  EXPECT_EQ(twice, 0);
  std::cout << "[ elastic ] agent B killed after 14 steps; A's worker exited " << worker_exit << " s later, A ended "
            << after_kill << " s after the kill, restarted alone from "
            << "step-" << resumed << " (2 ranks), " << read_docs << " documents read: " << missing
            << " tokens missing, " << twice << " read twice" << std::endl;
}

// Open MPI's mpirun: ranks from OMPI_COMM_WORLD_*, rank 0 serves the store.
TEST_F(Launchers, MpirunMatchesRunTrainBitwise) {
  auto which = sh("command -v mpirun");
  ASSERT_EQ(which.code, 0) << "mpirun is missing: scripts/install_deps.sh installs Debian's openmpi-bin";
  const std::string dump = (root_ / "mpirun").string();
  auto r = sh("mpirun -np 2 --oversubscribe --allow-run-as-root -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" +
              std::to_string(free_port()) + " " + kTrain + args(dump));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("launch: mpirun rank 0 of 2"), std::string::npos) << r.out;
  EXPECT_EQ(losses(dump + "/metrics.jsonl"), reference());
}

// Slurm: the test starts a one-host cluster of its own (scripts/slurm_local_cluster.sh: munged,
// slurmctld, slurmd, a generated slurm.conf), submits scripts/multinode_trainer.slurm with 2
// tasks, and checks (1) the losses equal run_train.sh's, (2) scancel --signal=TERM makes the
// job save and end with exit 0, (3) the same submission again resumes from that checkpoint.
// Where the daemons cannot run (a sandbox), it skips and prints why.
TEST_F(Launchers, SlurmSbatchTrainsStopsOnTermAndResumes) {
  for (const char* p : {"sbatch", "scancel", "scontrol", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"})
    ASSERT_EQ(sh(std::string("command -v ") + p).code, 0)
        << p << " is missing: scripts/install_deps.sh installs Debian's slurm-wlm and munge";
  const std::string cluster = (root_ / "slurm").string();
  auto up = sh(kSrc + "/scripts/slurm_local_cluster.sh start " + cluster);
  if (up.code != 0) {
    sh(kSrc + "/scripts/slurm_local_cluster.sh stop " + cluster);
    ASSERT_NE(up.code, 127) << up.out;
    GTEST_SKIP() << "a one-host Slurm cluster cannot run here: " << up.out;
  }
  struct Stop {
    std::string cmd;
    ~Stop() { sh(cmd); }
  } stop{kSrc + "/scripts/slurm_local_cluster.sh stop " + cluster};
  // Submitted from the job's folder (Slurm writes slurm-<id>.out there); `train` and the
  // config given by the environment sbatch passes on.
  const std::string env = "SLURM_CONF=" + cluster +
                          "/slurm.conf CTITAN_BUILD_DIR=" + fs::path(kTrain).parent_path().string() +
                          " CONFIG_FILE=" + kSrc + "/train_configs/debug_model.toml ";
  const auto submit = [&](const std::string& dump, const std::string& sbatch_flags, const std::string& extra) {
    fs::create_directories(dump);
    std::string a = args(dump);
    a = a.substr(a.find(" --model"));  // the config file comes from CONFIG_FILE
    return sh("cd " + dump + " && " + env + "timeout 300 sbatch " + sbatch_flags + " --ntasks 2 --ntasks-per-node 2 " +
              kSrc + "/scripts/multinode_trainer.slurm" + a + extra);
  };
  const auto job_output = [](const std::string& dump) {
    std::string all;
    for (const auto& e : fs::directory_iterator(dump))
      if (e.path().filename().string().rfind("slurm-", 0) == 0) all += read_file(e.path().string());
    return all;
  };

  // (0) srun -n 2 from the command line: the binary per task, ranks from SLURM_*.
  const std::string direct = (root_ / "slurm_srun").string();
  auto d = sh(env + "timeout 300 srun -n 2 --export=ALL,MASTER_PORT=" + std::to_string(free_port()) + " " + kTrain +
              args(direct));
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("launch: srun rank 0 of 2 (local 0 of 2)"), std::string::npos) << d.out;
  EXPECT_EQ(losses(direct + "/metrics.jsonl"), reference());

  // (1) sbatch --wait: 20 steps, the losses of run_train.sh.
  const std::string plain = (root_ / "slurm_plain").string();
  auto r = submit(plain, "--wait", "");
  ASSERT_EQ(r.code, 0) << r.out << job_output(plain);
  EXPECT_NE(job_output(plain).find("launch: srun rank 0 of 2"), std::string::npos) << job_output(plain);
  EXPECT_EQ(losses(plain + "/metrics.jsonl"), reference());

  // (1b) LAUNCH=torchrun: one torchrun per node (here one, with 2 workers) under srun.
  const std::string via_torchrun = (root_ / "slurm_torchrun").string();
  r = submit(via_torchrun,
             "--wait --export=ALL,LAUNCH=torchrun,TORCHRUN=" + torchrun() + ",RDZV_PORT=" + std::to_string(free_port()),
             "");
  ASSERT_EQ(r.code, 0) << r.out << job_output(via_torchrun);
  EXPECT_NE(job_output(via_torchrun).find("ranks join the agent's store"), std::string::npos)
      << job_output(via_torchrun);
  EXPECT_EQ(losses(via_torchrun + "/metrics.jsonl"), reference());

  // (2) a long job, SIGTERM to its tasks after 12 logged steps: it saves and exits 0.
  const std::string pre = (root_ / "slurm_preempt").string();
  auto sub = submit(pre, "--parsable", " --training.steps 5000");
  ASSERT_EQ(sub.code, 0) << sub.out;
  const std::string job = std::regex_replace(sub.out, std::regex("[^0-9].*$|\\s"), "");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (losses(pre + "/metrics.jsonl").size() < 12 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_GE(losses(pre + "/metrics.jsonl").size(), 12u) << job_output(pre);
  ASSERT_EQ(sh(env + "scancel --signal=TERM " + job).code, 0);
  std::string state;
  while (std::chrono::steady_clock::now() < deadline) {
    state = sh(env + "scontrol show job " + job).out;
    if (state.find("JobState=COMPLETED") != std::string::npos || state.find("JobState=FAILED") != std::string::npos ||
        state.find("JobState=CANCELLED") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const std::string out = job_output(pre);
  EXPECT_NE(state.find("JobState=COMPLETED"), std::string::npos) << state << out;
  EXPECT_NE(state.find("ExitCode=0:0"), std::string::npos) << state << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("stopping after step ([0-9]+) of 5000: SIGTERM"))) << out;
  const int stopped = std::stoi(m[1]);
  EXPECT_TRUE(fs::exists(pre + "/checkpoint/step-" + std::to_string(stopped) + "/COMPLETE")) << out;

  // (3) submitted again: resumes from that checkpoint and trains 5 more steps.
  r = submit(pre, "--wait", " --training.steps " + std::to_string(stopped + 5));
  ASSERT_EQ(r.code, 0) << r.out << job_output(pre);
  EXPECT_NE(job_output(pre).find("checkpoint: loaded step " + std::to_string(stopped)), std::string::npos)
      << job_output(pre);
  EXPECT_EQ(losses(pre + "/metrics.jsonl").rbegin()->first, stopped + 5);
  std::cout << "[ slurm ] job " << job << " stopped by SIGTERM after step " << stopped
            << ", saved, exit 0; resubmitted, resumed, ended at step " << stopped + 5 << std::endl;
}
