// torch.distributed.checkpoint (DCP) folders against the venv's real PyTorch (2.13.0):
// torchtitan-format checkpoints written by PyTorch resume in ctitan on 1, 2 and 3 ranks (FSDP
// saves) and on 1, 2 and tp 2 (tensor-parallel saves, alone and with FSDP on a 2-D mesh),
// ctitan's checkpoint.format = "dcp" saves load with torch.distributed.checkpoint.load, and
// hostile or damaged folders are one-line errors with nothing executed. The PyTorch side is
// scripts/dcp_torchtitan.py; these tests fail (not skip) without the venv.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/dcp.h"
#include "checkpoint/format.h"
#include "checkpoint/pickle.h"
#include "checkpoint/torch_save.h"
#include "e2e.h"
#include "multiprocess.h"

namespace fs = std::filesystem;
using namespace ctitan;
using ctitan::testing::kSrc;
using ctitan::testing::sh;

namespace {

std::string venv_python() {
  if (const char* p = std::getenv("CTITAN_PYTHON"); p && *p) return p;
  if (const char* v = std::getenv("CTITAN_VENV"); v && *v) return std::string(v) + "/bin/python";
  return kSrc + "/.venv/bin/python";
}
std::string script() { return venv_python() + " " + kSrc + "/scripts/dcp_torchtitan.py "; }

// A torch.save'd dict of tensors (Python's), by name.
std::map<std::string, torch::Tensor> load_pt(const std::string& path) {
  const std::string bytes = ckpt::read_whole_file(path);
  const c10::IValue v = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : v.toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

// The last line of `out` that contains `needle` ("" when none).
std::string line_with(const std::string& out, const std::string& needle) {
  std::istringstream in(out);
  std::string found;
  for (std::string l; std::getline(in, l);)
    if (l.find(needle) != std::string::npos) found = l;
  return found;
}

}  // namespace

class DcpE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_dcp_e2e_" + std::to_string(getpid()));
    fs::create_directories(root_);
    corpus_ = ctitan::testing::make_corpus(root_ / "data");
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ + " 300");
    ASSERT_EQ(r.code, 0) << r.out;
    ASSERT_TRUE(fs::exists(venv_python())) << venv_python() << " is missing: scripts/install_deps.sh makes the venv";
  }
  // torchtitan's layout, written by PyTorch's own DCP on `ranks` Gloo ranks after 3 AdamW
  // steps, once per test process (ctest runs each test in its own): <root>/torchtitan<ranks>/
  // step-3 and reference.pt beside it (every tensor whole, torch.save).
  static std::string torchtitan_checkpoint(int ranks) {
    return torchtitan_save("torchtitan" + std::to_string(ranks), "--ranks " + std::to_string(ranks));
  }
  // The same with torchtitan's Llama tensor-parallel plan on a dp_shard x tp mesh (dp_shard 1:
  // TP alone): wo / w2 split along dim 1, and along dims 0 and 1 with FSDP on top.
  static std::string torchtitan_tp_checkpoint(int dp_shard, int tp) {
    return torchtitan_save("torchtitan_dp" + std::to_string(dp_shard) + "_tp" + std::to_string(tp),
                           "--dp-shard " + std::to_string(dp_shard) + " --tp " + std::to_string(tp));
  }
  // Each folder is made once per build tree and shared by the test processes (ctest runs each
  // test in its own; five of them read torchtitan2, each save is 14-25 s of PyTorch on 2 cores):
  // <build>/dcp_fixtures/<name>, made under a lock, made again when its STAMP (the command, the
  // two Python files, the venv's torch/version.py) differs. Tests only read these folders (a
  // test that damages one copies it first).
  static std::string torchtitan_save(const std::string& name, const std::string& layout) {
    const fs::path dir = fs::current_path() / "dcp_fixtures" / name;
    const std::string out = (dir / "step-3").string();
    const std::string cmd =
        script() + "save --out " + out + " " + layout + " --steps 3 --total-steps 5 --seq 32 --batch 2";
    std::string key = cmd + ctitan::testing::read_file(kSrc + "/scripts/dcp_torchtitan.py") +
                      ctitan::testing::read_file(kSrc + "/bench/eager_llama.py");
    const fs::path lib = fs::path(venv_python()).parent_path().parent_path() / "lib";
    if (fs::is_directory(lib))
      for (const auto& e : fs::directory_iterator(lib))
        key += ctitan::testing::read_file((e.path() / "site-packages" / "torch" / "version.py").string());
    const std::string stamp = std::to_string(std::hash<std::string>{}(key));
    fs::create_directories(dir.parent_path());
    const int lock = ::open((dir.string() + ".lock").c_str(), O_CREAT | O_RDWR, 0644);
    EXPECT_GE(lock, 0) << dir;
    if (lock >= 0) ::flock(lock, LOCK_EX);
    if (ctitan::testing::read_file((dir / "STAMP").string()) != stamp) {
      fs::remove_all(dir);
      fs::create_directories(dir);
      auto s = sh(cmd);
      EXPECT_EQ(s.code, 0) << s.out;
      if (s.code == 0) std::ofstream(dir / "STAMP") << stamp;
    }
    if (lock >= 0) ::close(lock);
    return out;
  }
  static std::string reference_of(const std::string& ckpt) {
    return (fs::path(ckpt).parent_path() / "reference.pt").string();
  }
  static void TearDownTestSuite() {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(root_);
  }
  static std::vector<ctitan::testing::RankResult> train(int n, const std::string& dump, const std::string& extra,
                                                        std::map<std::string, std::string> env = {}) {
    const std::string a = "--job.config_file " + kSrc + "/train_configs/debug_model.toml" + " --model.tokenizer_path " +
                          tokenizer_ + " --training.dataset_path " + corpus_ + " --job.dump_folder " + dump +
                          " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1"
                          " --debug.seed 7 --checkpoint.enable --comm.train_timeout_seconds 60 " +
                          extra;
    std::vector<std::string> argv = {ctitan::testing::kTrain};
    std::istringstream is(a);
    for (std::string w; is >> w;) argv.push_back(w);
    return ctitan::testing::spawn_processes(argv, n, env, 300);
  }
  // The torchtitan checkpoint resumed: the schedule of the PyTorch run (5 steps, warmup 2,
  // linear decay over 3 steps, min 0.1), full training state, torchtitan's data state left out.
  static std::string resume_args(const std::string& src) {
    return "--checkpoint.initial_load_path " + src +
           " --checkpoint.initial_load_model_only false --training.steps 5 --lr_scheduler.warmup_steps 2"
           " --lr_scheduler.decay_ratio 0.6 --lr_scheduler.min_lr_factor 0.1 --optimizer.lr 8e-4"
           " --training.mixed_precision_param float32";
  }

  // Resumes `src` (reference tensors in `ref`) on n ranks (`extra`: more of train's options)
  // and checks tensors, step, LR and the losses of steps 4 and 5 against PyTorch's; see the
  // test below.
  static void check_resume(const std::string& src, const std::string& ref_path, int n, const std::string& tag,
                           const std::string& extra = "");

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path DcpE2E::root_;
std::string DcpE2E::corpus_, DcpE2E::tokenizer_;

