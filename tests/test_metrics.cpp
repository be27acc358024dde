// Metrics outputs beyond metrics.jsonl: TensorBoard event files (components/tensorboard.h)
// read back with TensorBoard's own reader (scripts/tb_read.py: EventAccumulator from the venv's
// PyPI tensorboard; these tests fail, not skip, without it), and validation
// (components/validate.h) checked against a one-process forward computed here.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/safetensors.h"
#include "tools/checkpoint_tool.h"
#include "components/metrics.h"
#include "components/tensorboard.h"
#include "util/crc.h"
#include "datasets/dataloader.h"
#include "datasets/tokenizer.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"

namespace fs = std::filesystem;
using namespace ctitan;
using namespace ctitan::testing;

namespace {

// The venv's python, as scripts/common.sh finds it: $CTITAN_PYTHON, else $CTITAN_VENV/bin/python,
// else <repo>/.venv/bin/python.
std::string venv_python() {
  if (const char* p = std::getenv("CTITAN_PYTHON"); p && *p) return p;
  if (const char* v = std::getenv("CTITAN_VENV"); v && *v) return std::string(v) + "/bin/python";
  return kSrc + "/.venv/bin/python";
}

// What TensorBoard's EventAccumulator reads from a folder: tag → step → value.
struct TbRead {
  int code = -1;
  std::string out;
  std::string file_version;
  std::map<std::string, std::map<int64_t, double>> scalars;
  size_t count = 0;  // values read (a step read twice for one tag would show here)
};

TbRead tb_read(const std::string& folder) {
  TbRead r;
  const Cmd c = sh(venv_python() + " " + kSrc + "/scripts/tb_read.py " + folder);
  r.code = c.code;
  r.out = c.out;
  std::istringstream in(c.out);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f;
    std::stringstream ls(line);
    for (std::string x; std::getline(ls, x, '\t');) f.push_back(x);
    if (f.size() == 2 && f[0] == "file_version") r.file_version = f[1];
    if (f.size() == 4) {
      r.scalars[f[0]][std::stoll(f[1])] = std::strtod(f[2].c_str(), nullptr);
      ++r.count;
    }
  }
  return r;
}

