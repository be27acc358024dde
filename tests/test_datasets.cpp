// Tests of datasets/: the sentencepiece shim next to LibTorch, text sources (paragraphs,
// JSONL), packing, per-rank split, re-looping and exact resume.
//
// Everything they need is made here: a corpus of a few KB written below and a tiny BPE
// model (vocab 400) trained with Debian's spm_train into a temporary folder.
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <zlib.h>

#include "config/errors.h"
#include "util/env.h"
#include "datasets/dataloader.h"
#include "datasets/text_source.h"
#include "datasets/token_shard.h"
#include "datasets/tokenizer.h"

namespace fs = std::filesystem;
using ctitan::Batch;
using ctitan::DataLoader;
using ctitan::Document;
using ctitan::DocumentReader;
using ctitan::Tokenizer;
using ctitan::UserError;

namespace {

// --------------------------------------------------------------------------------------
// Fixture data: temp folder, corpus, tokenizer
// --------------------------------------------------------------------------------------

const std::vector<std::string>& paragraphs() {
  static const std::vector<std::string> p = [] {
    std::vector<std::string> v = {
        "The harbour was quiet before dawn, and the boats rocked against the pier.",
        "A sailor counted the barrels twice.\nThen he counted them a third time, because\n"
        "the mate had asked him to, and the mate was never wrong about barrels.",
        "Numbers matter: 12 casks, 7 oars, 3 lanterns and 1024 feet of rope.",
        "Café owners in the port served naïve travellers strong coffee — très fort!",
        "Some visitors wrote postcards in Japanese: 港の朝は静かです。",
        "The whale 🐳 surfaced twice, spouted, and dived again out of sight.",
        "Rain fell on the deck.  Two spaces here, and a tab\there, kept as written.",
        "When the wind turned, every rope on the ship sang a different note.",
        "Old maps showed islands that no one had ever found again.",
        "The cook argued that soup, unlike the sea, should never be too salty.",
    };
    // A deterministic generator adds ~30 plain English paragraphs (an LCG picks words).
    const std::vector<std::string> subj = {"the captain", "a young harpooner", "the old cook",
                                           "the lookout", "a passenger",       "the carpenter"};
    const std::vector<std::string> verb = {"watched", "mended",  "forgot",   "remembered",
                                           "carried", "painted", "described"};
    const std::vector<std::string> obj = {"the grey horizon",   "a broken oar",       "the long voyage",
                                          "the silver compass", "a letter from home", "the frozen rigging",
                                          "every distant sail"};
    uint32_t state = 12345;
    auto pick = [&](const std::vector<std::string>& words) {
      state = state * 1664525u + 1013904223u;
      return words[(state >> 8) % words.size()];
    };
    for (int i = 0; i < 30; ++i) {
      std::string para;
      const int sentences = 2 + i % 4;
      for (int s = 0; s < sentences; ++s) {
        std::string sentence = pick(subj) + " " + pick(verb) + " " + pick(obj) + ".";
        sentence[0] = static_cast<char>(std::toupper(sentence[0]));
        para += (s ? (s % 3 == 0 ? "\n" : " ") : "") + sentence;
      }
      v.push_back(para);
    }
    return v;
  }();
  return p;
}

std::string write_file(const fs::path& path, const std::string& content) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << content;
  return path.string();
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// Escapes a string for JSON the simple way (test-side reference, independent of the lib).
std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"')
      out += "\\\"";
    else if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else
      out += c;
  }
  return out + "\"";
}

class Env : public ::testing::Environment {
 public:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "ctitan_test_datasets_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    const std::string corpus = write_file(dir_ / "train_corpus.txt", join(paragraphs(), "\n"));
    model_ = (dir_ / "tok.model").string();
    const std::string prefix = (dir_ / "tok").string();
    const std::string cmd = "spm_train --input=" + corpus + " --model_prefix=" + prefix +
                            " --model_type=bpe --vocab_size=400 --hard_vocab_limit=false --byte_fallback=true"
                            " --character_coverage=1.0 --normalization_rule_name=identity"
                            " --remove_extra_whitespaces=false --split_digits=true --allow_whitespace_only_pieces=true"
                            " --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 --num_threads=1 > " +
                            (dir_ / "spm_train.log").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "spm_train failed (is Debian's `sentencepiece` installed?):\n"
                                           << read_file(dir_ / "spm_train.log");
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  static fs::path dir_;
  static std::string model_;
};
fs::path Env::dir_;
std::string Env::model_;
::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new Env);

const Tokenizer& tok() {
  static std::unique_ptr<Tokenizer> t = Tokenizer::load(Env::model_);
  return *t;
}

// Plain-text corpus: paragraphs separated by blank lines, split into `files` files.
std::string make_txt_corpus(const std::string& name, size_t files) {
  const fs::path root = Env::dir_ / name;
  const auto& p = paragraphs();
  const size_t per = (p.size() + files - 1) / files;
  for (size_t f = 0; f < files; ++f) {
    std::vector<std::string> chunk(p.begin() + std::min(p.size(), f * per),
                                   p.begin() + std::min(p.size(), (f + 1) * per));
    write_file(root / ("part_" + std::to_string(f) + ".txt"), join(chunk, "\n\n") + "\n");
  }
  return root.string();
}

// The documents of a source in order, read with the library's reader.
std::vector<std::string> all_documents(const std::string& source) {
  DocumentReader r(source);
  std::vector<std::string> docs;
  Document d;
  while (r.next(&d)) docs.push_back(d.text);
  return docs;
}

// The token stream of a list of documents: each as BOS + ids + EOS.
std::vector<int64_t> reference_stream(const std::vector<std::string>& docs) {
  std::vector<int64_t> s;
  for (const auto& d : docs) {
    s.push_back(tok().bos_id());
    for (int32_t id : tok().encode(d, false, false)) s.push_back(id);
    s.push_back(tok().eos_id());
  }
  return s;
}

// A document with its identity: file (index in the sorted listing), the byte offset of its
// first line (.ctok: its index), its index inside the file and in the whole corpus.
struct Doc {
  size_t file = 0;
  uint64_t offset = 0;
  int64_t index = 0, global = 0;
  std::string text;
  std::vector<int32_t> ids;  // .ctok
};

std::vector<Doc> corpus_docs(const std::string& source) {
  DocumentReader r(source);
  std::vector<Doc> out;
  Document d;
  int64_t in_file = 0;
  while (r.next(&d)) {
    if (!out.empty() && out.back().file != d.file) in_file = 0;
    out.push_back({d.file, d.offset, in_file++, static_cast<int64_t>(out.size()), d.text, d.ids});
  }
  return out;
}

// The sharding rule as docs/data.md states it, re-stated here: files >= ranks: rank r takes
// files f with f % W == r; else the ranks r with r % F == f share file f, the j-th (j = r / F)
// of k taking the documents starting in [size·j/k, size·(j+1)/k) (.gz: every k-th document
// from the j-th; .ctok: document ranges).
std::vector<Doc> rank_docs(const std::string& source, int64_t rank, int64_t world) {
  const auto files = ctitan::list_source_files(source);
  const auto docs = corpus_docs(source);
  const auto F = static_cast<int64_t>(files.size());
  std::vector<Doc> out;
  for (const Doc& d : docs) {
    const auto f = static_cast<int64_t>(d.file);
    bool mine = false;
    if (F >= world) {
      mine = f % world == rank;
    } else if (f == rank % F) {
      const int64_t j = rank / F, k = world / F + (f < world % F ? 1 : 0);
      const bool gz = files[d.file].size() > 3 && files[d.file].substr(files[d.file].size() - 3) == ".gz";
      uint64_t extent = fs::file_size(files[d.file]);
      if (files[d.file].find(".ctok") != std::string::npos) {
        extent = 0;
        for (const Doc& e : docs) extent += e.file == d.file;
      }
      mine = gz ? d.index % k == j : (d.offset >= extent * j / k && d.offset < extent * (j + 1) / k);
    }
    if (mine) out.push_back(d);
  }
  return out;
}
std::vector<std::string> rank_documents(const std::string& source, int64_t rank, int64_t world) {
  std::vector<std::string> out;
  for (const Doc& d : rank_docs(source, rank, world)) out.push_back(d.text);
  return out;
}

template <typename Fn>
std::string user_error_text(Fn&& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no UserError thrown>";
}

// --------------------------------------------------------------------------------------
// Tokenizer
// --------------------------------------------------------------------------------------