// Criterion 1: on 1, 2 and 3 ranks, every model and optimizer tensor ctitan holds after the
// load equals PyTorch's (the job's state written back out by the CTITAN_CHECKPOINT_DUMP_LOADED
// hook, compared with the full tensors PyTorch saved beside the checkpoint); step and LR
// continue; the losses of steps 4 and 5 equal PyTorch's own steps 4 and 5 (the checkpoint
// loaded by dcp.load into one process) on the batches ctitan traced, within 1e-5 relative.
void DcpE2E::check_resume(const std::string& src, const std::string& ref_path, int n, const std::string& tag,
                          const std::string& extra) {
  SCOPED_TRACE(tag + ", ranks " + std::to_string(n) + (extra.empty() ? "" : ", " + extra));
  const auto ref = load_pt(ref_path);
  ASSERT_GT(ref.size(), 100u);
  const fs::path dir = root_ / ("resume_" + tag + "_" + std::to_string(n));
  const std::string dump = (dir / "loaded").string(), win = (dir / "windows").string();
  auto rs = train(n, dir.string(), resume_args(src) + " --checkpoint.exclude_from_loading dataloader " + extra,
                  {{"CTITAN_CHECKPOINT_DUMP_LOADED", dump}, {"CTITAN_TRACE_WINDOWS", win}});
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_NE(rs[0].output.find("loaded step 3 from " + src), std::string::npos) << rs[0].output;

  // Every tensor as PyTorch saved it.
  CheckpointReader loaded(ckpt::step_dir(dump, 3));
  size_t model = 0, moments = 0, steps = 0;
  for (const auto& [key, want] : ref) {
    if (key == "lr" || key == "lr_scheduler.last_epoch") continue;
    ASSERT_TRUE(loaded.has(key)) << key;
    const torch::Tensor got = loaded.read_tensor(key);
    if (key.size() > 5 && key.compare(key.size() - 5, 5, ".step") == 0) {
      EXPECT_EQ(got.item<int64_t>(), static_cast<int64_t>(want.item<float>())) << key;
      ++steps;
      continue;
    }
    EXPECT_TRUE(torch::equal(got, want)) << key;
    (key.rfind("optimizer.", 0) == 0 ? moments : model) += 1;
  }
  EXPECT_EQ(model, 57u);
  EXPECT_EQ(moments, 2 * 57u);
  EXPECT_EQ(steps, 57u);
  EXPECT_EQ(loaded.read_int("lr_scheduler.last_step"), ref.at("lr_scheduler.last_epoch").item<int64_t>());
  EXPECT_EQ(loaded.read_int("train_state.step"), 3);

  // PyTorch's own steps 4 and 5 on ctitan's batches.
  auto py = sh(script() + "continue --ckpt " + src + " --windows " + win +
               " --total-steps 5 --warmup 2 --decay-ratio 0.6 --min-lr 0.1 --seq 32");
  ASSERT_EQ(py.code, 0) << py.out;
  std::smatch m;
  std::vector<double> py_loss, py_lr;
  const std::string json = line_with(py.out, "\"losses\"");
  const std::regex loss_re("\"loss\": ([-0-9.e]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), loss_re); it != std::sregex_iterator(); ++it)
    py_loss.push_back(std::stod((*it)[1]));
  ASSERT_TRUE(std::regex_search(json, m, std::regex("\"lrs\": \\[([^\\]]*)\\]"))) << py.out;
  std::istringstream lrs(m[1].str());
  for (std::string x; std::getline(lrs, x, ',');) py_lr.push_back(std::stod(x));
  const auto steps_logged = ctitan::testing::jsonl_field((dir / "metrics.jsonl").string(), "step");
  const auto loss = ctitan::testing::jsonl_field((dir / "metrics.jsonl").string(), "loss");
  const auto lr = ctitan::testing::jsonl_field((dir / "metrics.jsonl").string(), "lr");
  ASSERT_EQ(steps_logged, (std::vector<std::string>{"4", "5"}));
  ASSERT_EQ(py_loss.size(), 2u) << py.out;
  ASSERT_EQ(py_lr.size(), 2u) << py.out;
  for (size_t i = 0; i < 2; ++i) {
    const double rel = std::abs(std::stod(loss[i]) - py_loss[i]) / std::abs(py_loss[i]);
    EXPECT_LT(rel, 1e-5) << "step " << 4 + i << ": ctitan " << loss[i] << ", PyTorch " << py_loss[i];
    EXPECT_NEAR(std::stod(lr[i]), py_lr[i], 1e-12 + 1e-9 * py_lr[i]) << "step " << 4 + i;
    std::printf("[%s, ranks %d] step %zu: loss ctitan %s PyTorch %.9g (rel %.2e); lr ctitan %s PyTorch %.9g\n",
                tag.c_str(), n, 4 + i, loss[i].c_str(), py_loss[i], rel, lr[i].c_str(), py_lr[i]);
  }
}

TEST_F(DcpE2E, TorchtitanCheckpointResumesOnOneTwoAndThreeRanks) {
  const std::string tt = torchtitan_checkpoint(2), tt3 = torchtitan_checkpoint(3);
  for (int n : {1, 2, 3}) check_resume(tt, reference_of(tt), n, "saved_on_2");
  // Uneven shards the other way: saved on 3 ranks, resumed on 2.
  check_resume(tt3, reference_of(tt3), 2, "saved_on_3");
}

namespace {
// The chunk offsets .metadata records for `key`, sorted.
std::set<std::vector<int64_t>> chunk_offsets(const std::string& dir, const std::string& key) {
  std::set<std::vector<int64_t>> out;
  const dcp::Metadata m = dcp::read_metadata(dir);
  for (const auto& c : m.items.at(key).chunks) out.insert(c.offsets);
  return out;
}
using Offsets = std::set<std::vector<int64_t>>;
}  // namespace

// Tensor parallelism: torchtitan's Llama plan (PyTorch's parallelize_module on 2 Gloo ranks)
// saves wo and w2 and their moments split along dim 1 (RowwiseParallel) and wq / w1 / the
// embedding / output along dim 0. ctitan resumes it on 1 rank, on 2 (FSDP: each rank's rows
// cut out of the column boxes) and with its own tp 2 (whole rows read, its columns kept): every
// parameter and moment bit-equal to PyTorch's full tensors, and the losses of steps 4 and 5
// PyTorch's own within 1e-5, as the FSDP test above.
TEST_F(DcpE2E, TorchtitanTensorParallelCheckpointResumes) {
  const std::string tt = torchtitan_tp_checkpoint(1, 2);
  // The folder really is split along dim 1 (what this test is about).
  EXPECT_EQ(chunk_offsets(tt, "layers.0.attention.wo.weight"), (Offsets{{0, 0}, {0, 128}}));
  EXPECT_EQ(chunk_offsets(tt, "optimizer.state.layers.5.feed_forward.w2.weight.exp_avg_sq"),
            (Offsets{{0, 0}, {0, 384}}));
  EXPECT_EQ(chunk_offsets(tt, "layers.0.attention.wq.weight"), (Offsets{{0, 0}, {128, 0}}));
  // Two ranks wrote it, one data-parallel replica (torchtitan's dataloader.world_size).
  const ckpt::Metadata saved = CheckpointReader(tt).meta();
  EXPECT_EQ(saved.world_size, 2);
  EXPECT_EQ(saved.dp(), 1);
  for (int n : {1, 2}) check_resume(tt, reference_of(tt), n, "tt_tp2");
  check_resume(tt, reference_of(tt), 2, "tt_tp2_on_tp2", "--parallelism.tensor_parallel_degree 2");
}

// FSDP + TP on a 2 x 2 mesh (4 Gloo ranks): wo / w2 (and moments) in four boxes split along
// dims 0 and 1, wq / w1 in four row ranges in the order FSDP's strided sharding lays out. The
// same resumes as above, and on 3 ranks, whose rows (86 + 86 + 84 of 256) cut the boxes.
TEST_F(DcpE2E, TorchtitanFsdpTensorParallelCheckpointResumes) {
  const std::string tt = torchtitan_tp_checkpoint(2, 2);
  EXPECT_EQ(chunk_offsets(tt, "layers.0.attention.wo.weight"), (Offsets{{0, 0}, {0, 128}, {128, 0}, {128, 128}}));
  EXPECT_EQ(chunk_offsets(tt, "optimizer.state.layers.5.feed_forward.w2.weight.exp_avg"),
            (Offsets{{0, 0}, {0, 384}, {128, 0}, {128, 384}}));
  const ckpt::Metadata saved = CheckpointReader(tt).meta();
  EXPECT_EQ(saved.world_size, 4);
  EXPECT_EQ(saved.dp(), 2);
  for (int n : {1, 2, 3}) check_resume(tt, reference_of(tt), n, "tt_dp2tp2");
  check_resume(tt, reference_of(tt), 2, "tt_dp2tp2_on_tp2", "--parallelism.tensor_parallel_degree 2");
}

// A tensor-parallel folder whose .metadata was rewritten so that two chunks of a tensor
// overlap (wo's second box moved from column 128 to 64: the same number of elements) or one
// is missing (a w2 moment's second box dropped): each is one line naming the folder and the
// key, and the run exits 1 before training.
TEST_F(DcpE2E, TensorParallelChunksThatOverlapOrLeaveAGapAreOneLineErrors) {
  const std::string tt = torchtitan_tp_checkpoint(1, 2);
  auto damaged = [&](const std::string& name, const std::string& key, const std::function<void(dcp::Item&)>& edit) {
    const fs::path d = root_ / "bad_tp" / name / "step-3";
    fs::create_directories(d.parent_path());
    fs::copy(tt, d, fs::copy_options::recursive);
    dcp::Metadata m = dcp::read_metadata(d.string());
    edit(m.items.at(key));
    ckpt::write_file_durable((d / dcp::kMetadataFile).string(), dcp::metadata_pickle(m));
    auto rs = train(1, (d.parent_path() / "run").string(),
                    resume_args(d.string()) + " --checkpoint.exclude_from_loading dataloader");
    EXPECT_EQ(rs[0].exit_code, 1) << rs[0].output;  // RuntimeFailure
    return std::make_pair(d.string(), rs[0].output);
  };
  const std::string wo = "layers.0.attention.wo.weight";
  const auto [ov, ov_out] = damaged("overlap", wo, [](dcp::Item& it) {
    for (auto& c : it.chunks)
      if (c.offsets[1] == 128) c.offsets[1] = 64;
  });
  EXPECT_NE(line_with(ov_out, "overlap")
                .find("checkpoint " + ov + " is corrupt: two chunks of " + wo +
                      " overlap (offsets [0, 0] sizes [256, 128] and offsets [0, 64] sizes [256, 128])"),
            std::string::npos)
      << ov_out;
  const std::string w2 = "optimizer.state.layers.1.feed_forward.w2.weight.exp_avg";
  const auto [gap, gap_out] = damaged("gap", w2, [](dcp::Item& it) { it.chunks.pop_back(); });
  EXPECT_NE(line_with(gap_out, "exactly once")
                .find("checkpoint " + gap + " is corrupt: the chunks of " + w2 +
                      " do not cover its shape [256, 768] exactly once (they hold 98304 of its 196608 elements)"),
            std::string::npos)
      << gap_out;
  std::printf("%s\n%s\n", line_with(ov_out, "overlap").c_str(), line_with(gap_out, "exactly once").c_str());
}

// torchtitan's dataloader state is a pickled Python object: loading it is refused before
// anything is loaded, with the setting that makes the load go ahead.
TEST_F(DcpE2E, TorchtitanDataloaderStateNeedsToBeExcluded) {
  auto rs = train(1, (root_ / "no_exclude").string(), resume_args(torchtitan_checkpoint(2)));
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_EQ(rs[0].exit_code, 2) << rs[0].output;
  const std::string l = line_with(rs[0].output, "not transferable");
  EXPECT_NE(l.find("checkpoint.exclude_from_loading = [\"dataloader\"]"), std::string::npos) << rs[0].output;
}

// torchtitan's own checkpoint folder as checkpoint.folder: its step-<N> (no ctitan marker;
// DCP commits with .metadata) is the newest complete checkpoint, and the run resumes from it.
TEST_F(DcpE2E, TorchtitanCheckpointFolderResumesInPlace) {
  const fs::path dump = root_ / "in_place";
  fs::create_directories(dump / "checkpoint");
  fs::copy(torchtitan_checkpoint(2), dump / "checkpoint" / "step-3", fs::copy_options::recursive);
  EXPECT_EQ(ckpt::scan_folder((dump / "checkpoint").string()).complete, (std::vector<int64_t>{3}));
  auto rs = train(1, dump.string(), "--training.steps 4 --checkpoint.exclude_from_loading dataloader");
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_NE(rs[0].output.find("loaded step 3 from " + (dump / "checkpoint" / "step-3").string()), std::string::npos)
      << rs[0].output;
  EXPECT_EQ(ctitan::testing::jsonl_field((dump / "metrics.jsonl").string(), "step"), (std::vector<std::string>{"4"}));
}

// checkpoint_tool lists a torchtitan DCP folder and --verify reads every item through its
// archive's CRC-32s.
TEST_F(DcpE2E, ToolInspectsAndVerifiesATorchtitanFolder) {
  const std::string tt = torchtitan_checkpoint(2);
  const std::string tool = (fs::path(ctitan::testing::kTrain).parent_path() / "checkpoint_tool").string();
  auto r = sh(tool + " inspect " + tt + " --verify");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* s :
       {"torch.distributed.checkpoint folder written by PyTorch (torchtitan?), complete", "step 3\n",
        "saved by 2 ranks", "file __0_0.distcp", "tok_embeddings.weight  sharded  float32 [2048, 256]  2 chunks",
        "lr_scheduler.last_step  replicated  int64 []", "verified: every chunk of "})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  // convert: the model, matched from its shapes, as a .pt whose tensors are PyTorch's.
  const std::string pt = (root_ / "tool_tt.pt").string();
  auto c = sh(tool + " convert " + tt + " " + pt);
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("llama3 \"debugmodel\" (57 tensors, float32)"), std::string::npos) << c.out;
  const auto ref = load_pt(reference_of(tt)), got = load_pt(pt);
  EXPECT_EQ(got.size(), 57u);
  for (const auto& [k, t] : got) EXPECT_TRUE(ref.count(k) && torch::equal(t, ref.at(k))) << k;
}

