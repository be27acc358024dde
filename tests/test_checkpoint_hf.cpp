// Hugging Face interop (checkpoint/hf.h, checkpoint/safetensors.h): the safetensors writer
// checked by a strict parser written here, damaged files, the name map against the real
// models, Mixtral's expert split, and the real `train` binary exporting (last_save_in_hf) and
// importing (initial_load_in_hf) on 1 and 2 ranks, bit for bit, with q/k permuted as
// computed here with plain ATen ops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "models/hf_adapter.h"
#include "models/llama/model.h"
#include "models/mixtral/model.h"
#include "tests/e2e.h"
#include "tests/multiprocess.h"
#include "tools/checkpoint_tool.h"
#include "tools/generate.h"

namespace fs = std::filesystem;
using namespace ctitan;

namespace {

// ---- the test's own safetensors parser ------------------------------------------------------
// Independent of checkpoint/safetensors.cpp and util/json: a minimal JSON reader
// for what a safetensors header may hold (objects, arrays, strings, integers), strict about
// everything the format requires. Throws std::runtime_error on any violation.

struct J {
  enum K { Obj, Arr, Str, Int, Other } k = Other;
  std::vector<std::pair<std::string, J>> obj;
  std::vector<J> arr;
  std::string str;
  int64_t num = 0;
};

struct JReader {
  const std::string& s;
  size_t i = 0;
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) ++i;
  }
  char peek() {
    ws();
    if (i >= s.size()) throw std::runtime_error("header JSON ends early");
    return s[i];
  }
  void expect(char c) {
    if (peek() != c) throw std::runtime_error(std::string("expected '") + c + "' at " + std::to_string(i));
    ++i;
  }
  J value() {
    J v;
    const char c = peek();
    if (c == '{') {
      v.k = J::Obj;
      ++i;
      if (peek() == '}') return ++i, v;
      for (;;) {
        J key = value();
        if (key.k != J::Str) throw std::runtime_error("object key is not a string");
        expect(':');
        v.obj.emplace_back(key.str, value());
        if (peek() == ',') {
          ++i;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.k = J::Arr;
      ++i;
      if (peek() == ']') return ++i, v;
      for (;;) {
        v.arr.push_back(value());
        if (peek() == ',') {
          ++i;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.k = J::Str;
      ++i;
      while (i < s.size() && s[i] != '"') {
        if (s[i] == '\\') ++i;
        if (i < s.size()) v.str += s[i++];
      }
      expect('"');
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.k = J::Int;
      size_t j = i;
      if (s[j] == '-') ++j;
      while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
      if (j < s.size() && (s[j] == '.' || s[j] == 'e' || s[j] == 'E')) throw std::runtime_error("non-integer number");
      v.num = std::stoll(s.substr(i, j - i));
      i = j;
      return v;
    }
    throw std::runtime_error(std::string("unexpected '") + c + "'");
  }
};

struct StTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};
struct StFile {
  uint64_t header_len = 0;
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> meta;
  std::string data;  // the data section
  torch::Tensor tensor(const std::string& name) const {
    const StTensor& t = tensors.at(name);
    const auto dt = t.dtype == "F32"    ? torch::kFloat
                    : t.dtype == "BF16" ? torch::kBFloat16
                    : t.dtype == "F16"  ? torch::kHalf
                                        : torch::kLong;
    auto out = torch::empty(t.shape, torch::TensorOptions().dtype(dt));
    std::memcpy(out.data_ptr(), data.data() + t.begin, t.end - t.begin);
    return out;
  }
};

StFile parse_safetensors(const std::string& bytes) {
  if (bytes.size() < 8) throw std::runtime_error("shorter than 8 bytes");
  StFile f;
  for (int b = 7; b >= 0; --b) f.header_len = (f.header_len << 8) | static_cast<unsigned char>(bytes[b]);
  if (f.header_len > bytes.size() - 8) throw std::runtime_error("header longer than the file");
  if ((8 + f.header_len) % 8 != 0) throw std::runtime_error("data section not 8-byte aligned");
  const std::string header = bytes.substr(8, f.header_len);
  JReader r{header};
  J root = r.value();
  r.ws();
  if (r.i != header.size()) throw std::runtime_error("bytes after the header JSON");
  if (root.k != J::Obj) throw std::runtime_error("header is not an object");
  f.data = bytes.substr(8 + f.header_len);
  const std::map<std::string, uint64_t> sizes = {{"F32", 4}, {"BF16", 2}, {"F16", 2}, {"I64", 8}, {"F64", 8}};
  for (const auto& [name, v] : root.obj) {
    if (name == "__metadata__") {
      for (const auto& [k, x] : v.obj) {
        if (x.k != J::Str) throw std::runtime_error("metadata value not a string");
        f.meta[k] = x.str;
      }
      continue;
    }
    if (f.tensors.count(name)) throw std::runtime_error("duplicate " + name);
    if (v.k != J::Obj || v.obj.size() != 3) throw std::runtime_error(name + ": not {dtype, shape, data_offsets}");
    StTensor t;
    std::set<std::string> fields;
    for (const auto& [k, x] : v.obj) {
      fields.insert(k);
      if (k == "dtype") t.dtype = x.str;
      if (k == "shape")
        for (const auto& d : x.arr) {
          if (d.k != J::Int || d.num < 0) throw std::runtime_error(name + ": bad dimension");
          t.shape.push_back(d.num);
        }
      if (k == "data_offsets") {
        if (x.arr.size() != 2) throw std::runtime_error(name + ": data_offsets not a pair");
        t.begin = static_cast<uint64_t>(x.arr[0].num);
        t.end = static_cast<uint64_t>(x.arr[1].num);
      }
    }
    if (fields != std::set<std::string>{"dtype", "shape", "data_offsets"}) throw std::runtime_error(name + ": fields");
    if (!sizes.count(t.dtype)) throw std::runtime_error(name + ": dtype " + t.dtype);
    uint64_t n = sizes.at(t.dtype);
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    if (t.end < t.begin || t.end - t.begin != n) throw std::runtime_error(name + ": size does not match dtype x shape");
    if (t.begin % sizes.at(t.dtype) != 0) throw std::runtime_error(name + ": misaligned");
    f.tensors[name] = t;
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& kv : f.tensors) ranges.emplace_back(kv.second.begin, kv.second.end);
  std::sort(ranges.begin(), ranges.end());
  uint64_t next = 0;
  for (const auto& [b, e] : ranges) {
    if (b != next) throw std::runtime_error("offsets not contiguous at " + std::to_string(b));
    next = e;
  }
  if (next != f.data.size()) throw std::runtime_error("data section has bytes no tensor owns");
  return f;
}

StFile parse_safetensors_file(const std::string& path) { return parse_safetensors(ckpt::read_whole_file(path)); }

fs::path temp_dir(const std::string& name) {
  auto p = fs::temp_directory_path() / ("ctitan_hf_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// What read_header says about a damaged file ("" when it accepts it).
std::string header_error(const std::string& path) {
  try {
    safetensors::read_header(path);
  } catch (const RuntimeFailure& e) {
    return e.what();
  }
  return "";
}

// A safetensors file from a header text and a data section, written as given.
std::string raw_file(const fs::path& dir, const std::string& name, const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  bytes += header + data;
  const std::string path = (dir / name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// HF's rotary order computed here by index arithmetic, not by view/transpose as in hf.cpp:
// HF row h·hd + j·hd/2 + i holds ctitan row h·hd + 2i + j.
torch::Tensor permute_for_hf(const torch::Tensor& w, int64_t heads) {
  const int64_t rows = w.size(0), hd = rows / heads;
  std::vector<int64_t> src(rows);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < hd / 2; ++i) src[h * hd + j * (hd / 2) + i] = h * hd + 2 * i + j;
  return w.index_select(0, torch::tensor(src, torch::kLong));
}

// ctitan name -> HF name, written out here for the Llama layout.
std::string hf_name(const std::string& fqn) {
  static const std::vector<std::pair<std::regex, std::string>> rules = {
      {std::regex(R"(tok_embeddings\.weight)"), "model.embed_tokens.weight"},
      {std::regex(R"(norm\.weight)"), "model.norm.weight"},
      {std::regex(R"(output\.weight)"), "lm_head.weight"},
      {std::regex(R"(layers\.(\d+)\.attention\.wq\.weight)"), "model.layers.$1.self_attn.q_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.attention\.wk\.weight)"), "model.layers.$1.self_attn.k_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.attention\.wv\.weight)"), "model.layers.$1.self_attn.v_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.attention\.wo\.weight)"), "model.layers.$1.self_attn.o_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.feed_forward\.w1\.weight)"), "model.layers.$1.mlp.gate_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.feed_forward\.w2\.weight)"), "model.layers.$1.mlp.down_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.feed_forward\.w3\.weight)"), "model.layers.$1.mlp.up_proj.weight"},
      {std::regex(R"(layers\.(\d+)\.attention_norm\.weight)"), "model.layers.$1.input_layernorm.weight"},
      {std::regex(R"(layers\.(\d+)\.ffn_norm\.weight)"), "model.layers.$1.post_attention_layernorm.weight"}};
  for (const auto& [re, out] : rules)
    if (std::regex_match(fqn, re)) return std::regex_replace(fqn, re, out);
  return "";
}

}  // namespace