TEST(Tokenizer, RoundTripInAProcessRunningLibTorch) {
  // LibTorch works before the shim is loaded...
  const auto a = torch::arange(6, torch::kFloat32).reshape({2, 3});
  const auto b = torch::arange(12, torch::kFloat32).reshape({3, 4});
  const auto before = torch::matmul(a, b);
  EXPECT_FLOAT_EQ(before[1][2].item<float>(), 3 * 2 + 4 * 6 + 5 * 10);  // row 1 . col 2

  const std::vector<std::string> texts = {
      "Hello world, the whale surfaced.",
      "  leading spaces, double  spaces and trailing space ",
      "line one\nline two\n\nafter a blank line\ttab",
      "Café naïve — 港の朝は静かです。 🐳",
      "Zebra-quagga xylophones: Ωμέγα, Привет, عربى",  // characters never seen in training
      "",
  };
  for (const auto& t : texts) {
    const auto ids = tok().encode(t, false, false);
    for (int32_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, tok().vocab_size());
    }
    EXPECT_EQ(tok().decode(ids), t) << "round trip of: " << t;
  }

  // ...and after: same product, computed independently by hand.
  const auto after = torch::matmul(a, b);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      float ref = 0;
      for (int k = 0; k < 3; ++k) ref += static_cast<float>((i * 3 + k) * (k * 4 + j));
      EXPECT_FLOAT_EQ(after[i][j].item<float>(), ref);
    }
  }
  EXPECT_TRUE(fs::exists(Tokenizer::shim_path()));
}

TEST(Tokenizer, SpecialIdsAndVocabComeFromTheModel) {
  EXPECT_EQ(tok().unk_id(), 0);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_EQ(tok().pad_id(), -1);
  // spm_train writes one line per piece to <prefix>.vocab: an independent count.
  std::ifstream vocab(Env::dir_ / "tok.vocab");
  int64_t lines = 0;
  for (std::string l; std::getline(vocab, l);) ++lines;
  EXPECT_EQ(tok().vocab_size(), lines);
  EXPECT_GT(lines, 259);  // 3 specials + 256 byte pieces + learned pieces

  const std::string text = "The captain watched the grey horizon.";
  const auto plain = tok().encode(text, false, false);
  const auto framed = tok().encode(text, true, true);
  ASSERT_EQ(framed.size(), plain.size() + 2);
  EXPECT_EQ(framed.front(), 1);
  EXPECT_EQ(framed.back(), 2);
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), framed.begin() + 1));
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  EXPECT_EQ(tok().encode(text, true, false).front(), 1);
  EXPECT_EQ(tok().encode(text, false, true).back(), 2);
  EXPECT_EQ(tok().decode(framed), text);  // control ids decode to nothing
  EXPECT_THROW(tok().decode({5, static_cast<int32_t>(tok().vocab_size())}), std::out_of_range);
}

TEST(Tokenizer, MissingOrCorruptModelIsAUserError) {
  const std::string missing = (Env::dir_ / "no_such.model").string();
  const std::string e1 = user_error_text([&] { Tokenizer::load(missing); });
  EXPECT_EQ(e1.rfind("tokenizer: cannot load " + missing + ": ", 0), 0u) << e1;
  EXPECT_NE(e1.find("No such file"), std::string::npos) << e1;

  const std::string junk = write_file(Env::dir_ / "junk.model", "this is not a protobuf\x01\x02");
  const std::string e2 = user_error_text([&] { Tokenizer::load(junk); });
  EXPECT_EQ(e2.rfind("tokenizer: cannot load " + junk + ": ", 0), 0u) << e2;
}

TEST(Tokenizer, ResolvePath) {
  using ctitan::resolve_tokenizer_path;
  EXPECT_EQ(resolve_tokenizer_path(Env::model_, ""), Env::model_);
  EXPECT_EQ(resolve_tokenizer_path(Env::model_, "/elsewhere"), Env::model_);  // explicit wins
  const fs::path assets = Env::dir_ / "hf_assets";
  fs::create_directories(assets);
  fs::copy_file(Env::model_, assets / "tokenizer.model", fs::copy_options::overwrite_existing);
  EXPECT_EQ(resolve_tokenizer_path("", assets.string()), (assets / "tokenizer.model").string());

  const std::string none = user_error_text([] { resolve_tokenizer_path("", ""); });
  EXPECT_NE(none.find("model.tokenizer_path"), std::string::npos) << none;
  EXPECT_NE(none.find("model.hf_assets_path"), std::string::npos) << none;
  const std::string empty_assets = user_error_text([&] { resolve_tokenizer_path("", Env::dir_.string()); });
  EXPECT_NE(empty_assets.find("model.hf_assets_path=" + Env::dir_.string()), std::string::npos);
  EXPECT_NE(empty_assets.find("model.tokenizer_path"), std::string::npos) << empty_assets;
  const std::string bad = user_error_text([] { resolve_tokenizer_path("/nope.model", ""); });
  EXPECT_NE(bad.find("model.tokenizer_path=/nope.model"), std::string::npos) << bad;
}

TEST(Tokenizer, TrainTokenizerScriptIsDeterministic) {
  // scripts/train_tokenizer.sh on a JSONL folder, twice: identical models that round-trip.
  const fs::path corpus = Env::dir_ / "script_corpus";
  const auto& p = paragraphs();
  for (size_t f = 0; f < 2; ++f) {
    std::string lines;
    for (size_t i = f; i < p.size(); i += 2) lines += "{\"text\": " + json_str(p[i]) + "}\n";
    write_file(corpus / ("s" + std::to_string(f) + ".jsonl"), lines);
  }
  const std::string script = std::string(CTITAN_SOURCE_DIR) + "/scripts/train_tokenizer.sh";
  for (const char* name : {"a.model", "b.model"}) {
    const std::string cmd = "bash " + script + " " + corpus.string() + " " +
                            (Env::dir_ / "script_out" / name).string() + " 320 > " +
                            (Env::dir_ / "script.log").string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << read_file(Env::dir_ / "script.log");
  }
  const std::string a = read_file(Env::dir_ / "script_out" / "a.model");
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, read_file(Env::dir_ / "script_out" / "b.model"));
  const auto t = Tokenizer::load((Env::dir_ / "script_out" / "a.model").string());
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(t->eos_id(), 2);
  const std::string text = "Multi-line\n  text, 42 casks — and bytes: Привет 🐳";
  EXPECT_EQ(t->decode(t->encode(text, true, true)), text);
}

// --------------------------------------------------------------------------------------
// Text sources
// --------------------------------------------------------------------------------------

TEST(TextSource, PlainTextIsOneDocumentPerParagraph) {
  const std::string path = write_file(Env::dir_ / "paras" / "p.txt",
                                      "\xEF\xBB\xBF"
                                      "\r\n\r\nFirst para line 1\r\nline 2\r\n"
                                      "   \t \r\n"
                                      "Second  para\n\n\n\n"
                                      "  Third, indented\n"
                                      "last line without newline");
  DocumentReader r(path);
  std::vector<Document> docs;
  Document d;
  while (r.next(&d)) docs.push_back(d);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0].text, "First para line 1\nline 2");
  EXPECT_EQ(docs[0].line, 3);
  EXPECT_EQ(docs[1].text, "Second  para");
  EXPECT_EQ(docs[1].line, 6);
  EXPECT_EQ(docs[2].text, "  Third, indented\nlast line without newline");
  EXPECT_EQ(docs[2].line, 10);
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(docs[i].index, static_cast<int64_t>(i));
  EXPECT_FALSE(r.next(&d));  // stays at the end
  r.rewind();
  ASSERT_TRUE(r.next(&d));
  EXPECT_EQ(d.text, docs[0].text);
}

TEST(TextSource, JsonlRecordsWithEscapes) {
  const std::string path =
      write_file(Env::dir_ / "jsonl" / "a.jsonl",
                 "{\"id\": 1, \"text\": \"plain\"}\n"
                 "\n"
                 "{\"meta\": {\"tags\": [1, 2.5e3, true, null, {\"x\": \"}\"}]}, \"text\": "
                 "\"q\\\" b\\\\ s\\/ n\\n t\\t r\\r \\u00e9 \\u6e2f \\ud83d\\udc33 \\b\\f end\"}\r\n"
                 "  {\"text\": \"\", \"url\": \"http://x\"}  \n"
                 "{\"text\": \"raw UTF-8 stays: 港 🐳\"}");
  const auto docs = all_documents(path);
  ASSERT_EQ(docs.size(), 4u);
  EXPECT_EQ(docs[0], "plain");
  EXPECT_EQ(docs[1], "q\" b\\ s/ n\n t\t r\r \xC3\xA9 \xE6\xB8\xAF \xF0\x9F\x90\xB3 \b\f end");
  EXPECT_EQ(docs[2], "");
  EXPECT_EQ(docs[3], "raw UTF-8 stays: 港 🐳");
}

