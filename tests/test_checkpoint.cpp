// Checkpointing: format, resharding, faults, retention (in-process: ranks are threads sharing
// an in-memory all-gather), then the real `train` binary end to end (determinism of
// save + resume, resharding 4→2/3 and 2→4, weights only, faults, corruption).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "util/crc.h"
#include "util/env.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
#include "models/hf_adapter.h"
#include "checkpoint/convert.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "tests/e2e.h"
#include "tests/loader_state.h"
#include "tests/multiprocess.h"
#include "tools/checkpoint_tool.h"

namespace fs = std::filesystem;
using namespace ctitan;
using ctitan::testing::spawn_processes;

namespace {

// ---- in-process ranks ------------------------------------------------------------------------

// n threads, one all-gather round at a time.
class ThreadWorld {
 public:
  explicit ThreadWorld(int n) : n_(n), slots_(n) {}
  std::vector<std::string> gather(int rank, const std::string& s) {
    std::unique_lock<std::mutex> lk(m_);
    const int64_t gen = gen_;
    slots_[rank] = s;
    if (++arrived_ == n_) {
      result_ = slots_;
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    return result_;
  }
  CheckpointComm comm(int rank) {
    CheckpointComm c;
    c.rank = rank;
    c.world_size = n_;
    c.all_gather = [this, rank](const std::string& s, const std::string&) { return gather(rank, s); };
    return c;
  }

 private:
  int n_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t gen_ = 0;
  std::vector<std::string> slots_, result_;
};

// Runs f(rank, comm) on n threads; returns each rank's exception text ("" = ok).
std::vector<std::string> run_ranks(int n, const std::function<void(int, CheckpointComm)>& f) {
  ThreadWorld w(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        f(r, w.comm(r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

bool all_empty(const std::vector<std::string>& v) {
  for (const auto& s : v)
    if (!s.empty()) return false;
  return true;
}

fs::path temp_dir(const std::string& name) {
  auto p = fs::temp_directory_path() / ("ctitan_ckpt_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// FSDP's layout, written independently here: ceil(rows / N) rows per rank, zero padding.
ShardedParam shard_of(const std::string& fqn, const torch::Tensor& global, int64_t rank, int64_t n) {
  const int64_t rows = global.size(0), c = (rows + n - 1) / n;
  const int64_t b = std::min(rows, rank * c), e = std::min(rows, b + c);
  auto shape = global.sizes().vec();
  shape[0] = c;
  auto local = torch::zeros(shape, global.options());
  if (e > b) local.narrow(0, 0, e - b).copy_(global.narrow(0, b, e - b));
  return {fqn, local, global.sizes().vec(), b, e};
}

// Two "parameters" with rows that divide unevenly by 3 and 4.
std::map<std::string, torch::Tensor> global_params() {
  auto g = at::detail::createCPUGenerator(11);
  return {{"layers.0.w", torch::randn({11, 5}, g)},
          {"tok_embeddings.weight", torch::randn({7, 3}, g)},
          {"norm.weight", torch::randn({6}, g)}};
}

CheckpointOptions options_for(const fs::path& dir) {
  CheckpointOptions o;
  o.enable = true;
  o.folder = (dir / "checkpoint").string();
  o.interval = 1;
  o.keep_latest_k = 0;
  o.last_save_model_only = false;
  o.model_name = "llama3";
  o.model_flavor = "debugmodel";
  return o;
}

// One rank's state in the in-process tests: sharded parameters, AdamW over them, a counter.
struct RankState {
  std::vector<ShardedParam> params;
  std::unique_ptr<torch::optim::AdamW> opt;
  int64_t last_step = 0;
  std::unique_ptr<ModelState> model;
  std::unique_ptr<OptimizerState> optim;
  std::unique_ptr<ScalarsState> sched;
  std::unique_ptr<CheckpointManager> mgr;

  RankState(int rank, int n, const CheckpointOptions& o, CheckpointComm comm,
            const std::map<std::string, torch::Tensor>& globals) {
    std::vector<torch::Tensor> ts;
    for (const auto& [fqn, g] : globals) {
      params.push_back(shard_of(fqn, g, rank, n));
      params.back().local.requires_grad_(true);
      ts.push_back(params.back().local);
    }
    opt = std::make_unique<torch::optim::AdamW>(ts, torch::optim::AdamWOptions(0.1));
    model = std::make_unique<ModelState>(params, true);
    optim = std::make_unique<OptimizerState>(*opt, params, true);
    sched = std::make_unique<ScalarsState>("lr_scheduler",
                                           std::vector<std::pair<std::string, int64_t*>>{{"last_step", &last_step}});
    mgr = std::make_unique<CheckpointManager>(o, std::move(comm));
    mgr->add("model", model.get());
    mgr->add("optimizer", optim.get());
    mgr->add("lr_scheduler", sched.get());
  }
  // One AdamW step with gradients that are slices of a global gradient (as FSDP's).
  void step(int64_t k) {
    for (auto& p : params) {
      auto g = at::detail::createCPUGenerator(100 + k);
      auto full = torch::randn(p.global_shape, g);
      auto grad = torch::zeros_like(p.local);
      if (p.end > p.begin) grad.narrow(0, 0, p.end - p.begin).copy_(full.narrow(0, p.begin, p.end - p.begin));
      p.local.mutable_grad() = grad;
    }
    opt->step();
    ++last_step;
  }
  torch::Tensor exp_avg(size_t i) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*opt->state().at(params[i].local.unsafeGetTensorImpl()));
    return st.exp_avg();
  }
};

}  // namespace

// ---- format ----------------------------------------------------------------------------------

TEST(CheckpointFormat, Crc32MatchesTheStandardCheckValue) {
  EXPECT_EQ(crc::crc32("123456789", 9), 0xCBF43926u);
  // Continuation equals one pass.
  const std::string s = "the quick brown fox jumps over the lazy dog, twice over";
  EXPECT_EQ(crc::crc32(s.data() + 10, s.size() - 10, crc::crc32(s.data(), 10)), crc::crc32(s.data(), s.size()));
  // Combining two parts' CRCs (what the writer does per chunk) equals one pass, any split.
  std::string big(70000, '\0');
  std::mt19937 rng(5);
  for (char& c : big) c = static_cast<char>(rng());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{69999}, big.size()})
    EXPECT_EQ(crc::crc32_combine(crc::crc32(big.data(), cut), crc::crc32(big.data() + cut, big.size() - cut),
                                 big.size() - cut),
              crc::crc32(big.data(), big.size()))
        << cut;
  // And a file written through DurableFileWriter with precomputed chunk CRCs has the CRC of its bytes.
  const auto dir = temp_dir("crc");
  ckpt::DurableFileWriter w((dir / "f").string());
  w.append(big.data(), 1000, crc::crc32(big.data(), 1000));
  w.append(big.data() + 1000, big.size() - 1000);
  w.commit();
  EXPECT_EQ(w.crc(), crc::crc32(big.data(), big.size()));
  EXPECT_EQ(ckpt::read_whole_file((dir / "f").string()), big);
  fs::remove_all(dir);
}

TEST(CheckpointFormat, MetadataRoundTripsAndRejectsDamage) {
  ckpt::Metadata m;
  m.step = 7;
  m.world_size = 2;
  m.dp_shard = 2;
  m.model_name = "llama3";
  m.model_flavor = "debugmodel";
  m.files = {{"rank0.bin", 100, 0x1234}, {"rank1.bin", 60, 0xabcd}};
  ckpt::EntryMeta e;
  e.key = "w";
  e.rule = ckpt::Rule::Sharded;
  e.dtype = "float32";
  e.shape = {5, 2};
  e.chunks = {{"rank0.bin", 0, 24, 0, 3, 1, {}, {}, {}}, {"rank1.bin", 0, 16, 3, 5, 2, {}, {}, {}}};
  m.entries["w"] = e;
  const std::string text = m.to_text();
  const auto back = ckpt::Metadata::parse(text, "t");
  EXPECT_EQ(back.to_text(), text);
  EXPECT_EQ(back.entries.at("w").chunks.size(), 2u);
  // Truncated: no end record.
  EXPECT_THROW(ckpt::Metadata::parse(text.substr(0, text.size() - 4), "t"), RuntimeFailure);
  // A gap in the rows.
  std::string gap = std::regex_replace(text, std::regex("rank1.bin 0 16 3 5"), "rank1.bin 0 8 4 5");
  try {
    ckpt::Metadata::parse(gap, "t");
    FAIL() << "gap accepted";
  } catch (const RuntimeFailure& err) {
    EXPECT_NE(std::string(err.what()).find("not covered exactly once"), std::string::npos) << err.what();
  }
}

// ---- resharding --------------------------------------------------------------------------------

// Save on `from` ranks after two AdamW steps, load on `to` ranks: every rank's parameters and
// moments equal the rows of the global tensors the saving ranks held (assembled here), padding
// rows are zero, step counts and the scheduler position are restored.
// dcp: saved as a torch.distributed.checkpoint folder (checkpoint.format = "dcp").
void reshard_roundtrip(int from, int to, bool dcp = false) {
  const auto dir = temp_dir("reshard_" + std::to_string(from) + "_" + std::to_string(to) + (dcp ? "_dcp" : ""));
  const auto globals = global_params();
  auto o = options_for(dir);
  o.format = dcp ? "dcp" : "ctitan";
  std::vector<std::map<std::string, torch::Tensor>> saved_param(from), saved_avg(from);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(from);
  auto errs = run_ranks(from, [&](int r, CheckpointComm c) {
    RankState s(r, from, o, c, globals);
    s.step(1);
    s.step(2);
    s.mgr->save(2, false);
    for (size_t i = 0; i < s.params.size(); ++i) {
      saved_param[r][s.params[i].fqn] = s.params[i].local.detach().clone();
      saved_avg[r][s.params[i].fqn] = s.exp_avg(i).clone();
      rows[r].emplace_back(s.params[i].begin, s.params[i].end);
    }
  });
  ASSERT_TRUE(all_empty(errs)) << errs[0];
  ASSERT_EQ(fs::exists(ckpt::step_dir(o.folder, 2) + "/.metadata"), dcp);
  // The global tensors the saving job held, assembled from its shards' real rows.
  std::map<std::string, torch::Tensor> want_param, want_avg;
  size_t i = 0;
  for (const auto& [fqn, g] : globals) {
    std::vector<torch::Tensor> ps, as;
    for (int r = 0; r < from; ++r) {
      const auto [b, e] = rows[r][i];
      ps.push_back(saved_param[r][fqn].narrow(0, 0, e - b));
      as.push_back(saved_avg[r][fqn].narrow(0, 0, e - b));
    }
    want_param[fqn] = torch::cat(ps);
    want_avg[fqn] = torch::cat(as);
    ASSERT_EQ(want_param[fqn].sizes(), g.sizes());
    ASSERT_FALSE(torch::equal(want_param[fqn], g));  // training moved them
    ++i;
  }
  auto zeros = globals;
  for (auto& kv : zeros) kv.second = torch::zeros_like(kv.second);
  errs = run_ranks(to, [&](int r, CheckpointComm c) {
    RankState s(r, to, o, c, zeros);
    const LoadResult res = s.mgr->load();
    if (!res.loaded || res.step != 2) throw std::runtime_error("not loaded");
    if (s.last_step != 2) throw std::runtime_error("lr_scheduler.last_step not restored");
    for (size_t k = 0; k < s.params.size(); ++k) {
      const auto& p = s.params[k];
      const int64_t n = p.end - p.begin;
      if (!torch::equal(p.local.narrow(0, 0, n), want_param[p.fqn].narrow(0, p.begin, n)))
        throw std::runtime_error("param rows differ: " + p.fqn);
      if (!torch::equal(s.exp_avg(k).narrow(0, 0, n), want_avg[p.fqn].narrow(0, p.begin, n)))
        throw std::runtime_error("exp_avg rows differ: " + p.fqn);
      if (p.local.size(0) > n && p.local.narrow(0, n, p.local.size(0) - n).abs().sum().item<double>() != 0)
        throw std::runtime_error("padding not zero: " + p.fqn);
      auto& st = static_cast<torch::optim::AdamWParamState&>(*s.opt->state().at(p.local.unsafeGetTensorImpl()));
      if (st.step() != 2) throw std::runtime_error("step not restored");
    }
    // The optimizer keeps using the loaded state (same keys LibTorch uses): no new entries.
    const size_t before = s.opt->state().size();
    s.step(3);
    if (s.opt->state().size() != before) throw std::runtime_error("optimizer state keys differ from LibTorch's");
  });
  for (int r = 0; r < to; ++r) EXPECT_EQ(errs[r], "") << from << "→" << to << " rank " << r;
  fs::remove_all(dir);
}

TEST(CheckpointReshard, FourToTwo) { reshard_roundtrip(4, 2); }
TEST(CheckpointReshard, FourToThree) { reshard_roundtrip(4, 3); }
TEST(CheckpointReshard, TwoToFour) { reshard_roundtrip(2, 4); }
TEST(CheckpointReshard, ThreeToOne) { reshard_roundtrip(3, 1); }
TEST(CheckpointReshard, DcpFourToThree) { reshard_roundtrip(4, 3, true); }
TEST(CheckpointReshard, DcpTwoToFour) { reshard_roundtrip(2, 4, true); }

// Continuing after a save + load is bitwise the same as not stopping (one process).
TEST(CheckpointReshard, ResumeIsBitwiseIdentical) {
  const auto dir = temp_dir("bitwise");
  const auto globals = global_params();
  const auto o = options_for(dir);
  RankState straight(0, 1, o, CheckpointComm::single_process(), globals);
  for (int k = 1; k <= 4; ++k) {
    straight.step(k);
    if (k == 2) straight.mgr->save(2, false);
  }
  auto zeros = globals;
  for (auto& kv : zeros) kv.second = torch::zeros_like(kv.second);
  auto o2 = o;
  o2.load_step = -1;  // the latest complete one: step-2
  RankState replay(0, 1, o2, CheckpointComm::single_process(), zeros);
  ASSERT_EQ(replay.mgr->load().step, 2);
  replay.step(3);
  replay.step(4);
  for (size_t i = 0; i < straight.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(straight.params[i].local, replay.params[i].local)) << straight.params[i].fqn;
    EXPECT_TRUE(torch::equal(straight.exp_avg(i), replay.exp_avg(i)));
  }
  fs::remove_all(dir);
}

// ---- data loader rule, weights only, retention -------------------------------------------------

struct FakeLoader {
  std::string state;
};

TEST(CheckpointDataloader, ChangedDegreeFailsBeforeLoadingUnlessExcludedOrRedistributed) {
  const auto dir = temp_dir("dl");
  auto o = options_for(dir);
  const auto globals = global_params();
  auto errs = run_ranks(4, [&](int r, CheckpointComm c) {
    RankState s(r, 4, o, c, globals);
    FakeLoader fl{"pos-of-" + std::to_string(r)};
    DataLoaderState dl([&] { return fl.state; }, [&](const std::string& x) { fl.state = x; }, r, 4, "error", nullptr);
    s.mgr->add("dataloader", &dl);
    s.step(1);
    s.mgr->save(1, false);
  });
  ASSERT_TRUE(all_empty(errs));
  auto zeros = globals;
  for (auto& kv : zeros) kv.second = torch::zeros_like(kv.second);
  // Default: every rank fails, before anything is loaded, naming both degrees.
  std::vector<double> touched(2, -1);
  errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, zeros);
    FakeLoader fl{"fresh"};
    DataLoaderState dl([&] { return fl.state; }, [&](const std::string& x) { fl.state = x; }, r, 2, "error", nullptr);
    s.mgr->add("dataloader", &dl);
    try {
      s.mgr->load();
    } catch (...) {
      touched[r] = s.params[0].local.abs().sum().item<double>() + (fl.state == "fresh" ? 0 : 1);
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errs[r].find("saved with data-parallel degree 4 and this run has data-parallel degree 2"),
              std::string::npos)
        << errs[r];
    EXPECT_NE(errs[r].find("exclude_from_loading = [\"dataloader\"]"), std::string::npos);
    EXPECT_NE(errs[r].find("dataloader_reshard = \"redistribute\""), std::string::npos);
    EXPECT_EQ(touched[r], 0.0) << "rank " << r << " loaded state before failing";
  }
  // Excluded: everything else loads, the loader keeps its fresh state.
  auto ox = o;
  ox.exclude_from_loading = {"dataloader"};
  errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, ox, c, zeros);
    FakeLoader fl{"fresh"};
    DataLoaderState dl([&] { return fl.state; }, [&](const std::string& x) { fl.state = x; }, r, 2, "error", nullptr);
    s.mgr->add("dataloader", &dl);
    const auto res = s.mgr->load();
    if (fl.state != "fresh" || s.last_step != 1 || res.components.size() != 3)
      throw std::runtime_error("exclude did not work");
  });
  EXPECT_TRUE(all_empty(errs)) << errs[0];
  // Redistribute: the rule receives every saved rank's state, in saved-rank order.
  errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, zeros);
    FakeLoader fl{"fresh"};
    DataLoaderState dl([&] { return fl.state; }, [&](const std::string& x) { fl.state = x; }, r, 2, "redistribute",
                       [](const std::vector<std::string>& saved, int64_t rank, int64_t world) {
                         std::string s = std::to_string(rank) + "/" + std::to_string(world) + ":";
                         for (const auto& x : saved) s += x + ",";
                         return s;
                       });
    s.mgr->add("dataloader", &dl);
    s.mgr->load();
    const std::string want = std::to_string(r) + "/2:pos-of-0,pos-of-1,pos-of-2,pos-of-3,";
    if (fl.state != want) throw std::runtime_error("redistribute got " + fl.state);
  });
  EXPECT_TRUE(all_empty(errs)) << errs[0] << errs[1];
  fs::remove_all(dir);
}