// ---- safetensors ---------------------------------------------------------------------------

TEST(HFSafetensors, WriterOutputPassesTheTestsStrictParser) {
  const auto dir = temp_dir("writer");
  auto a = torch::randn({3, 5});
  auto b = torch::randn({7}).to(torch::kBFloat16);
  auto c = torch::arange(6, torch::kLong).view({2, 3});
  const std::string path = (dir / "x.safetensors").string();
  {
    // Declared with the 2-byte tensor first: the writer puts larger elements first so each
    // tensor starts aligned to its element size.
    safetensors::Writer w(path, {{"b", "BF16", {7}}, {"a", "F32", {3, 5}}, {"c", "I64", {2, 3}}},
                          {{"note", "hi \"x\""}});
    for (const auto& s : w.order()) {
      const torch::Tensor& t = s.name == "a" ? a : s.name == "b" ? b : c;
      w.write(s.name, t.data_ptr(), t.numel() * t.element_size());
    }
    w.commit();
  }
  const StFile f = parse_safetensors_file(path);
  EXPECT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.meta.at("note"), "hi \"x\"");
  EXPECT_EQ(f.tensors.at("a").shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(f.tensors.at("b").dtype, "BF16");
  EXPECT_EQ(f.tensors.at("b").begin, f.data.size() - 14) << "the 2-byte tensor comes last";
  EXPECT_TRUE(torch::equal(f.tensor("a"), a));
  EXPECT_TRUE(torch::equal(f.tensor("b"), b));
  EXPECT_TRUE(torch::equal(f.tensor("c"), c));
  // The library's reader agrees.
  const auto h = safetensors::read_header(path);
  ASSERT_NE(h.find("c"), nullptr);
  EXPECT_EQ(h.find("c")->begin, f.tensors.at("c").begin);
  EXPECT_EQ(h.data_start, 8 + f.header_len);
  fs::remove_all(dir);
}

TEST(HFSafetensors, DamagedFilesAreOneLineErrorsNamingFileAndTensor) {
  const auto dir = temp_dir("damaged");
  const std::string data(24, 'x');  // room for a F32 [2, 3]
  auto ok = raw_file(dir, "ok.safetensors", R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", data);
  EXPECT_EQ(header_error(ok), "");
  struct Case {
    std::string name, header, data, want;
  };
  const std::vector<Case> cases = {
      {"trunc", R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", data.substr(0, 20),
       "run past the end of the data (20 bytes; truncated?) (tensor t)"},
      {"dtype", R"({"t":{"dtype":"F33","shape":[2,3],"data_offsets":[0,24]}})", data, "unknown dtype F33 (tensor t)"},
      {"size", R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,24]}})", data,
       "holds 24 bytes but its dtype and shape need 16 (tensor t)"},
      {"overlap",
       R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"u":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}})",
       data.substr(0, 20), "data_offsets overlap the previous tensor's (tensor u)"},
      {"gap",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
       data, "a gap of 8 bytes precedes its data (tensor u)"},
      {"tail", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data,
       "16 bytes after the last tensor belong to none"},
      {"dup",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       data.substr(0, 16), "duplicate key in the header (tensor t)"},
      {"json", R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})", data, "the header is not valid JSON"},
      {"field", R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24],"x":1}})", data,
       "unexpected or repeated field \"x\" (tensor t)"},
      {"neg", R"({"t":{"dtype":"F32","shape":[-2,3],"data_offsets":[0,24]}})", data,
       "shape must hold non-negative integers (tensor t)"},
  };
  for (const auto& c : cases) {
    const std::string path = raw_file(dir, c.name + ".safetensors", c.header, c.data);
    const std::string err = header_error(path);
    EXPECT_NE(err.find("safetensors " + path + ": "), std::string::npos) << c.name << ": " << err;
    EXPECT_NE(err.find(c.want), std::string::npos) << c.name << ": " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << c.name;
    // The test's own parser refuses the same files.
    EXPECT_ANY_THROW(parse_safetensors_file(path)) << c.name;
  }
  // A header length beyond the file, and a file too short to hold one.
  {
    std::string bytes = ckpt::read_whole_file(ok);
    bytes[0] = static_cast<char>(0xff);
    bytes[1] = static_cast<char>(0x7f);
    std::ofstream(dir / "len.safetensors", std::ios::binary) << bytes;
    EXPECT_NE(header_error((dir / "len.safetensors").string()).find("runs past the end of the file"),
              std::string::npos);
    std::ofstream(dir / "short.safetensors", std::ios::binary) << "abc";
    EXPECT_NE(header_error((dir / "short.safetensors").string()).find("shorter than the 8-byte header length"),
              std::string::npos);
  }
  fs::remove_all(dir);
}

