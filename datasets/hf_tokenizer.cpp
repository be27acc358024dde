// Hugging Face byte-level BPE; see hf_tokenizer.h for the pipeline and what is supported.
#include "datasets/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "util/text.h"
#include "util/json.h"

namespace ctitan {
namespace {

using json::Value;

// ---- UTF-8 -------------------------------------------------------------------------------

// Length of the valid UTF-8 sequence at s[i], or 0 when it is not one (overlongs, surrogates
// and code points above U+10FFFF are invalid, as in Rust's and Python's decoders).
size_t utf8_seq_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + 1 >= s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (i + k >= s.size() || (b(i + k) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// Byte offset of the first invalid sequence, or npos.
size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_seq_len(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

// The code point at s[i] (valid UTF-8 assumed); advances i.
uint32_t next_code_point(std::string_view s, size_t* i) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[k])); };
  const uint32_t c = b(*i);
  if (c < 0x80) {
    *i += 1;
    return c;
  }
  if (c < 0xE0) {
    const uint32_t cp = ((c & 0x1F) << 6) | (b(*i + 1) & 0x3F);
    *i += 2;
    return cp;
  }
  if (c < 0xF0) {
    const uint32_t cp = ((c & 0x0F) << 12) | ((b(*i + 1) & 0x3F) << 6) | (b(*i + 2) & 0x3F);
    *i += 3;
    return cp;
  }
  const uint32_t cp = ((c & 0x07) << 18) | ((b(*i + 1) & 0x3F) << 12) | ((b(*i + 2) & 0x3F) << 6) | (b(*i + 3) & 0x3F);
  *i += 4;
  return cp;
}

// The code point that ends at s[end) (valid UTF-8 assumed); sets *start to its first byte.
uint32_t prev_code_point(std::string_view s, size_t end, size_t* start) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  *start = i;
  size_t j = i;
  return next_code_point(s, &j);
}

// Bytes -> text as Rust's String::from_utf8_lossy (what tokenizers' ByteLevel decoder ends
// with): each maximal invalid subpart becomes one U+FFFD.
std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = utf8_seq_len(s, i);
    if (n > 0) {
      out.append(s.data() + i, n);
      i += n;
      continue;
    }
    // Skip the lead byte and the continuation bytes that were still valid after it.
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t k = 1;
    size_t want = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
    if (want > 1) {
      unsigned char lo = 0x80, hi = 0xBF;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
      while (k < want && i + k < s.size()) {
        const unsigned char d = static_cast<unsigned char>(s[i + k]);
        if (k == 1 ? (d < lo || d > hi) : (d & 0xC0) != 0x80) break;
        ++k;
      }
    }
    out += "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

// ---- Unicode classes (ICU), as Rust's regex crate defines them for tokenizers' added tokens

bool is_white_space(uint32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE); }

// \w: Alphabetic, marks, decimal numbers, connector punctuation, Join_Control.
bool is_word_char(uint32_t c) {
  const auto cp = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) || u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL)) return true;
  const int8_t t = u_charType(cp);
  return t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK ||
         t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION;
}

// ---- the byte-level alphabet (GPT-2's bytes_to_unicode) ----------------------------------

struct ByteAlphabet {
  uint32_t byte_to_cp[256];
  int16_t cp_to_byte[324];  // code points used are < 256 + 68
  ByteAlphabet() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), int16_t{-1});
    uint32_t extra = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_to_cp[b] = printable ? b : 256 + extra++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// A byte-level token ("Ġthe") -> its raw bytes (" the"); false when a character is outside
// the alphabet (an added token such as "hello world" is then its own UTF-8).
bool byte_level_to_raw(std::string_view token, std::string* raw) {
  raw->clear();
  if (find_invalid_utf8(token) != std::string_view::npos) return false;
  const ByteAlphabet& a = alphabet();
  size_t i = 0;
  while (i < token.size()) {
    const uint32_t cp = next_code_point(token, &i);
    if (cp >= 324 || a.cp_to_byte[cp] < 0) return false;
    raw->push_back(static_cast<char>(a.cp_to_byte[cp]));
  }
  return true;
}

std::string raw_to_byte_level(std::string_view raw) {
  std::string out;
  for (unsigned char b : raw) append_utf8(&out, alphabet().byte_to_cp[b]);
  return out;
}

// ---- JSON access with errors that name the file and the field ----------------------------

struct JsonFile {
  std::string path;
  [[noreturn]] void fail(const std::string& what) const {
    throw UserError("tokenizer: cannot load " + path + ": " + what);
  }
  [[noreturn]] void unsupported(const std::string& what) const {
    throw UserError("tokenizer: " + path + " uses " + what +
                    ", which ctitan does not support (supported: byte-level BPE with a "
                    "none/NFC normalizer, Split + ByteLevel pre-tokenizers, ByteLevel / "
                    "TemplateProcessing post-processors, a ByteLevel decoder)");
  }
  const Value& member(const Value& obj, const char* key, const std::string& where) const {
    const Value* v = obj.find(key);
    if (v == nullptr) fail(where + " has no \"" + key + "\"");
    return *v;
  }
  std::string str(const Value& v, const std::string& where) const {
    if (v.type != Value::Type::String) fail(where + " is a " + json::type_name(v.type) + ", expected a string");
    return v.text;
  }
  bool flag(const Value& obj, const char* key, bool dflt, const std::string& where) const {
    const Value* v = obj.find(key);
    if (v == nullptr || v->type == Value::Type::Null) return dflt;
    if (v->type != Value::Type::Bool) fail(where + "." + key + " is not a boolean");
    return v->boolean;
  }
  int64_t integer(const Value& v, const std::string& where) const {
    int64_t out = 0;
    if (v.type != Value::Type::Number || !v.as_int64(&out)) fail(where + " is not an integer");
    return out;
  }
  const std::string& type_of(const Value& v, const std::string& where) const {
    if (v.type != Value::Type::Object) fail(where + " is not an object");
    const Value* t = v.find("type");
    if (t == nullptr || t->type != Value::Type::String) fail(where + " has no \"type\"");
    return t->text;
  }
};

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("tokenizer: cannot load " + path + ": No such file or unreadable");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Value parse_json_file(const std::string& path) {
  const std::string text = read_whole_file(path);
  Value v;
  std::string err;
  if (!json::parse(text, &v, &err)) throw UserError("tokenizer: cannot load " + path + ": not JSON: " + err);
  return v;
}