TEST(CheckpointWeightsOnly, ModelOnlySaveLoadsOnOtherDegreesButDoesNotResume) {
  const auto dir = temp_dir("weights");
  auto o = options_for(dir);
  o.last_save_model_only = true;
  o.export_dtype = "bfloat16";
  const auto globals = global_params();
  std::map<std::string, torch::Tensor> full;
  auto errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, globals);
    s.step(1);
    s.mgr->save(1, /*last_step=*/true);
  });
  ASSERT_TRUE(all_empty(errs)) << errs[0];
  const std::string path = ckpt::step_dir(o.folder, 1);
  CheckpointReader reader(path);
  EXPECT_TRUE(reader.meta().model_only);
  EXPECT_FALSE(reader.has("optimizer.state.norm.weight.exp_avg"));
  EXPECT_EQ(reader.entry("layers.0.w").dtype, "bfloat16");
  auto zeros = globals;
  for (auto& kv : zeros) kv.second = torch::zeros_like(kv.second);
  for (int n : {1, 3}) {
    auto oi = options_for(dir / ("fresh" + std::to_string(n)));
    oi.initial_load_path = path;
    oi.initial_load_model_only = true;
    errs = run_ranks(n, [&](int r, CheckpointComm c) {
      RankState s(r, n, oi, c, zeros);
      const auto res = s.mgr->load();
      if (!res.loaded || !res.model_only || res.components != std::vector<std::string>{"model"})
        throw std::runtime_error("not a model-only load");
      for (const auto& p : s.params) {
        auto want = reader.read_tensor(p.fqn).to(torch::kFloat).narrow(0, p.begin, p.end - p.begin);
        if (!torch::equal(p.local.narrow(0, 0, p.end - p.begin), want)) throw std::runtime_error("rows differ");
      }
      if (!s.opt->state().empty() || s.last_step != 0) throw std::runtime_error("not fresh");
      s.step(1);  // a fresh optimizer trains
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errs[r], "") << n << " ranks, rank " << r;
  }
  // Resuming full training state from it: one clear error, no missing-key crash.
  errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, zeros);
    s.mgr->load();
  });
  for (const auto& e : errs)
    EXPECT_NE(e.find("holds model weights only (checkpoint.last_save_model_only)"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(CheckpointRetention, KeepLatestKNeverDeletesTheNewestOrOneBeingWritten) {
  const auto dir = temp_dir("keep");
  auto o = options_for(dir);
  o.keep_latest_k = 2;
  RankState s(0, 1, o, CheckpointComm::single_process(), global_params());
  fs::create_directories(ckpt::staging_dir(o.folder, 99));  // a save in progress elsewhere
  for (int k = 1; k <= 5; ++k) {
    s.step(k);
    s.mgr->save(k, false);
    const auto scan = ckpt::scan_folder(o.folder);
    ASSERT_FALSE(scan.complete.empty());
    EXPECT_EQ(scan.complete.back(), k) << "the newest complete checkpoint is kept";
    EXPECT_LE(scan.complete.size(), 2u);
  }
  EXPECT_EQ(ckpt::scan_folder(o.folder).complete, (std::vector<int64_t>{4, 5}));
  EXPECT_TRUE(fs::exists(ckpt::staging_dir(o.folder, 99)));
  // Async: the write of step 6 runs in the background; the purge happens only once it is
  // committed (at the next save or finalize), so it never removes the newest complete one.
  auto oa = o;
  oa.async = true;
  RankState a(0, 1, oa, CheckpointComm::single_process(), global_params());
  a.step(6);
  a.mgr->save(6, false);
  EXPECT_EQ(ckpt::scan_folder(o.folder).complete, (std::vector<int64_t>{4, 5}));
  a.mgr->finalize();
  EXPECT_EQ(ckpt::scan_folder(o.folder).complete, (std::vector<int64_t>{5, 6}));
  // The async files equal a synchronous save of the same state.
  RankState b(0, 1, options_for(dir / "sync"), CheckpointComm::single_process(), global_params());
  b.step(6);
  b.mgr->save(6, false);
  EXPECT_EQ(ckpt::read_whole_file(ckpt::step_dir(o.folder, 6) + "/rank0.bin"),
            ckpt::read_whole_file(ckpt::step_dir(options_for(dir / "sync").folder, 6) + "/rank0.bin"));
  fs::remove_all(dir);
}

// Async saves copy the state into staging buffers reused from save to save: each save's files
// equal a synchronous save of the state at its step, though training changes the state while
// the previous write is still running.
TEST(CheckpointAsync, ReusedStagingBuffersHoldEachSavesOwnState) {
  const auto dir = temp_dir("async_reuse");
  auto oa = options_for(dir / "async");
  oa.async = true;
  const auto os = options_for(dir / "sync");
  RankState a(0, 1, oa, CheckpointComm::single_process(), global_params());
  RankState b(0, 1, os, CheckpointComm::single_process(), global_params());
  for (int k = 1; k <= 3; ++k) {
    a.step(k);
    b.step(k);
    a.mgr->save(k, false);  // written in the background while the next step runs
    b.mgr->save(k, false);
  }
  a.mgr->finalize();
  for (int k = 1; k <= 3; ++k)
    EXPECT_EQ(ckpt::read_whole_file(ckpt::step_dir(oa.folder, k) + "/rank0.bin"),
              ckpt::read_whole_file(ckpt::step_dir(os.folder, k) + "/rank0.bin"))
        << "step " << k;
  EXPECT_NE(ckpt::read_whole_file(ckpt::step_dir(oa.folder, 2) + "/rank0.bin"),
            ckpt::read_whole_file(ckpt::step_dir(oa.folder, 3) + "/rank0.bin"));
  fs::remove_all(dir);
}

// ---- faults (in-process) ----------------------------------------------------------------------

TEST(CheckpointFaults, ARankRaisingDuringSaveFailsEveryRankAndKeepsThePrevious) {
  const auto dir = temp_dir("raise");
  const auto o = options_for(dir);
  const auto globals = global_params();
  setenv("CTITAN_CHECKPOINT_FAULT", "raise:2:2", 1);
  reload_runtime_env();
  auto errs = run_ranks(3, [&](int r, CheckpointComm c) {
    RankState s(r, 3, o, c, globals);
    s.step(1);
    s.mgr->save(1, false);
    s.step(2);
    s.mgr->save(2, false);
  });
  unsetenv("CTITAN_CHECKPOINT_FAULT");
  reload_runtime_env();
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(errs[r].find("checkpoint save of step 2 failed on rank 2: injected fault"), std::string::npos) << errs[r];
  EXPECT_NE(errs[0].find("the previous checkpoint step-1 is intact"), std::string::npos) << errs[0];
  const auto scan = ckpt::scan_folder(o.folder);
  EXPECT_EQ(scan.complete, (std::vector<int64_t>{1}));
  EXPECT_TRUE(scan.staging.empty()) << "the failed save's files were removed";
  fs::remove_all(dir);
}

// checkpoint.format = "dcp" keeps the save's atomicity: a rank failing mid-write leaves the
// previous checkpoint the newest complete one, and a ctitan DCP step folder's COMPLETE marker
// must match its .metadata.
TEST(CheckpointFaults, DcpSavesAreCompleteOnlyWithTheirMarker) {
  const auto dir = temp_dir("dcp_atomic");
  auto o = options_for(dir);
  o.format = "dcp";
  const auto globals = global_params();
  setenv("CTITAN_CHECKPOINT_FAULT", "raise:1:2", 1);
  reload_runtime_env();
  auto errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, globals);
    s.step(1);
    s.mgr->save(1, false);
    s.step(2);
    s.mgr->save(2, false);
  });
  unsetenv("CTITAN_CHECKPOINT_FAULT");
  reload_runtime_env();
  EXPECT_NE(errs[0].find("checkpoint save of step 2 failed on rank 1: injected fault"), std::string::npos) << errs[0];
  auto scan = ckpt::scan_folder(o.folder);
  EXPECT_EQ(scan.complete, (std::vector<int64_t>{1}));
  const std::string step1 = ckpt::step_dir(o.folder, 1);
  ASSERT_TRUE(fs::exists(step1 + "/.metadata"));
  EXPECT_EQ(ckpt::incomplete_reason(step1, 1), "");
  const std::string md = ckpt::read_whole_file(step1 + "/.metadata");
  ckpt::write_file_durable(step1 + "/.metadata", md + "x");
  EXPECT_NE(ckpt::incomplete_reason(step1, 1).find("does not match the COMPLETE marker"), std::string::npos);
  ckpt::write_file_durable(step1 + "/.metadata", md);
  // Without its marker the folder reads as PyTorch's own DCP folder (committed by .metadata,
  // which ctitan writes only inside step-<N>.partial): complete, but not ctitan's.
  fs::remove(step1 + "/COMPLETE");
  EXPECT_EQ(ckpt::incomplete_reason(step1, 1), "");
  EXPECT_TRUE(CheckpointReader(step1).is_foreign_dcp());
  fs::remove(step1 + "/.metadata");
  EXPECT_NE(ckpt::incomplete_reason(step1, 1).find("no COMPLETE marker"), std::string::npos);
  EXPECT_TRUE(ckpt::scan_folder(o.folder).complete.empty());
  fs::remove_all(dir);
}