// Criterion 2: a 2-rank run saved with checkpoint.format = "dcp" loads with PyTorch's
// torch.distributed.checkpoint.load into a state dict of the same keys, every tensor (and
// byte string) equal to the same run saved in ctitan's own format; ctitan resumes from it.
// Every entry of a ctitan-format step folder as a tensor (bytes as uint8) in one torch.save
// archive at `path`, for scripts/dcp_torchtitan.py compare; returns how many.
size_t write_reference(const std::string& step_dir, const std::string& path) {
  CheckpointReader own(step_dir);
  std::vector<torch_save::TensorSpec> specs;
  std::vector<torch::Tensor> values;
  for (const auto& [key, e] : own.meta().entries) {
    torch::Tensor t;
    if (e.is_bytes) {
      const std::string bytes = own.read_bytes(key);
      t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    } else {
      t = own.read_tensor(key).contiguous();
    }
    const char* dt = t.scalar_type() == torch::kFloat ? "float32" : t.scalar_type() == torch::kLong ? "int64" : "uint8";
    specs.push_back({key, dt, t.sizes().vec()});
    values.push_back(t);
  }
  torch_save::Writer w(path, specs);
  for (size_t i = 0; i < specs.size(); ++i)
    w.write(specs[i].name, values[i].data_ptr(), values[i].numel() * values[i].element_size());
  w.commit();
  return specs.size();
}