// ---- regex (PCRE2) -----------------------------------------------------------------------

// Oniguruma (tokenizers) -> PCRE2: \s is Unicode White_Space in Oniguruma but leaves out
// U+0085 in PCRE2 with UCP; \h is a hex digit in Oniguruma (horizontal space in PCRE2).
std::string onig_to_pcre2(const std::string& p, const JsonFile& file) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's') {
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      } else if (e == 'S' && !in_class) {
        out += "[^\\s\\x{85}]";
      } else if (e == 'h') {
        out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
      } else if (e == 'H' && !in_class) {
        out += "[^0-9a-fA-F]";
      } else if ((e == 'S' || e == 'H') && in_class) {
        file.unsupported("a regex with \\" + std::string(1, e) + " inside a character class (" + p + ")");
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is literal
      continue;
    }
    if (in_class && c == '[') {
      if (i + 1 < p.size() && p[i + 1] == ':') {  // POSIX class [:alpha:]
        const size_t close = p.find(":]", i + 2);
        if (close == std::string::npos) file.unsupported("the regex " + p);
        out.append(p, i, close + 2 - i);
        i = close + 1;
        continue;
      }
      file.unsupported("a regex with a nested character class (Oniguruma set operations) (" + p + ")");
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// Per-thread PCRE2 match state: match data, and a JIT stack larger than the default 32 KiB
// (long runs such as \s+ over a page of whitespace).
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(4, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    if (data == nullptr || context == nullptr || stack == nullptr) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const JsonFile& file) : source_(pattern) {
    int err = 0;
    PCRE2_SIZE at = 0;
    const std::string translated = literal ? pattern : onig_to_pcre2(pattern, file);
    uint32_t opts = PCRE2_UTF | PCRE2_UCP;
    if (literal) opts |= PCRE2_LITERAL;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), opts, &err, &at, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      file.unsupported("the regex " + pattern + " (PCRE2: " + reinterpret_cast<const char*>(msg) + " at offset " +
                       std::to_string(at) + ")");
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // fn(start, end) for each leftmost, non-overlapping match in s (valid UTF-8).
  template <typename Fn>
  void for_each_match(std::string_view s, Fn&& fn) const {
    MatchScratch& m = scratch();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t pos = 0;
    while (pos <= s.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, m.data, m.context)
                          : pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, m.data, m.context);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        throw RuntimeFailure("tokenizer: regex " + source_ + " failed on a " + std::to_string(s.size()) +
                             "-byte piece: " + reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.data);
      const size_t start = ov[0], end = ov[1];
      if (end == start) {  // an empty match: nothing to split off; step over one character
        if (start >= s.size()) return;
        const size_t n = utf8_seq_len(s, start);
        pos = start + (n ? n : 1);
        continue;
      }
      fn(start, end);
      pos = end;
    }
  }

 private:
  std::string source_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// GPT-2's pre-tokenizer pattern: what ByteLevel with use_regex splits with.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- NFC (ICU) ---------------------------------------------------------------------------

const icu::Normalizer2& nfc() {
  static const icu::Normalizer2* n = [] {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* p = icu::Normalizer2::getNFCInstance(status);
    if (U_FAILURE(status) || p == nullptr)
      throw RuntimeFailure(std::string("tokenizer: ICU's NFC normalizer is unavailable: ") + u_errorName(status));
    return p;
  }();
  return *n;
}