TEST(CheckpointFaults, CorruptionIsReportedAndIncompleteFoldersAreSkipped) {
  const auto dir = temp_dir("corrupt");
  const auto o = options_for(dir);
  const auto globals = global_params();
  {
    RankState s(0, 1, o, CheckpointComm::single_process(), globals);
    for (int k = 1; k <= 3; ++k) {
      s.step(k);
      s.mgr->save(k, false);
    }
  }
  auto load_error = [&](CheckpointOptions oo) -> std::string {
    RankState s(0, 1, oo, CheckpointComm::single_process(), globals);
    try {
      auto res = s.mgr->load();
      return "loaded step " + std::to_string(res.step);
    } catch (const std::exception& e) {
      return e.what();
    }
  };
  const std::string s3 = ckpt::step_dir(o.folder, 3), s2 = ckpt::step_dir(o.folder, 2);
  auto o3 = o;  // step 3 asked for explicitly: its damage is an error
  o3.load_step = 3;
  // A flipped byte in a data file.
  {
    std::fstream f(s3 + "/rank0.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    char c;
    f.read(&c, 1);
    f.seekp(40);
    c ^= 0x10;
    f.write(&c, 1);
  }
  std::string e = load_error(o3);
  EXPECT_NE(e.find("is corrupt: rank0.bin bytes ["), std::string::npos) << e;
  EXPECT_NE(e.find("fail their CRC-32 check"), std::string::npos) << e;
  EXPECT_EQ(load_error(o), "loaded step 2") << "the newest, chosen automatically, falls back to the one before";
  // A truncated data file.
  fs::resize_file(s3 + "/rank0.bin", 100);
  e = load_error(o3);
  EXPECT_NE(e.find("rank0.bin has 100 bytes, the metadata records"), std::string::npos) << e;
  EXPECT_EQ(load_error(o), "loaded step 2");
  // Step 2 damaged as well: back to step 1.
  fs::copy_file(s2 + "/rank0.bin", dir / "rank0.bin.step2");
  fs::resize_file(s2 + "/rank0.bin", 10);
  EXPECT_EQ(load_error(o), "loaded step 1");
  fs::copy_file(dir / "rank0.bin.step2", s2 + "/rank0.bin", fs::copy_options::overwrite_existing);
  EXPECT_EQ(load_error(o), "loaded step 2");
  // Missing metadata: step-3 is not a checkpoint at all (skipped by the scan).
  fs::remove(s3 + "/metadata");
  EXPECT_EQ(load_error(o), "loaded step 2");
  // Asked for explicitly: an error listing what exists.
  e = load_error(o3);
  EXPECT_NE(e.find("checkpoint.load_step = 3"), std::string::npos) << e;
  EXPECT_NE(e.find("the metadata file is missing"), std::string::npos) << e;
  EXPECT_NE(e.find("step-1, step-2"), std::string::npos) << e;
  // Another flavor.
  auto of = o;
  of.model_flavor = "33M";
  e = load_error(of);
  EXPECT_NE(e.find("holds a llama3 \"debugmodel\" model; this run builds llama3 \"33M\""), std::string::npos) << e;
  // Another shape of a parameter.
  auto other = globals;
  other["layers.0.w"] = torch::zeros({12, 5});
  {
    RankState s(0, 1, o, CheckpointComm::single_process(), other);
    try {
      s.mgr->load();
      ADD_FAILURE() << "shape mismatch accepted";
    } catch (const UserError& err) {
      EXPECT_NE(std::string(err.what()).find("layers.0.w has shape [11, 5], this run's is [12, 5]"), std::string::npos)
          << err.what();
    }
  }
  EXPECT_TRUE(fs::exists(s2 + "/COMPLETE"));
  fs::remove_all(dir);
}

TEST(CheckpointConfig, UnknownExcludeNamesListTheValidOnes) {
  JobConfig cfg;
  cfg.checkpoint.exclude_from_loading = {"dataloader", "optimizers"};
  try {
    checkpoint_options(cfg);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "config error: checkpoint.exclude_from_loading names \"optimizers\", which is not one of: model, "
              "optimizer, lr_scheduler, dataloader, train_state, rng");
  }
}

