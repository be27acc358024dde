// Tests of datasets/hf_tokenizer: ctitan's Hugging Face byte-level BPE against the
// `tokenizers` library itself.
//
// scripts/make_hf_tokenizers.py (run here through the venv's python; it skips the work when
// its output is current) trains tokenizers with Hugging Face `tokenizers` — Llama 3 style,
// GPT-2 style (tokenizer.json and vocab.json + merges.txt), NFC — and writes the ids
// `tokenizers` gives (with BOS/EOS as torchtitan's HuggingFaceTokenizer adds them) for every
// document of Moby-Dick and of the State of the Union addresses, as written and with special
// and added tokens inserted, and for documents sweeping Unicode. Every document must give the
// same ids here and decode back to the same text. A missing venv or corpus is a failure, not
// a skip: without them nothing here would be checked.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "config/errors.h"
#include "datasets/hf_tokenizer.h"
#include "util/json.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"

namespace fs = std::filesystem;
using ctitan::HfTokenizer;
using ctitan::Tokenizer;
using ctitan::UserError;
namespace json = ctitan::json;

namespace {

const std::string kSrc = CTITAN_SOURCE_DIR;

std::string env_or(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : dflt;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs a shell command; returns its exit code, its output in *out.
int run(const std::string& cmd, std::string* out) {
  out->clear();
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The reference tokenizers and ids, made once per test run.
class Reference : public ::testing::Environment {
 public:
  void SetUp() override {
    data_ = env_or("CTITAN_DATA_DIR", kSrc + "/data");
    dir_ = env_or("CTITAN_HF_TOKENIZERS_DIR", (fs::current_path() / "hf_tokenizers").string());
    const std::string python = env_or("CTITAN_VENV", kSrc + "/.venv") + "/bin/python";
    if (!fs::exists(python)) {
      error_ = python + " not found: run scripts/install_deps.sh (the venv with tokenizers)";
      return;
    }
    if (!fs::exists(data_ + "/moby_dick/moby_dick.txt") || !fs::exists(data_ + "/sotu")) {
      error_ = "corpora missing under " + data_ + ": run scripts/fetch_data.sh all";
      return;
    }
    std::string out;
    const std::string cmd = python + " " + kSrc + "/scripts/make_hf_tokenizers.py --out " + dir_ + " --data " + data_;
    if (run(cmd, &out) != 0) error_ = "scripts/make_hf_tokenizers.py failed:\n" + out;
  }
  static std::string error_, dir_, data_;
};
std::string Reference::error_, Reference::dir_, Reference::data_;
::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new Reference);

#define REQUIRE_REFERENCE() ASSERT_TRUE(Reference::error_.empty()) << Reference::error_

template <typename Fn>
std::string user_error_text(Fn&& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no UserError thrown>";
}

json::Value parse_line(const std::string& line) {
  json::Value v;
  std::string err;
  if (!json::parse(line, &v, &err)) throw std::runtime_error("bad reference line: " + err);
  return v;
}

std::vector<int32_t> ids_of(const json::Value& v) {
  std::vector<int32_t> ids;
  ids.reserve(v.items.size());
  for (const auto& x : v.items) {
    int64_t i = 0;
    x.as_int64(&i);
    ids.push_back(static_cast<int32_t>(i));
  }
  return ids;
}

std::string show(const std::vector<int32_t>& ids, size_t from, size_t n) {
  std::string s;
  for (size_t i = from; i < ids.size() && i < from + n; ++i) s += std::to_string(ids[i]) + " ";
  return s;
}

struct Tally {
  int64_t docs = 0, tokens = 0, id_mismatch = 0, decode_mismatch = 0, exact_round_trips = 0;
};

// "<CRC-32 hex>:<bytes>" of s, as make_hf_tokenizers.py writes it (zlib's CRC-32).
std::string fingerprint(const std::string& s) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : s) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%08x:", crc ^ 0xFFFFFFFFu);
  return buf + std::to_string(s.size());
}