// True when s changed; the NFC form is then in *out.
bool nfc_normalize(std::string_view s, std::string* out) {
  bool ascii = true;
  for (unsigned char c : s) {
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return false;
  UErrorCode status = U_ZERO_ERROR;
  const icu::StringPiece piece(s.data(), static_cast<int32_t>(s.size()));
  if (nfc().isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return false;
  status = U_ZERO_ERROR;
  out->clear();
  icu::StringByteSink<std::string> sink(out);
  nfc().normalizeUTF8(0, piece, sink, nullptr, status);
  if (U_FAILURE(status)) throw RuntimeFailure(std::string("tokenizer: NFC failed: ") + u_errorName(status));
  return true;
}

// ---- added tokens ------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
  bool operator==(const AddedToken& o) const {
    return content == o.content && single_word == o.single_word && lstrip == o.lstrip && rstrip == o.rstrip &&
           normalized == o.normalized && special == o.special;
  }
};

// Leftmost-longest matching of a set of strings (what tokenizers' Aho-Corasick automaton
// with MatchKind::LeftmostLongest finds), by first byte: added tokens are few and their first
// bytes rare ('<' for the 256 specials of a 128K tiktoken-style vocabulary).
class TokenMatcher {
 public:
  void build(const std::vector<std::pair<std::string, int32_t>>& tokens) {
    by_first_.assign(256, {});
    any_ = false;
    for (const auto& [text, id] : tokens) {
      if (text.empty()) continue;
      by_first_[static_cast<unsigned char>(text[0])].push_back({text, id});
      any_ = true;
    }
    for (auto& v : by_first_) {
      std::stable_sort(v.begin(), v.end(),
                       [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    }
  }
  bool empty() const { return !any_; }
  struct Match {
    size_t start, end;
    int32_t id;
  };
  std::vector<Match> find_all(std::string_view s) const {
    std::vector<Match> out;
    if (!any_) return out;
    size_t i = 0;
    while (i < s.size()) {
      const auto& cands = by_first_[static_cast<unsigned char>(s[i])];
      bool hit = false;
      for (const auto& [text, id] : cands) {  // longest first
        if (s.compare(i, text.size(), text) == 0) {
          out.push_back({i, i + text.size(), id});
          i += text.size();
          hit = true;
          break;
        }
      }
      if (!hit) ++i;
    }
    return out;
  }

 private:
  std::vector<std::vector<std::pair<std::string, int32_t>>> by_first_;
  bool any_ = false;
};

// ---- pre-tokenizers, post-processor, decoder ---------------------------------------------

struct PreTokenizer {
  enum class Kind { Split, ByteLevel } kind;
  std::unique_ptr<Regex> regex;   // Split's pattern, or GPT-2's for ByteLevel with use_regex
  bool remove_matches = false;    // Split behavior "Removed" (else "Isolated")
  bool add_prefix_space = false;  // ByteLevel
};

struct TemplatePiece {
  bool sequence;  // Sequence A, else a special token's ids
  std::vector<int32_t> ids;
};

}  // namespace

// ---- the implementation ------------------------------------------------------------------

struct HfTokenizer::Impl {
  std::string path;
  // Model: BPE over byte-level symbols.
  std::unordered_map<std::string, int32_t> vocab;      // byte-level token -> id
  std::unordered_map<std::string, int32_t> raw_vocab;  // its raw bytes -> id (ignore_merges)
  std::vector<std::string> id_to_token;                // model ids; "" where none
  std::vector<bool> has_token;
  int64_t model_vocab_size = 0;  // tokenizers' model.get_vocab_size(): the vocab's entries
  int32_t byte_id[256];
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged id)
  int32_t unk = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;

  // Added tokens, as tokenizers' AddedVocabulary keeps them.
  std::map<std::string, int32_t> added_ids;               // content -> id
  std::unordered_map<int32_t, AddedToken> added;          // id -> token (latest flags)
  std::vector<std::string> special_order, classic_order;  // registration order
  std::unordered_set<std::string> special_set;
  std::unordered_map<std::string, bool> trie_normalized;  // content -> normalized flag used for matching
  TokenMatcher raw_matcher, normalized_matcher;

  bool nfc = false;
  std::vector<PreTokenizer> pre;
  std::vector<TemplatePiece> single_template;  // empty: no TemplateProcessing
  enum class Decoder { ByteLevel, None } decoder = Decoder::ByteLevel;

  // Cache of pre-token (raw bytes) -> ids, in one arena.
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::pair<uint32_t, uint32_t>> cache;
  mutable std::vector<int32_t> cache_ids;
  static constexpr size_t kCacheMaxEntries = 1 << 20;
  static constexpr size_t kCacheMaxKey = 256;

  int32_t token_to_id(const std::string& t) const {
    if (auto it = added_ids.find(t); it != added_ids.end()) return it->second;
    if (auto it = vocab.find(t); it != vocab.end()) return it->second;
    return -1;
  }

  void add_vocab_entry(const std::string& token, int64_t id, const JsonFile& file) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max() - 1)
      file.fail("vocabulary id " + std::to_string(id) + " of " + token + " is out of range");
    const auto i32 = static_cast<int32_t>(id);
    vocab[token] = i32;  // duplicate keys: the last wins, as in a Python/serde map
    if (static_cast<size_t>(id) >= id_to_token.size()) {
      id_to_token.resize(static_cast<size_t>(id) + 1);
      has_token.resize(static_cast<size_t>(id) + 1, false);
    }
    id_to_token[static_cast<size_t>(id)] = token;
    has_token[static_cast<size_t>(id)] = true;
  }

  void finish_vocab() {
    model_vocab_size = static_cast<int64_t>(vocab.size());
    std::string raw;
    for (const auto& [tok, id] : vocab) {
      if (byte_level_to_raw(tok, &raw)) raw_vocab[raw] = id;
    }
    for (int b = 0; b < 256; ++b) {
      const auto it = vocab.find(raw_to_byte_level(std::string(1, static_cast<char>(b))));
      byte_id[b] = it == vocab.end() ? -1 : it->second;
    }
  }

  void add_merge(const std::string& a, const std::string& b, int32_t rank, const JsonFile& file) {
    const auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || im == vocab.end()) {
      file.fail("merge \"" + a + " " + b + "\" (rank " + std::to_string(rank) +
                ") uses a token that is not in the vocabulary");
    }
    const uint64_t key =
        (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) | static_cast<uint32_t>(ib->second);
    merges[key] = {rank, im->second};  // a repeated pair: the last rank wins, as in tokenizers
  }

  // tokenizers' AddedVocabulary::add_tokens for one token.
  void add_token(const AddedToken& t) {
    if (t.special && !t.content.empty() && special_set.insert(t.content).second) {
      special_order.push_back(t.content);
      trie_normalized.emplace(t.content, t.normalized);
    }
    if (t.content.empty()) return;
    for (const auto& [id, have] : added) {
      if (have == t) return;
    }
    int32_t id = token_to_id(t.content);
    if (id < 0) {
      int32_t max_added = -1;
      for (const auto& [c, i] : added_ids) max_added = std::max(max_added, i);
      const auto model_size = static_cast<int32_t>(model_vocab_size);
      id = max_added < 0 ? model_size : (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
    }
    added_ids[t.content] = id;
    added[id] = t;
    if (!special_set.count(t.content)) {
      classic_order.push_back(t.content);
      trie_normalized.emplace(t.content, t.normalized);
    }
  }

  void refresh_matchers() {
    std::vector<std::pair<std::string, int32_t>> raw, normalized;
    std::unordered_set<std::string> seen;
    auto take = [&](const std::string& content) {
      if (!seen.insert(content).second) return;
      const int32_t id = token_to_id(content);
      if (trie_normalized.at(content)) {
        std::string n;
        normalized.push_back({nfc && nfc_normalize(content, &n) ? n : content, id});
      } else {
        raw.push_back({content, id});
      }
    };
    for (const auto& c : special_order) take(c);
    for (const auto& c : classic_order) take(c);
    raw_matcher.build(raw);
    normalized_matcher.build(normalized);
  }

  // ---- encoding ----

  // BPE of one pre-token (raw bytes): tokenizers' Word::merge_all — repeatedly the pair of
  // lowest rank, the leftmost of equal ranks — on a linked list with a heap of candidates.
  void bpe(std::string_view raw, std::vector<int32_t>* out) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;
      bool alive;
    };
    thread_local std::vector<Sym> syms;
    syms.clear();
    for (unsigned char b : raw) {
      const int32_t id = byte_id[b];
      if (id >= 0) {
        syms.push_back({id, 0, 0, true});
      } else if (unk >= 0) {
        if (fuse_unk && !syms.empty() && syms.back().id == unk) continue;
        syms.push_back({unk, 0, 0, true});
      }  // no unk token: the byte is dropped, as tokenizers does
    }
    const int32_t n = static_cast<int32_t>(syms.size());
    for (int32_t i = 0; i < n; ++i) {
      syms[i].prev = i - 1;
      syms[i].next = i + 1 < n ? i + 1 : -1;
    }
    auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
      const auto it = merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b));
      return it == merges.end() ? nullptr : &it->second;
    };
    struct Cand {
      int32_t rank, pos, new_id;
      bool operator<(const Cand& o) const {  // priority_queue pops the largest: invert
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Cand> heap;
    for (int32_t i = 0; i + 1 < n; ++i) {
      if (const auto* m = lookup(syms[i].id, syms[i + 1].id)) heap.push({m->first, i, m->second});
    }
    while (!heap.empty()) {
      const Cand top = heap.top();
      heap.pop();
      Sym& left = syms[top.pos];
      if (!left.alive || left.next < 0) continue;
      Sym& right = syms[left.next];
      const auto* m = lookup(left.id, right.id);
      if (m == nullptr || m->second != top.new_id) continue;  // stale candidate
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) syms[left.next].prev = top.pos;
      if (left.prev >= 0) {
        if (const auto* pm = lookup(syms[left.prev].id, left.id)) heap.push({pm->first, left.prev, pm->second});
      }
      if (left.next >= 0) {
        if (const auto* nm = lookup(left.id, syms[left.next].id)) heap.push({nm->first, top.pos, nm->second});
      }
    }
    for (int32_t i = n ? 0 : -1; i >= 0; i = syms[i].next) out->push_back(syms[i].id);
  }

  void tokenize_pre_token(std::string_view raw, std::vector<int32_t>* out) const {
    if (raw.empty()) return;
    const bool cacheable = raw.size() <= kCacheMaxKey;
    std::string key;
    if (cacheable) {
      key.assign(raw.data(), raw.size());
      std::lock_guard<std::mutex> lock(cache_mu);
      const auto it = cache.find(key);
      if (it != cache.end()) {
        out->insert(out->end(), cache_ids.begin() + it->second.first,
                    cache_ids.begin() + it->second.first + it->second.second);
        return;
      }
    }
    const size_t before = out->size();
    bool whole = false;
    if (ignore_merges) {
      if (const auto it = raw_vocab.find(key.empty() ? std::string(raw) : key); it != raw_vocab.end()) {
        out->push_back(it->second);
        whole = true;
      }
    }
    if (!whole) bpe(raw, out);
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mu);
      if (cache.size() < kCacheMaxEntries && !cache.count(key)) {
        cache.emplace(std::move(key), std::make_pair(static_cast<uint32_t>(cache_ids.size()),
                                                     static_cast<uint32_t>(out->size() - before)));
        cache_ids.insert(cache_ids.end(), out->begin() + static_cast<std::ptrdiff_t>(before), out->end());
      }
    }
  }

  // Pre-tokenizer `level` and the ones after it on one piece, then BPE.
  void pre_tokenize(size_t level, std::string_view piece, std::vector<int32_t>* out) const {
    if (piece.empty()) return;
    if (level == pre.size()) {
      tokenize_pre_token(piece, out);
      return;
    }
    const PreTokenizer& p = pre[level];
    if (p.kind == PreTokenizer::Kind::ByteLevel) {
      std::string prefixed;
      if (p.add_prefix_space && piece.front() != ' ') {
        prefixed.reserve(piece.size() + 1);
        prefixed.push_back(' ');
        prefixed.append(piece.data(), piece.size());
        piece = prefixed;
      }
      if (!p.regex) {
        pre_tokenize(level + 1, piece, out);
        return;
      }
      split(level, *p.regex, false, piece, out);
      return;
    }
    split(level, *p.regex, p.remove_matches, piece, out);
  }

  void split(size_t level, const Regex& re, bool remove, std::string_view piece, std::vector<int32_t>* out) const {
    size_t prev = 0;
    re.for_each_match(piece, [&](size_t start, size_t end) {
      if (start > prev) pre_tokenize(level + 1, piece.substr(prev, start - prev), out);
      if (!remove) pre_tokenize(level + 1, piece.substr(start, end - start), out);
      prev = end;
    });
    if (prev < piece.size()) pre_tokenize(level + 1, piece.substr(prev), out);
  }

  // tokenizers' find_matches: token matches with single_word / lstrip / rstrip applied;
  // calls gap(start, end) for text between them and token(id) for each token, in order.
  template <typename Gap, typename Tok>
  void split_added(std::string_view s, const TokenMatcher& matcher, Gap&& gap, Tok&& token) const {
    size_t start_offset = 0;
    if (!matcher.empty()) {
      for (const auto& m : matcher.find_all(s)) {
        size_t start = m.start, stop = m.end;
        const AddedToken& t = added.at(m.id);
        if (t.single_word) {
          size_t ps = 0;
          const bool start_space = start == 0 || !is_word_char(prev_code_point(s, start, &ps));
          size_t j = stop;
          const bool stop_space = stop == s.size() || !is_word_char(next_code_point(s, &j));
          if (!start_space || !stop_space) continue;
        }
        if (t.lstrip) {
          size_t new_start = start;
          while (new_start > 0) {
            size_t ps = 0;
            if (!is_white_space(prev_code_point(s, new_start, &ps))) break;
            new_start = ps;
          }
          start = std::max(new_start, start_offset);
        }
        if (t.rstrip) {
          while (stop < s.size()) {
            size_t j = stop;
            if (!is_white_space(next_code_point(s, &j))) break;
            stop = j;
          }
        }
        if (start_offset < start) gap(start_offset, start);
        token(m.id);
        start_offset = stop;
      }
    }
    if (start_offset < s.size()) gap(start_offset, s.size());
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
    std::string normalized;
    if (nfc && nfc_normalize(piece, &normalized)) piece = normalized;
    split_added(
        piece, normalized_matcher, [&](size_t a, size_t b) { pre_tokenize(0, piece.substr(a, b - a), out); },
        [&](int32_t id) { out->push_back(id); });
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const {
    if (const size_t bad = find_invalid_utf8(text); bad != std::string_view::npos) {
      throw RuntimeFailure("tokenizer: the text to encode is not valid UTF-8 (byte " + std::to_string(bad) + " of " +
                           std::to_string(text.size()) + ")");
    }
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    split_added(
        text, raw_matcher, [&](size_t a, size_t b) { encode_piece(text.substr(a, b - a), &ids); },
        [&](int32_t id) { ids.push_back(id); });
    if (!add_special_tokens || single_template.empty()) return ids;
    std::vector<int32_t> framed;
    framed.reserve(ids.size() + 4);
    for (const auto& piece : single_template) {
      if (piece.sequence) {
        framed.insert(framed.end(), ids.begin(), ids.end());
      } else {
        framed.insert(framed.end(), piece.ids.begin(), piece.ids.end());
      }
    }
    return framed;
  }
};