// ---- tools -------------------------------------------------------------------------------------

TEST(CheckpointTool, InspectVerifyAndConsolidatedExport) {
  const auto dir = temp_dir("tool");
  const auto o = options_for(dir);
  const auto globals = global_params();
  auto errs = run_ranks(2, [&](int r, CheckpointComm c) {
    RankState s(r, 2, o, c, globals);
    s.step(1);
    s.mgr->save(1, false);
  });
  ASSERT_TRUE(all_empty(errs)) << errs[0];
  const std::string step = ckpt::step_dir(o.folder, 1);
  const std::string text = inspect_checkpoint(step, /*verify=*/true);
  EXPECT_NE(text.find("step 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("saved by 2 ranks, dp 1 x 1"), std::string::npos) << text;
  EXPECT_NE(text.find("layers.0.w  sharded  float32 [11, 5]  2 chunks"), std::string::npos) << text;
  EXPECT_NE(text.find("optimizer.state.norm.weight.step  replicated  int64 []  1 chunk"), std::string::npos) << text;
  EXPECT_NE(text.find("verified: every chunk"), std::string::npos) << text;
  EXPECT_NE(inspect_checkpoint(o.folder, false).find("step-1  complete"), std::string::npos);
  // Consolidated export: a pickled {fqn: tensor} dict of the model only (torch.load's format).
  const std::string out = (dir / "model.pt").string();
  export_consolidated(step, out, "bfloat16", hf_adapter());
  const std::string bytes = ckpt::read_whole_file(out);
  auto dict = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict();
  CheckpointReader r(step);
  EXPECT_EQ(dict.size(), globals.size());
  for (const auto& [fqn, g] : globals) {
    ASSERT_TRUE(dict.contains(fqn)) << fqn;
    auto t = dict.at(fqn).toTensor();
    EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(t, r.read_tensor(fqn).to(torch::kBFloat16))) << fqn;
  }
  // A flipped byte: --verify names it.
  {
    std::fstream f(step + "/rank1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    char c;
    f.read(&c, 1);
    f.seekp(8);
    c = static_cast<char>(c ^ 0x40);
    f.write(&c, 1);
  }
  EXPECT_EQ(checkpoint_tool_main({"inspect", step}), 0);
  EXPECT_EQ(checkpoint_tool_main({"inspect", step, "--verify"}), 1);
  EXPECT_EQ(checkpoint_tool_main({"frobnicate"}), 2);
  fs::remove_all(dir);
}

// ---- the real binary ---------------------------------------------------------------------------

namespace {

using ctitan::testing::kSrc;
using ctitan::testing::kTrain;
using ctitan::testing::sh;

std::vector<std::string> jsonl_losses(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  const std::regex re("\"step\": ([0-9]+).*\"loss\": ([^,}]+)");
  for (std::string line; std::getline(f, line);) {
    std::smatch m;
    if (std::regex_search(line, m, re)) out.push_back(std::string(m[1]) + ":" + std::string(m[2]));
  }
  return out;
}

}  // namespace

class CheckpointE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_ckpt_e2e_" + std::to_string(getpid()));
    fs::create_directories(root_ / "data");
    corpus_ = (root_ / "data" / "corpus.txt").string();
    // One line per document, each numbered so no two are alike.
    const char* subj[] = {"the whale", "the captain", "a sailor", "the harpooneer", "the mate", "the ship"};
    const char* verb[] = {"watched", "followed", "feared", "sought", "sailed past", "remembered"};
    const char* obj[] = {"the white sea", "a distant spout", "the old chart", "the long voyage"};
    std::mt19937 rng(99);
    std::ofstream f(corpus_);
    for (int d = 0; d < 1500; ++d) {
      f << "entry " << d << ":";
      const int n = 1 + rng() % 3;
      for (int s = 0; s < n; ++s) f << " " << subj[rng() % 6] << " " << verb[rng() % 6] << " " << obj[rng() % 4] << ".";
      f << "\n\n";
    }
    f.close();
    tokenizer_ = (root_ / "tok.model").string();
    auto r = sh(kSrc + "/scripts/train_tokenizer.sh " + corpus_ + " " + tokenizer_ + " 400");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(root_);
  }
  // A test running many jobs drops each job's files once it has checked them, so that it holds
  // one case's checkpoints at a time rather than all of them (a Mixtral debug checkpoint with its
  // optimizer is ~355 MiB; kept to the end, this file's TP test held 4.8 GB and CI's disk ran out).
  static void drop(const std::string& path) {
    if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(path);
  }

  // float32 parameters: on a CPU without native bf16 matmuls (avx512_bf16 / AMX) FSDP's bf16
  // compute is emulated and ~4x slower per step; what is tested here does not depend on it,
  // and TrainE2E and FSDP.* run the bf16 path.
  static std::string args(const std::string& dump, int steps) {
    return " --job.config_file " + kSrc + "/train_configs/debug_model.toml --model.tokenizer_path " + tokenizer_ +
           " --training.dataset_path " + corpus_ + " --job.dump_folder " + dump + " --training.steps " +
           std::to_string(steps) +
           " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1"
           " --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3 --debug.seed 5 --checkpoint.enable"
           " --comm.train_timeout_seconds 20 --training.mixed_precision_param float32";
  }
  // n ranks without the launcher (each rank's output separately).
  static std::vector<ctitan::testing::RankResult> ranks(int n, const std::string& a,
                                                        std::map<std::string, std::string> env = {}) {
    std::vector<std::string> argv = {kTrain};
    std::istringstream is(a);
    for (std::string w; is >> w;) argv.push_back(w);
    return spawn_processes(argv, n, env, 120);
  }
  static std::string launcher(int n) {
    return "NPROC=" + std::to_string(n) + " CTITAN_BUILD_DIR=" + fs::path(kTrain).parent_path().string() + " " + kSrc +
           "/scripts/run_train.sh";
  }
  static std::string launcher_args(const std::string& dump, int steps) {
    const std::string a = args(dump, steps);
    return a.substr(a.find(" --model"));
  }

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path CheckpointE2E::root_;
std::string CheckpointE2E::corpus_, CheckpointE2E::tokenizer_;

// 20 steps straight == 10 steps, a crash, and a fresh process resuming for the last 10:
// bitwise (losses printed with 17 significant digits), on 1 rank and on 2 (launcher).
TEST_F(CheckpointE2E, ResumeIsBitwiseIdenticalOnOneAndTwoRanks) {
  for (int n : {1, 2}) {
    const std::string straight = (root_ / ("straight" + std::to_string(n))).string();
    const std::string resumed = (root_ / ("resumed" + std::to_string(n))).string();
    const std::string run = n == 1 ? kTrain : launcher(n);
    const std::string extra = " --checkpoint.interval 10 --checkpoint.keep_latest_k 0";
    auto a = sh(run + (n == 1 ? args(straight, 20) : launcher_args(straight, 20)) + extra);
    ASSERT_EQ(a.code, 0) << a.out;
    // First half: killed at step 11, after step-10 was saved.
    auto b = sh("CTITAN_FAULT=raise:0:11 " + run + (n == 1 ? args(resumed, 20) : launcher_args(resumed, 20)) + extra);
    ASSERT_NE(b.code, 0) << b.out;
    ASSERT_TRUE(fs::exists(resumed + "/checkpoint/step-10/COMPLETE")) << b.out;
    auto c = sh(run + (n == 1 ? args(resumed, 20) : launcher_args(resumed, 20)) + extra);
    ASSERT_EQ(c.code, 0) << c.out;
    EXPECT_NE(c.out.find("checkpoint: loaded step 10"), std::string::npos) << c.out;
    auto want = jsonl_losses(straight + "/metrics.jsonl");
    auto got = jsonl_losses(resumed + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 20u);
    ASSERT_EQ(got.size(), 20u) << "steps 1-10 from the first process, 11-20 from the second";
    EXPECT_EQ(got, want) << n << " ranks";
    // The final save is model-only (last_save_model_only) and holds the trained weights.
    CheckpointReader last(resumed + "/checkpoint/step-20");
    EXPECT_TRUE(last.meta().model_only);
    EXPECT_EQ(last.meta().world_size, n);
  }
}

// Save on 4 → resume on 2 and 3; save on 2 → resume on 4. What each job loaded, written back
// out by the loading job, equals the saved checkpoint tensor for tensor, bit for bit; by
// default every rank refuses the changed dp degree before step 1; training continues.
TEST_F(CheckpointE2E, ReshardsModelAndOptimizerAcrossDegrees) {
  struct Case {
    int from, to;
  };
  for (const Case cs : {Case{4, 2}, Case{4, 3}, Case{2, 4}}) {
    const std::string tag = std::to_string(cs.from) + "to" + std::to_string(cs.to);
    const std::string src = (root_ / ("src" + tag)).string();
    auto s = ranks(cs.from, args(src, 3) + " --checkpoint.interval 3 --checkpoint.no_last_save_model_only");
    ASSERT_TRUE(ctitan::testing::all_ok(s));
    const std::string saved = src + "/checkpoint/step-3";
    // A new job on another degree, loading from it.
    const std::string dst = (root_ / ("dst" + tag)).string();
    const std::string from_args = args(dst, 5) + " --checkpoint.initial_load_path " + saved +
                                  " --checkpoint.no_initial_load_model_only --checkpoint.interval 100";
    // Refused by default (checked once: the rule does not depend on the degrees).
    const auto refused = cs.from == 4 && cs.to == 2 ? ranks(cs.to, from_args) : decltype(ranks(0, "")){};
    for (int r = 0; r < static_cast<int>(refused.size()); ++r) {
      EXPECT_EQ(refused[r].exit_code, 2) << refused[r].output;
      EXPECT_NE(refused[r].output.find("saved with data-parallel degree " + std::to_string(cs.from) +
                                       " and this run has data-parallel degree " + std::to_string(cs.to)),
                std::string::npos)
          << refused[r].output;
    }
    EXPECT_FALSE(fs::exists(dst + "/metrics.jsonl")) << "no step ran";
    const std::string dump = (root_ / ("dump" + tag)).string();
    auto ok = ranks(cs.to, from_args + " --checkpoint.exclude_from_loading dataloader",
                    {{"CTITAN_CHECKPOINT_DUMP_LOADED", dump}});
    ASSERT_TRUE(ctitan::testing::all_ok(ok));
    EXPECT_EQ(jsonl_losses(dst + "/metrics.jsonl").size(), 2u) << "steps 4 and 5 trained";
    CheckpointReader a(saved), b(dump + "/step-3");
    EXPECT_EQ(b.meta().world_size, cs.to);
    int compared = 0;
    for (const auto& [key, e] : a.meta().entries) {
      if (key.rfind("dataloader", 0) == 0 || key.rfind("rng", 0) == 0) continue;
      ASSERT_TRUE(b.has(key)) << key;
      EXPECT_TRUE(torch::equal(a.read_tensor(key), b.read_tensor(key))) << key << " " << tag;
      ++compared;
    }
    EXPECT_GT(compared, 3 * 6 * 9) << "model, exp_avg, exp_avg_sq of every parameter";
  }
}

// Tensor parallelism's checkpoints (issue 35), saved on one mesh and resumed on another: tp 2 → 1
// and 1 → 2 on one dp rank, dp_shard 2 × tp 2 → dp_shard 2 and back (tp changes, dp stays):
// the resumed run's losses equal the straight run's within 1e-6 relative at every step;
// dp_shard 2 × tp 2 → dp_shard 4 and back (dp changes too, the dataloader redistributed): the
// same as the same dp change without TP; Mixtral tp 2 → 1 and 1 → 2 as the first two. Every
// model and optimizer tensor the resuming job loaded equals the saved one bit for bit. Each
// first job is stopped at step 4, after step-3.
TEST_F(CheckpointE2E, TensorParallelCheckpointsResumeOnOtherMeshes) {
  struct Mesh {
    int ranks, tp;
    std::string text() const { return std::to_string(ranks) + "r_tp" + std::to_string(tp); }
  };
  const std::string common =
      " --checkpoint.interval 3 --checkpoint.keep_latest_k 0 --checkpoint.no_last_save_model_only"
      " --checkpoint.dataloader_reshard redistribute --debug.deterministic true --lr_scheduler.decay_ratio 0";
  std::string family;  // extra arguments of the family under test ("": llama3)
  auto job = [&](const Mesh& m, const std::string& dump) {
    return args(dump, 6) + common + family + " --parallelism.tensor_parallel_degree " + std::to_string(m.tp);
  };
  auto losses = [](const std::string& dump) {
    std::vector<double> out;
    for (const auto& s : jsonl_losses(dump + "/metrics.jsonl")) out.push_back(std::stod(s.substr(s.find(':') + 1)));
    return out;
  };
  // Saved on `from` (stopped at step 4), resumed on `to`: the losses of steps 1-3 and 4-6.
  auto resume = [&](const Mesh& from, const Mesh& to) {
    const std::string tag = (family.empty() ? "" : "moe_") + from.text() + "_to_" + to.text();
    const std::string dump = (root_ / ("tp_" + tag)).string(), loaded = (root_ / ("tp_loaded_" + tag)).string();
    auto first = ranks(from.ranks, job(from, dump), {{"CTITAN_FAULT", "raise:0:4"}});
    EXPECT_NE(first[0].exit_code, 0) << tag;
    EXPECT_TRUE(fs::exists(dump + "/checkpoint/step-3/COMPLETE")) << tag << first[0].output;
    auto second = ranks(to.ranks, job(to, dump), {{"CTITAN_CHECKPOINT_DUMP_LOADED", loaded}});
    EXPECT_TRUE(ctitan::testing::all_ok(second)) << tag;
    EXPECT_NE(second[0].output.find("checkpoint: loaded step 3"), std::string::npos) << tag << second[0].output;
    CheckpointReader saved(dump + "/checkpoint/step-3"), got(loaded + "/step-3");
    int compared = 0;
    for (const auto& [key, e] : saved.meta().entries) {
      if (key.rfind("dataloader", 0) == 0 || key.rfind("rng", 0) == 0) continue;
      EXPECT_TRUE(got.has(key) && torch::equal(saved.read_tensor(key), got.read_tensor(key))) << key << " " << tag;
      ++compared;
    }
    EXPECT_GT(compared, 3 * 6 * 9) << "model, exp_avg, exp_avg_sq of every parameter (" << tag << ")";
    drop(loaded);
    drop(dump + "/checkpoint");
    return losses(dump);
  };
  auto straight = [&](const Mesh& m) {
    const std::string dump =
        (root_ / (std::string("tp_straight_") + (family.empty() ? "" : "moe_") + m.text())).string();
    EXPECT_TRUE(ctitan::testing::all_ok(ranks(m.ranks, job(m, dump)))) << m.text();
    drop(dump + "/checkpoint");
    return losses(dump);
  };
  auto expect_close = [](const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    ASSERT_EQ(got.size(), 6u) << what;
    ASSERT_EQ(want.size(), 6u) << what;
    for (size_t i = 0; i < 6; ++i)
      EXPECT_LE(std::abs(got[i] - want[i]), 1e-6 * std::abs(want[i])) << what << " step " << i + 1;
    EXPECT_LT(want.back(), want.front()) << what << ": the model trained";
  };
  const Mesh one{1, 1}, tp2{2, 2}, dp2{2, 1}, dp2tp2{4, 2}, dp4{4, 1};
  const auto s1 = straight(one), s2 = straight(dp2);
  expect_close(resume(tp2, one), s1, "tp 2 -> 1");
  expect_close(resume(one, tp2), s1, "tp 1 -> 2");
  expect_close(resume(dp2tp2, dp2), s2, "dp_shard 2 x tp 2 -> dp_shard 2");
  expect_close(resume(dp2, dp2tp2), s2, "dp_shard 2 -> dp_shard 2 x tp 2");
  expect_close(resume(dp2tp2, dp4), resume(dp2, dp4), "dp_shard 2 x tp 2 -> dp_shard 4");
  expect_close(resume(dp4, dp2tp2), resume(dp4, dp2), "dp_shard 4 -> dp_shard 2 x tp 2");
  // Mixtral: its experts split on two dimensions (w1, w3 over their hidden units, w2 over its
  // inputs), the router replicated.
  family = " --model.name mixtral --model.flavor debugmodel";
  const auto m1 = straight(one);
  expect_close(resume(tp2, one), m1, "mixtral tp 2 -> 1");
  expect_close(resume(one, tp2), m1, "mixtral tp 1 -> 2");
}

// A rank raising, or killed, while writing: every rank stops non-zero naming it, promptly; the
// previous checkpoint is untouched and is what the next run resumes from.
TEST_F(CheckpointE2E, FailuresDuringSaveKeepThePreviousCheckpoint) {
  for (const std::string kind : {"raise", "kill"}) {
    const std::string dump = (root_ / ("fault_" + kind)).string();
    const auto t0 = std::chrono::steady_clock::now();
    auto rs = ranks(2, args(dump, 6) + " --checkpoint.interval 2", {{"CTITAN_CHECKPOINT_FAULT", kind + ":1:4"}});
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(secs, 60);
    EXPECT_NE(rs[0].exit_code, 0);
    EXPECT_NE(rs[1].exit_code, 0);
    EXPECT_FALSE(rs[0].timed_out);
    if (kind == "raise") {
      for (const auto& r : rs)
        EXPECT_NE(r.output.find("checkpoint save of step 4 failed on rank 1: injected fault"), std::string::npos)
            << r.output;
    } else {
      EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL);
      EXPECT_NE(rs[0].output.find("checkpoint save of step 4 failed: rank 1 did not finish writing"), std::string::npos)
          << "exit code " << rs[0].exit_code << "\n"
          << rs[0].output;
    }
    const auto scan = ckpt::scan_folder(dump + "/checkpoint");
    EXPECT_EQ(scan.complete, (std::vector<int64_t>{2}));
    auto again = ranks(2, args(dump, 6) + " --checkpoint.interval 2");
    ASSERT_TRUE(ctitan::testing::all_ok(again));
    EXPECT_NE(again[0].output.find("checkpoint: loaded step 2"), std::string::npos) << again[0].output;
    EXPECT_EQ(ckpt::scan_folder(dump + "/checkpoint").complete, (std::vector<int64_t>{2, 4, 6}));
  }
}