// Every document of docs.jsonl through the tokenizer in <dir>/<name>, against
// <dir>/<name>/reference.jsonl. Per corpus tallies in *tally.
void compare_all(const std::string& name, std::map<std::string, Tally>* tally) {
  const std::string folder = Reference::dir_ + "/" + name;
  const std::string path = ctitan::resolve_tokenizer_path("", folder);
  std::unique_ptr<Tokenizer> loaded = Tokenizer::load(path);
  const auto* tok = dynamic_cast<const HfTokenizer*>(loaded.get());
  ASSERT_NE(tok, nullptr) << path << " did not load as a Hugging Face tokenizer";
  EXPECT_EQ(tok->kind(), "huggingface");

  std::ifstream docs(Reference::dir_ + "/docs.jsonl"), ref(folder + "/reference.jsonl");
  ASSERT_TRUE(docs && ref);
  std::string dline, rline;
  ASSERT_TRUE(std::getline(ref, rline));
  const json::Value header = parse_line(rline);
  int64_t v = 0;
  const json::Value* bos = header.find("bos_id");
  const json::Value* eos = header.find("eos_id");
  EXPECT_EQ(tok->bos_id(), bos->type == json::Value::Type::Null ? -1 : (bos->as_int64(&v), v)) << name;
  EXPECT_EQ(tok->eos_id(), eos->type == json::Value::Type::Null ? -1 : (eos->as_int64(&v), v)) << name;
  header.find("vocab_size")->as_int64(&v);
  EXPECT_EQ(tok->vocab_size(), v) << name << ": tokenizers' get_vocab_size()";

  int shown = 0;
  while (std::getline(docs, dline)) {
    ASSERT_TRUE(std::getline(ref, rline)) << name << ": reference.jsonl is shorter than docs.jsonl";
    const json::Value d = parse_line(dline), r = parse_line(rline);
    const std::string& text = d.find("text")->text;
    const std::string corpus = d.find("corpus")->text + "/" + d.find("variant")->text;
    const std::vector<int32_t> want = ids_of(*r.find("ids"));
    const std::vector<int32_t> got = tok->encode(text, true, true);
    Tally& t = (*tally)[corpus];
    t.docs += 1;
    t.tokens += static_cast<int64_t>(want.size());
    if (got != want) {
      t.id_mismatch += 1;
      if (shown++ < 5) {
        size_t k = 0;
        while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
        ADD_FAILURE() << name << " " << corpus << " doc " << d.find("doc")->text << ": ids differ at " << k << " of "
                      << want.size() << ": ctitan [" << show(got, k, 8) << "] tokenizers [" << show(want, k, 8)
                      << "]; text from there on: "
                      << json::quote(tok->decode(std::vector<int32_t>(want.begin() + static_cast<std::ptrdiff_t>(k),
                                                                      want.begin() + static_cast<std::ptrdiff_t>(
                                                                                         std::min(want.size(), k + 8))),
                                                 false));
      }
      continue;
    }
    // Decoding: the same text as tokenizers' decode, with and without skipping special tokens
    // (compared by CRC-32 and length); where that gives the document back, the exact text.
    const std::string dec = tok->decode(got, false), dec_skip = tok->decode(got);
    bool same =
        fingerprint(dec) == r.find("decoded_crc")->text && fingerprint(dec_skip) == r.find("decoded_skip_crc")->text;
    if (r.find("skip_is_text")->boolean) {
      same = same && dec_skip == text;
      t.exact_round_trips += 1;
    }
    if (!same) {
      t.decode_mismatch += 1;
      if (shown++ < 5) {
        ADD_FAILURE() << name << " " << corpus << " doc " << d.find("doc")->text
                      << ": decode differs: " << json::quote(dec.substr(0, 200))
                      << " (skipping special tokens: " << json::quote(dec_skip.substr(0, 200)) << ")";
      }
    }
  }
  EXPECT_FALSE(std::getline(ref, rline)) << name << ": reference.jsonl is longer than docs.jsonl";
  EXPECT_GT(tok->cache_size(), 0u);
}

class SameIds : public ::testing::TestWithParam<const char*> {};