// PyTorch's DCP reader loads `dcp_step` and compares every tensor with the ctitan-format
// `own_step` (written to `ref` by write_reference): all must be present and equal. Returns the
// script's JSON summary line.
std::string equal_in_pytorch(const std::string& own_step, const std::string& dcp_step, const std::string& ref) {
  const size_t n_keys = write_reference(own_step, ref);
  auto py = sh(script() + "compare --ckpt " + dcp_step + " --ref " + ref);
  EXPECT_EQ(py.code, 0) << py.out;
  const std::string json = line_with(py.out, "\"keys\"");
  EXPECT_NE(json.find("\"keys\": " + std::to_string(n_keys) + ", \"equal\": " + std::to_string(n_keys)),
            std::string::npos)
      << py.out;
  return json;
}

TEST_F(DcpE2E, DcpSaveLoadsInPyTorchWithEqualTensors) {
  const std::string common = "--training.steps 2 --checkpoint.interval 2 --checkpoint.last_save_model_only false";
  const std::string a = (root_ / "own").string(), b = (root_ / "dcp").string();
  ASSERT_TRUE(ctitan::testing::all_ok(train(2, a, common)));
  auto rb = train(2, b, common + " --checkpoint.format dcp");
  ASSERT_TRUE(ctitan::testing::all_ok(rb));
  const std::string step_b = ckpt::step_dir(b + "/checkpoint", 2);
  ASSERT_TRUE(fs::exists(step_b + "/.metadata"));
  ASSERT_TRUE(fs::exists(step_b + "/__0_0.distcp") && fs::exists(step_b + "/__1_0.distcp"));
  EXPECT_FALSE(fs::exists(step_b + "/metadata"));
  EXPECT_EQ(ckpt::incomplete_reason(step_b, 2), "");

  // The reference: the ctitan-format save, every entry as a tensor (bytes as uint8).
  const std::string json =
      equal_in_pytorch(ckpt::step_dir(a + "/checkpoint", 2), step_b, (root_ / "own_reference.pt").string());
  EXPECT_EQ(json.find("\"extra\": 0}"), std::string::npos) << "torchtitan's param_groups / LambdaLR keys";
  std::printf("%s\n", json.c_str());

  // ctitan reads its own DCP save back: both runs continue to step 3 with the same loss.
  auto ca = train(2, a, "--training.steps 3 --checkpoint.interval 2 --checkpoint.last_save_model_only false");
  auto cb = train(2, b,
                  "--training.steps 3 --checkpoint.interval 2 --checkpoint.last_save_model_only false "
                  "--checkpoint.format dcp");
  ASSERT_TRUE(ctitan::testing::all_ok(ca));
  ASSERT_TRUE(ctitan::testing::all_ok(cb));
  EXPECT_NE(cb[0].output.find("loaded step 2 from " + step_b), std::string::npos) << cb[0].output;
  const auto la = ctitan::testing::jsonl_field(a + "/metrics.jsonl", "loss");
  const auto lb = ctitan::testing::jsonl_field(b + "/metrics.jsonl", "loss");
  ASSERT_EQ(la.size(), 3u);
  ASSERT_EQ(lb.size(), 3u);
  EXPECT_EQ(la, lb);
}