// ---- loading -----------------------------------------------------------------------------

namespace {

void parse_normalizer(const Value* v, const JsonFile& f, HfTokenizer::Impl* impl) {
  if (v == nullptr || v->type == Value::Type::Null) return;
  const std::string& type = f.type_of(*v, "normalizer");
  if (type == "NFC") {
    impl->nfc = true;
  } else if (type == "Sequence") {
    const Value& list = f.member(*v, "normalizers", "normalizer (Sequence)");
    if (list.type != Value::Type::Array) f.fail("normalizer.normalizers is not an array");
    for (const auto& n : list.items) parse_normalizer(&n, f, impl);
  } else {
    f.unsupported("the normalizer " + type);
  }
}

void parse_pre_tokenizer(const Value* v, const JsonFile& f, HfTokenizer::Impl* impl) {
  if (v == nullptr || v->type == Value::Type::Null) return;
  const std::string& type = f.type_of(*v, "pre_tokenizer");
  if (type == "Sequence") {
    const Value& list = f.member(*v, "pretokenizers", "pre_tokenizer (Sequence)");
    if (list.type != Value::Type::Array) f.fail("pre_tokenizer.pretokenizers is not an array");
    for (const auto& p : list.items) parse_pre_tokenizer(&p, f, impl);
    return;
  }
  PreTokenizer p;
  if (type == "ByteLevel") {
    p.kind = PreTokenizer::Kind::ByteLevel;
    p.add_prefix_space = f.flag(*v, "add_prefix_space", true, "pre_tokenizer ByteLevel");
    if (f.flag(*v, "use_regex", true, "pre_tokenizer ByteLevel")) {
      p.regex = std::make_unique<Regex>(kGpt2Pattern, false, f);
    }
  } else if (type == "Split") {
    p.kind = PreTokenizer::Kind::Split;
    const Value& pattern = f.member(*v, "pattern", "pre_tokenizer Split");
    bool literal = false;
    std::string text;
    if (const Value* r = pattern.find("Regex")) {
      text = f.str(*r, "pre_tokenizer Split pattern.Regex");
    } else if (const Value* s = pattern.find("String")) {
      text = f.str(*s, "pre_tokenizer Split pattern.String");
      literal = true;
    } else {
      f.fail("pre_tokenizer Split has a pattern that is neither Regex nor String");
    }
    if (f.flag(*v, "invert", false, "pre_tokenizer Split")) f.unsupported("a Split pre-tokenizer with invert = true");
    const std::string behavior = f.str(f.member(*v, "behavior", "pre_tokenizer Split"), "pre_tokenizer Split behavior");
    if (behavior == "Removed") {
      p.remove_matches = true;
    } else if (behavior != "Isolated") {
      f.unsupported("a Split pre-tokenizer with behavior " + behavior + " (ctitan: Isolated, Removed)");
    }
    p.regex = std::make_unique<Regex>(text, literal, f);
  } else {
    f.unsupported("the pre-tokenizer " + type);
  }
  impl->pre.push_back(std::move(p));
}

void parse_model(const Value& m, const JsonFile& f, HfTokenizer::Impl* impl) {
  if (m.type != Value::Type::Object) f.fail("\"model\" is not an object");
  const Value* type = m.find("type");
  const std::string t = type && type->type == Value::Type::String ? type->text : "BPE";
  if (t != "BPE") f.unsupported("the model type " + t + " (ctitan reads BPE only)");
  if (const Value* d = m.find("dropout"); d && d->type != Value::Type::Null) {
    double p = std::strtod(d->text.c_str(), nullptr);
    if (d->type != Value::Type::Number || p != 0.0) f.unsupported("BPE dropout " + d->text);
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const Value* s = m.find(key);
        s && s->type != Value::Type::Null && !(s->type == Value::Type::String && s->text.empty())) {
      f.unsupported(std::string("BPE ") + key + " \"" + s->text + "\"");
    }
  }
  if (f.flag(m, "byte_fallback", false, "model")) f.unsupported("BPE byte_fallback = true");
  impl->fuse_unk = f.flag(m, "fuse_unk", false, "model");
  impl->ignore_merges = f.flag(m, "ignore_merges", false, "model");