// The folders under `root` (recursively) that hold event files, sorted.
std::vector<fs::path> event_folders(const fs::path& root) {
  std::set<fs::path> dirs;
  if (fs::exists(root))
    for (const auto& e : fs::recursive_directory_iterator(root))
      if (e.is_regular_file() && e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
        dirs.insert(e.path().parent_path());
  return {dirs.begin(), dirs.end()};
}

// Every line of a metrics.jsonl as field → value (step included).
std::vector<std::map<std::string, double>> jsonl_records(const std::string& path) {
  std::vector<std::map<std::string, double>> out;
  std::ifstream f(path);
  const std::regex field("\"([A-Za-z_]+)\": ([^,}]+)");
  for (std::string line; std::getline(f, line);) {
    std::map<std::string, double> rec;
    for (std::sregex_iterator it(line.begin(), line.end(), field), end; it != end; ++it)
      rec[(*it)[1]] = std::strtod((*it)[2].str().c_str(), nullptr);
    out.push_back(rec);
  }
  return out;
}

// ---- the encoder and the framing ----------------------------------------------------------

TEST(TensorBoard, Crc32cMatchesTheStandardCheckValues) {
  // The CRC-32C check value, and RFC 3720's 32 zero bytes / 32 bytes 0xff vectors.
  EXPECT_EQ(crc::crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc::crc32c(ones.data(), 32), 0x62A8AB43u);
  // Continuing a CRC equals the CRC of the concatenation.
  EXPECT_EQ(crc::crc32c("6789", 4, crc::crc32c("12345", 5)), 0xE3069283u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(tensorboard::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, EventBytesFollowTheProtobufWireFormat) {
  // Event{wall_time 1.5, step 300, summary{value{tag "a", simple_value 2}}}, encoded by hand:
  //   09 <1.5 as LE double>  10 AC 02  2A 0A [0A 08 [0A 01 'a' 15 <2.0f LE>]]
  const std::string want = std::string("\x09\x00\x00\x00\x00\x00\x00\xf8\x3f", 9) + std::string("\x10\xac\x02", 3) +
                           std::string(
                               "\x2a\x0a\x0a\x08\x0a\x01"
                               "a"
                               "\x15\x00\x00\x00\x40",
                               12);
  EXPECT_EQ(tensorboard::encode_scalars_event(1.5, 300, {{"a", 2.0}}), want);
  EXPECT_EQ(tensorboard::encode_file_version_event(1.5), std::string("\x09\x00\x00\x00\x00\x00\x00\xf8\x3f\x1a\x0d"
                                                                     "brain.Event:2",
                                                                     24));
  // TFRecord: LE length, masked CRC of those 8 bytes, data, masked CRC of the data.
  const std::string rec = tensorboard::tfrecord("xyz");
  ASSERT_EQ(rec.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  uint32_t len_crc, data_crc;
  std::memcpy(&len_crc, rec.data() + 8, 4);
  std::memcpy(&data_crc, rec.data() + 15, 4);
  EXPECT_EQ(len_crc, tensorboard::masked_crc32c(rec.data(), 8));
  EXPECT_EQ(data_crc, tensorboard::masked_crc32c("xyz", 3));
}

// TensorBoard's reader takes every step of a file ctitan wrote, values as float (simple_value);
// it checks the CRCs: a flipped byte in the third step's record hides that step and the rest.
TEST(TensorBoard, TensorBoardReadsTheWritersFileAndChecksItsCrcs) {
  const fs::path dir = fs::temp_directory_path() / ("ctitan_tb_unit_" + std::to_string(getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w(dir.string());
    path = w.path();
    for (int64_t step = 1; step <= 5; ++step)
      w.add_scalars(step, {{"loss_metrics/global_avg_loss", 10.0 / step}, {"mfu(%)", 0.1 * step}, {"lr", 3e-4}});
  }
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;
  TbRead r = tb_read(dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.file_version, "2.0");  // EventAccumulator parses "brain.Event:2"
  ASSERT_EQ(r.scalars.size(), 3u) << r.out;
  for (int64_t step = 1; step <= 5; ++step) {
    EXPECT_EQ(r.scalars["loss_metrics/global_avg_loss"][step], static_cast<double>(static_cast<float>(10.0 / step)));
    EXPECT_EQ(r.scalars["mfu(%)"][step], static_cast<double>(static_cast<float>(0.1 * step)));
  }
  EXPECT_EQ(r.count, 15u);

  // Records: file version, then steps 1..5. Flip a byte inside step 3's record data.
  std::string bytes = read_file(path);
  size_t off = 0;
  for (int rec = 0; rec < 3; ++rec) {
    uint64_t len;
    std::memcpy(&len, bytes.data() + off, 8);
    off += 8 + 4 + len + 4;
  }
  bytes[off + 12 + 5] ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  r = tb_read(dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.scalars["lr"].size(), 2u) << "steps 1 and 2 only:\n" << r.out;
  fs::remove_all(dir);
}

// ---- the train binary ------------------------------------------------------------------------

// A held-out text of the same vocabulary as make_corpus's, from another seed: one paragraph
// (= one document) per line, separated by blank lines.
std::string make_heldout(const fs::path& dir, int paragraphs) {
  const char* subj[] = {"the whale", "the captain", "a sailor", "the harpooneer", "the mate", "the ship"};
  const char* verb[] = {"watched", "followed", "feared", "sought", "sailed past", "remembered"};
  const char* obj[] = {"the white sea", "a distant spout", "the old chart", "the long voyage"};
  std::mt19937 rng(987);
  fs::create_directories(dir);
  const fs::path path = dir / "heldout.txt";
  std::ofstream f(path);
  for (int p = 0; p < paragraphs; ++p) {
    const int sentences = 1 + rng() % 3;
    for (int s = 0; s < sentences; ++s)
      f << (s ? " " : "") << subj[rng() % 6] << " " << verb[rng() % 6] << " " << obj[rng() % 4] << " at dawn.";
    f << "\n\n";
  }
  return path.string();
}

class MetricsE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_metrics_e2e_" + std::to_string(getpid()));
    corpus_ = make_corpus(root_ / "data");
    heldout_ = make_heldout(root_ / "heldout", 60);
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ + " 400");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(root_);
  }

  // A small, fast run of the debug model in float32 (so that FSDP's gathered parameters are
  // the master weights and a one-process forward is comparable to 1e-5).
  static std::string args(const std::string& dump, int steps) {
    return " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " + tokenizer_ +
           " --training.dataset_path " + corpus_ + " --job.dump_folder " + dump + " --training.steps " +
           std::to_string(steps) +
           " --training.seq_len 64 --training.local_batch_size 4 --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3"
           " --training.mixed_precision_param float32 --activation_checkpoint.mode none --debug.seed 11";
  }
  static std::string validation_args() {
    return " --validation.enable --validation.dataset_path " + heldout_ +
           " --validation.freq 10 --validation.steps -1 --validation.local_batch_size 2 --validation.seq_len 32";
  }

  static std::vector<std::string> argv_of(const std::string& args) {
    std::vector<std::string> argv = {kTrain};
    std::istringstream is(args);
    for (std::string a; is >> a;) argv.push_back(a);
    return argv;
  }

  static fs::path root_;
  static std::string corpus_, heldout_, tokenizer_;
};
fs::path MetricsE2E::root_;
std::string MetricsE2E::corpus_, MetricsE2E::heldout_, MetricsE2E::tokenizer_;

// Checks that TensorBoard holds exactly the numbers of metrics.jsonl: every record's every
// field under its tag at the record's step (as float), and nothing else.
void expect_tensorboard_equals_jsonl(const TbRead& tb, const std::string& jsonl) {
  const auto records = jsonl_records(jsonl);
  ASSERT_FALSE(records.empty());
  size_t expected_values = 0;
  for (const auto& rec : records) {
    const auto step = static_cast<int64_t>(rec.at("step"));
    for (const auto& [field, value] : rec) {
      if (field == "step") continue;
      ++expected_values;
      const std::string tag = MetricsLogger::tensorboard_tag(field);
      auto t = tb.scalars.find(tag);
      ASSERT_NE(t, tb.scalars.end()) << "no tag " << tag << " (" << field << ")";
      auto s = t->second.find(step);
      ASSERT_NE(s, t->second.end()) << tag << " has no step " << step;
      EXPECT_EQ(s->second, static_cast<double>(static_cast<float>(value))) << tag << " at step " << step;
    }
  }
  EXPECT_EQ(tb.count, expected_values) << "TensorBoard holds values metrics.jsonl does not";
}

// Criterion: a 50-step debug run with TensorBoard on; its event file, read by TensorBoard's
// EventAccumulator, holds every logged step for every tag with metrics.jsonl's values, under
// torchtitan's tag names; and the file is valid while the job still runs.
TEST_F(MetricsE2E, FiftyStepRunTensorBoardEqualsMetricsJsonl) {
  const std::string dump = (root_ / "tb50").string();
  auto r = sh(kTrain + args(dump, 50) + validation_args() +
              " --validation.steps 2 --metrics.enable_tensorboard --metrics.log_freq 5");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto folders = event_folders(fs::path(dump) / "tb");
  ASSERT_EQ(folders.size(), 1u) << "one folder, rank 0's";
  // <dump>/tb/<%Y%m%d-%H%M>/, as torchtitan.
  EXPECT_TRUE(std::regex_match(folders[0].filename().string(), std::regex("[0-9]{8}-[0-9]{4}"))) << folders[0];
  EXPECT_EQ(folders[0].parent_path(), fs::path(dump) / "tb");
  const TbRead tb = tb_read(folders[0].string());
  ASSERT_EQ(tb.code, 0) << tb.out;
  EXPECT_EQ(tb.file_version, "2.0");
  for (const char* tag : {"loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm", "lr",
                          "throughput(tps)", "tflops", "mfu(%)", "memory/max_reserved(GiB)", "n_tokens_seen",
                          "validation_metrics/loss", "validation_metrics/throughput(tps)"})
    EXPECT_TRUE(tb.scalars.count(tag)) << tag << "\n" << tb.out;
  std::set<int64_t> steps;
  for (const auto& [s, v] : tb.scalars.at("loss_metrics/global_avg_loss")) steps.insert(s);
  std::set<int64_t> want = {1};
  for (int s = 5; s <= 50; s += 5) want.insert(s);
  EXPECT_EQ(steps, want);
  std::set<int64_t> val_steps;
  for (const auto& [s, v] : tb.scalars.at("validation_metrics/loss")) val_steps.insert(s);
  EXPECT_EQ(val_steps, (std::set<int64_t>{1, 10, 20, 30, 40, 50}));
  expect_tensorboard_equals_jsonl(tb, dump + "/metrics.jsonl");
  // One process: the largest rank's loss is the loss.
  for (const auto& [s, v] : tb.scalars.at("loss_metrics/global_max_loss"))
    EXPECT_EQ(v, tb.scalars.at("loss_metrics/global_avg_loss").at(s));
}

// torchtitan's llama3_8b.toml runs on a CPU with a CPU-sized flavor: train_configs/llama3_8b.toml
// (the same tables, keys and values, TensorBoard on, selective AC "op", profiling every 100
// steps), with only the data, the tokenizer, the flavor, and — to keep this test seconds
// long — the steps and seq_len (8192) changed on the command line. Exit 0, and TensorBoard
// reads the event file under <dump>/tb/<minute>/ with metrics.jsonl's values.
TEST_F(MetricsE2E, Llama3_8bConfigRunsWithACpuSizedFlavor) {
  const std::string dump = (root_ / "llama3_8b").string();
  auto r = sh(kTrain + " --job.config_file " + kSrc + "/train_configs/llama3_8b.toml --model.flavor debugmodel" +
              " --model.hf_assets_path '' --model.tokenizer_path " + tokenizer_ + " --training.dataset_path " +
              corpus_ + " --job.dump_folder " + dump + " --training.steps 2 --training.seq_len 128 2>&1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("activation checkpointing: selective op"), std::string::npos) << r.out;
  const auto folders = event_folders(fs::path(dump) / "tb");
  ASSERT_EQ(folders.size(), 1u);
  const TbRead tb = tb_read(folders[0].string());
  ASSERT_EQ(tb.code, 0) << tb.out;
  std::set<int64_t> steps;
  ASSERT_TRUE(tb.scalars.count("loss_metrics/global_avg_loss")) << tb.out;
  for (const auto& [s, v] : tb.scalars.at("loss_metrics/global_avg_loss")) steps.insert(s);
  EXPECT_EQ(steps, (std::set<int64_t>{1, 2})) << "log_freq 10: the first and the last step";
  expect_tensorboard_equals_jsonl(tb, dump + "/metrics.jsonl");
}

// Read while the writer still runs: rank 0 stops inside step 12 (CTITAN_FAULT=hang), its
// event file open; TensorBoard reads steps 1..11, each equal to metrics.jsonl's.
TEST_F(MetricsE2E, EventFileIsValidWhileTheJobRuns) {
  const std::string dump = (root_ / "tb_live").string();
  const std::string cmd =
      "CTITAN_FAULT=hang:0:12 " + kTrain + args(dump, 50) + " --metrics.enable_tensorboard --metrics.log_freq 1";
  const std::string jsonl = dump + "/metrics.jsonl";
  // A simple command in the background: $! is the train process itself.
  auto r = sh("{ " + cmd + " > " + root_.string() +
              "/live.log 2>&1 & pid=$!; "
              "for i in $(seq 1200); do [ -f " +
              jsonl + " ] && [ $(wc -l < " + jsonl +
              ") -ge 11 ] && break; "
              "sleep 0.1; done; sleep 1; kill -0 $pid && echo RUNNING_BEFORE; "
              "dir=$(dirname $(ls " +
              dump + "/tb/*/events.out.tfevents.*)); " + venv_python() + " " + kSrc + "/scripts/tb_read.py $dir > " +
              root_.string() +
              "/live.tb; echo READ_RC=$?; "
              "kill -0 $pid && echo RUNNING_AFTER; kill -KILL $pid; wait $pid; }");
  EXPECT_NE(r.out.find("RUNNING_BEFORE"), std::string::npos) << r.out << read_file(root_.string() + "/live.log");
  EXPECT_NE(r.out.find("READ_RC=0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("RUNNING_AFTER"), std::string::npos) << r.out;
  TbRead tb;
  tb.code = 0;
  {
    std::ifstream in(root_.string() + "/live.tb");
    for (std::string line; std::getline(in, line);) {
      std::vector<std::string> f;
      std::stringstream ls(line);
      for (std::string x; std::getline(ls, x, '\t');) f.push_back(x);
      if (f.size() == 2) tb.file_version = f[1];
      if (f.size() == 4) {
        tb.scalars[f[0]][std::stoll(f[1])] = std::strtod(f[2].c_str(), nullptr);
        ++tb.count;
      }
    }
  }
  EXPECT_EQ(tb.file_version, "2.0");
  ASSERT_EQ(jsonl_records(jsonl).size(), 11u);
  EXPECT_EQ(tb.scalars["loss_metrics/global_avg_loss"].size(), 11u);
  expect_tensorboard_equals_jsonl(tb, jsonl);
}

// metrics.save_for_all_ranks: one event file per rank in <minute>/rank_<r>/ (torchtitan's
// layout), both folders of the same minute; the global metrics equal on both ranks.
TEST_F(MetricsE2E, SaveForAllRanksWritesOneFilePerRank) {
  const std::string dump = (root_ / "tb_all").string();
  auto rs = spawn_processes(argv_of(args(dump, 4) + " --metrics.enable_tensorboard --metrics.save_for_all_ranks"
                                                    " --metrics.log_freq 1"),
                            2, {}, 300);
  ASSERT_TRUE(all_ok(rs));
  const auto folders = event_folders(fs::path(dump) / "tb");
  ASSERT_EQ(folders.size(), 2u);
  EXPECT_EQ(folders[0].filename(), "rank_0");
  EXPECT_EQ(folders[1].filename(), "rank_1");
  EXPECT_EQ(folders[0].parent_path(), folders[1].parent_path());
  const TbRead t0 = tb_read(folders[0].string()), t1 = tb_read(folders[1].string());
  ASSERT_EQ(t0.code, 0) << t0.out;
  ASSERT_EQ(t1.code, 0) << t1.out;
  expect_tensorboard_equals_jsonl(t0, dump + "/metrics.jsonl");
  EXPECT_EQ(t0.scalars.at("loss_metrics/global_avg_loss"), t1.scalars.at("loss_metrics/global_avg_loss"));
  EXPECT_EQ(t0.scalars.at("loss_metrics/global_avg_loss").size(), 4u);
  // Two ranks: the mean of the ranks' losses is at most their max, and they differ.
  for (const auto& [s, v] : t0.scalars.at("loss_metrics/global_max_loss"))
    EXPECT_GT(v, t0.scalars.at("loss_metrics/global_avg_loss").at(s)) << "step " << s;
}

TEST_F(MetricsE2E, WandbIsRefusedAndBadValidationKeysExitTwo) {
  const std::string dump = (root_ / "refused").string();
  auto r = sh(kTrain + args(dump, 2) + " --metrics.enable_wandb");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not supported yet: metrics.enable_wandb = true (ctitan supports: false)"), std::string::npos)
      << r.out;
  r = sh(kTrain + args(dump, 2) + " --validation.enable --validation.seq_len 32");  // torchtitan's default dataset
  EXPECT_EQ(r.code, 2) << r.out;
  // Known by name, as in torchtitan, but its files (allenai/c4's en/c4-validation.*) are not here.
  EXPECT_NE(r.out.find("validation.dataset=c4_validation: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("set validation.dataset_path"), std::string::npos) << r.out;
  r = sh(kTrain + args(dump, 2) + validation_args() + " --validation.seq_len 65");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config error: validation.seq_len = 65 exceeds training.seq_len = 64"), std::string::npos)
      << r.out;
  r = sh(kTrain + args(dump, 2) + validation_args() + " --validation.local_batch_size 1000");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("less than one batch"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dump)) << "bad input writes nothing";
}

// ---- validation against a one-process forward --------------------------------------------

// The validation windows of dp rank r of W, packed here as the loader documents it: the one
// file is cut into W equal byte ranges and rank r takes the paragraphs (one line each here)
// that start in the r-th, each encoded with BOS and EOS, concatenated, cut into windows of T + 1.
std::vector<std::vector<int64_t>> heldout_windows(const Tokenizer& tok, const std::string& path, int r, int W, int T) {
  std::ifstream f(path);
  std::vector<int64_t> stream;
  const uint64_t size = fs::file_size(path);
  uint64_t at = 0;
  for (std::string line; std::getline(f, line);) {
    const uint64_t start = at;
    at += line.size() + 1;
    if (line.empty()) continue;
    if (W > 1 && (start < size * r / W || start >= size * (r + 1) / W)) continue;
    for (int32_t id : tok.encode(line, true, true)) stream.push_back(id);
  }
  std::vector<std::vector<int64_t>> out;
  for (size_t at = 0; at + T + 1 <= stream.size(); at += T + 1)
    out.emplace_back(stream.begin() + at, stream.begin() + at + T + 1);
  return out;
}

struct Reference {
  double loss = 0;
  double tokens = 0;
};

// Σ CE / tokens over the first n_batches · B windows of every rank, each window's logits from
// checkpoint_tool's float32 one-process forward of the step's checkpoint.
Reference reference_loss(const std::string& step_dir, const std::string& tokenizer, const std::string& heldout, int W,
                         int B, int T, const fs::path& scratch) {
  auto tok = Tokenizer::load(tokenizer);
  std::vector<std::vector<std::vector<int64_t>>> per_rank;
  size_t n_batches = SIZE_MAX;
  for (int r = 0; r < W; ++r) {
    per_rank.push_back(heldout_windows(*tok, heldout, r, W, T));
    n_batches = std::min(n_batches, per_rank.back().size() / B);
  }
  double sum = 0, tokens = 0;
  const std::string out = (scratch / "logits.safetensors").string();
  for (int r = 0; r < W; ++r)
    for (size_t w = 0; w < n_batches * B; ++w) {
      const auto& win = per_rank[r][w];
      dump_logits(step_dir, {std::vector<int64_t>(win.begin(), win.end() - 1)}, out);
      const auto h = safetensors::read_header(out);
      const auto* info = h.find("logits");
      const int64_t V = info->shape[1];
      std::vector<float> logits(static_cast<size_t>(T * V));
      safetensors::read_bytes(h, *info, 0, logits.size() * sizeof(float), logits.data());
      for (int t = 0; t < T; ++t) {
        const float* row = logits.data() + t * V;
        double mx = -INFINITY, se = 0;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
        for (int64_t v = 0; v < V; ++v) se += std::exp(static_cast<double>(row[v]) - mx);
        sum += mx + std::log(se) - row[win[t + 1]];
        tokens += 1;
      }
    }
  return {sum / tokens, tokens};
}

// Criterion: validation every 10 steps on a held-out file, on 1 and 2 real ranks: the loss is in
// the console line, metrics.jsonl and TensorBoard, equals a one-process forward over the same
// tokens within 1e-5 relative, and the training losses equal a run without validation bitwise.
void check_validation(int W, const std::string& dump, const std::string& plain,
                      const std::function<std::string(const std::string&)>& args, const std::string& val,
                      const std::string& tokenizer, const std::string& heldout, const fs::path& scratch) {
  auto run = [&](const std::string& a) {
    const std::vector<std::string> argv = [&] {
      std::vector<std::string> v = {kTrain};
      std::istringstream is(a);
      for (std::string x; is >> x;) v.push_back(x);
      return v;
    }();
    return spawn_processes(argv, W, {}, 600);
  };
  auto with = run(args(dump) + val + " --metrics.enable_tensorboard --checkpoint.enable --checkpoint.interval 10");
  ASSERT_TRUE(all_ok(with));
  auto without = run(args(plain));
  ASSERT_TRUE(all_ok(without));

  // Training losses: bitwise the same with and without validation (17 significant digits).
  const auto losses = jsonl_field(dump + "/metrics.jsonl", "loss"),
             plain_losses = jsonl_field(plain + "/metrics.jsonl", "loss");
  ASSERT_EQ(losses.size(), 20u);
  EXPECT_EQ(losses, plain_losses);

  // Validation after steps 1, 10, 20 in metrics.jsonl, the console line and TensorBoard.
  std::map<int64_t, double> jsonl_val, tokens_val;
  for (const auto& rec : jsonl_records(dump + "/metrics.jsonl"))
    if (rec.count("validation_loss")) {
      jsonl_val[static_cast<int64_t>(rec.at("step"))] = rec.at("validation_loss");
      tokens_val[static_cast<int64_t>(rec.at("step"))] = rec.at("validation_tokens");
    }
  ASSERT_EQ(jsonl_val.size(), 3u);
  const auto folders = event_folders(fs::path(dump) / "tb");
  ASSERT_EQ(folders.size(), 1u) << "rank 0 only";
  const TbRead tb = tb_read(folders[0].string());
  ASSERT_EQ(tb.code, 0) << tb.out;
  for (int64_t s : {1, 10, 20}) {
    ASSERT_TRUE(jsonl_val.count(s)) << "no validation after step " << s;
    char line[96];
    std::snprintf(line, sizeof line, "validate step: %5ld  loss: %7.4f", static_cast<long>(s), jsonl_val[s]);
    EXPECT_NE(with[0].output.find(line), std::string::npos) << line << "\n" << with[0].output;
    EXPECT_EQ(tb.scalars.at("validation_metrics/loss").at(s), static_cast<double>(static_cast<float>(jsonl_val[s])));
  }
  EXPECT_NE(jsonl_val[10], jsonl_val[20]) << "the model changed between the validations";

  // Against one process: the checkpoints of steps 10 and 20 hold the weights validated then.
  for (int64_t s : {10, 20}) {
    const Reference ref =
        reference_loss(dump + "/checkpoint/step-" + std::to_string(s), tokenizer, heldout, W, 2, 32, scratch);
    std::printf("[ranks %d] validation after step %ld: %.17g; one-process forward %.17g (relative %.2e), %.0f tokens\n",
                W, static_cast<long>(s), jsonl_val[s], ref.loss, std::fabs(jsonl_val[s] - ref.loss) / ref.loss,
                ref.tokens);
    EXPECT_EQ(tokens_val[s], ref.tokens) << "step " << s;
    EXPECT_LT(std::fabs(jsonl_val[s] - ref.loss) / ref.loss, 1e-5)
        << "step " << s << ": validation " << jsonl_val[s] << " vs one-process forward " << ref.loss;
  }
}

TEST_F(MetricsE2E, ValidationEqualsOneProcessForwardOnOneRank) {
  check_validation(
      1, (root_ / "val1").string(), (root_ / "plain1").string(),
      [](const std::string& d) { return args(d, 20) + " --metrics.log_freq 1"; }, validation_args(), tokenizer_,
      heldout_, root_);
}

TEST_F(MetricsE2E, ValidationEqualsOneProcessForwardOnTwoRanks) {
  check_validation(
      2, (root_ / "val2").string(), (root_ / "plain2").string(),
      [](const std::string& d) { return args(d, 20) + " --metrics.log_freq 1"; }, validation_args(), tokenizer_,
      heldout_, root_);
}

// MoE: the validation forward routes tokens too; the routing counters it fills are reset, so
// the next steps' expert load (expert_spread, and the expert-bias update it feeds) and losses
// equal a run without validation, bitwise.
TEST_F(MetricsE2E, MixtralValidationLeavesTrainingAndRoutingStatisticsUnchanged) {
  const std::string base = " --job.config_file " + kSrc + "/train_configs/mixtral_debug.toml --model.tokenizer_path " +
                           tokenizer_ + " --training.dataset_path " + corpus_ +
                           " --training.steps 8 --training.seq_len 32 --training.local_batch_size 2"
                           " --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --activation_checkpoint.mode none"
                           " --training.mixed_precision_param float32 --debug.seed 5";
  const std::string with = (root_ / "moe_val").string(), without = (root_ / "moe_plain").string();
  auto r = sh(kTrain + base + " --job.dump_folder " + with + validation_args() +
              " --validation.freq 3 --validation.steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kTrain + base + " --job.dump_folder " + without);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(jsonl_field(with + "/metrics.jsonl", "validation_loss").size(), 3u) << "after steps 1, 3, 6";
  for (const char* field : {"loss", "expert_spread", "lb_loss", "grad_norm"}) {
    const auto a = jsonl_field(with + "/metrics.jsonl", field), b = jsonl_field(without + "/metrics.jsonl", field);
    EXPECT_EQ(a.size(), 8u) << field;
    EXPECT_EQ(a, b) << field;
  }
}

// Validation's "until exhausted" rests on the loader's one-pass mode: whole batches only,
// then has_next_batch() false and next() a logic error; repeating loaders never run out.
TEST_F(MetricsE2E, LoaderWithoutRepeatStopsAfterTheLastWholeBatch) {
  auto tok = Tokenizer::load(tokenizer_);
  const int T = 32, B = 2;
  const size_t windows = heldout_windows(*tok, heldout_, 0, 1, T).size();
  ASSERT_GT(windows, 4u);
  DataLoader once(*tok, heldout_, T, B, 0, 1);
  once.set_repeat(false);
  size_t batches = 0;
  while (once.has_next_batch()) {
    const Batch b = once.next();
    ASSERT_EQ(b.inputs.size(), static_cast<size_t>(B * T));
    ++batches;
  }
  EXPECT_EQ(batches, windows / B);
  EXPECT_EQ(once.epoch(), 0);
  EXPECT_THROW(once.next(), std::logic_error);
  DataLoader looping(*tok, heldout_, T, B, 0, 1);
  for (size_t i = 0; i < windows; ++i) ASSERT_TRUE(looping.has_next_batch());
  for (size_t i = 0; i < windows; ++i) looping.next();
  EXPECT_EQ(looping.epoch(), 1) << "the repeating loader went round";
}

}  // namespace

CTITAN_MULTIPROCESS_MAIN()