TEST(TextSource, BadJsonlLinesNameFileAndLine) {
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {"{\"title\": \"no text here\"}", "record has no \"text\" field"},
      {"{\"text\": 42}", "\"text\" must be a string, not number"},
      {"{\"text\": [\"a\"]}", "\"text\" must be a string, not array"},
      {"[\"text\"]", "expected a JSON object with a \"text\" field, not array"},
      {"{\"text\": \"unterminated}", "invalid JSON (unterminated string"},
      {"{\"text\": \"a\"} trailing", "invalid JSON (unexpected trailing characters"},
      {"{\"text\": \"lone \\ud800 surrogate\"}", "invalid JSON (high surrogate not followed"},
      {"{\"text\": \"bad \\x escape\"}", "invalid JSON (invalid escape"},
      {"{\"text\": \"tab\there\"}", "invalid JSON (raw control character"},
      {"{\"text\": \"x\",}", "invalid JSON (expected a string key"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = write_file(Env::dir_ / "badjsonl" / ("b" + std::to_string(i) + ".jsonl"),
                                        "{\"text\": \"ok\"}\n\n" + cases[i].line + "\n");
    const std::string err = user_error_text([&] { all_documents(path); });
    EXPECT_EQ(err.rfind("dataset: " + path + ":3: " + cases[i].expect, 0), 0u)
        << "line: " << cases[i].line << "\nerror: " << err;
  }
}

// Files that are not UTF-8 text: a NUL byte (binary data) or an ill-formed UTF-8 sequence
// is an error naming the file, line, column and byte; well-formed multi-byte text passes.
TEST(TextSource, BinaryAndNonUtf8FilesNameTheByte) {
  struct Case {
    std::string bytes, expect;
    int column;  // in the .txt file; 10 more in the .jsonl line ({"text": " comes first)
  };
  const std::vector<Case> bad = {
      {std::string("ab\0cd", 5), "a NUL byte at column %: binary data, not text", 3},
      {"caf\xe9 au lait", "not valid UTF-8 (byte 0xe9 at column %)", 4},         // Latin-1
      {"x \xc0\xaf y", "not valid UTF-8 (byte 0xc0 at column %)", 3},            // overlong '/'
      {"\xed\xa0\x80 surrogate", "not valid UTF-8 (byte 0xed at column %)", 1},  // U+D800
      {"big \xf4\x90\x80\x80", "not valid UTF-8 (byte 0xf4 at column %)", 5},    // > U+10FFFF
      {"cut \xe6\xb8", "not valid UTF-8 (byte 0xe6 at column %)", 5},            // truncated
      {"\x80 stray continuation", "not valid UTF-8 (byte 0x80 at column %)", 1},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    for (const std::string ext : {".txt", ".jsonl"}) {
      const bool txt = ext == ".txt";
      const std::string first = txt ? "fine line" : "{\"text\": \"fine\"}";
      const std::string body = txt ? bad[i].bytes : "{\"text\": \"" + bad[i].bytes + "\"}";
      const std::string path =
          write_file(Env::dir_ / "nonutf8" / ("b" + std::to_string(i) + ext), first + "\n\n" + body + "\n");
      std::string expect = bad[i].expect;
      expect.replace(expect.find('%'), 1, std::to_string(bad[i].column + (txt ? 0 : 10)));
      EXPECT_EQ(user_error_text([&] { all_documents(path); }).rfind("dataset: " + path + ":3: " + expect, 0), 0u)
          << ext << " case " << i;
    }
  }
  // Random bytes: an error, never a crash or a tokenized mess.
  std::mt19937 rng(7);
  std::string noise(4096, '\0');
  for (char& c : noise) c = static_cast<char>(rng());
  const std::string bin = write_file(Env::dir_ / "nonutf8" / "random.txt", noise);
  EXPECT_NE(user_error_text([&] { all_documents(bin); }).find("dataset: " + bin + ":"), std::string::npos);
  const std::string good = write_file(Env::dir_ / "nonutf8" / "good.txt", "港 🐳 \xc3\xa9\n");
  EXPECT_EQ(all_documents(good), (std::vector<std::string>{"港 🐳 é"}));
}

TEST(TextSource, FolderListingAndErrors) {
  const fs::path d = Env::dir_ / "mixed";
  write_file(d / "b.jsonl", "{\"text\": \"from b\"}\n{\"text\": \"b again\"}\n");
  write_file(d / "a.txt", "from a\n\nsecond of a\n");
  write_file(d / "c.md", "ignored");
  write_file(d / ".hidden.txt", "ignored");
  write_file(d / "sub" / "deeper.txt", "ignored (not recursive)");
  const auto files = ctitan::list_source_files(d.string());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(fs::path(files[0]).filename(), "a.txt");
  EXPECT_EQ(fs::path(files[1]).filename(), "b.jsonl");
  EXPECT_EQ(all_documents(d.string()), (std::vector<std::string>{"from a", "second of a", "from b", "b again"}));

  fs::create_directories(Env::dir_ / "empty_dir");
  write_file(Env::dir_ / "empty_dir" / "notes.md", "x");
  const std::string e1 = user_error_text([&] { ctitan::list_source_files((Env::dir_ / "empty_dir").string()); });
  EXPECT_NE(e1.find("holds no .txt/.jsonl/.json/.jsonl.gz/.json.gz/.ctok files"), std::string::npos) << e1;
  const std::string e2 = user_error_text([&] { ctitan::list_source_files((d / "c.md").string()); });
  EXPECT_NE(e2.find("neither a .txt/.jsonl/.json/.jsonl.gz/.json.gz/.ctok file nor a folder"), std::string::npos) << e2;
  const std::string e3 = user_error_text([&] { ctitan::list_source_files("/no/such/path"); });
  EXPECT_NE(e3.find("/no/such/path does not exist"), std::string::npos) << e3;
}

TEST(TextSource, ResolveDatasetPath) {
  using ctitan::resolve_dataset_path;
  const fs::path root = Env::dir_ / "data_root";
  write_file(root / "moby_dick" / "moby_dick.txt", "Call me Ishmael.\n");
  write_file(root / "sotu" / "1790_x.jsonl", "{\"text\": \"Fellow-Citizens\"}\n");
  EXPECT_EQ(resolve_dataset_path("moby_dick", "", root.string()), (root / "moby_dick" / "moby_dick.txt").string());
  EXPECT_EQ(resolve_dataset_path("sotu", "", root.string()), (root / "sotu").string());
  const std::string own = make_txt_corpus("own_corpus", 1);
  EXPECT_EQ(resolve_dataset_path("moby_dick", own, "/nowhere"), own);  // dataset_path wins

  const std::string unknown = user_error_text([&] { resolve_dataset_path("wikitext", "", root.string()); });
  EXPECT_NE(unknown.find("training.dataset=wikitext is not a known corpus (known: moby_dick, sotu, c4_test, c4, "
                         "c4_validation)"),
            std::string::npos)
      << unknown;
  EXPECT_NE(unknown.find("training.dataset_path"), std::string::npos) << unknown;
  const std::string missing =
      user_error_text([&] { resolve_dataset_path("sotu", "", (Env::dir_ / "nodata").string()); });
  EXPECT_NE(missing.find("run scripts/fetch_data.sh sotu"), std::string::npos) << missing;
  EXPECT_NE(missing.find("moby_dick, sotu"), std::string::npos) << missing;
  EXPECT_NE(missing.find("training.dataset_path"), std::string::npos) << missing;
  const std::string bad_path = user_error_text([] { resolve_dataset_path("", "/no/x.txt", ""); });
  EXPECT_NE(bad_path.find("training.dataset_path=/no/x.txt does not exist"), std::string::npos);

  const char* prior = std::getenv("CTITAN_DATA_DIR");
  const std::string saved = prior ? prior : "";
  ::setenv("CTITAN_DATA_DIR", "/custom/data", 1);
  ctitan::reload_runtime_env();
  EXPECT_EQ(ctitan::default_data_root("/repo"), "/custom/data");
  ::unsetenv("CTITAN_DATA_DIR");
  ctitan::reload_runtime_env();
  EXPECT_EQ(ctitan::default_data_root("/repo"), "/repo/data");
  if (prior != nullptr) ::setenv("CTITAN_DATA_DIR", saved.c_str(), 1);
  ctitan::reload_runtime_env();
}

