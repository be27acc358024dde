// End-to-end tests of the data side through the real `train` binary: malformed documents
// (training.on_bad_document), corpus formats and sharding as a run sees them, and the
// batches read ahead of the step (training.prefetch_batches).
//
// The corpus is generated here (JSON lines of English-like sentences) and a sentencepiece
// tokenizer (vocab 400) is trained on it with scripts/train_tokenizer.sh.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/e2e.h"

namespace fs = std::filesystem;
using namespace ctitan::testing;

namespace {

// Line `i` (0-based) of the generated corpus: one JSON object with a "text" field.
std::string sentence_text(std::mt19937& rng) {
  const char* subj[] = {"the whale", "the captain", "a sailor", "the harpooneer", "the mate", "the ship"};
  const char* verb[] = {"watched", "followed", "feared", "sought", "sailed past", "remembered"};
  const char* obj[] = {"the white sea", "a distant spout", "the old chart", "the long voyage"};
  std::string s;
  const int n = 2 + rng() % 3;
  for (int k = 0; k < n; ++k)
    s += std::string(k ? " " : "") + subj[rng() % 6] + " " + verb[rng() % 6] + " " + obj[rng() % 4] + ".";
  return s;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) out.push_back(line);
  return out;
}

class DataE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_data_e2e_" + std::to_string(getpid()));
    fs::create_directories(root_);
    std::mt19937 rng(99);
    std::ofstream txt(root_ / "plain.txt");
    for (int i = 0; i < 600; ++i) {
      const std::string t = sentence_text(rng);
      lines_.push_back("{\"text\": \"" + t + "\", \"id\": " + std::to_string(i) + "}");
      txt << t << "\n\n";
    }
    txt.close();
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + (root_ / "plain.txt").string() + " " + tokenizer_ + " 400");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  // Writes the corpus with `bad` replacing some lines (1-based line -> content).
  static std::string write_jsonl(const std::string& name, const std::vector<std::pair<int, std::string>>& bad) {
    std::vector<std::string> lines = lines_;
    for (const auto& [n, content] : bad) lines[n - 1] = content;
    const fs::path p = root_ / name;
    std::ofstream f(p, std::ios::binary);
    for (const auto& l : lines) f << l << "\n";
    return p.string();
  }

  // float32 parameters: on a CPU without native bf16 matmuls (avx512_bf16 / AMX) FSDP's bf16
  // compute is emulated and ~4x slower per step; what is tested here does not depend on it,
  // and TrainE2E and FSDP.* run the bf16 path.
  static std::string args(const std::string& data, const std::string& dump, int steps) {
    return " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " + tokenizer_ +
           " --training.dataset_path " + data + " --job.dump_folder " + dump + " --training.steps " +
           std::to_string(steps) + " --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 1" +
           " --training.mixed_precision_param float32";
  }

  static fs::path root_;
  static std::vector<std::string> lines_;
  static std::string tokenizer_;
};
fs::path DataE2E::root_;
std::vector<std::string> DataE2E::lines_;
std::string DataE2E::tokenizer_;

// training.on_bad_document. Four malformed lines: bad JSON, invalid UTF-8, a NUL byte, no
// "text". stop (default): the run ends at the first one with exit 2 and one line naming
// file, line and reason; the checkpoint saved before it is intact (a rerun with skip loads
// it). skip: the four are left out and counted — in the console line and metrics.jsonl —
// and a resume from a checkpoint taken after them reports the same count, not twice it.
TEST_F(DataE2E, BadDocumentsStopOrAreSkippedAndCounted) {
  const std::string data = write_jsonl("bad.jsonl", {{40, "{\"text\": \"unterminated}"},
                                                     {41, "{\"text\": \"caf\xe9 au lait\"}"},
                                                     {60, std::string("{\"text\": \"a\0b\"}", 15)},
                                                     {75, "{\"title\": \"no text\"}"}});
  const std::string dump = (root_ / "stop").string();
  auto r = sh(kTrain + args(data, dump, 30) + " --checkpoint.enable --checkpoint.interval 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("\ndataset: " + data + ":40: invalid JSON (unterminated string"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("on_bad_document = \"skip\""), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("step: +([0-9]+)/30[^\\n]*\\ndataset: "))) << r.out;
  const int last = std::stoi(m[1]);
  ASSERT_GE(last, 2) << "the bad line must come after the first checkpoint";
  const std::string ckpt = dump + "/checkpoint/step-" + std::to_string(last - last % 2);
  ASSERT_TRUE(fs::exists(ckpt)) << r.out;

  // skip, resuming from the checkpoint the stopped run left: it loads, then passes the bad lines.
  const std::string dump2 = (root_ / "skip").string();
  r = sh(kTrain + args(data, dump2, 14) +
         " --training.on_bad_document skip --checkpoint.enable "
         "--checkpoint.interval 10 --checkpoint.initial_load_path " +
         ckpt + " --checkpoint.no_initial_load_model_only");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("checkpoint: loaded step " + std::to_string(last - last % 2)), std::string::npos) << r.out;
  for (const std::string& w : {"skipping " + data + ":40: invalid JSON", "skipping " + data + ":41: not valid UTF-8",
                               "skipping " + data + ":60: a NUL byte", "skipping " + data + ":75: record has no"})
    EXPECT_NE(r.out.find(w), std::string::npos) << w << "\n" << r.out;
  EXPECT_NE(r.out.find("step:    14/14"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bad_documents_skipped: 4.0000"), std::string::npos) << r.out;
  auto counts = jsonl_field(dump2 + "/metrics.jsonl", "bad_documents_skipped");
  ASSERT_FALSE(counts.empty());
  EXPECT_EQ(std::stod(counts.back()), 4.0);
  // Resume from step 10 (after the bad lines) to step 14: the count stays 4.
  const std::string dump3 = (root_ / "skip_resume").string();
  r = sh(kTrain + args(data, dump3, 14) +
         " --training.on_bad_document skip --checkpoint.enable "
         "--checkpoint.initial_load_path " +
         dump2 + "/checkpoint/step-10" + " --checkpoint.no_initial_load_model_only");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("skipping "), std::string::npos) << "no bad line read again\n" << r.out;
  counts = jsonl_field(dump3 + "/metrics.jsonl", "bad_documents_skipped");
  ASSERT_FALSE(counts.empty());
  EXPECT_EQ(std::stod(counts.front()), 4.0);
  EXPECT_EQ(std::stod(counts.back()), 4.0);
}