TEST_P(SameIds, AsTokenizersOnEveryDocumentAndDecodesBack) {
  REQUIRE_REFERENCE();
  std::map<std::string, Tally> tally;
  compare_all(GetParam(), &tally);
  for (const auto& [corpus, t] : tally) {
    std::printf(
        "[ %-10s ] %-18s %5lld docs %9lld tokens: %lld with other ids, %lld decode differently, "
        "%lld decode to the exact text\n",
        GetParam(), corpus.c_str(), static_cast<long long>(t.docs), static_cast<long long>(t.tokens),
        static_cast<long long>(t.id_mismatch), static_cast<long long>(t.decode_mismatch),
        static_cast<long long>(t.exact_round_trips));
    EXPECT_EQ(t.id_mismatch, 0) << corpus;
    EXPECT_EQ(t.decode_mismatch, 0) << corpus;
    // Byte-level BPE loses nothing: without a normalizer every document as written decodes
    // back to itself.
    if (std::string(GetParam()) != "nfc" && corpus.find("/plain") != std::string::npos) {
      EXPECT_EQ(t.exact_round_trips, t.docs) << corpus;
    }
  }
  // Moby-Dick's paragraphs, SOTU's addresses, each as written and with inserted tokens.
  ASSERT_EQ(tally.count("moby_dick/plain") + tally.count("moby_dick/specials") + tally.count("sotu/plain") +
                tally.count("sotu/specials") + tally.count("unicode/plain"),
            5u);
  EXPECT_EQ(tally["sotu/plain"].docs, 233);
  EXPECT_EQ(tally["sotu/specials"].docs, 59);  // every fourth address (make_hf_tokenizers.py)
  EXPECT_GT(tally["moby_dick/plain"].docs, 2000);
}

INSTANTIATE_TEST_SUITE_P(HfTokenizer, SameIds, ::testing::Values("llama3", "gpt2", "gpt2_files", "nfc"));

// The documents the reference encoded are the ones ctitan's reader gives (what training sees).
TEST(HfTokenizer, ReferenceDocumentsAreCtitansDocuments) {
  REQUIRE_REFERENCE();
  std::map<std::string, std::vector<std::string>> ref;
  std::ifstream docs(Reference::dir_ + "/docs.jsonl");
  for (std::string line; std::getline(docs, line);) {
    const json::Value d = parse_line(line);
    if (d.find("variant")->text == "plain") ref[d.find("corpus")->text].push_back(d.find("text")->text);
  }
  for (const auto& [corpus, path] : std::map<std::string, std::string>{
           {"moby_dick", Reference::data_ + "/moby_dick/moby_dick.txt"}, {"sotu", Reference::data_ + "/sotu"}}) {
    ctitan::DocumentReader reader(path);
    ctitan::Document doc;
    size_t i = 0;
    while (reader.next(&doc)) {
      ASSERT_LT(i, ref[corpus].size()) << corpus;
      ASSERT_EQ(doc.text, ref[corpus][i]) << corpus << " document " << i;
      ++i;
    }
    EXPECT_EQ(i, ref[corpus].size()) << corpus;
  }
}