// Writes `content` gzip-compressed with zlib, as `members` concatenated gzip members (C4's
// files have one; `cat a.gz b.gz` makes several, which gzip -d reads as one stream).
std::string write_gz(const fs::path& path, const std::string& content, int members = 1) {
  fs::create_directories(path.parent_path());
  std::string all;
  const size_t per = content.size() / static_cast<size_t>(members) + 1;
  for (int m = 0; m < members; ++m) {
    const std::string part = content.substr(std::min(content.size(), m * per), per);
    const std::string tmp = path.string() + ".part";
    gzFile f = gzopen(tmp.c_str(), "wb6");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(gzwrite(f, part.data(), static_cast<unsigned>(part.size())), static_cast<int>(part.size()));
    gzclose(f);
    std::ifstream in(tmp, std::ios::binary);
    all += std::string(std::istreambuf_iterator<char>(in), {});
    fs::remove(tmp);
  }
  std::ofstream(path, std::ios::binary) << all;
  return path.string();
}

std::string jsonl_of(const std::vector<std::string>& docs) {
  std::string out;
  for (size_t i = 0; i < docs.size(); ++i)
    out += "{\"text\": " + json_str(docs[i]) + ", \"i\": " + std::to_string(i) + "}\n";
  return out;
}

// The same JSON lines as .jsonl, .json (torchtitan's c4_test holds JSON lines in a .json
// file), .jsonl.gz and a two-member .json.gz give the same documents, and gzip's bytes are
// really compressed (the file is smaller than the text).
TEST(TextSource, JsonGzipAndJsonlReadAlike) {
  const std::string lines = jsonl_of(paragraphs());
  const fs::path d = Env::dir_ / "formats";
  const std::string a = write_file(d / "a.jsonl", lines);
  const std::string b = write_file(d / "b.json", lines);
  const std::string c = write_gz(d / "c.jsonl.gz", lines);
  const std::string e = write_gz(d / "e.json.gz", lines, 2);
  EXPECT_LT(fs::file_size(c), lines.size() / 2);
  const auto want = paragraphs();
  for (const auto& path : {a, b, c, e}) EXPECT_EQ(all_documents(path), want) << path;
  EXPECT_EQ(ctitan::list_source_files(d.string()).size(), 4u);
  // A damaged stream is a runtime error naming the file, not silently short data.
  std::ifstream in(c, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes.resize(bytes.size() * 2 / 3);
  for (size_t i = bytes.size() / 2; i < bytes.size(); i += 7) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
  const std::string broken = write_file(Env::dir_ / "broken" / "x.jsonl.gz", bytes);
  std::string err = "<no error>";
  try {
    all_documents(broken);
  } catch (const std::exception& ex) {
    err = ex.what();
  }
  EXPECT_NE(err.find("dataset: read error in " + broken), std::string::npos) << err;
}

// Named corpora as torchtitan has them: c4_test (a folder of JSON-lines .json files) and c4 /
// c4_validation (allenai/c4's en/c4-train.*.json.gz and en/c4-validation.*.json.gz, one
// pattern each, so train and validation files in one folder stay apart); when absent, the
// error points at the folder expected and at training.dataset_path.
TEST(TextSource, C4NamesResolveToLocalFiles) {
  using ctitan::resolve_dataset_path;
  const fs::path root = Env::dir_ / "c4_root";
  for (const std::string name : {"c4_test", "c4", "c4_validation"}) {
    const std::string e = user_error_text([&] { resolve_dataset_path(name, "", root.string()); });
    EXPECT_NE(e.find("training.dataset=" + name + ": " + root.string()), std::string::npos) << e;
    EXPECT_NE(e.find("set training.dataset_path"), std::string::npos) << e;
  }
  write_file(root / "c4_test" / "data.json", jsonl_of({"c4 test one", "c4 test two"}));
  write_gz(root / "c4" / "en" / "c4-train.00000-of-01024.json.gz", jsonl_of({"train zero"}));
  write_gz(root / "c4" / "en" / "c4-train.00001-of-01024.json.gz", jsonl_of({"train one"}));
  write_gz(root / "c4" / "en" / "c4-validation.00000-of-00008.json.gz", jsonl_of({"validation zero"}));
  EXPECT_EQ(all_documents(resolve_dataset_path("c4_test", "", root.string())),
            (std::vector<std::string>{"c4 test one", "c4 test two"}));
  EXPECT_EQ(all_documents(resolve_dataset_path("c4", "", root.string())),
            (std::vector<std::string>{"train zero", "train one"}));
  EXPECT_EQ(all_documents(resolve_dataset_path("c4_validation", "", root.string(), "validation")),
            (std::vector<std::string>{"validation zero"}));
}

// --------------------------------------------------------------------------------------
// Packing and the per-rank split
// --------------------------------------------------------------------------------------

TEST(DataLoader, WindowsArePackedLikeTorchtitanAndReloop) {
  // Capture the log to see the re-loop line.
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));

  const std::string src = make_txt_corpus("pack", 3);
  const auto docs = all_documents(src);
  ASSERT_EQ(docs, paragraphs());  // paragraph split reproduces the corpus
  const auto stream = reference_stream(docs);
  const int64_t T = 16, B = 4, L = T + 1;
  DataLoader dl(tok(), src, T, B, 0, 1, "pack");

  // 2.5 epochs worth of windows: window k must be tokens [kL, (k+1)L) of the stream
  // repeated forever (leftovers carry across the epoch boundary, nothing is padded).
  const int64_t batches = static_cast<int64_t>(stream.size()) * 5 / 2 / (B * L) + 1;
  int64_t k = 0;
  int64_t bos_seen = 0, eos_seen = 0;
  for (int64_t step = 0; step < batches; ++step) {
    const Batch b = dl.next();
    ASSERT_EQ(b.batch, B);
    ASSERT_EQ(b.seq, T);
    ASSERT_EQ(b.inputs.size(), static_cast<size_t>(B * T));
    ASSERT_EQ(b.labels.size(), static_cast<size_t>(B * T));
    for (int64_t row = 0; row < B; ++row, ++k) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t expect_in = stream[(k * L + t) % stream.size()];
        const int64_t expect_label = stream[(k * L + t + 1) % stream.size()];
        ASSERT_EQ(b.inputs[row * T + t], expect_in) << "window " << k << " t " << t;
        ASSERT_EQ(b.labels[row * T + t], expect_label) << "window " << k << " t " << t;
        if (t + 1 < T) {
          ASSERT_EQ(b.labels[row * T + t], b.inputs[row * T + t + 1]);
        }
        bos_seen += b.inputs[row * T + t] == tok().bos_id();
        eos_seen += b.labels[row * T + t] == tok().eos_id();
      }
    }
  }
  EXPECT_EQ(dl.windows_produced(), k);
  EXPECT_EQ(dl.epoch(), 2);
  EXPECT_GE(bos_seen, static_cast<int64_t>(2 * docs.size()));  // every document starts with BOS
  EXPECT_GE(eos_seen, static_cast<int64_t>(2 * docs.size()));
  EXPECT_EQ(stream.front(), tok().bos_id());
  EXPECT_EQ(stream.back(), tok().eos_id());

  spdlog::set_default_logger(previous);
  const std::string text = log.str();
  EXPECT_NE(text.find("dataset pack exhausted on dp rank 0, re-looping (epoch 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("dataset pack exhausted on dp rank 0, re-looping (epoch 2)"), std::string::npos) << text;
}

TEST(DataLoader, RanksTakeDisjointDocumentsCoveringTheCorpus) {
  // 2 files, 3 ranks: file 0 is cut in two byte ranges (ranks 0 and 2), file 1 is rank 1's.
  const std::string src = make_txt_corpus("ranks", 2);
  const auto docs = all_documents(src);
  const int64_t W = 3, T = 8, L = T + 1;
  std::map<std::string, int> seen;  // document text -> how many ranks decoded it
  for (int64_t r = 0; r < W; ++r) {
    const auto ref = reference_stream(rank_documents(src, r, W));
    ASSERT_FALSE(ref.empty()) << "rank " << r;
    DataLoader dl(tok(), src, T, 1, r, W);
    std::vector<int64_t> got;
    while (got.size() < ref.size()) {
      const auto w = dl.next_window();
      ASSERT_EQ(w.size(), static_cast<size_t>(L));
      got.insert(got.end(), w.begin(), w.end());
    }
    // The rank's windows, concatenated, are exactly its token stream.
    ASSERT_TRUE(std::equal(ref.begin(), ref.end(), got.begin())) << "rank " << r;
    // Cut the stream at BOS/EOS and decode each document.
    for (size_t i = 0; i < ref.size();) {
      ASSERT_EQ(got[i], tok().bos_id());
      size_t j = i + 1;
      while (j < ref.size() && got[j] != tok().eos_id()) ++j;
      ASSERT_LT(j, ref.size()) << "document without EOS on rank " << r;
      seen[tok().decode(std::vector<int32_t>(got.begin() + i + 1, got.begin() + j))] += 1;
      i = j + 1;
    }
  }
  std::map<std::string, int> corpus;
  for (const auto& d : docs) corpus[d] += 1;
  EXPECT_EQ(seen, corpus);  // every document on exactly one rank, none invented
}

TEST(DataLoader, EmptyOrBlankFilesAreAUserError) {
  for (const std::string body : {"", "\n\n  \n\t\n"}) {
    const std::string src = write_file(Env::dir_ / "blank" / "b.txt", body);
    DataLoader dl(tok(), src, 4, 1, 0, 1, "blank");
    EXPECT_EQ(user_error_text([&] { dl.next_window(); }),
              "dataset blank holds no documents (its files are empty or only blank lines)");
  }
}

TEST(DataLoader, TooFewDocumentsForTheRanksIsAUserError) {
  const std::string src = write_file(Env::dir_ / "tiny2" / "t.txt", "one\n\ntwo\n");
  DataLoader ok(tok(), src, 4, 1, 1, 3);
  EXPECT_EQ(ok.next_window().front(), tok().bos_id());
  DataLoader starved(tok(), src, 4, 1, 2, 3, "tiny2");
  const std::string e = user_error_text([&] { starved.next_window(); });
  EXPECT_NE(e.find("dataset tiny2: dp rank 2 of 3 gets no documents (its share: t.txt bytes 6..9); too few "
                   "documents for dp degree 3"),
            std::string::npos)
      << e;
  EXPECT_NE(user_error_text([&] { DataLoader(tok(), src, 4, 1, 3, 3); }).find("dp rank 3 is not in [0, 3)"),
            std::string::npos);
  EXPECT_NE(user_error_text([&] { DataLoader(tok(), src, 0, 1, 0, 1); }).find("seq_len=0"), std::string::npos);
}

// --------------------------------------------------------------------------------------
// State save / restore
// --------------------------------------------------------------------------------------

std::string make_jsonl_corpus(const std::string& name) {
  const fs::path root = Env::dir_ / name;
  const auto& p = paragraphs();
  for (size_t f = 0; f < 4; ++f) {
    std::string lines;
    for (size_t i = f; i < p.size(); i += 4)
      lines += "{\"text\": " + json_str(p[i]) + ", \"n\": " + std::to_string(i) + "}\n";
    write_file(root / ("shard_" + std::to_string(f) + ".jsonl"), lines);
  }
  return root.string();
}

void expect_same(const std::vector<Batch>& a, const std::vector<Batch>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].inputs, b[i].inputs) << "batch " << i;
    EXPECT_EQ(a[i].labels, b[i].labels) << "batch " << i;
  }
}