// Read-ahead and exact resume through the real binary, windows traced (CTITAN_TRACE_WINDOWS):
// a run reading 4 batches ahead trains on the windows of a run that reads none, with bitwise
// its losses, and so does the run resumed from its step-3 checkpoint, saved while the
// batches of steps 4-9 were being read ahead, for steps 4-8.
TEST_F(DataE2E, ReadAheadRunsAndTheirResumesTrainOnTheSameWindows) {
  const std::string data = write_jsonl("ahead.jsonl", {});
  const auto run = [&](const std::string& name, int depth, const std::string& extra) {
    const std::string dump = (root_ / name).string();
    auto r = sh("CTITAN_TRACE_WINDOWS=" + dump + "_trace " + kTrain + args(data, dump, 8) +
                " --debug.seed 5 --training.prefetch_batches " + std::to_string(depth) + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::to_string(depth) + " batches read ahead)"), std::string::npos) << r.out;
    return std::make_pair(jsonl_field(dump + "/metrics.jsonl", "loss"), read_lines(dump + "_trace.rank0"));
  };
  const auto [ref_loss, ref_windows] = run("ahead_ref", 0, "");
  ASSERT_EQ(ref_loss.size(), 8u);
  ASSERT_EQ(ref_windows.size(), 8u * 4) << "8 steps of 4 windows";
  const auto [loss, windows] = run("ahead_4", 4, " --checkpoint.enable --checkpoint.interval 3");
  EXPECT_EQ(loss, ref_loss);
  EXPECT_EQ(windows, ref_windows);
  const std::string ckpt = (root_ / "ahead_4" / "checkpoint" / "step-3").string();
  ASSERT_TRUE(fs::exists(ckpt));
  const auto [resumed_loss, resumed_windows] =
      run("ahead_resumed", 4,
          " --checkpoint.enable --checkpoint.initial_load_path " + ckpt + " --checkpoint.no_initial_load_model_only");
  EXPECT_EQ(resumed_loss, std::vector<std::string>(ref_loss.begin() + 3, ref_loss.end()));
  EXPECT_EQ(resumed_windows, std::vector<std::string>(ref_windows.begin() + 3 * 4, ref_windows.end()));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// A slow source no longer adds its time to the step when the step computes for longer: with