// A disk that fills during a save (an injected ENOSPC on rank 1): the save fails on both
// ranks naming the rank and the error, nothing of it stays, step-2 is intact; the run stops
// (exit 1) or, with checkpoint.on_save_failure = "continue", trains on and saves later.
TEST_F(CheckpointE2E, DiskFullDuringSaveStopsOrContinues) {
  const std::string dump = (root_ / "enospc").string();
  const std::map<std::string, std::string> fault = {{"CTITAN_CHECKPOINT_FAULT", "enospc:1:4"}};
  auto rs = ranks(2, args(dump, 6) + " --checkpoint.interval 2", fault);
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error: checkpoint save of step 4 failed on rank 1: checkpoint: cannot write " + dump +
                            "/checkpoint/step-4.partial/rank1.bin.tmp: No space left on device (the previous "
                            "checkpoint step-2 is intact)"),
              std::string::npos)
        << r.output;
  }
  auto scan = ckpt::scan_folder(dump + "/checkpoint");
  EXPECT_EQ(scan.complete, (std::vector<int64_t>{2}));
  EXPECT_TRUE(scan.staging.empty() && scan.incomplete.empty());
  fs::remove_all(dump);
  rs = ranks(2, args(dump, 6) + " --checkpoint.interval 2 --checkpoint.on_save_failure continue", fault);
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_NE(rs[0].output.find("No space left on device (the previous checkpoint step-2 is intact); training "
                              "continues (checkpoint.on_save_failure = \"continue\")"),
            std::string::npos)
      << rs[0].output;
  EXPECT_EQ(ckpt::scan_folder(dump + "/checkpoint").complete, (std::vector<int64_t>{2, 6}));
}