TEST(DataLoader, StateDictResumesExactly) {
  // Both source kinds, W=2 rank 1, 7 batches then save, then 5 more. The window length is
  // chosen from the rank's token count S so that the epoch boundary falls either after the
  // save (7*3*L < S < 12*3*L) or before it (S < 7*3*L): the carried buffer and the
  // re-loop both have to survive the restore.
  for (const std::string& src : {make_jsonl_corpus("resume_jsonl"), make_txt_corpus("resume_txt", 3)}) {
    const int64_t S = static_cast<int64_t>(reference_stream(rank_documents(src, 1, 2)).size());
    for (const int64_t L : {S / 27, S / 15}) {
      const int64_t T = L - 1, B = 3;
      SCOPED_TRACE(src + " seq_len " + std::to_string(T));
      DataLoader a(tok(), src, T, B, 1, 2);
      for (int i = 0; i < 7; ++i) a.next();
      EXPECT_EQ(a.epoch(), L == S / 27 ? 0 : 1);
      const std::string saved = a.state_dict();
      std::vector<Batch> continued;
      for (int i = 0; i < 5; ++i) continued.push_back(a.next());
      EXPECT_EQ(a.epoch(), L == S / 27 ? 1 : 2);  // 36 windows: 1.33 or 2.4 epochs

      DataLoader b(tok(), src, T, B, 1, 2);
      b.next();  // some progress that the restore must discard
      b.load_state_dict(saved);
      EXPECT_EQ(b.state_dict(), saved);
      std::vector<Batch> resumed;
      for (int i = 0; i < 5; ++i) resumed.push_back(b.next());
      expect_same(continued, resumed);
      EXPECT_EQ(b.windows_produced(), a.windows_produced());
      EXPECT_EQ(b.windows_produced(), 12 * B);
      EXPECT_EQ(b.epoch(), a.epoch());
      EXPECT_EQ(b.state_dict(), a.state_dict());
    }
  }
}