// each batch delayed by D (CTITAN_DATA_DELAY_MS, the loader sleeping before each batch, as a
// slow file system would make it wait) and D a third of this machine's step time (measured first,
// without a delay), the data wait a run reports per step (data_loading_s) is at least D without
// read-ahead and under D / 4 with 2 batches read ahead, on every step after the first.
TEST_F(DataE2E, ReadAheadHidesASlowSourceBehindALongerStep) {
  const std::string data = write_jsonl("slow.jsonl", {});
  const auto run = [&](const std::string& name, int delay_ms, int depth) {
    const std::string dump = (root_ / name).string();
    auto r = sh("CTITAN_DATA_DELAY_MS=" + std::to_string(delay_ms) + " " + kTrain + args(data, dump, 6) +
                " --training.seq_len 256 --training.local_batch_size 8 --training.prefetch_batches " +
                std::to_string(depth));
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<double> wait, at;
    for (const auto& v : jsonl_field(dump + "/metrics.jsonl", "data_loading_s")) wait.push_back(std::stod(v));
    for (const auto& v : jsonl_field(dump + "/metrics.jsonl", "elapsed_s")) at.push_back(std::stod(v));
    EXPECT_EQ(wait.size(), 6u) << r.out;
    return std::make_pair(wait, at);
  };
  const auto [free_wait, free_at] = run("slow_none", 0, 0);
  ASSERT_EQ(free_at.size(), 6u);
  std::vector<double> step_s;  // steps 3-6 (step 2's time holds the first line's matmul peak)
  for (size_t i = 2; i < free_at.size(); ++i) step_s.push_back(free_at[i] - free_at[i - 1]);
  const int delay_ms = std::clamp(static_cast<int>(median(step_s) * 1000 / 3), 20, 300);
  const double D = delay_ms / 1000.0;
  const auto [sync_wait, sync_at] = run("slow_sync", delay_ms, 0);
  const auto [ahead_wait, ahead_at] = run("slow_ahead", delay_ms, 2);
  ASSERT_EQ(sync_wait.size(), 6u);
  ASSERT_EQ(ahead_wait.size(), 6u);
  for (size_t i = 1; i < 6; ++i) {
    EXPECT_GE(sync_wait[i], 0.95 * D) << "step " << i + 1 << " without read-ahead, D = " << D;
    EXPECT_LT(ahead_wait[i], D / 4) << "step " << i + 1 << " with 2 batches read ahead, D = " << D;
  }
  std::printf("step %.3f s without delay; D = %.3f s; data wait per step (median of steps 2-6): %.4f s, %.4f s ahead\n",
              median(step_s), D, median(std::vector<double>(sync_wait.begin() + 1, sync_wait.end())),
              median(std::vector<double>(ahead_wait.begin() + 1, ahead_wait.end())));
}

}  // namespace

// Pre-tokenized shards through the real tools: `tokenize` turns the corpus (two .jsonl files)
// into .ctok shards, and `train` on them logs bitwise the same losses as on the text (the
// same windows on 2 ranks); a truncated shard and shards made with another tokenizer end the
// run with exit 2 and one line naming the file, before anything is written.
TEST_F(DataE2E, TokenShardsTrainLikeTheTextAndDamagedOnesExitTwo) {
  const fs::path text = root_ / "shard_text";
  fs::create_directories(text);
  for (int f = 0; f < 2; ++f) {
    std::ofstream o(text / ("part" + std::to_string(f) + ".jsonl"));
    for (size_t i = f; i < lines_.size(); i += 2) o << lines_[i] << "\n";
  }
  const std::string tokenize = (fs::path(kTrain).parent_path() / "tokenize").string();
  const std::string shards = (root_ / "shards").string();
  auto r = sh(tokenize + " --tokenizer " + tokenizer_ + " --output " + shards + " " + text.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenize: 2 shards in " + shards + ": 600 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(uint16)"), std::string::npos) << r.out;
  const std::string d1 = (root_ / "on_text").string(), d2 = (root_ / "on_shards").string();
  const std::string two = "NPROC=2 " + kSrc + "/scripts/run_train.sh";
  r = sh(two + args(text.string(), d1, 3) + " --debug.seed 5");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(two + args(shards, d2, 3) + " --debug.seed 5");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = jsonl_field(d1 + "/metrics.jsonl", "loss"), b = jsonl_field(d2 + "/metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b) << "losses on the text and on its shards";
  // Truncated.
  const fs::path cut = root_ / "cut";
  fs::create_directories(cut);
  fs::copy_file(shards + "/part0.jsonl.ctok", cut / "part0.jsonl.ctok");
  fs::resize_file(cut / "part0.jsonl.ctok", fs::file_size(cut / "part0.jsonl.ctok") - 3);
  const std::string d3 = (root_ / "on_cut").string();
  r = sh(kTrain + args(cut.string(), d3, 3));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find((cut / "part0.jsonl.ctok").string() + ": truncated or corrupt token shard"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(d3 + "/metrics.jsonl"));
  // Another tokenizer.
  const std::string other = (root_ / "other.model").string();
  r = sh(kSrc + "/scripts/train_tokenizer.sh " + (root_ / "plain.txt").string() + " " + other + " 300");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string d4 = (root_ / "on_other").string();
  std::string with_other = args(shards, d4, 3);
  with_other.replace(with_other.find(tokenizer_), tokenizer_.size(), other);
  r = sh(kTrain + with_other);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("part0.jsonl.ctok was tokenized with " + tokenizer_), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("but this run's tokenizer is " + other), std::string::npos) << r.out;
}