// ---- names and shapes ------------------------------------------------------------------------

// The parameter list the HF mapping derives from a config equals the real models' own.
TEST(HFNames, ParamListMatchesTheModelsAndEveryParameterHasAnHFName) {
  {
    auto a = llama::llama3_flavor("debugmodel");
    a.vocab_size = 300;
    a.max_seq_len = 16;
    llama::Transformer model(a);
    ParamList real;
    for (const auto& kv : model->named_parameters()) real.push_back({kv.key(), kv.value().sizes().vec()});
    const ParamList derived = hf_adapter().params(hf_adapter().config_for("llama3", "debugmodel", 300));
    EXPECT_EQ(derived, real);
    std::set<std::string> keys;
    for (const auto& [fqn, shape] : derived) {
      const auto pieces = hf_adapter().pieces(fqn, shape, hf_adapter().config_for("llama3", "debugmodel", 300));
      ASSERT_EQ(pieces.size(), 1u);
      EXPECT_EQ(pieces[0].key, hf_name(fqn)) << fqn;
      keys.insert(pieces[0].key);
    }
    EXPECT_EQ(keys.size(), derived.size());
  }
  {
    auto a = mixtral::mixtral_flavor("debugmodel");
    a.vocab_size = 300;
    a.max_seq_len = 16;
    mixtral::Transformer model(a);
    ParamList real;
    for (const auto& kv : model->named_parameters()) real.push_back({kv.key(), kv.value().sizes().vec()});
    EXPECT_EQ(hf_adapter().params(hf_adapter().config_for("mixtral", "debugmodel", 300)), real);
  }
  EXPECT_THROW(
      hf_adapter().pieces("layers.0.something.weight", {3}, hf_adapter().config_for("llama3", "debugmodel", 300)),
      UserError);
}

// Mixtral: grouped experts become HF's per-expert tensors; sharded -> HF -> sharded is exact.
TEST(HFExport, MixtralExpertsSplitAndRoundTripThroughTheTool) {
  const auto dir = temp_dir("mixtral");
  auto a = mixtral::mixtral_flavor("debugmodel");
  a.vocab_size = 300;
  a.max_seq_len = 16;
  torch::manual_seed(3);
  mixtral::Transformer model(a);
  model->init_weights();
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& kv : model->named_parameters()) dict.insert(kv.key(), kv.value().detach().clone());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(dir / "m.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));

  EXPECT_EQ(checkpoint_tool_main({"convert", (dir / "m.pt").string(), (dir / "hf").string()}), 0);
  const StFile f = parse_safetensors_file((dir / "hf" / "model.safetensors").string());
  const auto w1 = model->named_parameters()["layers.2.moe.experts.w1"];
  const auto w2 = model->named_parameters()["layers.2.moe.experts.w2"];
  for (int64_t j = 0; j < a.moe.num_experts; ++j) {
    EXPECT_TRUE(
        torch::equal(f.tensor("model.layers.2.block_sparse_moe.experts." + std::to_string(j) + ".w1.weight"), w1[j]));
    EXPECT_TRUE(
        torch::equal(f.tensor("model.layers.2.block_sparse_moe.experts." + std::to_string(j) + ".w2.weight"), w2[j]));
  }
  EXPECT_TRUE(torch::equal(f.tensor("model.layers.0.block_sparse_moe.gate.weight"),
                           model->named_parameters()["layers.0.moe.router.gate.weight"]));
  const std::string cfg = ckpt::read_whole_file((dir / "hf" / "config.json").string());
  EXPECT_NE(cfg.find("\"architectures\": [\"MixtralForCausalLM\"]"), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("\"num_local_experts\": 8"), std::string::npos) << cfg;

  EXPECT_EQ(checkpoint_tool_main({"convert", (dir / "hf").string(), (dir / "ck" / "step-0").string()}), 0);
  CheckpointReader r((dir / "ck" / "step-0").string());
  EXPECT_EQ(r.meta().model_name, "mixtral");
  EXPECT_EQ(r.meta().model_flavor, "debugmodel");
  for (const auto& kv : model->named_parameters())
    EXPECT_TRUE(torch::equal(r.read_tensor(kv.key()), kv.value())) << kv.key();
  fs::remove_all(dir);
}

TEST(HFConfig, LastSaveInHFNeedsAModelOnlyLastSave) {
  JobConfig c;
  c.checkpoint.enable = true;
  c.checkpoint.last_save_in_hf = true;
  EXPECT_NO_THROW(checkpoint_options(c));
  c.checkpoint.last_save_model_only = false;
  try {
    checkpoint_options(c);
    ADD_FAILURE() << "accepted";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "config error: checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true (an HF "
              "folder holds the model only)");
  }
}

// ---- the real binary -------------------------------------------------------------------------

class HFE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("ctitan_hf_e2e_" + std::to_string(getpid()));
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
  // n ranks of train (no launcher), each rank's output apart.
  static std::vector<ctitan::testing::RankResult> train(int n, const std::string& dump, const std::string& extra,
                                                        std::map<std::string, std::string> env = {}) {
    const std::string a = "--job.config_file " + ctitan::testing::kSrc + "/train_configs/debug_model.toml" +
                          " --model.tokenizer_path " + tokenizer_ + " --training.dataset_path " + corpus_ +
                          " --job.dump_folder " + dump +
                          " --training.steps 2 --training.seq_len 32 --training.local_batch_size 2"
                          " --metrics.log_freq 1 --debug.seed 7 --checkpoint.enable --comm.train_timeout_seconds 30 " +
                          extra;
    std::vector<std::string> argv = {ctitan::testing::kTrain};
    std::istringstream is(a);
    for (std::string w; is >> w;) argv.push_back(w);
    return ctitan::testing::spawn_processes(argv, n, env, 120);
  }
  static std::string tool() { return (fs::path(ctitan::testing::kTrain).parent_path() / "checkpoint_tool").string(); }

  static fs::path root_;
  static std::string corpus_, tokenizer_;
};
fs::path HFE2E::root_;
std::string HFE2E::corpus_, HFE2E::tokenizer_;