// Tensor parallelism (issue 35): a DCP save of a tp 2 run (2 ranks; the column-split weights
// gathered to whole rows by tp rank 0, the row-split ones written by both ranks) loads in
// PyTorch's DCP reader with every tensor equal to the ctitan-format save of the same run, and
// ctitan resumes it on one process.
TEST_F(DcpE2E, TensorParallelDcpSaveLoadsInPyTorch) {
  const std::string common =
      "--training.steps 2 --checkpoint.interval 2 --checkpoint.last_save_model_only false "
      "--parallelism.tensor_parallel_degree 2 --training.mixed_precision_param float32 --debug.deterministic true";
  const std::string a = (root_ / "tp_own").string(), b = (root_ / "tp_dcp").string();
  ASSERT_TRUE(ctitan::testing::all_ok(train(2, a, common)));
  ASSERT_TRUE(ctitan::testing::all_ok(train(2, b, common + " --checkpoint.format dcp")));
  const std::string step_b = ckpt::step_dir(b + "/checkpoint", 2);
  ASSERT_TRUE(fs::exists(step_b + "/__0_0.distcp") && fs::exists(step_b + "/__1_0.distcp"));
  const std::string json =
      equal_in_pytorch(ckpt::step_dir(a + "/checkpoint", 2), step_b, (root_ / "tp_own_reference.pt").string());
  std::printf("tp 2 DCP save in PyTorch: %s\n", json.c_str());
  // ctitan itself resumes the DCP folder on one process (tp 1): step 3 trains.
  auto c = train(1, b,
                 "--training.steps 3 --checkpoint.interval 2 --checkpoint.last_save_model_only false "
                 "--checkpoint.format dcp --training.mixed_precision_param float32");
  ASSERT_TRUE(ctitan::testing::all_ok(c));
  EXPECT_NE(c[0].output.find("loaded step 2 from " + step_b), std::string::npos) << c[0].output;
  EXPECT_EQ(ctitan::testing::jsonl_field(b + "/metrics.jsonl", "loss").size(), 3u);
}