  const Value& vocab = f.member(m, "vocab", "model");
  if (vocab.type != Value::Type::Object) f.fail("model.vocab is not an object");
  for (const auto& [tok, id] : vocab.members) impl->add_vocab_entry(tok, f.integer(id, "model.vocab[" + tok + "]"), f);
  impl->finish_vocab();
  if (const Value* u = m.find("unk_token"); u && u->type != Value::Type::Null) {
    const std::string unk = f.str(*u, "model.unk_token");
    const auto it = impl->vocab.find(unk);
    // tokenizers fails only when an unknown character meets a missing unk token; ctitan
    // checks up front.
    if (it == impl->vocab.end()) f.fail("model.unk_token \"" + unk + "\" is not in the vocabulary");
    impl->unk = it->second;
  }

  const Value& merges = f.member(m, "merges", "model");
  if (merges.type != Value::Type::Array) f.fail("model.merges is not an array");
  int32_t rank = 0;
  for (const auto& mv : merges.items) {
    if (mv.type == Value::Type::String) {  // "a b" (tokenizers < 0.20)
      const size_t sp = mv.text.find(' ');
      if (sp == std::string::npos || mv.text.find(' ', sp + 1) != std::string::npos) {
        f.fail("merge " + std::to_string(rank) + " \"" + mv.text + "\" is not two tokens separated by one space");
      }
      impl->add_merge(mv.text.substr(0, sp), mv.text.substr(sp + 1), rank, f);
    } else if (mv.type == Value::Type::Array && mv.items.size() == 2) {  // ["a", "b"]
      impl->add_merge(f.str(mv.items[0], "merge " + std::to_string(rank)),
                      f.str(mv.items[1], "merge " + std::to_string(rank)), rank, f);
    } else {
      f.fail("merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    ++rank;
  }
}

void parse_post_processor(const Value* v, const JsonFile& f, HfTokenizer::Impl* impl) {
  if (v == nullptr || v->type == Value::Type::Null) return;
  const std::string& type = f.type_of(*v, "post_processor");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const Value& list = f.member(*v, "processors", "post_processor (Sequence)");
    if (list.type != Value::Type::Array) f.fail("post_processor.processors is not an array");
    for (const auto& p : list.items) parse_post_processor(&p, f, impl);
    return;
  }
  if (type != "TemplateProcessing") f.unsupported("the post-processor " + type);
  if (!impl->single_template.empty()) f.unsupported("two TemplateProcessing post-processors");
  const Value& single = f.member(*v, "single", "post_processor TemplateProcessing");
  const Value& specials = f.member(*v, "special_tokens", "post_processor TemplateProcessing");
  if (single.type != Value::Type::Array) f.fail("post_processor.single is not an array");
  for (const auto& piece : single.items) {
    TemplatePiece tp;
    if (const Value* seq = piece.find("Sequence")) {
      const std::string id =
          f.str(f.member(*seq, "id", "post_processor.single Sequence"), "post_processor.single Sequence.id");
      if (id != "A") f.unsupported("a TemplateProcessing single template with sequence " + id);
      tp.sequence = true;
    } else if (const Value* st = piece.find("SpecialToken")) {
      tp.sequence = false;
      const std::string name =
          f.str(f.member(*st, "id", "post_processor.single SpecialToken"), "post_processor.single SpecialToken.id");
      const Value* entry = specials.find(name);
      if (entry == nullptr) f.fail("post_processor.special_tokens has no \"" + name + "\"");
      const Value& ids = f.member(*entry, "ids", "post_processor.special_tokens[" + name + "]");
      if (ids.type != Value::Type::Array) f.fail("post_processor.special_tokens[" + name + "].ids is not an array");
      for (const auto& id : ids.items)
        tp.ids.push_back(static_cast<int32_t>(f.integer(id, "post_processor.special_tokens[" + name + "].ids")));
    } else {
      f.fail("post_processor.single has an item that is neither Sequence nor SpecialToken");
    }
    impl->single_template.push_back(std::move(tp));
  }
}

void parse_decoder(const Value* v, const JsonFile& f, HfTokenizer::Impl* impl) {
  if (v == nullptr || v->type == Value::Type::Null) {
    impl->decoder = HfTokenizer::Impl::Decoder::None;
    return;
  }
  const std::string& type = f.type_of(*v, "decoder");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const Value& list = f.member(*v, "decoders", "decoder (Sequence)");
    if (list.type != Value::Type::Array || list.items.size() != 1)
      f.unsupported("a Sequence decoder other than [ByteLevel]");
    parse_decoder(&list.items[0], f, impl);
    return;
  }
  f.unsupported("the decoder " + type);
}