// Tensor parallelism (issue 35): a tp 2 run's HF export holds whole tensors (its bytes equal the
// offline conversion of the same run's ctitan save, which holds the one-process layout), and an
// HF folder imports into a tp 2 job (each rank cutting its share of the rows or columns) bit
// for bit.
TEST_F(HFE2E, TensorParallelRunsExportAndImportWholeTensors) {
  const std::string tp = " --parallelism.tensor_parallel_degree 2 --training.mixed_precision_param float32";
  const std::string a = (root_ / "tp_plain").string(), c = (root_ / "tp_hf").string();
  ASSERT_TRUE(ctitan::testing::all_ok(train(2, a, tp)));
  auto rc = train(2, c, tp + " --checkpoint.last_save_in_hf");
  ASSERT_TRUE(ctitan::testing::all_ok(rc));
  const std::string plain = a + "/checkpoint/step-2", hf = c + "/checkpoint/step-2";
  CheckpointReader orig(plain);
  EXPECT_EQ(orig.read_tensor("layers.0.attention.wo.weight").sizes(), at::IntArrayRef({256, 256}));
  const std::string offline = (root_ / "tp_offline").string();
  auto conv = ctitan::testing::sh(tool() + " convert " + plain + " " + offline);
  ASSERT_EQ(conv.code, 0) << conv.out;
  EXPECT_EQ(ckpt::read_whole_file(offline + "/model.safetensors"), ckpt::read_whole_file(hf + "/model.safetensors"));
  const std::string dst = (root_ / "tp_import").string(), dump = dst + "/loaded";
  auto r = train(2, dst,
                 tp + " --checkpoint.initial_load_in_hf --checkpoint.initial_load_path " + hf + " --training.steps 1",
                 {{"CTITAN_CHECKPOINT_DUMP_LOADED", dump}});
  ASSERT_TRUE(ctitan::testing::all_ok(r));
  CheckpointReader got(dump + "/step-2");
  ASSERT_EQ(got.meta().entries.size(), orig.meta().entries.size());
  for (const auto& [fqn, e] : orig.meta().entries)
    EXPECT_TRUE(torch::equal(got.read_tensor(fqn), orig.read_tensor(fqn))) << fqn;
}

// Two identical runs on n ranks, one ending with the usual model-only save and one with
// last_save_in_hf: the HF file holds the first run's tensors under HF names, q/k permuted;
// it equals the offline conversion byte for byte; imported on the other rank count
// (FSDP re-slicing), what the job holds equals the original bit for bit.
TEST_F(HFE2E, ExportImportRoundTripOnOneAndTwoRanks) {
  std::map<int, std::string> sharded, hf;
  for (int n : {1, 2}) {
    const std::string a = (root_ / ("plain" + std::to_string(n))).string();
    const std::string c = (root_ / ("hf" + std::to_string(n))).string();
    ASSERT_TRUE(ctitan::testing::all_ok(train(n, a, "")));
    auto rc = train(n, c, "--checkpoint.last_save_in_hf");
    ASSERT_TRUE(ctitan::testing::all_ok(rc));
    EXPECT_NE(rc[0].output.find("saved step 2 (model only, HF safetensors)"), std::string::npos) << rc[0].output;
    sharded[n] = a + "/checkpoint/step-2";
    hf[n] = c + "/checkpoint/step-2";
    EXPECT_FALSE(fs::exists(hf[n] + "/metadata")) << "the HF step folder holds no shard files";
    EXPECT_EQ(ckpt::incomplete_reason(hf[n], 2), "");

    CheckpointReader orig(sharded[n]);
    ASSERT_TRUE(orig.meta().model_only);
    const StFile f = parse_safetensors_file(hf[n] + "/model.safetensors");
    EXPECT_EQ(f.meta.at("format"), "pt");
    EXPECT_EQ(f.meta.at("ctitan.model"), "llama3 debugmodel");
    size_t n_model = 0;
    for (const auto& [fqn, e] : orig.meta().entries) {
      ++n_model;
      const std::string key = hf_name(fqn);
      ASSERT_TRUE(f.tensors.count(key)) << fqn << " -> " << key;
      EXPECT_EQ(f.tensors.at(key).dtype, "F32");
      EXPECT_EQ(f.tensors.at(key).shape, e.shape) << key;
      torch::Tensor want = orig.read_tensor(fqn);
      if (key.find("q_proj") != std::string::npos) want = permute_for_hf(want, 16);  // debugmodel: 16 heads
      if (key.find("k_proj") != std::string::npos) want = permute_for_hf(want, 16);  // 16 kv heads
      EXPECT_TRUE(torch::equal(f.tensor(key), want)) << key;
    }
    EXPECT_EQ(f.tensors.size(), n_model);
    EXPECT_FALSE(torch::equal(f.tensor("model.layers.0.self_attn.q_proj.weight"),
                              orig.read_tensor("layers.0.attention.wq.weight")))
        << "the permutation changed something";
    const std::string cfg = ckpt::read_whole_file(hf[n] + "/config.json");
    for (const char* field : {"\"hidden_size\": 256", "\"intermediate_size\": 768", "\"num_attention_heads\": 16",
                              "\"num_key_value_heads\": 16", "\"num_hidden_layers\": 6",
                              "\"vocab_size\": 2048",  // the flavor's, not the tokenizer's 300
                              "\"rms_norm_eps\": 1e-05", "\"rope_theta\": 500000.0", "\"tie_word_embeddings\": false",
                              "\"torch_dtype\": \"float32\"", "\"architectures\": [\"LlamaForCausalLM\"]"})
      EXPECT_NE(cfg.find(field), std::string::npos) << field << "\n" << cfg;

    // Offline conversion of the plain run's save: the same bytes as the online export.
    const std::string offline = (root_ / ("offline" + std::to_string(n))).string();
    auto conv = ctitan::testing::sh(tool() + " convert " + sharded[n] + " " + offline);
    ASSERT_EQ(conv.code, 0) << conv.out;
    EXPECT_EQ(ckpt::read_whole_file(offline + "/model.safetensors"),
              ckpt::read_whole_file(hf[n] + "/model.safetensors"));
  }
  // Import on the other rank count; what the job then holds, written back out, equals the
  // original checkpoint bit for bit.
  for (int n : {1, 2}) {
    const int m = 3 - n;
    const std::string dst = (root_ / ("import" + std::to_string(n) + "to" + std::to_string(m))).string();
    const std::string dump = dst + "/loaded";
    auto r =
        train(m, dst, "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " + hf[n] + " --training.steps 1",
              {{"CTITAN_CHECKPOINT_DUMP_LOADED", dump}});
    ASSERT_TRUE(ctitan::testing::all_ok(r));
    EXPECT_NE(r[0].output.find("checkpoint: loaded HF safetensors from " + hf[n]), std::string::npos) << r[0].output;
    CheckpointReader orig(sharded[n]), got(dump + "/step-2");
    EXPECT_EQ(got.meta().world_size, m);
    ASSERT_EQ(got.meta().entries.size(), orig.meta().entries.size());
    for (const auto& [fqn, e] : orig.meta().entries)
      EXPECT_TRUE(torch::equal(got.read_tensor(fqn), orig.read_tensor(fqn))) << fqn << " " << n << " -> " << m;
  }
  // The logits of the HF folder and of the sharded checkpoint: the same model, bit for bit.
  const std::string la = (root_ / "la.safetensors").string(), lb = (root_ / "lb.safetensors").string();
  ASSERT_EQ(ctitan::testing::sh(tool() + " logits " + sharded[2] + " 1,5,9,200,3 " + la).code, 0);
  ASSERT_EQ(ctitan::testing::sh(tool() + " logits " + hf[2] + " 1,5,9,200,3 " + lb).code, 0);
  EXPECT_TRUE(torch::equal(parse_safetensors_file(la).tensor("logits"), parse_safetensors_file(lb).tensor("logits")));
  EXPECT_EQ(parse_safetensors_file(la).tensors.at("logits").shape,
            (std::vector<int64_t>{5, 2048}));  // debugmodel's vocabulary

  // The HF step folder is model-only: resuming training from it is a clear error.
  auto again = train(1, (root_ / "hf1").string(), "--training.steps 4");
  EXPECT_EQ(again[0].exit_code, 2) << again[0].output;
  EXPECT_NE(again[0].output.find("holds model weights only, as HF safetensors"), std::string::npos) << again[0].output;
  EXPECT_NE(again[0].output.find("checkpoint.initial_load_in_hf = true"), std::string::npos) << again[0].output;

  // A truncated or damaged copy: every rank stops with one line naming the file; no hang.
  const fs::path bad = root_ / "bad";
  fs::copy(hf[1], bad);
  const std::string st = (bad / "model.safetensors").string();
  fs::resize_file(st, fs::file_size(st) - 100);
  auto rb = train(2, (root_ / "bad_run").string(),
                  "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " + bad.string());
  for (const auto& rr : rb) {
    EXPECT_EQ(rr.exit_code, 1) << rr.output;
    EXPECT_NE(rr.output.find("safetensors " + st + ": data_offsets"), std::string::npos) << rr.output;
    EXPECT_NE(rr.output.find("truncated?"), std::string::npos) << rr.output;
  }
  // A config.json of another model: a user error naming the difference.
  {
    std::string cfg = ckpt::read_whole_file((bad / "config.json").string());
    fs::copy_file(hf[1] + "/model.safetensors", st, fs::copy_options::overwrite_existing);
    cfg = std::regex_replace(cfg, std::regex("\"num_hidden_layers\": 6"), "\"num_hidden_layers\": 4");
    std::ofstream(bad / "config.json") << cfg;
    auto rl = train(1, (root_ / "bad_run2").string(),
                    "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " + bad.string());
    EXPECT_EQ(rl[0].exit_code, 2) << rl[0].output;
    EXPECT_NE(
        rl[0].output.find("describes another model than this run's llama3 \"debugmodel\" (num_hidden_layers: 4 vs 6"),
        std::string::npos)
        << rl[0].output;
  }
}