// The state names what this pass still holds: 4 files on 3 ranks, rank 1 has file 1 alone;
// after one window its range starts at the first document it has not read.
TEST(DataLoader, StateDictRecordsWhatThePassStillHolds) {
  const std::string src = make_jsonl_corpus("position");
  const auto docs = corpus_docs(src);
  DataLoader dl(tok(), src, 16, 1, 1, 3);
  dl.next();
  size_t tokens = 0, next = 0;
  std::vector<Doc> mine;
  for (const Doc& d : docs)
    if (d.file == 1) mine.push_back(d);
  while (tokens < 17) tokens += tok().encode(mine[next++].text, true, true).size();
  const std::string s = dl.state_dict();
  EXPECT_NE(s.find("\"work\":[[1," + std::to_string(mine[next].offset) + ",-1,1,0," + std::to_string(next) + ",0]]"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("\"files\":[\"shard_0.jsonl\",\"shard_1.jsonl\",\"shard_2.jsonl\",\"shard_3.jsonl\"]"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("\"dp_rank\":1,\"dp_world\":3"), std::string::npos) << s;
  EXPECT_NE(s.find("\"format\":\"ctitan.dataloader\",\"version\":2"), std::string::npos) << s;
  EXPECT_EQ(dl.documents_parsed(), static_cast<int64_t>(next));
}

TEST(DataLoader, CorruptOrMismatchedStateIsRejectedAndLeavesTheLoaderAlone) {
  const std::string src = make_jsonl_corpus("corrupt");
  DataLoader a(tok(), src, 16, 2, 0, 2);
  for (int i = 0; i < 3; ++i) a.next();
  const std::string good = a.state_dict();

  DataLoader victim(tok(), src, 16, 2, 0, 2);
  victim.next();
  const std::string before = victim.state_dict();
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const auto at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  struct Case {
    std::string state, expect;
  };
  const std::string vocab = std::to_string(tok().vocab_size());
  const std::vector<Case> cases = {
      {good.substr(0, good.size() / 2), "is corrupt: invalid JSON"},
      {"[]", "is corrupt: expected a JSON object"},
      {replace("\"format\":\"ctitan.dataloader\"", "\"format\":\"other\""), "\"format\" is not"},
      {replace("\"version\":2", "\"version\":9"), "has version 9; this build reads 1 and 2"},
      {replace("\"dp_world\":2", "\"dp_world\":4"), "was saved by dp rank 0 of 4, this is dp rank 0 of 2"},
      {replace("\"vocab_size\":" + vocab, "\"vocab_size\":7"), "tokenizer of vocab_size 7"},
      {replace("\"epoch\":", "\"epochs\":"), "is corrupt: missing \"epoch\""},
      {replace("\"windows_produced\":", "\"windows_produced\":-"), "\"windows_produced\" is not an integer >= 0"},
      {replace("\"buffer\":[", "\"buffer\":[" + vocab + ","), "\"buffer\" holds a value that is not a token id"},
      {replace("\"files\":[\"shard_0", "\"files\":[\"other_0"),
       "file 0 is other_0.jsonl there and shard_0.jsonl here (different corpus?)"},
      {replace("\"work\":[[0,", "\"work\":[[9,"), "\"work\"[0] does not fit the corpus (file 9 of 4"},
      {replace("\"work\":[[0,", "\"work\":[[0,0,"), "\"work\"[0] is not [file,begin,end,stride,phase,ordinal,chain]"},
      {replace("\"work\":[[0,", "\"work\":[[0,99999999"), "\"work\"[0] does not fit the corpus"},
  };
  for (const auto& c : cases) {
    const std::string e = user_error_text([&] { victim.load_state_dict(c.state); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected: " << c.expect << "\ngot: " << e;
    EXPECT_EQ(victim.state_dict(), before);
  }
  // Still usable, continuing from where it was.
  DataLoader twin(tok(), src, 16, 2, 0, 2);
  twin.next();
  expect_same({victim.next()}, {twin.next()});
}

// Exact resume inside a gzip stream: the position is an offset of the uncompressed text,
// restored by re-inflating and skipping. A loader restored mid-file gives the same windows
// as the one that went on, on 1 and on 2 ranks, across the re-loop.
TEST(DataLoader, ResumesExactlyInsideAGzipFile) {
  const std::string src = write_gz(Env::dir_ / "gzresume" / "all.jsonl.gz", jsonl_of(paragraphs()));
  for (const int64_t W : {1, 2}) {
    DataLoader a(tok(), src, 24, 2, W - 1, W);
    for (int i = 0; i < 5; ++i) a.next();
    const std::string saved = a.state_dict();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(saved, m, std::regex("\"work\":\\[\\[0,([0-9]+),")));
    EXPECT_GT(std::stoll(m[1]), 0) << "saved mid-file";
    std::vector<Batch> continued, resumed;
    for (int i = 0; i < 60; ++i) continued.push_back(a.next());
    EXPECT_GE(a.epoch(), 1) << "the run went past the end of the file";
    DataLoader b(tok(), src, 24, 2, W - 1, W);
    b.load_state_dict(saved);
    for (int i = 0; i < 60; ++i) resumed.push_back(b.next());
    expect_same(continued, resumed);
  }
}

// --------------------------------------------------------------------------------------
// Sharding: byte ranges, redistribution, token accounting, older states, token shards
// --------------------------------------------------------------------------------------

// Paragraphs of a .txt text with the byte offset of each one's first line, found here
// independently of the library: a paragraph starts at a non-blank line after a blank line
// (or the file's start); lines end at '\n', a '\r' before it is dropped.
std::vector<std::pair<uint64_t, std::string>> txt_paragraphs(const std::string& text) {
  std::vector<std::pair<uint64_t, std::string>> out;
  bool prev_blank = true;
  for (size_t at = 0; at < text.size();) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(at, nl - at);
    if (at == 0 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const bool blank = line.find_first_not_of(" \t\f\v") == std::string::npos;
    if (!blank && prev_blank)
      out.push_back({at, line});
    else if (!blank)
      out.back().second += "\n" + line;
    prev_blank = blank;
    at = nl + 1;
  }
  return out;
}

// Every cut of a file into two byte ranges, [0, c) and [c, size), and cuts into W equal
// ranges for W = 2..9: each document is read by exactly one range, whole, and in order.
// The .txt file has multi-line paragraphs, runs of blank and whitespace-only lines, CRLF
// line ends in part, a BOM; the .jsonl file blank lines and long records.
TEST(Sharding, ByteRangesGiveEachDocumentToExactlyOneReader) {
  std::string txt = "\xEF\xBB\xBF";
  const auto& p = paragraphs();
  for (size_t i = 0; i < p.size(); ++i) {
    std::string para = p[i];
    if (i % 5 == 3) {  // CRLF line ends
      std::string crlf;
      for (char c : para) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
      para = crlf;
    }
    txt += para + (i % 4 == 0 ? "\n\n\n" : i % 4 == 1 ? "\n \t\n" : "\n\n");
  }
  std::string jsonl;
  for (size_t i = 0; i < p.size(); ++i)
    jsonl += (i % 6 == 2 ? "\n" : "") + std::string("{\"text\": ") + json_str(p[i]) + "}\n";
  const std::string t = write_file(Env::dir_ / "ranges" / "r.txt", txt);
  const std::string j = write_file(Env::dir_ / "ranges" / "r.jsonl", jsonl);
  // The reference for the .txt file comes from the independent split above.
  std::vector<std::pair<uint64_t, std::string>> want_txt;
  for (const auto& [off, text] : txt_paragraphs(txt)) want_txt.push_back({off, text});
  ASSERT_EQ(want_txt.size(), p.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(want_txt[i].second, p[i]) << i;
  auto read_range = [](const std::string& path, uint64_t b, uint64_t e) {
    DocumentReader r(path);
    r.set_range(0, b, e, false);
    std::vector<std::pair<uint64_t, std::string>> got;
    Document d;
    while (r.next(&d)) got.push_back({d.offset, d.text});
    return got;
  };
  for (const std::string& path : {t, j}) {
    SCOPED_TRACE(path);
    const auto want = path == t ? want_txt : read_range(path, 0, DocumentReader::kToEnd);
    ASSERT_EQ(want.size(), p.size());
    const uint64_t size = fs::file_size(path);
    int bad_cuts = 0;
    for (uint64_t c = 0; c <= size; ++c) {
      auto a = read_range(path, 0, c), b = read_range(path, c, size);
      a.insert(a.end(), b.begin(), b.end());
      if (a != want && ++bad_cuts <= 3) ADD_FAILURE() << "cut at byte " << c;
    }
    EXPECT_EQ(bad_cuts, 0);
    for (int64_t W = 2; W <= 9; ++W) {
      std::vector<std::pair<uint64_t, std::string>> all;
      int64_t parsed = 0;
      for (int64_t r = 0; r < W; ++r) {
        const auto part = read_range(path, size * r / W, size * (r + 1) / W);
        all.insert(all.end(), part.begin(), part.end());
        // The loader of rank r of W over this one file parses exactly those documents.
        DataLoader dl(tok(), path, 4, 1, r, W);
        dl.set_repeat(false);
        while (dl.has_next_batch()) dl.next();
        EXPECT_EQ(dl.documents_parsed(), static_cast<int64_t>(part.size())) << "rank " << r << " of " << W;
        parsed += dl.documents_parsed();
      }
      EXPECT_EQ(all, want) << W << " ranks";
      EXPECT_EQ(parsed, static_cast<int64_t>(want.size())) << W << " ranks: documents parsed in total";
    }
  }
}

// A state's "work" as test code reads it: units of 7 integers.
struct Unit {
  int64_t file, begin, end, stride, phase, ordinal, chain;
};
std::vector<Unit> work_of(const std::string& state) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(state, m, std::regex("\"work\":\\[(.*?)\\],\"buffer\""))) << state;
  std::vector<int64_t> v;
  const std::string w = m[1];
  const std::regex num("-?[0-9]+");
  for (auto it = std::sregex_iterator(w.begin(), w.end(), num); it != std::sregex_iterator(); ++it)
    v.push_back(std::stoll(it->str()));
  EXPECT_EQ(v.size() % 7, 0u) << state;
  std::vector<Unit> out;
  for (size_t i = 0; i + 7 <= v.size(); i += 7)
    out.push_back({v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6]});
  return out;
}
std::vector<int64_t> buffer_of(const std::string& state) {
  std::vector<int64_t> out;
  std::istringstream is(state.substr(state.find("\"buffer\":[") + 10));
  for (int64_t v; is >> v;) {
    out.push_back(v);
    if (is.peek() == ',') is.get();
  }
  return out;
}
int64_t int_field(const std::string& state, const std::string& key) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(state, m, std::regex("\"" + key + "\":(-?[0-9]+)"))) << key;
  return std::stoll(m[1]);
}
// Whether a document is still to be read according to a unit (the state format's meaning).
bool unread(const Unit& u, const Doc& d) {
  if (u.chain) {
    const bool after = static_cast<int64_t>(d.file) > u.file ||
                       (static_cast<int64_t>(d.file) == u.file && static_cast<int64_t>(d.offset) >= u.begin);
    return after && d.global % u.stride == u.phase;
  }
  if (static_cast<int64_t>(d.file) != u.file || static_cast<int64_t>(d.offset) < u.begin) return false;
  if (u.end >= 0 && static_cast<int64_t>(d.offset) >= u.end) return false;
  return d.index % u.stride == u.phase;
}

void add_windows(const Batch& b, std::map<int64_t, int64_t>* have) {
  for (int64_t row = 0; row < b.batch; ++row) {
    for (int64_t t = 0; t < b.seq; ++t) ++(*have)[b.inputs[row * b.seq + t]];
    ++(*have)[b.labels[row * b.seq + b.seq - 1]];
  }
}

struct Accounting {
  int64_t duplicated = 0, missing = 0, read_docs = 0, windows = 0;
};