AddedToken added_token_from_json(const Value& v, const JsonFile& f, const std::string& where) {
  AddedToken t;
  t.content = f.str(f.member(v, "content", where), where + ".content");
  t.single_word = f.flag(v, "single_word", false, where);
  t.lstrip = f.flag(v, "lstrip", false, where);
  t.rstrip = f.flag(v, "rstrip", false, where);
  t.normalized = f.flag(v, "normalized", true, where);
  t.special = f.flag(v, "special", false, where);
  return t;
}

std::string folder_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

}  // namespace

HfTokenizer::HfTokenizer() : impl_(std::make_unique<Impl>()) {}
HfTokenizer::~HfTokenizer() = default;

std::unique_ptr<HfTokenizer> HfTokenizer::from_tokenizer_json(const std::string& tokenizer_json) {
  const JsonFile f{tokenizer_json};
  const Value root = parse_json_file(tokenizer_json);
  if (root.type != Value::Type::Object) f.fail("the top level is not an object");
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  Impl& impl = *tok->impl_;
  impl.path = tokenizer_json;
  for (const char* key : {"truncation", "padding"}) {
    if (const Value* v = root.find(key); v && v->type != Value::Type::Null)
      f.unsupported(std::string(key) + " settings");
  }
  parse_model(f.member(root, "model", "the file"), f, &impl);
  parse_normalizer(root.find("normalizer"), f, &impl);
  parse_pre_tokenizer(root.find("pre_tokenizer"), f, &impl);
  bool byte_level = false;
  for (const auto& p : impl.pre) byte_level |= p.kind == PreTokenizer::Kind::ByteLevel;
  if (!byte_level) f.unsupported("BPE without a ByteLevel pre-tokenizer (ctitan reads byte-level BPE only)");
  parse_post_processor(root.find("post_processor"), f, &impl);
  parse_decoder(root.find("decoder"), f, &impl);
  if (const Value* added = root.find("added_tokens"); added && added->type != Value::Type::Null) {
    if (added->type != Value::Type::Array) f.fail("added_tokens is not an array");
    for (size_t i = 0; i < added->items.size(); ++i) {
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      const AddedToken t = added_token_from_json(added->items[i], f, where);
      impl.add_token(t);
      int64_t want = -1;
      if (const Value* id = added->items[i].find("id")) want = f.integer(*id, where + ".id");
      const int32_t got = impl.token_to_id(t.content);
      if (want >= 0 && got != want) {
        // tokenizers assigns the id itself and warns the same way.
        spdlog::warn("tokenizer: {}: added token {} was expected to have id {} but was given id {}", tokenizer_json,
                     t.content, want, got);
      }
    }
  }
  tok->finish_special_tokens(folder_of(tokenizer_json) + "/tokenizer_config.json");
  return tok;
}