// ---- consolidated .pt files: torch.save's format ----------------------------------------------
// checkpoint_tool writes .pt files as Python's torch.save does (checkpoint/torch_save.h); the
// venv's PyTorch (scripts/install_deps.sh: 2.13.0) loads them with its safe default and with
// mmap=True (scripts/pt_load_check.py), against tensors this test dumps from the checkpoint
// itself. The forms ctitan read before keep converting; damaged files are one line, exit 2.

namespace {

// The venv's python, as scripts/common.sh finds it: $CTITAN_PYTHON, else $CTITAN_VENV/bin/python,
// else <repo>/.venv/bin/python. The PtExport tests fail (not skip) without it.
std::string venv_python() {
  if (const char* p = std::getenv("CTITAN_PYTHON"); p && *p) return p;
  if (const char* v = std::getenv("CTITAN_VENV"); v && *v) return std::string(v) + "/bin/python";
  return ctitan::testing::kSrc + "/.venv/bin/python";
}

std::string tool_bin() { return (fs::path(ctitan::testing::kTrain).parent_path() / "checkpoint_tool").string(); }

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// The Llama debug model's parameters (vocab 300), randomly initialised, in model order.
Named llama_weights(uint64_t seed) {
  auto a = llama::llama3_flavor("debugmodel");
  a.vocab_size = 300;
  a.max_seq_len = 16;
  torch::manual_seed(seed);
  llama::Transformer model(a);
  model->init_weights();
  Named out;
  for (const auto& kv : model->named_parameters()) out.emplace_back(kv.key(), kv.value().detach().clone());
  return out;
}

// A .pt file as ctitan wrote it before torch_save.h: LibTorch's pickle_save of a {fqn: tensor}
// c10::Dict (TorchScript type tags included).
void write_pickle_save_pt(const fs::path& path, const Named& w, torch::ScalarType dtype) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [k, t] : w) dict.insert(k, t.to(dtype).contiguous());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

const char* dtype_text(torch::ScalarType t) {
  return t == torch::kFloat ? "float32" : t == torch::kBFloat16 ? "bfloat16" : t == torch::kHalf ? "float16" : "?";
}

// scripts/pt_load_check.py's reference folder: manifest.txt ("<name> <dtype> <d,d,...>") and
// <i>.bin (the tensor's bytes), in the order given.
void write_reference(const fs::path& dir, const Named& tensors) {
  fs::create_directories(dir);
  std::ofstream manifest(dir / "manifest.txt");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor t = tensors[i].second.contiguous();
    std::string dims;
    for (int64_t d : t.sizes()) dims += (dims.empty() ? "" : ",") + std::to_string(d);
    manifest << tensors[i].first << " " << dtype_text(t.scalar_type()) << " " << dims << "\n";
    std::ofstream(dir / (std::to_string(i) + ".bin"), std::ios::binary)
        .write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
}

// Runs scripts/pt_load_check.py on a .pt file against a reference folder.
ctitan::testing::Cmd pt_load_check(const std::string& pt, const fs::path& ref) {
  return ctitan::testing::sh(venv_python() + " " + ctitan::testing::kSrc + "/scripts/pt_load_check.py " + pt + " " +
                             ref.string());
}

}  // namespace