// BOS/EOS as torchtitan derives them: Llama 3's template already puts <|begin_of_text|> first
// (encode adds only EOS); GPT-2's config names <|endoftext|> as both, so it is BOS and there is
// no EOS; the NFC tokenizer's template frames with <s> … </s> (encode adds nothing).
TEST(HfTokenizer, BosAndEosAsTorchtitanDerivesThem) {
  REQUIRE_REFERENCE();
  auto load = [](const std::string& name) {
    return HfTokenizer::from_tokenizer_json(Reference::dir_ + "/" + name + "/tokenizer.json");
  };
  const auto llama = load("llama3");
  const int32_t begin = llama->token_to_id("<|begin_of_text|>"), end = llama->token_to_id("<|end_of_text|>");
  EXPECT_EQ(llama->bos_id(), begin);
  EXPECT_EQ(llama->eos_id(), end);
  EXPECT_EQ(begin, 8192);  // special tokens come after the 8192 trained entries, as in Llama 3
  const std::string text = "Call me Ishmael.";
  const auto raw = llama->encode_ids(text, false);
  EXPECT_EQ(llama->encode_ids(text), [&] {
    auto v = raw;
    v.insert(v.begin(), begin);
    return v;
  }());
  auto framed = llama->encode(text, true, true);
  ASSERT_EQ(framed.size(), raw.size() + 2);
  EXPECT_EQ(framed.front(), begin);
  EXPECT_EQ(framed.back(), end);
  EXPECT_EQ(llama->encode(text, false, false).front(), begin);  // the template's, not encode's
  EXPECT_EQ(llama->decode(framed), text);                       // specials skipped
  EXPECT_EQ(llama->decode(framed, false), "<|begin_of_text|>" + text + "<|end_of_text|>");
  EXPECT_EQ(llama->encode_ids("<|eot_id|>", false), std::vector<int32_t>{llama->token_to_id("<|eot_id|>")});

  const auto gpt2 = load("gpt2");
  EXPECT_EQ(gpt2->bos_id(), gpt2->token_to_id("<|endoftext|>"));
  EXPECT_EQ(gpt2->eos_id(), -1);
  EXPECT_EQ(gpt2->encode(text, true, true).size(), gpt2->encode_ids(text).size() + 1);

  const auto nfc = load("nfc");
  EXPECT_TRUE(nfc->default_add_bos());
  EXPECT_TRUE(nfc->default_add_eos());
  const auto framed_nfc = nfc->encode(text, true, true);
  EXPECT_EQ(framed_nfc, nfc->encode_ids(text));
  EXPECT_EQ(framed_nfc.front(), nfc->bos_id());
  EXPECT_EQ(framed_nfc.back(), nfc->eos_id());
  // The normalized added token "café" is matched after NFC: the decomposed form is one id.
  EXPECT_EQ(nfc->encode_ids("cafe\xCC\x81", false), std::vector<int32_t>{nfc->token_to_id("café")});
}

// encode() is thread-safe: four threads sharing one tokenizer (and its pre-token cache, empty
// at the start) give the ids one thread gives.
TEST(HfTokenizer, ConcurrentEncodesGiveTheSameIds) {
  REQUIRE_REFERENCE();
  std::vector<std::string> texts;
  std::ifstream docs(Reference::dir_ + "/docs.jsonl");
  for (std::string line; std::getline(docs, line) && texts.size() < 400;)
    texts.push_back(parse_line(line).find("text")->text);
  const auto reference = HfTokenizer::from_tokenizer_json(Reference::dir_ + "/llama3/tokenizer.json");
  std::vector<std::vector<int32_t>> want;
  for (const auto& t : texts) want.push_back(reference->encode(t, true, true));
  const auto shared = HfTokenizer::from_tokenizer_json(Reference::dir_ + "/llama3/tokenizer.json");
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0; i < texts.size(); ++i) {
        const size_t j = (i * 7 + static_cast<size_t>(k) * 101) % texts.size();  // each thread its own order
        if (shared->encode(texts[j], true, true) != want[j]) ++wrong[static_cast<size_t>(k)];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(wrong[static_cast<size_t>(k)], 0) << "thread " << k;
  EXPECT_EQ(shared->cache_size(), reference->cache_size());
}