std::unique_ptr<HfTokenizer> HfTokenizer::from_vocab_merges(const std::string& vocab_json,
                                                            const std::string& merges_txt) {
  const JsonFile f{vocab_json};
  const Value vocab = parse_json_file(vocab_json);
  if (vocab.type != Value::Type::Object) f.fail("the top level is not an object of token -> id");
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  Impl& impl = *tok->impl_;
  impl.path = vocab_json;
  for (const auto& [t, id] : vocab.members) impl.add_vocab_entry(t, f.integer(id, "vocab[" + t + "]"), f);
  impl.finish_vocab();
  // merges.txt as torchtitan reads it: stripped lines; empty ones and those starting with
  // '#' (the "#version" header) skipped; the first two whitespace-separated fields.
  std::ifstream in(merges_txt, std::ios::binary);
  if (!in) throw UserError("tokenizer: cannot load " + merges_txt + ": No such file or unreadable");
  const JsonFile mf{merges_txt};
  int32_t rank = 0;
  size_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    std::istringstream fields(line);
    std::string a, b;
    if (!(fields >> a) || a[0] == '#') continue;
    if (!(fields >> b)) continue;  // torchtitan skips lines with fewer than two fields
    impl.add_merge(a, b, rank++, mf);
  }
  PreTokenizer p;
  p.kind = PreTokenizer::Kind::ByteLevel;
  p.add_prefix_space = false;
  p.regex = std::make_unique<Regex>(kGpt2Pattern, false, f);
  impl.pre.push_back(std::move(p));
  tok->finish_special_tokens(folder_of(vocab_json) + "/tokenizer_config.json");
  return tok;
}