// For each of float32, bfloat16 and float16: a checkpoint holding that dtype (converted from
// a pre-change .pt), exported as stored and, from the float32 checkpoint, with --dtype; the
// venv's torch.load reads both with weights_only=True (the default) and with mmap=True, and
// every tensor equals the checkpoint's, bitwise, names, order and shapes included.
TEST(PtExport, TorchLoadReadsTheExportWithItsSafeDefaultAndMmapForEachDtype) {
  const std::string py = venv_python();
  ASSERT_TRUE(fs::exists(py)) << py << " is missing: scripts/install_deps.sh makes the venv this test needs";
  const auto dir = temp_dir("pt_export");
  const Named w = llama_weights(11);
  write_pickle_save_pt(dir / "old.pt", w, torch::kFloat);
  for (torch::ScalarType dt : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const std::string name = dtype_text(dt);
    SCOPED_TRACE(name);
    const fs::path ck = dir / ("ck_" + name) / "step-0";
    ASSERT_EQ(checkpoint_tool_main({"convert", (dir / "old.pt").string(), ck.string(), "--dtype", name}), 0);
    CheckpointReader r(ck.string());
    Named ref;
    for (const auto& [k, t] : w) {
      const torch::Tensor c = r.read_tensor(k);
      ASSERT_EQ(c.scalar_type(), dt) << k;
      ASSERT_TRUE(torch::equal(c, t.to(dt))) << k;
      ref.emplace_back(k, c);
    }
    write_reference(dir / ("ref_" + name), ref);

    // As stored, and (from the float32 checkpoint) converted on export.
    const std::string as_stored = (dir / ("stored_" + name + ".pt")).string();
    auto e = ctitan::testing::sh(tool_bin() + " export " + ck.string() + " " + as_stored);
    ASSERT_EQ(e.code, 0) << e.out;
    EXPECT_NE(e.out.find("torch.load reads it with its default weights_only=True, mmap=True too (checked with "
                         "PyTorch 2.13.0+cpu)"),
              std::string::npos)
        << e.out;
    auto c = pt_load_check(as_stored, dir / ("ref_" + name));
    EXPECT_EQ(c.code, 0) << c.out;
    EXPECT_NE(c.out.find(std::to_string(w.size()) + " tensors"), std::string::npos) << c.out;
    std::cout << c.out;

    const std::string cast = (dir / ("cast_" + name + ".pt")).string();
    e = ctitan::testing::sh(tool_bin() + " export " + (dir / "ck_float32" / "step-0").string() + " " + cast +
                            " --dtype " + name);
    ASSERT_EQ(e.code, 0) << e.out;
    c = pt_load_check(cast, dir / ("ref_" + name));
    EXPECT_EQ(c.code, 0) << c.out;
    std::cout << c.out;
  }
  // The check itself fails on a tensor that differs in one bit.
  {
    Named off;
    CheckpointReader r((dir / "ck_bfloat16" / "step-0").string());
    for (const auto& [k, t] : w) off.emplace_back(k, r.read_tensor(k));
    auto& v = off.back().second;
    auto* bits = static_cast<int16_t*>(v.data_ptr());  // contiguous, as read
    bits[7] = static_cast<int16_t>(bits[7] ^ 1);
    write_reference(dir / "ref_off", off);
    const auto c = pt_load_check((dir / "stored_bfloat16.pt").string(), dir / "ref_off");
    EXPECT_EQ(c.code, 1) << c.out;
    EXPECT_NE(c.out.find(off.back().first + ": bytes differ from the reference (1 bytes)"), std::string::npos) << c.out;
  }
  if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(dir);
}

// .pt files in every form ctitan read before this writer: LibTorch's pickle_save (what
// ctitan's exporter wrote, TorchScript type tags included), float32 and bfloat16, and Python's
// torch.save (a plain dict). Each converts; .pt -> HF -> .pt -> HF -> .pt is byte-stable after
// the first conversion, and the first .pt holds the original tensors.
TEST(PtExport, EarlierFormsStillConvertAndRoundTripsAreByteStable) {
  const std::string py = venv_python();
  ASSERT_TRUE(fs::exists(py)) << py << " is missing: scripts/install_deps.sh makes the venv this test needs";
  const auto dir = temp_dir("pt_forms");
  const Named w = llama_weights(12);
  for (torch::ScalarType dt : {torch::kFloat, torch::kBFloat16}) {
    const std::string name = dtype_text(dt);
    SCOPED_TRACE(name);
    const fs::path d = dir / name;
    fs::create_directories(d / "a");
    fs::create_directories(d / "b");
    write_pickle_save_pt(d / "old.pt", w, dt);
    EXPECT_NE(ckpt::read_whole_file((d / "old.pt").string()).find("restore_type_tag"), std::string::npos)
        << "the pre-change form carries TorchScript type tags";
    ASSERT_EQ(checkpoint_tool_main({"convert", (d / "old.pt").string(), (d / "hf1").string()}), 0);
    ASSERT_EQ(checkpoint_tool_main({"convert", (d / "hf1").string(), (d / "a" / "model.pt").string()}), 0);
    ASSERT_EQ(checkpoint_tool_main({"convert", (d / "a" / "model.pt").string(), (d / "hf2").string()}), 0);
    ASSERT_EQ(checkpoint_tool_main({"convert", (d / "hf2").string(), (d / "b" / "model.pt").string()}), 0);
    const std::string a = ckpt::read_whole_file((d / "a" / "model.pt").string());
    EXPECT_EQ(a, ckpt::read_whole_file((d / "b" / "model.pt").string()));
    EXPECT_EQ(ckpt::read_whole_file((d / "hf1" / "model.safetensors").string()),
              ckpt::read_whole_file((d / "hf2" / "model.safetensors").string()));
    EXPECT_EQ(a.find("restore_type_tag"), std::string::npos);
    Named ref;
    for (const auto& [k, t] : w) ref.emplace_back(k, t.to(dt));
    write_reference(d / "ref", ref);
    const auto c = pt_load_check((d / "a" / "model.pt").string(), d / "ref");
    EXPECT_EQ(c.code, 0) << c.out;

    // Python's torch.save, a plain dict: converts to a step folder holding the same tensors.
    const std::string pysave = (d / "py.pt").string();
    const auto s = ctitan::testing::sh(py +
                                       " -c \"import sys, torch; sd = torch.load(sys.argv[1]); "
                                       "torch.save(dict(sd), sys.argv[2])\" " +
                                       (d / "a" / "model.pt").string() + " " + pysave);
    ASSERT_EQ(s.code, 0) << s.out;
    ASSERT_EQ(checkpoint_tool_main({"convert", pysave, (d / "ck" / "step-0").string()}), 0);
    CheckpointReader r((d / "ck" / "step-0").string());
    ASSERT_EQ(r.meta().entries.size(), w.size());
    for (const auto& [k, t] : ref) EXPECT_TRUE(torch::equal(r.read_tensor(k), t)) << k;
  }
  // torch.save of an OrderedDict (a module's state_dict()) is not read (LibTorch's unpickler
  // takes it for None): one line saying so, exit 2.
  const std::string od = (dir / "od.pt").string();
  const auto s = ctitan::testing::sh(py +
                                     " -c \"import sys, collections, torch; sd = torch.load(sys.argv[1]); "
                                     "torch.save(collections.OrderedDict(sd), sys.argv[2])\" " +
                                     (dir / "float32" / "a" / "model.pt").string() + " " + od);
  ASSERT_EQ(s.code, 0) << s.out;
  const auto r = ctitan::testing::sh(tool_bin() + " convert " + od + " " + (dir / "od_hf").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out, "checkpoint tool: " + od +
                       " is not a readable .pt file: it holds a collections.OrderedDict (as "
                       "torch.save(model.state_dict()) writes), which is not read here; save a plain dict: "
                       "torch.save(dict(state_dict), path)\n");
  if (!std::getenv("CTITAN_KEEP_TEST_OUTPUT")) fs::remove_all(dir);
}