// A real small file system (a tmpfs; the test is skipped where it cannot be mounted). Too
// little space: the check before the save refuses it on every rank, naming the folder, the
// bytes needed and free, before writing anything. Enough space, but the disk fills during the
// write (CTITAN_CHECKPOINT_FAULT=fill takes the rest): the kernel's ENOSPC fails the save on
// every rank, the previous checkpoint stays intact and the filler goes with the staging folder.
TEST_F(CheckpointE2E, SmallFileSystem) {
  const std::string mnt = (root_ / "tmpfs").string();
  fs::create_directories(mnt);
  auto mount = [&](const std::string& size) {
    return sh("mount -t tmpfs -o size=" + size + " ctitan_test " + mnt).code == 0;
  };
  if (!mount("40m")) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  struct Unmount {
    std::string dir;
    ~Unmount() { sh("umount " + dir); }
  } unmount{mnt};
  // A full save of 2 ranks is ~71 MiB (model 6.2M parameters — debugmodel's 2048-row
  // vocabulary, whatever the tokenizer's — + Adam moments, fp32).
  const std::string dump = mnt + "/run";
  auto rs = ranks(2, args(dump, 4) + " --checkpoint.interval 2");
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(std::regex_search(
        r.output,
        std::regex("error: checkpoint save of step 2 refused: not enough free space for " + dump +
                   "/checkpoint on ranks 0, 1: needs [0-9]+ bytes \\([0-9.]+ MiB\\), [0-9]+ bytes "
                   "\\([0-9.]+ MiB\\) free; nothing was written \\(no earlier complete checkpoint exists\\) HINT: ")))
        << r.output;
  }
  EXPECT_FALSE(fs::exists(dump + "/checkpoint/step-2.partial"));
  // "continue": training goes on, and the final model-only save (~24 MiB) fits.
  fs::remove_all(dump);
  rs = ranks(2, args(dump, 4) + " --checkpoint.interval 2 --checkpoint.on_save_failure continue");
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_EQ(ckpt::scan_folder(dump + "/checkpoint").complete, (std::vector<int64_t>{4}));

  // Room for two full saves: step 2 is saved; step 4 passes the check but the disk fills
  // during its write and the write runs out of space for real.
  fs::remove_all(dump);
  sh("umount " + mnt);
  ASSERT_TRUE(mount("165m"));
  rs = ranks(2, args(dump, 6) + " --checkpoint.interval 2", {{"CTITAN_CHECKPOINT_FAULT", "fill:1:4"}});
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("error: checkpoint save of step 4 failed on rank"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("No space left on device"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(the previous checkpoint step-2 is intact)"), std::string::npos) << r.output;
  }
  const auto scan = ckpt::scan_folder(dump + "/checkpoint");
  EXPECT_EQ(scan.complete, (std::vector<int64_t>{2}));
  EXPECT_TRUE(scan.staging.empty());
  EXPECT_GT(ckpt::disk_space(dump).free, 60u << 20) << "the filler was removed with the staging folder";
  auto again = ranks(2, args(dump, 6) + " --checkpoint.interval 100");  // then only the model-only save
  ASSERT_TRUE(ctitan::testing::all_ok(again));
  EXPECT_NE(again[0].output.find("checkpoint: loaded step 2"), std::string::npos) << again[0].output;
}