// W ranks train 2 + r batches each and save; W2 ranks load the redistributed states, train 3
// batches each and save. Every token trained on (windows) plus what the final buffers hold
// must be, as a multiset, the tokens of the documents the final states do not hold as
// unread. `saved` may come from outside (older states); then the first phase is skipped.
Accounting account(const std::string& src, int64_t W, int64_t W2, std::vector<std::string> saved = {},
                   std::map<int64_t, int64_t> have = {}) {
  const int64_t T = 12, B = 2;
  Accounting acc;
  if (saved.empty()) {
    for (int64_t r = 0; r < W; ++r) {
      DataLoader dl(tok(), src, T, B, r, W);
      for (int64_t i = 0; i < 2 + r; ++i, acc.windows += B) add_windows(dl.next(), &have);
      saved.push_back(dl.state_dict());
    }
  }
  // A new rank may finish what it was given and start its own next pass (epoch 1): the
  // documents it read there are those of its fresh share (rank_docs) it no longer holds.
  std::vector<Unit> left;  // what the first pass still holds
  std::map<int64_t, int64_t> want;
  auto add_doc = [&](const Doc& d) {
    ++acc.read_docs;
    const std::vector<int32_t> ids = d.ids.empty() ? tok().encode(d.text, true, true) : d.ids;
    for (int32_t v : ids) ++want[v];
  };
  for (int64_t r = 0; r < W2; ++r) {
    DataLoader dl(tok(), src, T, B, r, W2);
    dl.load_state_dict(dl.redistributed_state(saved));
    for (int64_t i = 0; i < 3; ++i, acc.windows += B) add_windows(dl.next(), &have);
    const std::string fin = dl.state_dict();
    const int64_t epoch = int_field(fin, "epoch");
    EXPECT_LE(epoch, 1) << "the test must stay inside the first two passes";
    for (int64_t v : buffer_of(fin)) ++have[v];
    const std::vector<Unit> work = work_of(fin);
    if (epoch == 0) left.insert(left.end(), work.begin(), work.end());
    if (epoch == 1)
      for (const Doc& d : rank_docs(src, r, W2))
        if (std::none_of(work.begin(), work.end(), [&](const Unit& u) { return unread(u, d); })) add_doc(d);
  }
  for (const Doc& d : corpus_docs(src))
    if (std::none_of(left.begin(), left.end(), [&](const Unit& u) { return unread(u, d); })) add_doc(d);
  std::set<int64_t> keys;
  for (const auto& kv : have) keys.insert(kv.first);
  for (const auto& kv : want) keys.insert(kv.first);
  for (int64_t k : keys) {
    const int64_t d = have[k] - want[k];
    (d > 0 ? acc.duplicated : acc.missing) += std::abs(d);
  }
  return acc;
}

// The old (version 1) loader, re-stated: rank r of W reads every document of the stream in
// order, keeping those whose global index is ≡ r (mod W); each window asks for T+1 tokens
// and documents are read until that many are buffered. Returns its state after `windows`
// windows (the format of older builds) and the windows it would give next.
std::string v1_state(const std::string& src, int64_t r, int64_t W, int64_t T, int64_t windows, int64_t more,
                     std::vector<std::vector<int64_t>>* next_windows, std::map<int64_t, int64_t>* emitted) {
  const auto docs = corpus_docs(src);
  const auto files = ctitan::list_source_files(src);
  std::vector<int64_t> buf;
  size_t g = 0;
  auto window = [&] {
    while (buf.size() < static_cast<size_t>(T + 1)) {
      const Doc& d = docs.at(g++);
      if (d.global % W != r) continue;
      for (int32_t v : tok().encode(d.text, true, true)) buf.push_back(v);
    }
    std::vector<int64_t> w(buf.begin(), buf.begin() + T + 1);
    buf.erase(buf.begin(), buf.begin() + T + 1);
    return w;
  };
  for (int64_t i = 0; i < windows; ++i)
    for (int64_t v : window()) ++(*emitted)[v];
  // Where the old reader stood: just after document g-1 (at the end of its file if last).
  const Doc& last = docs.at(g - 1);
  const uint64_t end = g < docs.size() && docs[g].file == last.file ? docs[g].offset : fs::file_size(files[last.file]);
  std::string s = "{\"format\":\"ctitan.dataloader\",\"version\":1,\"dp_rank\":" + std::to_string(r) +
                  ",\"dp_world\":" + std::to_string(W) + ",\"seq_len\":" + std::to_string(T) +
                  ",\"vocab_size\":" + std::to_string(tok().vocab_size()) +
                  ",\"epoch\":0,\"windows_produced\":" + std::to_string(windows) +
                  ",\"next_document\":" + std::to_string(g) + ",\"file_index\":" + std::to_string(last.file) +
                  ",\"file_name\":\"" + fs::path(files[last.file]).filename().string() +
                  "\",\"file_offset\":" + std::to_string(end) + ",\"file_line\":" + std::to_string(last.index + 1) +
                  ",\"skipped_documents\":0,\"buffer\":[";
  for (size_t i = 0; i < buf.size(); ++i) s += (i ? "," : "") + std::to_string(buf[i]);
  s += "]}";
  for (int64_t i = 0; i < more; ++i) next_windows->push_back(window());
  return s;
}

std::string make_jsonl_files(const std::string& name, size_t files) {
  const fs::path root = Env::dir_ / name;
  const auto& p = paragraphs();
  for (size_t f = 0; f < files; ++f) {
    std::string lines;
    for (size_t i = f; i < p.size(); i += files) lines += "{\"text\": " + json_str(p[i]) + "}\n";
    write_file(root / ("part_" + std::to_string(f) + ".jsonl"), lines);
  }
  return root.string();
}

// Criterion: resume on another number of ranks (2 -> 3, 4 -> 2) with each format — .txt
// (one file: byte ranges), .jsonl (3 files: whole files on 2 ranks, byte ranges on 4), .json
// (one file), .jsonl.gz (one file: shared, every k-th document), pre-tokenized .ctok shards
// (3 shards), and states written in the older version-1 format — shows 0 duplicated and 0
// missing tokens.
TEST(Sharding, RedistributionAccountsForEveryTokenInEachFormat) {
  const auto& p = paragraphs();
  std::string txt;
  for (const auto& para : p) txt += para + "\n\n";
  const std::string jsonl_dir = make_jsonl_files("acct_jsonl", 3);
  const std::string ctok_dir = (Env::dir_ / "acct_ctok").string();
  ctitan::tokenize_corpus(jsonl_dir, tok(), ctok_dir, false);
  const std::vector<std::pair<std::string, std::string>> formats = {
      {".txt", write_file(Env::dir_ / "acct_txt" / "all.txt", txt)},
      {".jsonl", jsonl_dir},
      {".json", write_file(Env::dir_ / "acct_json" / "all.json", jsonl_of(p))},
      {".jsonl.gz", write_gz(Env::dir_ / "acct_gz" / "all.jsonl.gz", jsonl_of(p))},
      {".ctok", ctok_dir},
  };
  for (const auto& [kind, src] : formats) {
    for (const auto& [W, W2] : std::vector<std::pair<int64_t, int64_t>>{{2, 3}, {4, 2}}) {
      const Accounting a = account(src, W, W2);
      std::printf(
          "redistribute %s %lld -> %lld: %lld windows, %lld documents read; duplicated tokens %lld, "
          "missing tokens %lld\n",
          kind.c_str(), static_cast<long long>(W), static_cast<long long>(W2), static_cast<long long>(a.windows),
          static_cast<long long>(a.read_docs), static_cast<long long>(a.duplicated), static_cast<long long>(a.missing));
      EXPECT_EQ(a.duplicated, 0) << kind << " " << W << "->" << W2;
      EXPECT_EQ(a.missing, 0) << kind << " " << W << "->" << W2;
      EXPECT_GT(a.read_docs, 0);
    }
  }
  // Version-1 states (written by the old loader, re-stated above) redistributed likewise.
  const std::string v1_src = make_jsonl_files("acct_v1", 2);
  for (const auto& [W, W2] : std::vector<std::pair<int64_t, int64_t>>{{2, 3}, {4, 2}}) {
    std::vector<std::string> saved;
    std::map<int64_t, int64_t> emitted;
    std::vector<std::vector<int64_t>> unused;
    for (int64_t r = 0; r < W; ++r) saved.push_back(v1_state(v1_src, r, W, 12, 4 + r, 0, &unused, &emitted));
    const Accounting a = account(v1_src, W, W2, saved, emitted);
    std::printf("redistribute version-1 states %lld -> %lld: duplicated tokens %lld, missing tokens %lld\n",
                static_cast<long long>(W), static_cast<long long>(W2), static_cast<long long>(a.duplicated),
                static_cast<long long>(a.missing));
    EXPECT_EQ(a.duplicated, 0) << "v1 " << W << "->" << W2;
    EXPECT_EQ(a.missing, 0) << "v1 " << W << "->" << W2;
  }
}