// A damaged .pt file, new form or old: the real binary prints one line naming the file and
// exits 2, and writes nothing.
TEST(PtExport, DamagedFilesAreOneErrorLineAndExitTwo) {
  const auto dir = temp_dir("pt_damaged");
  const Named w = llama_weights(13);
  write_pickle_save_pt(dir / "old.pt", w, torch::kFloat);
  ASSERT_EQ(checkpoint_tool_main({"convert", (dir / "old.pt").string(), (dir / "good.pt").string()}), 0);
  const std::string good = ckpt::read_whole_file((dir / "good.pt").string());
  const std::string old = ckpt::read_whole_file((dir / "old.pt").string());
  // A bare output name (no folder part): written as any other, its archive folder "bare/".
  {
    const auto r = ctitan::testing::sh("cd " + dir.string() + " && " + tool_bin() + " convert old.pt bare.pt");
    ASSERT_EQ(r.code, 0) << r.out;
    std::string bare = ckpt::read_whole_file((dir / "bare.pt").string());
    for (size_t i = bare.find("bare/"); i != std::string::npos; i = bare.find("bare/", i + 5))
      bare.replace(i, 5, "good/");
    EXPECT_EQ(bare, good);
  }
  auto replace_first = [](std::string s, const std::string& from, const std::string& to, size_t from_pos = 0) {
    const size_t i = s.find(from, from_pos);
    EXPECT_NE(i, std::string::npos) << from;
    if (i != std::string::npos) s.replace(i, from.size(), to);
    return s;
  };
  const size_t first_central = good.find(std::string("PK\x01\x02", 4));
  ASSERT_NE(first_central, std::string::npos);
  std::string flipped = good;
  const size_t data0 = good.find("good/data/0");
  ASSERT_NE(data0, std::string::npos);
  flipped[(data0 / 64 + 2) * 64 + 5] ^= 0x10;  // inside data/0's bytes (its header is under 128 bytes)
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"truncated_half", good.substr(0, good.size() / 2)},
      {"truncated_end", good.substr(0, good.size() - 10)},
      {"flipped_byte", flipped},
      // The central directory names an entry the local header does not.
      {"renamed_entry", replace_first(good, "good/data.pkl", "good/data.pkx", first_central)},
      {"bad_local_header", replace_first(good, std::string("PK\x03\x04", 4), "PK\x03\x05", 100)},
      {"old_truncated", old.substr(0, old.size() * 2 / 3)},
      {"empty", ""},
      {"not_a_zip", "hello, this is not a .pt file\n"},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    // The archive folder inside the file stays "good" (or "old"): what torch.save would name it.
    const fs::path bad = dir / (name + ".pt");
    std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    const fs::path out = dir / (name + "_hf");
    const auto r = ctitan::testing::sh(tool_bin() + " convert " + bad.string() + " " + out.string());
    EXPECT_EQ(r.code, 2) << r.out;
    ASSERT_FALSE(r.out.empty());
    EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << "one line:\n" << r.out;
    EXPECT_EQ(r.out.rfind("checkpoint tool: " + bad.string(), 0), 0u) << r.out;
    EXPECT_FALSE(fs::exists(out));
    std::cout << "  " << name << ": " << r.out;
  }
  fs::remove_all(dir);
}

// ---- sampling and `generate` ---------------------------------------------------------------

// sample_token against the definitions in generate.h, on a distribution whose every allowed
// set is known by hand: p = (0.05, 0.5, 0.15, 0.3).
TEST(Sampling, GreedyTemperatureTopKTopPAndSeeds) {
  const std::vector<double> p = {0.05, 0.5, 0.15, 0.3};
  const auto logits = torch::log(torch::tensor(p, torch::kDouble)).to(torch::kFloat) + 3.0;  // any shift
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_EQ(sample_token(logits, {}, g), 1);  // greedy: argmax
  // Draws n tokens; returns the frequency of each.
  auto freq = [&](SamplingOptions o, uint64_t seed, int n) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int> count(p.size(), 0);
    for (int i = 0; i < n; ++i) ++count.at(static_cast<size_t>(sample_token(logits, o, gen)));
    std::vector<double> f;
    for (int c : count) f.push_back(static_cast<double>(c) / n);
    return f;
  };
  const int N = 4000;
  // Within 4.5 standard deviations of the expected frequency q (q = 0: never drawn, q = 1:
  // always).
  auto expect_freq = [&](const std::vector<double>& f, const std::vector<double>& q, int n, const std::string& what) {
    for (size_t i = 0; i < q.size(); ++i) {
      if (q[i] == 0 || q[i] == 1) {
        EXPECT_EQ(f[i], q[i]) << what << ": token " << i;
      } else {
        EXPECT_NEAR(f[i], q[i], 4.5 * std::sqrt(q[i] * (1 - q[i]) / n)) << what << ": token " << i;
      }
    }
  };
  expect_freq(freq({1.0, 0, 1.0}, 2, N), p, N, "temperature 1");
  // Temperature 0.5 squares the probabilities (renormalised).
  {
    std::vector<double> q;
    double z = 0;
    for (double x : p) z += x * x;
    for (double x : p) q.push_back(x * x / z);
    expect_freq(freq({0.5, 0, 1.0}, 3, N), q, N, "temperature 0.5");
  }
  // top-k 2 keeps tokens 1 and 3; top-p 0.7 keeps them too (0.5 < 0.7, then 0.5 + 0.3 >= 0.7);
  // top-p 0.85 adds token 2 (0.8 < 0.85); top-k 1 and top-p 0.4 keep the argmax alone.
  expect_freq(freq({1.0, 2, 1.0}, 4, N), {0, 0.625, 0, 0.375}, N, "top-k 2");
  expect_freq(freq({1.0, 0, 0.7}, 5, N), {0, 0.625, 0, 0.375}, N, "top-p 0.7");
  expect_freq(freq({1.0, 0, 0.85}, 6, N), {0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95}, N, "top-p 0.85");
  expect_freq(freq({1.0, 1, 1.0}, 7, 200), {0, 1, 0, 0}, 200, "top-k 1");
  expect_freq(freq({1.0, 0, 0.4}, 8, 200), {0, 1, 0, 0}, 200, "top-p 0.4");
  // The seed decides the draws: the same seed the same sequence, another seed another.
  auto draws = [&](uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> d;
    for (int i = 0; i < 64; ++i) d.push_back(sample_token(logits, {1.0, 0, 1.0}, gen));
    return d;
  };
  EXPECT_EQ(draws(9), draws(9));
  EXPECT_NE(draws(9), draws(10));
}

namespace {

std::string generate_bin() { return (fs::path(ctitan::testing::kTrain).parent_path() / "generate").string(); }

std::vector<int64_t> ids_in(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string t; ss >> t;) out.push_back(std::stoll(t));
  return out;
}

}  // namespace

