// Tokenizer: what the dataloader and train need of a tokenizer (encode with BOS/EOS, decode,
// vocabulary size and special ids), with two back-ends:
//   - SentencePieceTokenizer (tokenizer.cpp): a sentencepiece model (.model file) used through
//     libctitan_spm_shim.so;
//   - HfTokenizer (hf_tokenizer.h): Hugging Face byte-level BPE, tokenizer.json or
//     vocab.json + merges.txt, as the `tokenizers` library does it.
// Tokenizer::load picks the back-end from the file; resolve_tokenizer_path picks the file as
// torchtitan v0.2.2 does.
//
// sentencepiece is never linked into ctitan: the shim is dlopen()ed with
// RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND (see spm_shim.h for the protobuf clash this
// avoids). The shim is searched, first hit wins:
//   1. $CTITAN_SPM_SHIM (a path to the .so),
//   2. libctitan_spm_shim.so in the folder of the running executable (/proc/self/exe),
//   3. the build-tree path baked in at compile time (CTITAN_SPM_SHIM_BUILD_PATH).
// It is loaded once per process and never unloaded.
//
// sentencepiece's BOS/EOS ids come from the model file (spm_train's defaults: unk=0, bos=1,
// eos=2); Hugging Face's from tokenizer_config.json (see hf_tokenizer.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctitan {

class Tokenizer {
 public:
  // By file: tokenizer.json (its folder's tokenizer_config.json beside it) or vocab.json
  // (merges.txt and tokenizer_config.json beside it) -> HfTokenizer; anything else is a
  // sentencepiece model. Throws UserError "tokenizer: cannot load <path>: <reason>" for a
  // missing, unreadable or corrupt file (HfTokenizer: or one with an unsupported feature),
  // and RuntimeFailure when the sentencepiece shim itself cannot be found.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  virtual ~Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // text (UTF-8) -> ids, optionally framed by BOS / EOS. Thread-safe.
  virtual std::vector<int32_t> encode(const std::string& text, bool bos, bool eos) const = 0;
  // ids -> text. Control/special ids (BOS/EOS/PAD) decode to nothing; an id outside
  // [0, vocab_size) throws std::out_of_range.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // "sentencepiece" or "huggingface" (for logs).
  virtual std::string kind() const = 0;

  // One more than the largest id the tokenizer can produce: the rows a model's embedding
  // needs at least.
  int64_t vocab_size() const { return vocab_size_; }
  int32_t bos_id() const { return bos_id_; }  // -1 when the tokenizer defines none
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  const std::string& model_path() const { return model_path_; }

  // The sentencepiece shim file this process loaded (for logs); loads it if not yet loaded.
  static std::string shim_path();

 protected:
  Tokenizer() = default;
  std::string model_path_;
  int64_t vocab_size_ = 0;
  int32_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1, unk_id_ = -1;
};

// The tokenizer file as torchtitan v0.2.2 finds it:
//   model.tokenizer_path when set (must be a file: tokenizer.json, vocab.json or a
//   sentencepiece .model), else in model.hf_assets_path the first of tokenizer.json,
//   vocab.json (with merges.txt), tokenizer.model.
// UserError naming both keys when neither gives an existing file.
std::string resolve_tokenizer_path(const std::string& tokenizer_path, const std::string& hf_assets_path);

}  // namespace ctitan