// Model-only saves on 2 ranks start fresh runs on 1 and 3 ranks; resuming training state from
// one is a clear error (another flavor: CheckpointFaults.CorruptionIsReported...; in-process).
TEST_F(CheckpointE2E, WeightsOnlyLoadsOnOtherDegrees) {
  const std::string src = (root_ / "weights").string();
  auto s = ranks(2, args(src, 3));
  ASSERT_TRUE(ctitan::testing::all_ok(s));
  // A fresh run draws its initial weights (per unit, FSDP keeping each rank's rows)...
  EXPECT_NE(s[0].output.find("model init: 8 of 8 units randomly initialised"), std::string::npos) << s[0].output;
  const std::string saved = src + "/checkpoint/step-3";
  ASSERT_TRUE(CheckpointReader(saved).meta().model_only);
  for (int n : {1, 3}) {
    const std::string dst = (root_ / ("weights_to" + std::to_string(n))).string();
    auto rs = ranks(n, args(dst, 2) + " --checkpoint.initial_load_path " + saved);
    ASSERT_TRUE(ctitan::testing::all_ok(rs));
    EXPECT_NE(rs[0].output.find("checkpoint: loaded step 3 from " + saved), std::string::npos) << rs[0].output;
    EXPECT_NE(rs[0].output.find("now " + std::to_string(n) + " ranks): model"), std::string::npos) << rs[0].output;
    // ...a run that loads weights draws none (with FSDP on 3 ranks, and on 1 process without).
    EXPECT_NE(rs[0].output.find("model init: 0 of 8 units randomly initialised on this rank (the weights come from "
                                "the checkpoint)"),
              std::string::npos)
        << rs[0].output;
    EXPECT_EQ(jsonl_losses(dst + "/metrics.jsonl").size(), 2u) << "steps 1 and 2 of a fresh run";
  }
  auto again = sh(kTrain + args(src, 5));
  EXPECT_EQ(again.code, 2) << again.out;
  EXPECT_NE(again.out.find("holds model weights only"), std::string::npos) << again.out;
}