// The real `generate` binary on a ctitan step folder (converted from a .pt) and a DCP folder: greedy tokens equal
// the argmax of the full forward re-run on the growing sequence (no cache), sampling is
// reproducible by seed, and bad input is one line with exit 2.
TEST(Generate, GreedyEqualsFullForwardArgmaxAndBadInputExitsTwo) {
  const auto dir = temp_dir("generate");
  const Named w = llama_weights(21);
  write_pickle_save_pt(dir / "w.pt", w, torch::kFloat);
  const std::string step = (dir / "ckpt" / "step-3").string();
  ASSERT_EQ(checkpoint_tool_main({"convert", (dir / "w.pt").string(), step}), 0);
  const std::vector<int64_t> prompt = {5, 17, 250, 3, 99};
  const int64_t n_new = 12;
  // Reference: the model in float32, argmax of forward() on prompt + tokens so far.
  auto a = llama::llama3_flavor("debugmodel");
  a.vocab_size = 300;
  a.max_seq_len = 64;
  llama::Transformer model(a);
  {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> byname(w.begin(), w.end());
    for (auto& kv : model->named_parameters()) kv.value().copy_(byname.at(kv.key()));
  }
  model->eval();
  std::vector<int64_t> seq = prompt, want;
  for (int64_t i = 0; i < n_new; ++i) {
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(torch::tensor(seq, torch::kLong).view({1, -1}));
    want.push_back(logits[0][-1].argmax().item<int64_t>());
    seq.push_back(want.back());
  }
  std::string ids;
  for (int64_t t : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  // The same weights as a torch.distributed.checkpoint folder (checkpoint.format = "dcp").
  {
    std::vector<ShardedParam> params;
    for (const auto& [fqn, t] : w) params.push_back({fqn, t, t.sizes().vec(), 0, t.size(0)});
    ModelState ms(params, true);
    CheckpointOptions o;
    o.enable = true;
    o.format = "dcp";
    o.folder = (dir / "dcp").string();
    CheckpointManager mgr(o, CheckpointComm::single_process());
    mgr.add("model", &ms);
    mgr.save_to(o.folder, 5, /*model_only=*/true);
  }
  ASSERT_TRUE(fs::exists(dir / "dcp" / "step-5" / ".metadata"));
  // The checkpoint folder (newest complete step), the step folder itself and the DCP folder;
  // one thread (a token's matmuls are too small to share, see docs/checkpoints.md).
  const std::string err = (dir / "stderr.txt").string();
  for (const std::string& src : {(dir / "ckpt").string(), step, (dir / "dcp" / "step-5").string()}) {
    const auto r = ctitan::testing::sh("(" + generate_bin() + " " + src + " --threads 1 --prompt-ids " + ids +
                                       " --max-new-tokens " + std::to_string(n_new) + " 2>" + err + ")");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(ids_in(r.out), want);
    EXPECT_NE(ckpt::read_whole_file(err).find("12 new tokens in"), std::string::npos) << ckpt::read_whole_file(err);
    EXPECT_NE(ckpt::read_whole_file(err).find("tokens/s"), std::string::npos);
  }
  // Sampling: a seed gives the same tokens twice; the tokens are in the vocabulary.
  const std::string sample = "(" + generate_bin() + " " + step + " --threads 1 --prompt-ids " + ids +
                             " --max-new-tokens 16 --temperature 1.5 --top-k 50 --top-p 0.95 2>/dev/null --seed ";
  const auto s1 = ctitan::testing::sh(sample + "7)"), s2 = ctitan::testing::sh(sample + "7)");
  ASSERT_EQ(s1.code, 0) << s1.out;
  EXPECT_EQ(s1.out, s2.out);
  ASSERT_EQ(ids_in(s1.out).size(), 16u);
  for (int64_t t : ids_in(s1.out)) EXPECT_TRUE(t >= 0 && t < 300) << t;
  const auto sampled = ids_in(s1.out);
  EXPECT_NE(std::vector<int64_t>(sampled.begin(), sampled.begin() + n_new), want)
      << "temperature 1.5 over 300 tokens: not the greedy path";
  // Bad input: one line, exit 2.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {(dir / "missing").string() + " --prompt-ids 1,2", "does not exist"},
      {step + " --prompt-ids 1,2 --frobnicate 3", "unknown option --frobnicate"},
      {step + " --prompt-ids 1,2,3,4,5,6 --max-seq-len 6", "the prompt is 6 tokens, the sequence limit 6"},
      {step + " --prompt-ids 1,2 --top-p 0", "--top-p must be in (0, 1]"},
      {step + " --prompt-ids 1,300", "outside the vocabulary"},
      {step + " --prompt hello", "no tokenizer for the prompt"},
  };
  for (const auto& [args, phrase] : bad) {
    const auto r = ctitan::testing::sh(generate_bin() + " " + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << "one line:\n" << r.out;
    EXPECT_NE(r.out.find(phrase), std::string::npos) << r.out;
  }
  fs::remove_all(dir);
}

// Parity with Hugging Face's own code (scripts/hf_parity.py roundtrip, the venv's transformers
// on PyTorch 2.13): models save_pretrained() by transformers (sharded bf16, with a tokenizer.json)
// load in ctitan with logits within 1e-4 in float32 on a batch, 32 greedy tokens from `generate`
// equal to transformers' generate(), and ctitan's export read back by from_pretrained() with
// the same weights and logits; Llama 3 (GQA, llama3 RoPE scaling), Mixtral and Llama 2 (a
// LlamaForCausalLM whose shapes only llama2's debugmodel has).
TEST(HFParity, TransformersModelsLoadGenerateAndExportBackForLlamaAndMixtral) {
  const std::string py = venv_python();
  ASSERT_TRUE(fs::exists(py)) << py << " is missing: scripts/install_deps.sh makes the venv this test needs";
  const std::string data =
      std::getenv("CTITAN_DATA_DIR") ? std::getenv("CTITAN_DATA_DIR") : ctitan::testing::kSrc + "/data";
  // The tokenizers test's reference folder (made once per build, shared under a lock).
  const std::string toks = std::getenv("CTITAN_HF_TOKENIZERS_DIR") ? std::getenv("CTITAN_HF_TOKENIZERS_DIR")
                                                                   : (fs::current_path() / "hf_tokenizers").string();
  const auto made = ctitan::testing::sh(py + " " + ctitan::testing::kSrc + "/scripts/make_hf_tokenizers.py --out " +
                                        toks + " --data " + data);
  ASSERT_EQ(made.code, 0) << made.out;
  const auto dir = temp_dir("parity");
  const auto r = ctitan::testing::sh(py + " " + ctitan::testing::kSrc + "/scripts/hf_parity.py roundtrip --bin " +
                                     fs::path(ctitan::testing::kTrain).parent_path().string() + " --tokenizer " + toks +
                                     "/llama3 --out " + dir.string());
  std::cout << r.out;
  EXPECT_EQ(r.code, 0) << r.out;
  size_t passes = 0;
  for (size_t i = r.out.find("PASS"); i != std::string::npos; i = r.out.find("PASS", i + 1)) ++passes;
  EXPECT_EQ(passes, 9u) << "3 checks x 3 models";
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos);
  fs::remove_all(dir);
}