// The other direction of a torchtitan job: PyTorch resumes a ctitan DCP save the way
// torchtitan loads (model keys, get_optimizer_state_dict flattened with its param groups,
// LambdaLR state, train_state ints) and its steps 4 and 5 on ctitan's batches give ctitan's
// losses and learning rates (fp32, 2 ranks).
TEST_F(DcpE2E, DcpSaveResumesInPyTorchWithTorchtitansLayout) {
  const fs::path dir = root_ / "to_pytorch";
  const std::string win = (dir / "windows").string();
  auto rs = train(2, dir.string(),
                  "--checkpoint.format dcp --checkpoint.interval 3 --training.steps 5 --lr_scheduler.warmup_steps 2"
                  " --lr_scheduler.decay_ratio 0.6 --lr_scheduler.min_lr_factor 0.1 --optimizer.lr 8e-4"
                  " --training.mixed_precision_param float32",
                  {{"CTITAN_TRACE_WINDOWS", win}});
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  auto py = sh(script() + "continue --ckpt " + ckpt::step_dir((dir / "checkpoint").string(), 3) + " --windows " + win +
               " --total-steps 5 --warmup 2 --decay-ratio 0.6 --min-lr 0.1 --seq 32");
  ASSERT_EQ(py.code, 0) << py.out;
  const std::string json = line_with(py.out, "\"losses\"");
  EXPECT_NE(json.find("\"train_state\": {\"step\": 3, \"ntokens_seen\": 384}, \"last_epoch\": 3"), std::string::npos)
      << json;
  std::vector<double> py_loss, py_lr;
  const std::regex loss_re("\"loss\": ([-0-9.e]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), loss_re); it != std::sregex_iterator(); ++it)
    py_loss.push_back(std::stod((*it)[1]));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(json, m, std::regex("\"lrs\": \\[([^\\]]*)\\]"))) << py.out;
  std::istringstream lrs(m[1].str());
  for (std::string x; std::getline(lrs, x, ',');) py_lr.push_back(std::stod(x));
  const auto loss = ctitan::testing::jsonl_field((dir / "metrics.jsonl").string(), "loss");
  const auto lr = ctitan::testing::jsonl_field((dir / "metrics.jsonl").string(), "lr");
  ASSERT_EQ(loss.size(), 5u);
  ASSERT_EQ(py_loss.size(), 2u) << py.out;
  ASSERT_EQ(py_lr.size(), 2u) << py.out;
  for (size_t i = 0; i < 2; ++i) {
    const double rel = std::abs(std::stod(loss[3 + i]) - py_loss[i]) / std::abs(py_loss[i]);
    EXPECT_LT(rel, 1e-5) << "step " << 4 + i << ": ctitan " << loss[3 + i] << ", PyTorch " << py_loss[i];
    EXPECT_NEAR(std::stod(lr[3 + i]), py_lr[i], 1e-12 + 1e-9 * py_lr[i]);
    std::printf("[ctitan DCP -> PyTorch] step %zu: loss ctitan %s PyTorch %.9g (rel %.2e)\n", 4 + i,
                loss[3 + i].c_str(), py_loss[i], rel);
  }
}