// torchtitan's HuggingFaceTokenizer: tokenizer_config.json's special tokens are added to the
// tokenizer as special tokens; BOS/EOS are the ids of its bos_token / eos_token; BOS/EOS are
// added by encode() only when the tokenizer's own post-processor does not add them.
void HfTokenizer::finish_special_tokens(const std::string& config_path) {
  Impl& impl = *impl_;
  {
    std::ifstream probe(config_path);
    if (!probe) {
      throw UserError("tokenizer: cannot load " + config_path +
                      ": No such file (torchtitan's HuggingFaceTokenizer needs tokenizer_config.json "
                      "beside the tokenizer files for BOS/EOS)");
    }
  }
  const JsonFile f{config_path};
  const Value cfg = parse_json_file(config_path);
  if (cfg.type != Value::Type::Object) f.fail("the top level is not an object");
  auto token_of = [&](const char* key) -> std::string {
    const Value* v = cfg.find(key);
    if (v == nullptr || v->type == Value::Type::Null) return {};
    if (v->type == Value::Type::String) return v->text;
    if (v->type == Value::Type::Object) return f.str(f.member(*v, "content", key), std::string(key) + ".content");
    f.fail(std::string(key) + " is neither a string nor an object with \"content\"");
  };
  const std::string bos_token = token_of("bos_token"), eos_token = token_of("eos_token");
  bool have_bos = false, have_eos = false;
  auto process = [&](const std::string& content, const Value* dict) {
    // As torchtitan: the token equal to bos_token is BOS, else the one equal to eos_token is
    // EOS (so a tokenizer whose bos_token and eos_token are the same string has no EOS).
    if (!bos_token.empty() && content == bos_token) {
      have_bos = true;
    } else if (!eos_token.empty() && content == eos_token) {
      have_eos = true;
    }
    AddedToken t;
    t.content = content;
    t.special = true;  // add_special_tokens makes every one special
    if (dict != nullptr) {
      t.single_word = f.flag(*dict, "single_word", false, content);
      t.lstrip = f.flag(*dict, "lstrip", false, content);
      t.rstrip = f.flag(*dict, "rstrip", false, content);
      t.normalized = f.flag(*dict, "normalized", true, content);
    } else {
      t.normalized = false;  // AddedToken(content, special=True): special tokens are not normalized
    }
    impl.add_token(t);
  };
  for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"}) {
    const Value* v = cfg.find(key);
    if (v == nullptr || v->type == Value::Type::Null) continue;
    process(token_of(key), v->type == Value::Type::Object ? v : nullptr);
  }
  if (const Value* dec = cfg.find("added_tokens_decoder"); dec && dec->type == Value::Type::Object) {
    for (const auto& [id, v] : dec->members) {
      if (v.type == Value::Type::Object && v.find("content") != nullptr) {
        process(f.str(*v.find("content"), "added_tokens_decoder[" + id + "].content"), &v);
      }
    }
  }
  impl.refresh_matchers();
  const Value* add_bos = cfg.find("add_bos_token");
  const Value* add_eos = cfg.find("add_eos_token");
  default_add_bos_ = add_bos && add_bos->type == Value::Type::Bool && add_bos->boolean;
  default_add_eos_ = add_eos && add_eos->type == Value::Type::Bool && add_eos->boolean;

  model_path_ = impl.path;
  bos_id_ = have_bos ? impl.token_to_id(bos_token) : -1;
  eos_id_ = have_eos ? impl.token_to_id(eos_token) : -1;
  unk_id_ = impl.unk;
  pad_id_ = cfg.find("pad_token") ? impl.token_to_id(token_of("pad_token")) : -1;
  int64_t max_id = static_cast<int64_t>(impl.id_to_token.size()) - 1;
  for (const auto& [content, id] : impl.added_ids) max_id = std::max<int64_t>(max_id, id);
  vocab_size_ = max_id + 1;
  // torchtitan: does the tokenizer itself frame an empty text with BOS / EOS?
  const std::vector<int32_t> empty = impl.encode("", true);
  adds_bos_ = bos_id_ >= 0 && std::find(empty.begin(), empty.end(), bos_id_) != empty.end();
  adds_eos_ = eos_id_ >= 0 && std::find(empty.begin(), empty.end(), eos_id_) != empty.end();
}

std::vector<int32_t> HfTokenizer::encode_ids(const std::string& text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::vector<int32_t> HfTokenizer::encode(const std::string& text, bool bos, bool eos) const {
  std::vector<int32_t> ids = impl_->encode(text, true);
  if (bos && !adds_bos_ && bos_id_ >= 0) ids.insert(ids.begin(), bos_id_);
  if (eos && !adds_eos_ && eos_id_ >= 0) ids.push_back(eos_id_);
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& impl = *impl_;
  std::string bytes, raw;
  bool first = true;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) {
      throw std::out_of_range("[tokenizer] decode: id " + std::to_string(id) + " is outside [0, " +
                              std::to_string(vocab_size_) + ")");
    }
    const std::string* token = nullptr;
    if (const auto it = impl.added.find(id); it != impl.added.end()) {
      token = &it->second.content;
    } else if (static_cast<size_t>(id) < impl.id_to_token.size() && impl.has_token[static_cast<size_t>(id)]) {
      token = &impl.id_to_token[static_cast<size_t>(id)];
    } else {
      continue;  // a hole in the ids: tokenizers skips it
    }
    if (skip_special_tokens && impl.special_set.count(*token)) continue;
    if (impl.decoder == Impl::Decoder::None) {  // tokenizers without a decoder: tokens joined by spaces
      if (!first) bytes.push_back(' ');
      bytes += *token;
    } else if (byte_level_to_raw(*token, &raw)) {
      bytes += raw;
    } else {
      bytes += *token;
    }
    first = false;
  }
  return utf8_lossy(bytes);
}

int32_t HfTokenizer::token_to_id(const std::string& token) const { return impl_->token_to_id(token); }

size_t HfTokenizer::cache_size() const {
  std::lock_guard<std::mutex> lock(impl_->cache_mu);
  return impl_->cache.size();
}

}  // namespace ctitan