// Damaged checkpoints through the binary: a truncated shard and a flipped byte are one-line
// errors naming the file when that checkpoint was asked for, and a fallback to the previous
// one when it was the newest; a step folder without metadata is skipped for the previous one.
TEST_F(CheckpointE2E, DamagedCheckpoints) {
  const std::string dump = (root_ / "damaged").string();
  auto s = ranks(2, args(dump, 4) + " --checkpoint.interval 2 --checkpoint.no_last_save_model_only");
  ASSERT_TRUE(ctitan::testing::all_ok(s));
  const std::string s4 = dump + "/checkpoint/step-4";
  const std::string copy = dump + "/step-4.orig";
  fs::copy(s4, copy, fs::copy_options::recursive);
  // Flipped byte.
  {
    std::fstream f(s4 + "/rank1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    char c;
    f.read(&c, 1);
    f.seekp(1000);
    c = static_cast<char>(c ^ 0x01);
    f.write(&c, 1);
  }
  // Named by load_step: a one-line error on every rank. Chosen as the newest: every rank
  // falls back to step-2 with a warning (load_only: these runs save nothing).
  auto rs = ranks(2, args(dump, 6) + " --checkpoint.load_step 4");
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("rank1.bin bytes ["), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fail their CRC-32 check"), std::string::npos) << r.output;
  }
  rs = ranks(2, args(dump, 6) + " --checkpoint.load_only");
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_TRUE(std::regex_search(rs[0].output, std::regex("checkpoint: " + s4 +
                                                         " cannot be loaded \\(.*rank1.bin bytes "
                                                         "\\[.*fail their CRC-32 check.*\\); falling back to " +
                                                         dump + "/checkpoint/step-2")))
      << rs[0].output;
  EXPECT_NE(rs[0].output.find("checkpoint: loaded step 2"), std::string::npos) << rs[0].output;
  // Truncated.
  fs::copy(copy + "/rank1.bin", s4 + "/rank1.bin", fs::copy_options::overwrite_existing);
  fs::resize_file(s4 + "/rank0.bin", fs::file_size(s4 + "/rank0.bin") / 2);
  rs = ranks(2, args(dump, 6) + " --checkpoint.load_step 4");
  for (const auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("rank0.bin has "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(truncated?)"), std::string::npos) << r.output;
  }
  rs = ranks(2, args(dump, 6) + " --checkpoint.load_only");
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_NE(rs[0].output.find("(truncated?)); falling back to " + dump + "/checkpoint/step-2"), std::string::npos)
      << rs[0].output;
  // Missing metadata: step-4 is skipped with a warning, step-2 resumes.
  fs::copy(copy + "/rank0.bin", s4 + "/rank0.bin", fs::copy_options::overwrite_existing);
  fs::remove(s4 + "/metadata");
  rs = ranks(2, args(dump, 6) + " --checkpoint.interval 100");
  ASSERT_TRUE(ctitan::testing::all_ok(rs));
  EXPECT_NE(rs[0].output.find("ignoring " + s4 + ": the metadata file is missing"), std::string::npos) << rs[0].output;
  EXPECT_NE(rs[0].output.find("checkpoint: loaded step 2"), std::string::npos) << rs[0].output;
}

// checkpoint.dataloader_reshard = "redistribute", 4 → 2 and 2 → 3 ranks. Every token the
// two jobs trained on (traced windows) plus what the resumed loaders still buffer at the end
// must be, as a multiset, exactly the tokens of the documents read: every document the final
// states do not hold as unread (their "work", datasets/sharding.h). Document encodings come
// from Debian's spm_encode, independently of ctitan's tokenizer code. Duplicates (tokens seen
// more often than their documents hold) and gaps (fewer) are counted; the bound on both is 0.
TEST_F(CheckpointE2E, RedistributeSeesEveryDocumentOnce) {
  // Documents of the corpus, in order (one line each), encoded by spm_encode.
  std::vector<std::vector<int64_t>> docs;
  {
    const std::string lines = (root_ / "doc_lines.txt").string();
    std::ifstream in(corpus_);
    std::ofstream out(lines);
    for (std::string l; std::getline(in, l);)
      if (!l.empty()) out << l << "\n";
    out.close();
    auto enc = sh("spm_encode --model=" + tokenizer_ + " --output_format=id < " + lines);
    ASSERT_EQ(enc.code, 0) << enc.out;
    std::istringstream is(enc.out);
    for (std::string l; std::getline(is, l);) {
      std::istringstream ls(l);
      std::vector<int64_t> ids;
      for (int64_t id; ls >> id;) ids.push_back(id);
      docs.push_back(ids);
    }
    ASSERT_EQ(docs.size(), 1500u);
  }
  auto ints_after = [](const std::string& json, const std::string& key) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(json, m, std::regex("\"" + key + "\":(-?[0-9]+)"))) << key;
    return std::stoll(m[1]);
  };
  struct Case {
    int from, to;
  };
  for (const Case cs : {Case{4, 2}, Case{2, 3}}) {
    const std::string tag = "redis" + std::to_string(cs.from) + "to" + std::to_string(cs.to);
    const std::string a = (root_ / (tag + "_a")).string(), b = (root_ / (tag + "_b")).string();
    const std::string trace_a = (root_ / (tag + "_trace_a")).string(), trace_b = (root_ / (tag + "_trace_b")).string();
    auto ra = ranks(cs.from, args(a, 3) + " --checkpoint.interval 3 --checkpoint.no_last_save_model_only",
                    {{"CTITAN_TRACE_WINDOWS", trace_a}});
    ASSERT_TRUE(ctitan::testing::all_ok(ra));
    auto rb = ranks(cs.to,
                    args(b, 6) + " --checkpoint.initial_load_path " + a + "/checkpoint/step-3" +
                        " --checkpoint.no_initial_load_model_only --checkpoint.interval 100"
                        " --checkpoint.no_last_save_model_only --checkpoint.dataloader_reshard redistribute",
                    {{"CTITAN_TRACE_WINDOWS", trace_b}});
    ASSERT_TRUE(ctitan::testing::all_ok(rb));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(rb[0].output, m, std::regex("bos ([0-9]+), eos ([0-9]+)"))) << rb[0].output;
    const int64_t bos = std::stoll(m[1]), eos = std::stoll(m[2]);
    EXPECT_NE(rb[0].output.find("dataloader: redistributed from dp " + std::to_string(cs.from)), std::string::npos);
    // What the saved ranks had reached, and what the new ranks still hold unread at the end.
    CheckpointReader fin(b + "/checkpoint/step-6");
    std::map<int64_t, int64_t> have, want;
    std::vector<ctitan::testing::StateUnit> left;
    for (int r = 0; r < cs.to; ++r) {
      const std::string st = fin.read_bytes("dataloader.dp_rank_" + std::to_string(r));
      ASSERT_EQ(ints_after(st, "epoch"), 0);
      for (int64_t v : ctitan::testing::state_buffer(st)) ++have[v];
      for (const auto& u : ctitan::testing::state_work(st)) left.push_back(u);
    }
    const auto doc_ids = ctitan::testing::line_documents(corpus_);
    ASSERT_EQ(doc_ids.size(), docs.size());
    int64_t ndocs = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      if (ctitan::testing::still_unread(left, doc_ids[d])) continue;
      ++ndocs;
      for (int64_t v : docs[d]) ++want[v];
    }
    // Documents counted in `want` also carry their BOS and EOS.
    want[bos] += ndocs;
    want[eos] += ndocs;
    int64_t windows = 0;
    for (const std::string& prefix : {trace_a, trace_b})
      for (int r = 0; r < std::max(cs.from, cs.to); ++r) {
        std::ifstream f(prefix + ".rank" + std::to_string(r));
        for (std::string line; std::getline(f, line);) {
          std::istringstream ls(line);
          int64_t step, v;
          ls >> step;
          while (ls >> v) ++have[v];
          ++windows;
        }
      }
    EXPECT_EQ(windows, (3 * cs.from + 3 * cs.to) * 2) << "every trained window traced";
    int64_t dup = 0, gap = 0;
    std::set<int64_t> ids;
    for (const auto& kv : have) ids.insert(kv.first);
    for (const auto& kv : want) ids.insert(kv.first);
    for (int64_t id : ids) {
      const int64_t d = have[id] - want[id];
      (d > 0 ? dup : gap) += std::abs(d);
    }
    std::printf(
        "redistribute %d -> %d: %lld documents read, %lld windows; duplicated tokens %lld, "
        "missing tokens %lld\n",
        cs.from, cs.to, static_cast<long long>(ndocs), static_cast<long long>(windows), static_cast<long long>(dup),
        static_cast<long long>(gap));
    EXPECT_EQ(dup, 0) << tag;
    EXPECT_EQ(gap, 0) << tag;
  }
}

CTITAN_MULTIPROCESS_MAIN()