// Criterion 3: a .metadata whose unpickling would run os.system, a truncated and a damaged
// .distcp: each is one line naming the file and the problem, a non-zero exit, and the
// command in the pickle never ran.
TEST_F(DcpE2E, HostileAndDamagedFoldersAreOneLineErrors) {
  const std::string tt = torchtitan_checkpoint(2);
  auto copy = [&](const std::string& name) {
    const fs::path d = root_ / "bad" / name / "step-3";
    fs::create_directories(d.parent_path());
    fs::copy(tt, d, fs::copy_options::recursive);
    return d.string();
  };
  auto run = [&](const std::string& path) {
    return train(1, (fs::path(path).parent_path() / "run").string(),
                 "--checkpoint.initial_load_path " + path +
                     " --checkpoint.initial_load_model_only false --training.steps 5"
                     " --checkpoint.exclude_from_loading dataloader");
  };

  const std::string evil = copy("evil"), marker = (root_ / "bad" / "PWNED").string();
  auto e = sh(script() + "evil --ckpt " + evil + " --marker " + marker);
  ASSERT_EQ(e.code, 0) << e.out;
  auto re = run(evil);
  EXPECT_NE(re[0].exit_code, 0);
  const std::string le = line_with(re[0].output, "refuses the pickled global");
  EXPECT_NE(le.find(evil + "/.metadata: refuses the pickled global posix.system"), std::string::npos) << re[0].output;
  EXPECT_FALSE(fs::exists(marker)) << "the pickled command ran";
  // The same file through the library: the same refusal, nothing else read.
  try {
    dcp::read_metadata(evil);
    ADD_FAILURE() << "read_metadata accepted os.system";
  } catch (const std::exception& x) {
    EXPECT_NE(std::string(x.what()).find("posix.system"), std::string::npos) << x.what();
  }

  const std::string trunc = copy("truncated");
  const auto f1 = fs::path(trunc) / "__1_0.distcp";
  fs::resize_file(f1, fs::file_size(f1) - 1000);
  auto rt = run(trunc);
  EXPECT_NE(rt[0].exit_code, 0);
  const std::string lt = line_with(rt[0].output, "(truncated?)");
  EXPECT_NE(lt.find("__1_0.distcp has "), std::string::npos) << rt[0].output;

  const std::string dmg = copy("damaged");
  const auto f0 = fs::path(dmg) / "__0_0.distcp";
  {
    std::fstream f(f0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(f0) / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(f0) / 2));
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  auto rd = run(dmg);
  EXPECT_NE(rd[0].exit_code, 0);
  const std::string ld = line_with(rd[0].output, "__0_0.distcp bytes [");
  EXPECT_NE(ld.find("CRC-32"), std::string::npos) << rd[0].output;
  for (const auto* r : {&re, &rt, &rd}) std::printf("%s\n", line_with((*r)[0].output, "error").c_str());
}