TEST(HfTokenizer, EveryUnsupportedFeatureIsOneClearError) {
  REQUIRE_REFERENCE();
  const json::Value manifest = parse_line(read_file(Reference::dir_ + "/unsupported/manifest.json"));
  ASSERT_GE(manifest.items.size(), 15u);
  for (const auto& c : manifest.items) {
    const std::string dir = Reference::dir_ + "/" + c.find("dir")->text;
    const std::string expect = c.find("expect")->text;
    const std::string err = user_error_text([&] { Tokenizer::load(dir + "/tokenizer.json"); });
    EXPECT_NE(err.find(dir + "/tokenizer.json"), std::string::npos) << err;
    EXPECT_NE(err.find(expect), std::string::npos) << "expected \"" << expect << "\" in: " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
}

TEST(HfTokenizer, BrokenFilesAreUserErrors) {
  REQUIRE_REFERENCE();
  const fs::path dir = fs::temp_directory_path() / ("ctitan_hf_broken_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string tj = (dir / "tokenizer.json").string();
  // No tokenizer_config.json beside it: torchtitan refuses such a folder too.
  fs::copy_file(Reference::dir_ + "/gpt2/tokenizer.json", tj);
  std::string err = user_error_text([&] { Tokenizer::load(tj); });
  EXPECT_NE(err.find((dir / "tokenizer_config.json").string()), std::string::npos) << err;
  // Not JSON.
  std::ofstream(tj) << "{\"model\": ";
  fs::copy_file(Reference::dir_ + "/gpt2/tokenizer_config.json", dir / "tokenizer_config.json");
  err = user_error_text([&] { Tokenizer::load(tj); });
  EXPECT_EQ(err.rfind("tokenizer: cannot load " + tj + ": not JSON", 0), 0u) << err;
  // A merge naming a token the vocabulary lacks.
  std::ofstream(tj) << R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]},
                          "pre_tokenizer": {"type": "ByteLevel"}})";
  err = user_error_text([&] { Tokenizer::load(tj); });
  EXPECT_NE(err.find("merge \"a b\" (rank 0) uses a token that is not in the vocabulary"), std::string::npos) << err;
  // Invalid UTF-8 to encode.
  const auto tok = Tokenizer::load(Reference::dir_ + "/gpt2/tokenizer.json");
  EXPECT_THROW(tok->encode("ok \xC3\x28 no", true, true), ctitan::RuntimeFailure);
  EXPECT_THROW(tok->decode({0, static_cast<int32_t>(tok->vocab_size())}), std::out_of_range);
  fs::remove_all(dir);
}

// model.hf_assets_path as torchtitan v0.2.2 reads it: tokenizer.json, else vocab.json +
// merges.txt; ctitan keeps tokenizer.model (sentencepiece) last.
TEST(HfTokenizer, SelectionFromHfAssetsPath) {
  REQUIRE_REFERENCE();
  using ctitan::resolve_tokenizer_path;
  const fs::path dir = fs::temp_directory_path() / ("ctitan_hf_select_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* f : {"vocab.json", "merges.txt", "tokenizer_config.json"})
    fs::copy_file(Reference::dir_ + "/gpt2_files/" + f, dir / f);
  std::ofstream(dir / "tokenizer.model") << "x";
  EXPECT_EQ(resolve_tokenizer_path("", dir.string()), (dir / "vocab.json").string());
  EXPECT_EQ(Tokenizer::load(resolve_tokenizer_path("", dir.string()))->kind(), "huggingface");
  fs::copy_file(Reference::dir_ + "/gpt2/tokenizer.json", dir / "tokenizer.json");
  EXPECT_EQ(resolve_tokenizer_path("", dir.string()), (dir / "tokenizer.json").string());
  fs::remove(dir / "tokenizer.json");
  fs::remove(dir / "merges.txt");
  const std::string err = user_error_text([&] { resolve_tokenizer_path("", dir.string()); });
  EXPECT_NE(err.find("holds vocab.json but no merges.txt"), std::string::npos) << err;
  fs::remove(dir / "vocab.json");
  EXPECT_EQ(resolve_tokenizer_path("", dir.string()), (dir / "tokenizer.model").string());
  fs::remove_all(dir);
}

// The model's vocabulary comes from the flavor (debugmodel: 2048); a tokenizer with more ids
// than that is refused before anything runs (exit 2, one line naming both numbers).
TEST(HfTokenizer, TokenizerLargerThanTheModelVocabularyIsAConfigError) {
  REQUIRE_REFERENCE();
  std::string out;
  const std::string base =
      std::string(CTITAN_TRAIN_BIN) + " --job.config_file " + kSrc +
      "/train_configs/debug_model.toml --training.dataset_path " + Reference::data_ +
      "/moby_dick/moby_dick.txt --job.validate_only --model.tokenizer_path= --model.hf_assets_path ";
  const int rc = run(base + Reference::dir_ + "/llama3", &out);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("8200 ids"), std::string::npos) << out;
  EXPECT_NE(out.find("vocab_size 2048"), std::string::npos) << out;
  // The GPT-2 style one (2003 ids) fits the debug model.
  EXPECT_EQ(run(base + Reference::dir_ + "/gpt2", &out), 0) << out;
  EXPECT_NE(out.find("config ok"), std::string::npos) << out;
}

}  // namespace
