// HfTokenizer: Hugging Face byte-level BPE (tokenizer.json, or vocab.json + merges.txt) as
// the `tokenizers` library encodes and decodes it, with BOS/EOS as torchtitan's
// HuggingFaceTokenizer derives them from tokenizer_config.json.
//
// The pipeline of tokenizers' Tokenizer.encode(text), step by step:
//   1. added tokens whose "normalized" is false are cut out of the raw text (leftmost-longest,
//      then single_word / lstrip / rstrip as tokenizers applies them);
//   2. every other piece is normalized (none, or NFC through ICU), and added tokens whose
//      "normalized" is true are cut out of the normalized piece;
//   3. the pre-tokenizer (a Split with the model's regex through PCRE2 in UTF + UCP mode,
//      JIT-compiled when PCRE2 has a JIT; then ByteLevel) splits the rest into pre-tokens;
//   4. each pre-token is mapped to byte-level symbols and merged by the BPE ranks (lowest
//      rank first, leftmost on ties); with ignore_merges a pre-token that is itself in the
//      vocabulary is one id (tiktoken-style BPE). A cache keeps the ids of pre-tokens seen before;
//   5. the post-processor (ByteLevel: nothing to do for ids; TemplateProcessing: the special
//      tokens of its "single" template, e.g. <|begin_of_text|>) frames the ids.
// encode(text, bos, eos) then adds BOS / EOS as torchtitan's HuggingFaceTokenizer.encode does:
// only when the tokenizer itself (step 5) did not already put them there.
//
// Regex dialect: tokenizers compiles patterns with Oniguruma, where \s is Unicode
// White_Space; PCRE2's \s with UCP leaves out U+0085 (NEL), so patterns are rewritten to
// include it. \h (Oniguruma: a hex digit) is rewritten to [0-9a-fA-F].
//
// Anything in a tokenizer.json that ctitan does not implement (another model type such as
// WordPiece or Unigram, normalizers other than NFC, other pre-tokenizers, byte_fallback,
// dropout, continuing_subword_prefix, truncation, padding, …) is one UserError naming the
// feature and the file: a tokenizer that silently differs from the reference would train a
// model on other ids than the ones it will be served with.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "datasets/tokenizer.h"

namespace ctitan {

class HfTokenizer final : public Tokenizer {
 public:
  // <dir>/tokenizer.json with <dir>/tokenizer_config.json. UserError naming the file for a
  // missing/corrupt file or an unsupported feature.
  static std::unique_ptr<HfTokenizer> from_tokenizer_json(const std::string& tokenizer_json);
  // GPT-2 style files, as torchtitan builds them: BPE(vocab, merges) with a ByteLevel
  // pre-tokenizer (add_prefix_space false, GPT-2's regex) and decoder; with
  // <dir>/tokenizer_config.json beside vocab.json.
  static std::unique_ptr<HfTokenizer> from_vocab_merges(const std::string& vocab_json, const std::string& merges_txt);
  ~HfTokenizer() override;

  // torchtitan's HuggingFaceTokenizer.encode(text, add_bos=bos, add_eos=eos). Thread-safe.
  // RuntimeFailure for text that is not valid UTF-8.
  std::vector<int32_t> encode(const std::string& text, bool bos, bool eos) const override;
  // tokenizers' Tokenizer.encode(text, add_special_tokens).ids.
  std::vector<int32_t> encode_ids(const std::string& text, bool add_special_tokens = true) const;
  // tokenizers' Tokenizer.decode(ids, skip_special_tokens) (its default, and torchtitan's:
  // true). std::out_of_range for an id that names no token.
  std::string decode(const std::vector<int32_t>& ids) const override { return decode(ids, true); }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;

  std::string kind() const override { return "huggingface"; }
  // -1 when the vocabulary has no such token.
  int32_t token_to_id(const std::string& token) const;
  // tokenizer_config.json's add_bos_token / add_eos_token (false when absent): torchtitan's
  // defaults for encode() calls that do not say.
  bool default_add_bos() const { return default_add_bos_; }
  bool default_add_eos() const { return default_add_eos_; }
  // Pre-tokens whose ids are cached (for tests and the benchmark).
  size_t cache_size() const;

  struct Impl;

 private:
  HfTokenizer();
  void finish_special_tokens(const std::string& config_path);
  std::unique_ptr<Impl> impl_;
  bool default_add_bos_ = false, default_add_eos_ = false;
  bool adds_bos_ = false, adds_eos_ = false;  // the post-processor already frames the ids
};

}  // namespace ctitan