// ---- the pieces, without PyTorch ------------------------------------------------------------

namespace {
std::string refusal(const std::string& pkl, const std::set<std::string>& allowed = {}) {
  try {
    pickle::load(pkl.data(), pkl.size(), allowed, "t.pkl");
  } catch (const pickle::PickleError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// Globals outside the allowed set are refused by name whether written as GLOBAL (protocol 2)
// or STACK_GLOBAL (4); opcodes no checkpoint pickle uses (INST, OBJ), truncation and memo
// misuse are errors; nothing is called.
TEST(DcpPickle, RefusesUnknownGlobalsOpcodesAndTruncation) {
  EXPECT_EQ(refusal(std::string("\x80\x02"
                                "cos\nsystem\nX\x02\x00\x00\x00idq\x00\x85R.",
                                25)),
            "t.pkl: refuses the pickled global os.system (not a class this checkpoint format uses; nothing in the "
            "file was run)");
  EXPECT_NE(refusal(std::string("\x80\x04\x8c\x08"
                                "builtins\x8c\x04"
                                "eval\x93.",
                                20))
                .find("builtins.eval"),
            std::string::npos);
  EXPECT_NE(refusal(std::string("\x80\x02(i__main__\nX\n.", 16)).find("unsupported pickle opcode 0x69"),
            std::string::npos);
  EXPECT_NE(refusal(std::string("\x80\x02X\x10\x00\x00\x00"
                                "abc",
                                10))
                .find("truncated?"),
            std::string::npos);
  EXPECT_NE(refusal(std::string("\x80\x02h\x07.", 5)).find("memo index 7 was never stored"), std::string::npos);
  // An allowed class is recorded, not called: REDUCE gives an Object with its arguments.
  const std::string ok(
      "\x80\x02"
      "ctorch\nSize\n(K\x02M\x00\x01t\x85R.",
      24);
  auto v = pickle::load(ok.data(), ok.size(), {"torch.Size"}, "t.pkl");
  ASSERT_TRUE(v->is(pickle::Value::Kind::Object));
  EXPECT_EQ(v->s, "torch.Size");
  EXPECT_EQ(pickle::describe(*v), "torch.Size((2, 256))");
}

// A tensor item (torch.save(tensor) archive) reads back bit for bit; the wrong shape or dtype
// and a flipped byte are errors naming the problem.
TEST(DcpItems, TensorArchivesRoundTripAndDamageIsCaught) {
  auto t = torch::randn({5, 3});
  const std::string item = dcp::tensor_item("float32", {5, 3}, t.data_ptr(), 60);
  auto back = torch::empty({5, 3});
  dcp::read_tensor_item(item, "item", "float32", {5, 3}, back.data_ptr());
  EXPECT_TRUE(torch::equal(back, t));
  auto err = [&](const std::string& it, const std::string& dt, std::vector<int64_t> s) -> std::string {
    try {
      dcp::read_tensor_item(it, "item", dt, s, back.data_ptr());
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(err(item, "float32", {3, 5}), "item: the stored tensor has shape [5,3], .metadata says [3,5]");
  EXPECT_EQ(err(item, "bfloat16", {5, 3}), "item: the tensor is float32, .metadata says bfloat16");
  std::string bad = item;
  const size_t at = bad.find(std::string(static_cast<const char*>(t.data_ptr()), 60));
  ASSERT_NE(at, std::string::npos);
  bad[at + 7] ^= 0x10;
  EXPECT_NE(err(bad, "float32", {5, 3}).find("do not match their CRC-32"), std::string::npos)
      << err(bad, "float32", {5, 3});
  EXPECT_NE(err(item.substr(0, item.size() - 30), "float32", {5, 3}).find("item: "), std::string::npos);
  // Python objects: an int, and bytes as protocol 2 writes them (_codecs.encode), all 256 values.
  EXPECT_EQ(dcp::read_object_item(dcp::int_item(123456789), "i")->i, 123456789);
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  EXPECT_EQ(dcp::read_object_item(dcp::bytes_item(all), "b")->s, all);
}