// A checkpoint written by an older build (state version 1) still resumes exactly on the same
// degree: the windows after the restore are those the old loader would have given.
TEST(Sharding, Version1StatesResumeExactly) {
  const std::string src = make_jsonl_files("v1_resume", 3);
  for (const auto& [r, W] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {2, 3}}) {
    std::vector<std::vector<int64_t>> want;
    std::map<int64_t, int64_t> unused;
    const std::string st = v1_state(src, r, W, 12, 7, 20, &want, &unused);
    DataLoader dl(tok(), src, 12, 1, r, W);
    dl.load_state_dict(st);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(dl.next_window(), want[i]) << "rank " << r << " window " << i;
    EXPECT_EQ(dl.windows_produced(), 27);
  }
  // Its checks stay: an offset that is not a line start, a file that is not the one named.
  std::vector<std::vector<int64_t>> w;
  std::map<int64_t, int64_t> e;
  const std::string st = v1_state(src, 0, 1, 12, 3, 0, &w, &e);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(st, m, std::regex("\"file_offset\":([0-9]+)")));
  DataLoader dl(tok(), src, 12, 1, 0, 1);
  std::string moved = std::regex_replace(st, std::regex("\"file_offset\":[0-9]+"),
                                         "\"file_offset\":" + std::to_string(std::stoll(m[1]) + 1));
  EXPECT_NE(user_error_text([&] { dl.load_state_dict(moved); }).find("is not a line start"), std::string::npos);
  moved = std::regex_replace(st, std::regex("\"file_name\":\"part_"), "\"file_name\":\"other_");
  EXPECT_NE(user_error_text([&] { dl.load_state_dict(moved); }).find("(different corpus?)"), std::string::npos);
}

// Pre-tokenized shards: `tokenize` then training on them gives the same windows as encoding
// on the fly (same files, same ranks, across the re-loop); ids are stored as uint16 for this
// vocabulary; a shard of another tokenizer, a truncated one and a damaged one are refused
// with one line.
TEST(Sharding, TokenShardsTrainLikeTheTextTheyCameFrom) {
  const std::string src = make_jsonl_files("shard_src", 3);
  const std::string out = (Env::dir_ / "shard_out").string();
  const ctitan::TokenizeReport rep = ctitan::tokenize_corpus(src, tok(), out, false);
  EXPECT_EQ(rep.files, 3);
  EXPECT_EQ(rep.documents, static_cast<int64_t>(paragraphs().size()));
  int64_t tokens = 0;
  for (const auto& d : paragraphs()) tokens += static_cast<int64_t>(tok().encode(d, true, true).size());
  EXPECT_EQ(rep.tokens, tokens);
  const std::string first = out + "/part_0.jsonl.ctok";
  const ctitan::TokenShardHeader h = ctitan::read_token_shard_header(first);
  EXPECT_EQ(h.token_bytes, 2u);
  EXPECT_EQ(h.vocab_size, static_cast<uint64_t>(tok().vocab_size()));
  EXPECT_EQ(h.tokenizer_hash, ctitan::tokenizer_hash(tok()));
  const auto text_docs = corpus_docs(src), shard_docs = corpus_docs(out);
  ASSERT_EQ(text_docs.size(), shard_docs.size());
  for (size_t i = 0; i < text_docs.size(); ++i) {
    ASSERT_EQ(shard_docs[i].ids, tok().encode(text_docs[i].text, true, true)) << i;
    EXPECT_EQ(shard_docs[i].file, text_docs[i].file);
  }
  for (const auto& [r, W] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {2, 3}}) {
    DataLoader a(tok(), src, 16, 2, r, W), b(tok(), out, 16, 2, r, W);
    for (int i = 0; i < 120; ++i) {
      const Batch x = a.next(), y = b.next();
      ASSERT_EQ(x.inputs, y.inputs) << "rank " << r << " of " << W << " batch " << i;
      ASSERT_EQ(x.labels, y.labels);
    }
    EXPECT_GE(b.epoch(), 1) << "went past the end of the shards";
    EXPECT_EQ(a.epoch(), b.epoch());
  }
  // Another tokenizer's hash in the header.
  const std::string bytes = read_file(first);
  const fs::path bad = Env::dir_ / "shard_bad";
  std::string other = bytes;
  other[24] = static_cast<char>(other[24] ^ 0x01);
  write_file(bad / "other" / "x.ctok", other);
  std::string e = user_error_text([&] { DataLoader(tok(), (bad / "other").string(), 16, 1, 0, 1); });
  EXPECT_NE(e.find("x.ctok was tokenized with " + tok().model_path() + " (hash "), std::string::npos) << e;
  EXPECT_NE(e.find("but this run's tokenizer is " + tok().model_path() + " (hash "), std::string::npos) << e;
  // Truncated: the size does not match the header.
  write_file(bad / "cut" / "x.ctok", bytes.substr(0, bytes.size() - 5));
  e = user_error_text([&] { DataLoader(tok(), (bad / "cut").string(), 16, 1, 0, 1); });
  EXPECT_NE(e.find("x.ctok: truncated or corrupt token shard: " + std::to_string(bytes.size() - 5) + " bytes"),
            std::string::npos)
      << e;
  write_file(bad / "tiny" / "x.ctok", bytes.substr(0, 50));
  e = user_error_text([&] { DataLoader(tok(), (bad / "tiny").string(), 16, 1, 0, 1); });
  EXPECT_NE(e.find("x.ctok: truncated token shard (50 bytes"), std::string::npos) << e;
  // A damaged offset table, found when the shard is opened for reading.
  std::string damaged = bytes;
  damaged[damaged.size() - 8 * 3 + 6] = static_cast<char>(0x7f);  // entry N-2 far past the tokens
  write_file(bad / "table" / "x.ctok", damaged);
  e = user_error_text([&] {
    DataLoader dl(tok(), (bad / "table").string(), 16, 1, 0, 1);
    dl.next();
  });
  EXPECT_NE(e.find("x.ctok: corrupt token shard: offset table entry"), std::string::npos) << e;
  write_file(bad / "magic" / "x.ctok", "PK" + bytes.substr(2));
  e = user_error_text([&] { DataLoader(tok(), (bad / "magic").string(), 16, 1, 0, 1); });
  EXPECT_NE(e.find("x.ctok: not a ctitan token shard"), std::string::npos) << e;
}

// A malformed line inside a range that starts mid-file is named by its line in the file (the
// reader counts the lines before its range only when a message needs them).
TEST(Sharding, ErrorsInsideARangeNameTheLineOfTheFile) {
  std::vector<std::string> docs(paragraphs().begin(), paragraphs().end());
  std::string lines;
  for (size_t i = 0; i < docs.size(); ++i)
    lines += (i == 31 ? std::string("{\"text\": oops}") : "{\"text\": " + json_str(docs[i]) + "}") + "\n";
  const std::string src = write_file(Env::dir_ / "range_error" / "e.jsonl", lines);
  DataLoader dl(tok(), src, 16, 1, 1, 2);  // rank 1 of 2: the second half of the bytes
  const std::string e = user_error_text([&] {
    for (int i = 0; i < 1000; ++i) dl.next();
  });
  EXPECT_NE(e.find("dataset: " + src + ":32: invalid JSON"), std::string::npos) << e;
}

// Resume on the same number of ranks, each format (the .txt and .json files single, so their
// ranks hold byte ranges; the .gz file shared by stride; 3 .ctok shards on 2 and 3 ranks,
// document ranges on 4): the batches after a restore equal the uninterrupted loader's, across
// the re-loop, and the restored state equals the saved one.
TEST(Sharding, SameDegreeResumeIsExactInEachFormat) {
  const auto& p = paragraphs();
  std::string txt;
  for (const auto& para : p) txt += para + "\n\n";
  const std::string jsonl_dir = make_jsonl_files("same_jsonl", 3);
  const std::string ctok_dir = (Env::dir_ / "same_ctok").string();
  ctitan::tokenize_corpus(jsonl_dir, tok(), ctok_dir, false);
  const std::vector<std::string> sources = {write_file(Env::dir_ / "same_txt" / "all.txt", txt), jsonl_dir,
                                            write_file(Env::dir_ / "same_json" / "all.json", jsonl_of(p)),
                                            write_gz(Env::dir_ / "same_gz" / "all.jsonl.gz", jsonl_of(p)), ctok_dir};
  for (const std::string& src : sources)
    for (const int64_t W : {2, 3, 4}) {
      SCOPED_TRACE(src + " on " + std::to_string(W) + " ranks");
      for (int64_t r = 0; r < W; ++r) {
        DataLoader a(tok(), src, 12, 2, r, W);
        for (int i = 0; i < 3 + r; ++i) a.next();
        const std::string saved = a.state_dict();
        std::vector<Batch> continued, resumed;
        for (int i = 0; i < 80; ++i) continued.push_back(a.next());
        EXPECT_GE(a.epoch(), 1) << "the run went past the end of its share";
        DataLoader b(tok(), src, 12, 2, r, W);
        b.load_state_dict(saved);
        EXPECT_EQ(b.state_dict(), saved);
        for (int i = 0; i < 80; ++i) resumed.push_back(b.next());
        expect_same(continued, resumed);
      }
    }
}

}  // namespace
